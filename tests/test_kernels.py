"""Triton kernels against the PyTorch reference, on the CPU through the Triton interpreter."""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from arsparse.kernels.reference import decode_attention_ref  # noqa: E402
from arsparse.kernels.triton import decode_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("B,H,Hkv,S,D,pos,splits", [
    (2, 4, 4, 70, 64, 0, None),  # a single valid position
    (3, 4, 2, 130, 64, 129, 3),  # GQA, full cache, uneven splits
    (1, 2, 2, 200, 100, 77, 4),  # head_dim 100 (GPT-3B), splits past the end are empty
    (2, 8, 1, 65, 128, 64, None),  # MQA, head_dim 128
])
def test_decode_attention_matches_reference(B, H, Hkv, S, D, pos, splits):
    g = torch.Generator().manual_seed(S * 7 + D)
    q = torch.randn(B, H, D, generator=g).to(DEVICE)
    k = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE)
    v = torch.randn(B, Hkv, S, D, generator=g).to(DEVICE)
    k[:, :, pos + 1 :] = float("nan")  # positions past pos must never be read
    v[:, :, pos + 1 :] = float("nan")
    p = torch.tensor(pos, device=DEVICE)
    got = decode_attention(q, k, v, p, num_splits=splits)
    want = decode_attention_ref(q, k, v, p)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_decode_attention_strided_query_and_cache_slice():
    """q as the model produces it (a transposed view) and a cache that is one layer of a bigger buffer."""
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(3, 2, 4, 96, 64, generator=g).to(DEVICE)  # (L, B, Hkv, S, D)
    q = torch.randn(2, 1, 4, 64, generator=g).to(DEVICE).transpose(1, 2)[:, :, 0]  # (B, H, D), non-contiguous
    p = torch.tensor(50, device=DEVICE)
    got = decode_attention(q, cache[1], cache[2], p)
    torch.testing.assert_close(got, decode_attention_ref(q, cache[1], cache[2], p), atol=2e-5, rtol=2e-5)


def test_decode_attention_rejects_bad_input():
    q = torch.randn(2, 4, 64)
    k = torch.randn(2, 3, 10, 64)
    with pytest.raises(ValueError, match="H % Hkv"):
        decode_attention(q, k, k, torch.tensor(3))
    with pytest.raises(ValueError, match="dtypes differ"):
        decode_attention(q.half(), torch.randn(2, 4, 10, 64), torch.randn(2, 4, 10, 64), torch.tensor(3))


def test_engine_with_triton_kernel_matches_torch_path():
    from arsparse.engine.generator import Generator
    from conftest import random_cond, random_gpt

    model = random_gpt("c2i", seed=9, n_kv_head=2)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.image_tokens))
    ref = Generator(model, device=DEVICE, dtype="fp32", kernel="torch").cached_logits(cond, tokens)
    got = Generator(model, device=DEVICE, dtype="fp32", kernel="triton").cached_logits(cond, tokens)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy,G,P", [
    (dict(name="diagonal", local=3, rows=2, band=1, sinks=2), 1, 1),
    (dict(name="streaming", sinks=3, recent=7), 2, 5),  # GQA, a 5-token prompt
    (dict(name="diagonal", local=1, rows=3, band=0, sinks=0), 1, 3),  # no sinks
])
def test_ring_kernel_matches_the_ring_cache_reference(policy, G, P):
    """Every decode step of a random sequence: Triton ring kernel == the gathered PyTorch reference."""
    import arsparse.policies as policies
    from arsparse.models.config import gpt_config

    cfg = gpt_config("GPT-tiny", image_tokens=25, n_head=4, n_kv_head=4 // G, cls_token_num=P)
    pol = policies.get(**policy)
    ref = pol.make_cache(cfg, 2, torch.float32, DEVICE, kernel="torch")
    fast = pol.make_cache(cfg, 2, torch.float32, DEVICE, kernel="triton")
    g = torch.Generator().manual_seed(P * 10 + G)
    D, Hkv = cfg.head_dim, cfg.kv_heads
    for c in (ref, fast):
        c.phase = "prefill"
    pk = torch.randn(2, Hkv, P, D, generator=g).to(DEVICE)
    pv = torch.randn(2, Hkv, P, D, generator=g).to(DEVICE)
    qp = torch.randn(2, 4, P, D, generator=g).to(DEVICE)
    for c in (ref, fast):
        for layer in range(cfg.n_layer):
            c.attend(layer, qp, pk, pv)
        c.phase = "decode"
        c.pos.fill_(P)
    for step in range(24):
        q = torch.randn(2, 4, 1, D, generator=g).to(DEVICE)
        k = torch.randn(2, Hkv, 1, D, generator=g).to(DEVICE)
        v = torch.randn(2, Hkv, 1, D, generator=g).to(DEVICE)
        for layer in range(cfg.n_layer):
            want = ref.attend(layer, q, k, v)
            got = fast.attend(layer, q, k, v)
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        ref.pos.add_(1)
        fast.pos.add_(1)
