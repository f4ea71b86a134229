"""Launch wrapper of split-KV decode attention: checks, split choice, scratch buffers."""
from __future__ import annotations

import torch
import triton

from ._decode import combine_kernel, decode_split_kernel

BLOCK_N = 128
#: Launch options of the split kernel (the defaults were chosen by a sweep on an H200, see BENCHMARKS.md).
SPLIT_LAUNCH = dict(num_warps=2, num_stages=3)


def choose_splits(rows: int, kv_heads: int, max_len: int, device: torch.device) -> int:
    """Enough (row, head, split) programs to fill the GPU about four times over, at least a block each."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    want = max(1, -(-4 * sms // (rows * kv_heads)))
    return max(1, min(want, -(-max_len // BLOCK_N), 64))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     scale: float | None = None, num_splits: int | None = None) -> torch.Tensor:
    """Dense decode attention over cache positions ``0..pos`` without reading the rest of the cache.

    Parameters
    ----------
    q : (B, H, D) tensor, fp16/bf16/fp32 (any strides with a unit last stride)
    k_cache, v_cache : (B, Hkv, S, D) tensors, same dtype, unit last stride; H % Hkv == 0
    pos : int64 scalar tensor on the same device, the last valid position (read on the device)
    Returns (B, H, D) in q's dtype; fp32 accumulation.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q (B, H, D) and k/v caches (B, Hkv, S, D), got {tuple(q.shape)}, "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    B, H, D = q.shape
    Bk, Hkv, S, Dk = k_cache.shape
    if Bk != B or Dk != D or H % Hkv:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)} vs cache {tuple(k_cache.shape)} (need same B, D and H % Hkv == 0)")
    if q.dtype != k_cache.dtype or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a unit stride in the last (head) dimension")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64) or pos.device != q.device:
        raise ValueError("pos must be a one-element integer tensor on q's device")
    G = H // Hkv
    splits = num_splits or choose_splits(B, Hkv, S, q.device)
    chunk = -(-S // splits)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N
    splits = -(-S // chunk)
    o_part = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
    m_part = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    block_d = triton.next_power_of_2(D)
    block_g = max(1, triton.next_power_of_2(G))
    scale = D**-0.5 if scale is None else scale
    decode_split_kernel[(B, Hkv, splits)](
        q, k_cache, v_cache, pos, o_part, m_part, l_part,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0), m_part.stride(1),
        scale, chunk, D,
        G=G, BLOCK_G=block_g, BLOCK_N=BLOCK_N, BLOCK_D=block_d, **SPLIT_LAUNCH,
    )
    combine_kernel[(B, H)](
        o_part, m_part, l_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0), m_part.stride(1),
        out.stride(0), out.stride(1), splits, D,
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
    )
    return out
