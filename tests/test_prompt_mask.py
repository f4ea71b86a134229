"""Caption padding masks of t2i prompts (LlamaGen's ``emb_masks``) through the decode kernels.

Each kernel takes a per-row ``[start, end)`` span of real prompt tokens; it runs through the Triton
interpreter on the CPU against the PyTorch reference, with NaN in the cache entries it must not
read (padded prompt positions among them) and in its output buffers.
"""
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed (pip install triton)")

from arsparse.kernels.reference import decode_attention_ref, ring_decode_attention_ref, slot_decode_attention_ref  # noqa: E402
from arsparse.kernels.triton import decode_attention, ring_decode_attention, slot_decode_attention  # noqa: E402
from conftest import random_offsets, random_ring_case, random_slot_tables, row_positions  # noqa: E402

KTOL = dict(atol=2e-5, rtol=2e-5)
NAN = float("nan")


def random_span(g, B: int, P: int) -> torch.Tensor:
    """(B, 2) int32 spans of left, right and two-sided padding (row 0: one real token at the end)."""
    lo = torch.randint(0, P, (B,), generator=g)
    hi = lo + 1 + (torch.rand(B, generator=g) * (P - lo)).long().clamp(max=P - lo - 1)
    lo[0], hi[0] = P - 1, P
    return torch.stack([lo, hi], 1).int()


# ---- (c) the Triton kernels with random spans == the PyTorch reference -----------------------

