"""Launch wrapper of HeadKV's stratified eviction (the body: ``_evict.py``)."""
from __future__ import annotations

import torch
import triton

from ._evict import evict_many_kernel, evict_one_kernel
from .decode import sm_count

BLOCK_C = 64  # slots per tile of evict_one_kernel
BLOCK_I = 32  # slots ranked per tile of evict_many_kernel (64: 255 registers and spills on sm_90)
BLOCK_J = 64  # slots compared with them per tile
LAUNCH = dict(num_warps=4)
MANY_PROGRAMS_PER_SM = 3  # evict_many_kernel's programs: its registers (168 on sm_90, Triton 3.6) fit three per SM


@torch.compiler.disable  # (a compiled caller breaks its graph here and launches the kernels as they are)
def stratified_evict_slots(score: torch.Tensor, pos: torch.Tensor, evictable: torch.Tensor, k: torch.Tensor,
                           layout) -> torch.Tensor:
    """The slots stratified eviction frees, as :func:`arsparse.policies.headwise.stratified_evict`.

    Parameters
    ----------
    score : (B, H, C) float32 accumulated attention, unit last stride
    pos : (B, H, C) int64 sequence positions: -1 for a free slot, else an image position of ``layout``
        (the kernels count rows ``0 .. grid_h - 1`` only; not checked, which would cost a host sync)
    evictable : (B, H, C) bool, unit last stride
    k : (B, H, 1) int64 entries to free (<= 0: none)
    layout : :class:`~arsparse.layout.Layout` (image row of position p: (p - prefix_len) // row_stride)

    Returns
    -------
    (B, H, C) bool, the slots to free.
    """
    if score.dim() != 3:
        raise ValueError(f"score must be (B, H, C), got {tuple(score.shape)}")
    B, H, C = score.shape
    want = dict(score=(score, torch.float32, (B, H, C)), pos=(pos, torch.long, (B, H, C)),
                evictable=(evictable, torch.bool, (B, H, C)), k=(k, torch.long, (B, H, 1)))
    for name, (t, dtype, shape) in want.items():
        if tuple(t.shape) != shape or t.dtype != dtype or t.device != score.device or t.stride(-1) != 1:
            raise ValueError(f"{name} must be {dtype} {shape} on {score.device} with a unit last stride, "
                             f"got {t.dtype} {tuple(t.shape)} on {t.device} with strides {t.stride()}")
    out = torch.empty(B, H, C, dtype=torch.int8, device=score.device)
    if B * H == 0 or C == 0:
        return out.view(torch.bool)
    rank = torch.empty(B * H, C, dtype=torch.int32, device=score.device)  # (the k > 1 programs' row ranks)
    args = (score, pos, evictable.view(torch.uint8), k)
    strides = (score.stride(0), score.stride(1), pos.stride(0), pos.stride(1), evictable.stride(0),
               evictable.stride(1), k.stride(0), k.stride(1), H, C, layout.prefix_len, layout.row_stride)
    evict_one_kernel[(B * H,)](*args, out, *strides, BLOCK_R=triton.next_power_of_2(layout.grid_h + 1),
                               BLOCK_C=BLOCK_C, **LAUNCH)  # (histogram bins: row + 1)
    tables = B * H
    tpp = -(-tables // min(tables, MANY_PROGRAMS_PER_SM * sm_count(score.device)))  # tables per program
    evict_many_kernel[(-(-tables // tpp),)](*args, rank, out, *strides, tables, tpp,
                                           BLOCK_T=triton.next_power_of_2(tpp), BLOCK_I=BLOCK_I, BLOCK_J=BLOCK_J,
                                           **LAUNCH)
    return out.view(torch.bool)
