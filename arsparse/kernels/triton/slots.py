"""Launch wrapper of slot-table decode attention for scored policies: checks, split choice, scratch."""
from __future__ import annotations

import torch
import triton

from ._slots import slots_combine_kernel, slots_split_kernel
from .decode import check_offsets_fit, check_prompt_span, choose_splits
from .settings import parse_tile_launch

BLOCK_C = 64  # slots per block of the weights pass
#: Launch options of the split pass: ``block_n`` slots per block, ``late_cast`` (K/V tiles in the
#: cache's dtype until the products, as the ring kernel's), warps and stages (chosen by a sweep on an
#: H200, BENCHMARKS.md run 23: 32-slot blocks and one warp 102 -> 73 us a layer at batch 256, h2o's
#: step 6.80 -> 5.83 ms, headkv's 7.55 -> 6.48; ``arsparse bench --variant slots.KEY=INT``).
LAUNCH = dict(block_n=32, late_cast=0, num_warps=1, num_stages=2)
COMBINE_LAUNCH = dict(num_warps=4)


def parse_launch(text: str) -> dict:
    """``'{"block_n": 128, "late_cast": 1}'`` -> :data:`LAUNCH` with those settings (``block_n`` a power
    of 2 >= 16, ``late_cast`` 0 or 1, warps a power of 2 up to 16, stages >= 1)."""
    return parse_tile_launch(text, LAUNCH, "slots launch", switches=("late_cast",))


def slot_decode_attention(q: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor, slot_k: torch.Tensor,
                          slot_v: torch.Tensor, slot_pos: torch.Tensor, scale: float | None = None,
                          num_splits: int | None = None,
                          prompt_span: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention over the prompt and the occupied slots of each (row, kv head).

    Parameters
    ----------
    q : (B, H, D) query of the step, fp16/bf16/fp32 (unit last stride)
    prompt_k, prompt_v : (B, Hkv, P, D) the prompt's keys and values, q's dtype; H % Hkv == 0
    slot_k, slot_v : (B, Hkv, C, D) the slot tables, q's dtype
    slot_pos : (B, Hkv, C) int64 sequence position of each slot, -1 for a free slot (never read)
    scale : logit scale, default D ** -0.5
    num_splits : splits of the slot table (default: enough programs to fill the GPU)
    prompt_span : optional (B, 2) int32, t2i caption padding: row ``b`` reads only prompt positions
        ``[prompt_span[b, 0], prompt_span[b, 1])`` (padded ones get no weight). None: the whole prompt.

    Returns
    -------
    out : (B, H, D) in q's dtype (fp32 arithmetic)
    weights : (B, Hkv, C) float32, each slot's attention weight summed over the G = H / Hkv query
        heads of its kv head (0 for free slots): with the prompt's share, each head's weights sum to 1.
    A (row, kv head) with no prompt and no occupied slot gets zeros.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H, D), got {tuple(q.shape)}")
    B, H, D = q.shape
    if prompt_k.dim() != 4 or slot_k.dim() != 4:
        raise ValueError(f"prompt_k and slot_k must be (B, Hkv, n, D), got {tuple(prompt_k.shape)}, "
                         f"{tuple(slot_k.shape)}")
    Hkv, P, C = prompt_k.shape[1], prompt_k.shape[2], slot_k.shape[2]
    want = dict(prompt_k=(B, Hkv, P, D), prompt_v=(B, Hkv, P, D), slot_k=(B, Hkv, C, D), slot_v=(B, Hkv, C, D))
    tensors = dict(prompt_k=prompt_k, prompt_v=prompt_v, slot_k=slot_k, slot_v=slot_v)
    for name, t in tensors.items():
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name} must be (B, Hkv, n, D) = {want[name]} to match q {tuple(q.shape)} "
                             f"and prompt_k/slot_k, got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.stride(-1) != 1 or t.device != q.device:
            raise ValueError(f"{name} must have q's dtype ({q.dtype}) and device and a unit last stride, "
                             f"got {t.dtype} on {t.device} with strides {t.stride()}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32) or q.stride(-1) != 1:
        raise ValueError(f"q must be fp16, bf16 or fp32 with a unit last stride, got {q.dtype} strides {q.stride()}")
    check_offsets_fit(**tensors)
    if prompt_k.stride() != prompt_v.stride() or slot_k.stride() != slot_v.stride():
        raise ValueError("keys and values must have the same strides (prompt_k/prompt_v, slot_k/slot_v)")
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv})")
    if slot_pos.shape != (B, Hkv, C) or slot_pos.dtype != torch.long or slot_pos.device != q.device \
            or slot_pos.stride(-1) != 1:
        raise ValueError(f"slot_pos must be int64 (B, Hkv, C) = {(B, Hkv, C)} on q's device with a unit last "
                         f"stride, got {slot_pos.dtype} {tuple(slot_pos.shape)} on {slot_pos.device}")
    if C == 0:
        raise ValueError("the slot table is empty (C = 0)")
    if prompt_span is not None:
        check_prompt_span(prompt_span, B, q.device)
    G = H // Hkv
    block_n, late_cast = LAUNCH["block_n"], LAUNCH["late_cast"]
    splits = num_splits or choose_splits(B, Hkv, C, q.device, tile=block_n)
    chunk = -(-C // splits)
    chunk = -(-chunk // block_n) * block_n
    splits = -(-C // chunk)
    f32 = dict(device=q.device, dtype=torch.float32)
    o_part = torch.empty(B, H, splits, D, **f32)
    m_part = torch.empty(B, H, splits, **f32)
    l_part = torch.empty(B, H, splits, **f32)
    logits = torch.empty(B, H, C, **f32)
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    weights = torch.empty(B, Hkv, C, **f32)
    block_d = triton.next_power_of_2(D)
    block_g = triton.next_power_of_2(G)
    slots_split_kernel[(B, Hkv, splits)](
        q, prompt_k, prompt_v, slot_k, slot_v, slot_pos, slot_pos if prompt_span is None else prompt_span,
        logits, o_part, m_part, l_part,
        q.stride(0), q.stride(1), prompt_k.stride(0), prompt_k.stride(1), prompt_k.stride(2),
        slot_k.stride(0), slot_k.stride(1), slot_k.stride(2), slot_pos.stride(0), slot_pos.stride(1),
        logits.stride(0), logits.stride(1), o_part.stride(0), o_part.stride(1), o_part.stride(2),
        m_part.stride(0), m_part.stride(1),
        P, C, chunk, D**-0.5 if scale is None else scale, D,
        G=G, BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d, HAS_SPAN=prompt_span is not None,
        LATE_CAST=bool(late_cast), num_warps=LAUNCH["num_warps"], num_stages=LAUNCH["num_stages"],
    )
    slots_combine_kernel[(B, Hkv)](
        o_part, m_part, l_part, logits, out, weights,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0), m_part.stride(1),
        logits.stride(0), logits.stride(1), out.stride(0), out.stride(1), weights.stride(0), weights.stride(1),
        splits, C, D,
        G=G, BLOCK_G=block_g, BLOCK_S=triton.next_power_of_2(splits), BLOCK_C=BLOCK_C, BLOCK_D=block_d, **COMBINE_LAUNCH,
    )
    return out, weights
