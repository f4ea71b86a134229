"""Plain-PyTorch decode attention on the same metadata the Triton kernels take: the oracle."""
from __future__ import annotations

import math

import torch


def _positions(pos: torch.Tensor, B: int) -> list[int]:
    """One position for every row (a one-element tensor) or (B,) one per row -> B ints."""
    return [int(pos)] * B if pos.numel() == 1 else [int(p) for p in pos]


def _span(prompt_span: torch.Tensor | None, b: int, P: int) -> tuple[int, int]:
    """Row b's [start, end) of real prompt tokens (the whole prompt without a span)."""
    return (0, P) if prompt_span is None else (int(prompt_span[b, 0]), int(prompt_span[b, 1]))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (H, D) over k, v (H, n, D) -> (H, D) in q's dtype, computed in fp32."""
    w = (torch.einsum("hd,hnd->hn", q.float(), k.float()) * scale).softmax(-1)
    return torch.einsum("hn,hnd->hd", w, v.float()).to(q.dtype)


def decode_attention_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, pos: torch.Tensor, scale: float | None = None,
                         prompt_span: torch.Tensor | None = None, prompt_len: int = 0) -> torch.Tensor:
    """Write the new token at ``pos`` (in place), then one query per row over positions ``0..pos``.

    q (B, H, D); k_new, v_new (B, Hkv, D); k_cache, v_cache (B, Hkv, S, D) with H a multiple of Hkv
    (GQA); pos: an integer tensor, one position or (B,) one per row; prompt_span: optional (B, 2)
    ``[start, end)`` of each row's real prompt tokens among positions ``0..prompt_len-1`` (the others
    are not read). Returns (B, H, D) in q's dtype, computed in fp32.
    """
    B, H, D = q.shape
    G = H // k_cache.shape[1]
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    for b, p in enumerate(_positions(pos, B)):
        k_cache[b, :, p] = k_new[b]
        v_cache[b, :, p] = v_new[b]
        lo, hi = _span(prompt_span, b, prompt_len)
        read = [j for j in range(p + 1) if j >= prompt_len or lo <= j < hi]
        k = k_cache[b, :, read].repeat_interleave(G, dim=0)  # (H, n, D)
        v = v_cache[b, :, read].repeat_interleave(G, dim=0)
        out[b] = _attend(q[b], k, v, scale)
    return out


def ring_decode_attention_ref(q, k_new, v_new, prompt_k, prompt_v, sink_k, sink_v, ring_k, ring_v, offsets, pos,
                              n_sinks: int, scale: float | None = None,
                              prompt_span: torch.Tensor | None = None, rest_sums=None) -> torch.Tensor:
    """The ring cache's decode step, row by row: write the new token of image index ``i = pos - P``
    (in place: ring slot ``i % W``, and sink ``i`` while ``i < n_sinks``), then attend over the
    prompt (its positions ``prompt_span[b]`` when given), the sinks ``0..min(i, n_sinks - 1)`` and
    the ring slots of ``pos - o`` for each offset ``o >= 0`` of the head with ``pos - o >= P + n_sinks``.

    Arguments as :func:`~arsparse.kernels.triton.ring_decode_attention`; returns (B, H, D) in q's
    dtype, computed in fp32.
    """
    B, H, D = q.shape
    Hkv, P, W = prompt_k.shape[1], prompt_k.shape[2], ring_k.shape[2]
    G = H // Hkv
    scale = D**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    for b, p in enumerate(_positions(pos, B)):
        i = p - P
        ring_k[b, :, i % W], ring_v[b, :, i % W] = k_new[b], v_new[b]
        if i < n_sinks:
            sink_k[b, :, i], sink_v[b, :, i] = k_new[b], v_new[b]
        lo, hi = _span(prompt_span, b, P)
        for h in range(H):
            hk = h // G
            slots = [(p - o - P) % W for o in offsets[h].tolist() if o >= 0 and p - o >= P + n_sinks]
            sinks = min(i + 1, n_sinks)
            k = torch.cat([prompt_k[b, hk, lo:hi], sink_k[b, hk, :sinks], ring_k[b, hk, slots]])  # (n, D)
            v = torch.cat([prompt_v[b, hk, lo:hi], sink_v[b, hk, :sinks], ring_v[b, hk, slots]])
            if rest_sums is None:
                out[b, h] = _attend(q[b, h : h + 1], k[None], v[None], scale)[0]
                continue
            # the remainder entry: the sums less the ring keys read, over the rest (none when empty)
            count = max(i + 1 - n_sinks, 0) - len(slots)
            s = k.float() @ q[b, h].float() * scale
            if count > 0:
                k_rest = (rest_sums[0][b, hk] - ring_k[b, hk, slots].float().sum(0)) / count
                v_rest = (rest_sums[1][b, hk] - ring_v[b, hk, slots].float().sum(0)) / count
                s = torch.cat([s, (k_rest @ q[b, h].float() * scale + math.log(count))[None]])
                v = torch.cat([v.float(), v_rest[None]])
            out[b, h] = (s.softmax(0) @ v.float()).to(q.dtype)
    return out


def slot_decode_attention_ref(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, slot_k: torch.Tensor,
                              slot_v: torch.Tensor, slot_pos: torch.Tensor, scale: float | None = None,
                              prompt_span: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over the prompt and the occupied slots (``slot_pos >= 0``) of its kv head.

    q (B, H, D); prompt_k/v (B, Hkv, P, D); slot_k/v (B, Hkv, C, D); slot_pos (B, Hkv, C), -1 free;
    prompt_span: optional (B, 2) ``[start, end)`` of each row's real prompt tokens (the others are not read).
    Returns out (B, H, D) in q's dtype and the slots' attention weights summed over the G = H / Hkv
    query heads of each kv head, (B, Hkv, C) float32 (0 for free slots); computed in fp32.
    """
    B, H, D = q.shape
    Hkv, P, C = prompt_k.shape[1], prompt_k.shape[2], slot_k.shape[2]
    G = H // Hkv
    k = torch.cat([prompt_k, slot_k], dim=2).float().repeat_interleave(G, dim=1)  # (B, H, P + C, D)
    v = torch.cat([prompt_v, slot_v], dim=2).float().repeat_interleave(G, dim=1)
    j = torch.arange(P, device=q.device)
    real = torch.ones(B, P, dtype=torch.bool, device=q.device) if prompt_span is None else \
        (j >= prompt_span[:, :1]) & (j < prompt_span[:, 1:])  # (B, P)
    valid = torch.cat([real[:, None].expand(B, Hkv, P), slot_pos >= 0], dim=2)
    scale = D**-0.5 if scale is None else scale
    s = torch.einsum("bhd,bhnd->bhn", q.float(), k) * scale
    w = s.masked_fill(~valid.repeat_interleave(G, dim=1), float("-inf")).softmax(-1)  # (B, H, P + C)
    out = torch.einsum("bhn,bhnd->bhd", w, v).to(q.dtype)
    return out, w[:, :, P:].reshape(B, Hkv, G, C).sum(2)
