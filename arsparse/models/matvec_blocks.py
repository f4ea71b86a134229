"""A transformer block's two halves for decode steps of a few rows (batch 1 and latency mode).

Same signatures and results as :func:`arsparse.models.gpt.block_in`, ``block_out`` and
``final_logits`` (``gpt.fuse(None, halves=halves(model))``), in five launches per block instead of about
ten: each projection is one :func:`arsparse.kernels.triton.matvec.matvec` with the work around it
folded in —

- RMSNorm + wqkv + RoPE (and the previous block's residual add),
- wo + the residual add,
- RMSNorm + w1 and w3 + SiLU * gate (SwiGLU's first half, both weights in one kernel),
- w2;

and after the last block, its residual add + the final RMSNorm + the output head in one launch.
Steps of more rows, or of several positions (prefill), take the PyTorch halves. (Each launch
prefetching the next launches' weights into the L2 was slower, BENCHMARKS run 9, and was removed.)
"""
from __future__ import annotations

import torch

from ..kernels.triton.matvec import MAX_ROWS, matvec
from . import gpt


def _decode_rows(x: torch.Tensor) -> bool:
    return x.shape[1] == 1 and x.shape[0] <= MAX_ROWS and x.is_contiguous()


def halves() -> tuple:
    """(block_in, block_out, final_logits) for ``gpt.fuse(None, halves=...)``."""

    def block_in(x, f, norm_w, wqkv, rope, n_head: int, n_kv: int, eps: float):
        if not _decode_rows(x) or (f is not None and not f.is_contiguous()):
            return gpt.block_in(x, f, norm_w, wqkv, rope, n_head, n_kv, eps)
        B, T, dim = x.shape
        D = wqkv.shape[0] // (n_head + 2 * n_kv)
        args = dict(norm=(norm_w, eps))
        if rope is not None:  # (None: the attention kernel rotates q and k)
            table = rope if rope.dim() == 3 else rope.reshape(B, D // 2, 2)  # (1, D/2, 2) shared, or one per row
            args["rope"] = (table.contiguous(), (n_head + n_kv) * D, D)
        if f is None:
            y = matvec(x.view(B, dim), wqkv, **args)
        else:
            y, xs = matvec(x.view(B, dim), wqkv, add=f.view(B, dim), **args)
            x = xs.view(B, T, dim)
        y = y.view(B, T, n_head + 2 * n_kv, D)
        q, k, v = y.split([n_head, n_kv, n_kv], dim=2)  # (B, T, heads, D) views
        return x, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def block_out(x, attn, wo, norm_w, w1, w3, w2, eps: float):
        if not _decode_rows(x) or not attn.is_contiguous():
            return gpt.block_out(x, attn, wo, norm_w, w1, w3, w2, eps)
        B, T, dim = x.shape
        h = matvec(attn.view(B, -1), wo, residual=x.view(B, dim))
        g = matvec(h, w1, norm=(norm_w, eps), w_up=w3)
        return h.view(B, T, dim), matvec(g, w2).view(B, T, dim)

    def final_logits(h, f, norm_w, out_w, eps: float):
        if h.shape[0] > MAX_ROWS:
            return gpt.final_logits(h, f, norm_w, out_w, eps)
        return matvec(h, out_w, add=f, norm=(norm_w, eps))[0].float()

    # RoPE costs nothing folded into the wqkv launch, and a ring kernel that rotates q and k itself waits
    # longer at a few rows (batch 1, 576 tokens: diagonal 0.989 -> 1.006 ms, run 17): keep it here
    block_in.folds_rope = True
    return block_in, block_out, final_logits
