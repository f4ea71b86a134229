"""Plain-PyTorch decode attention on the same metadata the Triton kernels take: the oracle."""
from __future__ import annotations

import torch


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                         scale: float | None = None) -> torch.Tensor:
    """One query per row over cache positions ``0..pos`` (inclusive).

    q (B, H, D); k_cache, v_cache (B, Hkv, S, D) with H a multiple of Hkv (GQA); pos: int64 scalar
    tensor. Returns (B, H, D) in q's dtype, computed in fp32.
    """
    B, H, D = q.shape
    G = H // k_cache.shape[1]
    n = int(pos) + 1
    k = k_cache[:, :, :n].float().repeat_interleave(G, dim=1)  # (B, H, n, D)
    v = v_cache[:, :, :n].float().repeat_interleave(G, dim=1)
    scale = D**-0.5 if scale is None else scale
    s = torch.einsum("bhd,bhnd->bhn", q.float(), k) * scale
    return torch.einsum("bhn,bhnd->bhd", s.softmax(-1), v).to(q.dtype)


def slot_decode_attention_ref(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, slot_k: torch.Tensor,
                              slot_v: torch.Tensor, slot_pos: torch.Tensor,
                              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query per row over the prompt and the occupied slots (``slot_pos >= 0``) of its kv head.

    q (B, H, D); prompt_k/v (B, Hkv, P, D); slot_k/v (B, Hkv, C, D); slot_pos (B, Hkv, C), -1 free.
    Returns out (B, H, D) in q's dtype and the slots' attention weights summed over the G = H / Hkv
    query heads of each kv head, (B, Hkv, C) float32 (0 for free slots); computed in fp32.
    """
    B, H, D = q.shape
    Hkv, P, C = prompt_k.shape[1], prompt_k.shape[2], slot_k.shape[2]
    G = H // Hkv
    k = torch.cat([prompt_k, slot_k], dim=2).float().repeat_interleave(G, dim=1)  # (B, H, P + C, D)
    v = torch.cat([prompt_v, slot_v], dim=2).float().repeat_interleave(G, dim=1)
    valid = torch.cat([torch.ones(B, Hkv, P, dtype=torch.bool, device=q.device), slot_pos >= 0], dim=2)
    scale = D**-0.5 if scale is None else scale
    s = torch.einsum("bhd,bhnd->bhn", q.float(), k) * scale
    w = s.masked_fill(~valid.repeat_interleave(G, dim=1), float("-inf")).softmax(-1)  # (B, H, P + C)
    out = torch.einsum("bhn,bhnd->bhd", w, v).to(q.dtype)
    return out, w[:, :, P:].reshape(B, Hkv, G, C).sum(2)
