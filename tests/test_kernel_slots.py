"""The slot-table (scored policies) Triton kernel against the PyTorch reference, on the CPU through
the Triton interpreter."""
import json
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from arsparse.kernels.triton import slot_decode_attention  # noqa: E402
from arsparse.kernels.reference import slot_decode_attention_ref  # noqa: E402
from conftest import random_slot_tables  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NAN = float("nan")


@pytest.mark.parametrize("B,H,Hkv,P,C,D,splits,dtype", [
    (2, 4, 4, 1, 70, 64, None, torch.float32),  # MHA, c2i prompt, C not a multiple of the block
    (3, 4, 2, 5, 130, 100, 3, torch.float32),  # G=2, head_dim 100 (padded dims), uneven splits
    (2, 8, 2, 3, 37, 128, None, torch.float16),  # G=4, head_dim 128
    (1, 4, 1, 70, 200, 64, 4, torch.bfloat16),  # G=4 (MQA), a long prompt (t2i-like) in split 0
    (2, 2, 1, 2, 9, 16, 5, torch.float32),  # more splits asked than blocks: clamped
])
def test_slot_kernel_matches_reference(poisoned_empty, B, H, Hkv, P, C, D, splits, dtype):
    inputs, (want_out, want_w) = random_slot_tables(B, H, Hkv, P, C, D, dtype, seed=B * 100 + C + D, device=DEVICE)
    out, w = slot_decode_attention(*inputs, num_splits=splits)
    assert out.dtype == dtype and w.dtype == torch.float32 and w.shape == (B, Hkv, C)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    atol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(w.cpu(), want_w, atol=2e-6, rtol=1e-4)
    assert (w[0, 0] == 0).all()  # the all-free head puts all its weight on the prompt


@pytest.mark.parametrize("launch", [dict(block_n=128, late_cast=1), dict(block_n=16, late_cast=1, num_warps=4),
                                    dict(block_n=32, late_cast=0, num_stages=2)])
def test_slot_kernel_launch_settings_match_reference(poisoned_empty, monkeypatch, launch):
    """Each tile size (one block for the whole table, several) and the late cast (bf16 tiles promoted
    in the products) gives the reference's output and weights; G=2, a prompt of 3, bf16."""
    from arsparse.kernels.triton import slots

    monkeypatch.setattr(slots, "LAUNCH", slots.parse_launch(json.dumps(launch)))
    seed = int(torch.randint(0, 2**31, ()))
    inputs, (want_out, want_w) = random_slot_tables(3, 4, 2, 3, 83, 64, torch.bfloat16, seed=seed, device=DEVICE)
    out, w = slot_decode_attention(*inputs)
    torch.testing.assert_close(out.cpu().float(), want_out.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(w.cpu(), want_w, atol=2e-6, rtol=1e-4)
    for bad, msg in ((dict(block_n=48), "power of 2 >= 16"), (dict(late_cast=2), "0 or 1"), (dict(tile=8), "keys from")):
        with pytest.raises(ValueError, match=msg):
            slots.parse_launch(json.dumps(bad))


def test_slot_kernel_strided_views_and_empty_heads(poisoned_empty):
    """q as the model makes it (a transposed view), tables as one layer's slice of the cache, and
    without a prompt a head with no occupied slot gets zeros, not NaN."""
    g = torch.Generator().manual_seed(5)
    B, H, Hkv, C, D = 2, 4, 2, 50, 32
    q = torch.randn(B, 1, H, D, generator=g).transpose(1, 2)[:, :, 0]  # (B, H, D), non-contiguous
    kv = torch.randn(3, B, Hkv, C, D, generator=g)  # (L, B, Hkv, C, D)
    spos = torch.randint(0, 100, (3, B, Hkv, C), generator=g)
    spos[1, 1, 0] = -1
    kv[1][spos[1] < 0] = NAN
    pk = torch.randn(B, Hkv, 0, D)
    out, w = slot_decode_attention(q.to(DEVICE), pk.to(DEVICE), pk.to(DEVICE), kv[1].to(DEVICE), kv[1].to(DEVICE),
                                   spos[1].to(DEVICE))
    out, w = out.cpu(), w.cpu()
    assert (out[1, :2] == 0).all() and (w[1, 0] == 0).all()
    want_out, want_w = slot_decode_attention_ref(q, pk, pk, kv[1].nan_to_num(), kv[1].nan_to_num(), spos[1])
    keep = torch.ones(B, Hkv, dtype=torch.bool)
    keep[1, 0] = False  # the reference gives NaN there
    torch.testing.assert_close(out[keep.repeat_interleave(2, 1)], want_out[keep.repeat_interleave(2, 1)],
                               atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(w[keep], want_w[keep], atol=2e-6, rtol=1e-4)


def test_slot_kernel_rejects_bad_input():
    q = torch.randn(2, 4, 64)
    pk, k = torch.randn(2, 2, 1, 64), torch.randn(2, 2, 10, 64)
    spos = torch.zeros(2, 2, 10, dtype=torch.long)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        slot_decode_attention(torch.randn(2, 3, 64), torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64), k, k, spos)
    with pytest.raises(ValueError, match="dtype"):
        slot_decode_attention(q, pk, pk, k.half(), k.half(), spos)
    with pytest.raises(ValueError, match="slot_pos must be int64"):
        slot_decode_attention(q, pk, pk, k, k, spos.int())
    with pytest.raises(ValueError, match="slot_v must be"):
        slot_decode_attention(q, pk, pk, k, k[:, :, :5], spos)


@pytest.mark.parametrize("policy,n_kv_head", [
    (dict(name="h2o", rho=0.4), 2),  # GQA: scores summed over the group
    (dict(name="tova", rho=0.3), 4),
    (dict(name="headkv", rho=0.5, calib_rows=2, recent=2), 2),  # capacities from the weights / G
])
def test_scored_cache_with_triton_kernel_matches_torch(policy, n_kv_head):
    """Teacher forcing through the evicting cache: every step's logits agree (an eviction that differs shows)."""
    import arsparse.policies as policies
    from arsparse.engine.generator import Generator
    from conftest import random_cond, random_gpt

    model = random_gpt("c2i", seed=11, n_kv_head=n_kv_head)
    pol = policies.get(**policy)
    cond = random_cond(model, 2)
    tokens = torch.randint(0, model.config.vocab_size, (2, model.config.image_tokens))
    runs = {}
    for kernel in ("torch", "triton"):
        gen = Generator(model, device=DEVICE, dtype="fp32", kernel=kernel, policy=pol)
        runs[kernel] = gen.cached_logits(cond, tokens)
    torch.testing.assert_close(runs["triton"], runs["torch"], atol=1e-4, rtol=1e-4)
