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
