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
Steps of more rows, or of several positions (prefill), take the PyTorch halves.

:func:`halves` binds them to a model: each launch is also given the weights the launches after it
read (wqkv: wo, w1, w3; wo: w2; w1 + w3: the next block's wqkv; the head: the first block's wqkv),
which it prefetches into the L2 with the launch setting ``prefetch=1`` (the attention and the
launches in between overlap the fetch).
"""
from __future__ import annotations

import torch

from ..kernels.triton.matvec import MAX_ROWS, matvec
from . import gpt


def _decode_rows(x: torch.Tensor) -> bool:
    return x.shape[1] == 1 and x.shape[0] <= MAX_ROWS and x.is_contiguous()


def _prefetch_plan(model) -> dict:
    """{weight's data_ptr: the weights read next}, as the module docstring says."""
    plan, layers = {}, list(model.layers)
    for i, layer in enumerate(layers):
        a, ff = layer.attention, layer.feed_forward
        plan[a.wqkv.weight.data_ptr()] = (a.wo.weight, ff.w1.weight, ff.w3.weight)
        plan[a.wo.weight.data_ptr()] = (ff.w2.weight,)
        if i + 1 < len(layers):
            plan[ff.w1.weight.data_ptr()] = (layers[i + 1].attention.wqkv.weight,)
    plan[model.output.weight.data_ptr()] = (layers[0].attention.wqkv.weight,)
    return plan


def halves(model=None) -> tuple:
    """(block_in, block_out, final_logits) for ``gpt.fuse(None, halves=...)``; with ``model`` (already
    on its device and in its dtype: the plan holds its weights' addresses), each launch names the
    weights read after it for prefetching."""
    plan = {} if model is None else _prefetch_plan(model)
    after = lambda w: plan.get(w.data_ptr(), ())  # noqa: E731

    def block_in(x, f, norm_w, wqkv, rope, n_head: int, n_kv: int, eps: float):
        if not _decode_rows(x) or (f is not None and not f.is_contiguous()):
            return gpt.block_in(x, f, norm_w, wqkv, rope, n_head, n_kv, eps)
        B, T, dim = x.shape
        D = wqkv.shape[0] // (n_head + 2 * n_kv)
        table = rope if rope.dim() == 3 else rope.reshape(B, D // 2, 2)  # (1, D/2, 2) shared, or one per row
        args = dict(norm=(norm_w, eps), rope=(table.contiguous(), (n_head + n_kv) * D, D), prefetch=after(wqkv))
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
        h = matvec(attn.view(B, -1), wo, residual=x.view(B, dim), prefetch=after(wo))
        g = matvec(h, w1, norm=(norm_w, eps), w_up=w3, prefetch=after(w1))
        return h.view(B, T, dim), matvec(g, w2).view(B, T, dim)

    def final_logits(h, f, norm_w, out_w, eps: float):
        if h.shape[0] > MAX_ROWS:
            return gpt.final_logits(h, f, norm_w, out_w, eps)
        return matvec(h, out_w, add=f, norm=(norm_w, eps), prefetch=after(out_w))[0].float()

    return block_in, block_out, final_logits