@pytest.mark.parametrize("B,H,Hkv,S,D,P_,pos,splits", [
    (4, 4, 2, 300, 64, 150, "rows", 3),  # a 150-token prompt: a whole tile of padding, several splits
    (3, 4, 4, 90, 32, 7, "rows", 1),  # one split: the output written directly
    (3, 8, 1, 200, 64, 130, 180, 2),  # MQA, one position for every row
])
def test_dense_kernel_skips_padded_prompt_positions(poisoned_empty, B, H, Hkv, S, D, P_, pos, splits):
    g = torch.Generator().manual_seed(S + P_)
    q, k_new, v_new = (torch.randn(B, h, D, generator=g) for h in (H, Hkv, Hkv))
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    p = row_positions(g, B, P_, S - 1, [P_, S - 1, P_ + 1]) if pos == "rows" else torch.tensor(pos)
    span = random_span(g, B, P_)
    for b, pb in enumerate(p.expand(B).tolist()):
        for t in (kc, vc):
            t[b, :, pb:] = NAN  # past the position
            t[b, :, : span[b, 0]] = NAN  # padding before the caption
            t[b, :, span[b, 1]: P_] = NAN  # and after it
    want_k, want_v = kc.clone(), vc.clone()
    want = decode_attention_ref(q, k_new, v_new, want_k, want_v, p, prompt_span=span, prompt_len=P_)
    assert torch.isfinite(want).all()
    got = decode_attention(q, k_new, v_new, kc, vc, p, num_splits=splits, prompt_span=span, prompt_len=P_)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, **KTOL)
    torch.testing.assert_close(kc, want_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(vc, want_v, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("grouped", [None, dict(rows=2, block_o=4)], ids=["heads", "grouped"])
def test_ring_kernel_skips_padded_prompt_positions(poisoned_empty, grouped):
    B, H, Hkv, P_, S, W, D = 4, 4, 2, 9, 2, 8, 64
    g = torch.Generator().manual_seed(21)
    offsets = random_offsets(g, H, 5, W)
    span = random_span(g, B, P_)
    pos = row_positions(g, B, P_, P_ + 4 * W, [P_, P_ + 1, P_ + 4 * W])
    for p in (pos, pos[2]):
        inputs, _ = random_ring_case(B, H, Hkv, P_, S, W, D, offsets, p, torch.float32, int(p.sum()))
        for t in inputs[3:5]:  # the prompt's padded keys and values
            for b in range(B):
                t[b, :, : span[b, 0]] = NAN
                t[b, :, span[b, 1]:] = NAN
        want_bufs = [t.clone() for t in inputs[3:9]]
        want = ring_decode_attention_ref(*inputs[:3], *want_bufs, offsets, p, S, prompt_span=span)
        assert torch.isfinite(want).all()
        got = ring_decode_attention(*inputs, S, grouped=grouped, prompt_span=span)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, **KTOL)
        for t, w in zip(inputs[3:9], want_bufs):
            torch.testing.assert_close(t, w, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("B,H,Hkv,P_,C,D,splits", [
    (3, 4, 2, 70, 130, 64, 3),  # a 70-token prompt over two blocks of split 0, uneven splits
    (2, 8, 2, 5, 37, 32, None),
])
def test_slot_kernel_skips_padded_prompt_positions(poisoned_empty, B, H, Hkv, P_, C, D, splits):
    g = torch.Generator().manual_seed(C + P_)
    (q, pk, pv, k, v, spos), _ = random_slot_tables(B, H, Hkv, P_, C, D, torch.float32, seed=C)
    span = random_span(g, B, P_)
    want_out, want_w = slot_decode_attention_ref(q, pk, pv, k.nan_to_num(), v.nan_to_num(), spos, prompt_span=span)
    for t in (pk, pv):
        for b in range(B):
            t[b, :, : span[b, 0]] = NAN
            t[b, :, span[b, 1]:] = NAN
    out, w = slot_decode_attention(q, pk, pv, k, v, spos, num_splits=splits, prompt_span=span)
    assert torch.isfinite(out).all() and torch.isfinite(w).all()
    torch.testing.assert_close(out, want_out, **KTOL)
    torch.testing.assert_close(w, want_w, atol=2e-6, rtol=1e-4)
    # with fewer prompt entries the slots weigh more than without the mask
    _, w_plain = slot_decode_attention_ref(q, pk.nan_to_num(), pv.nan_to_num(), k.nan_to_num(), v.nan_to_num(), spos)
    assert (w.sum(-1) >= w_plain.sum(-1) - 1e-6).all() and (w.sum(-1) > w_plain.sum(-1) + 1e-3).any()


def test_kernels_with_a_full_span_equal_no_span_exactly(poisoned_empty):
    """(e) at the kernel level: the masked specialisation with nothing padded gives the unmasked bits."""
    g = torch.Generator().manual_seed(8)
    B, H, Hkv, S, D, P_ = 3, 4, 2, 140, 32, 9
    full = torch.tensor([[0, P_]] * B, dtype=torch.int32)
    q, kn, vn = (torch.randn(B, h, D, generator=g) for h in (H, Hkv, Hkv))
    kc, vc = (torch.randn(B, Hkv, S, D, generator=g) for _ in range(2))
    pos = torch.tensor([P_, 100, S - 1])
    outs = [decode_attention(q, kn, vn, kc.clone(), vc.clone(), pos, num_splits=2, prompt_span=s, prompt_len=P_)
            for s in (None, full)]
    assert torch.equal(outs[0], outs[1])
    offsets = random_offsets(g, H, 4, 6)
    inputs, _ = random_ring_case(B, H, Hkv, P_, 2, 6, D, offsets, torch.tensor([P_, P_ + 3, P_ + 20]), torch.float32, 3)
    outs = [ring_decode_attention(*[t.clone() for t in inputs], 2, prompt_span=s) for s in (None, full)]
    assert torch.equal(outs[0], outs[1])
    tables, _ = random_slot_tables(B, H, Hkv, P_, 40, D, torch.float32, seed=9)
    outs = [slot_decode_attention(*tables, prompt_span=s) for s in (None, full)]
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_kernels_reject_a_bad_span():
    q, kv, pk = torch.randn(2, 4, 8), torch.randn(2, 4, 20, 8), torch.randn(2, 4, 5, 8)
    span = torch.tensor([[1, 5], [0, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match="prompt_span must be a contiguous int32"):
        decode_attention(q, q, q, kv, kv, torch.tensor(10), prompt_span=span.long(), prompt_len=5)
    with pytest.raises(ValueError, match=r"prompt_span must be a contiguous int32 \(B=2, 2\)"):
        slot_decode_attention(q, pk, pk, kv, kv, torch.zeros(2, 4, 20, dtype=torch.long), prompt_span=span[:1])
    with pytest.raises(ValueError, match="prompt_len must be in 1..20"):
        decode_attention(q, q, q, kv, kv, torch.tensor(10), prompt_span=span, prompt_len=0)
