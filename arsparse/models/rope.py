"""LlamaGen's 2-D rotary position embedding.

Each head's dimensions form D/2 interleaved pairs ``(x[2i], x[2i+1])``. The first D/4 pairs rotate
with the token's row, the last D/4 with its column, at frequencies ``base ** (-2j / (D/2))``.
Condition positions get the table entry (cos, sin) = (0, 0), as LlamaGen's: their queries and keys
are zeroed, not left unrotated.
"""
from __future__ import annotations

import torch


def rope_table(grid_h: int, grid_w: int, head_dim: int, base: float, prefix_len: int) -> torch.Tensor:
    """(prefix_len + grid_h * grid_w, head_dim // 2, 2) table of (cos, sin), fp32."""
    quarter = head_dim // 4
    # fp32 throughout, as the public checkpoints were trained with.
    inv_freq = 1.0 / base ** ((2 * torch.arange(quarter)).float() / (head_dim // 2))  # (D/4,)
    rows = torch.arange(grid_h).float().repeat_interleave(grid_w)  # (N,)
    cols = torch.arange(grid_w).float().repeat(grid_h)  # (N,)
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=1)  # (N, D/2)
    image = torch.stack([angles.cos(), angles.sin()], dim=-1)  # (N, D/2, 2)
    return torch.cat([torch.zeros(prefix_len, head_dim // 2, 2), image], dim=0)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by table (T, D/2, 2), or (B, T, D/2, 2) for per-row positions.

    Computed in fp32, returned in x's dtype.
    """
    B, T, H, D = x.shape
    xp = x.float().reshape(B, T, H, D // 2, 2)
    if table.dim() == 3:
        table = table[None]
    cos, sin = table[:, :, None, :, 0], table[:, :, None, :, 1]  # (1 or B, T, 1, D/2)
    a, b = xp[..., 0], xp[..., 1]
    out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.reshape(B, T, H, D).type_as(x)
