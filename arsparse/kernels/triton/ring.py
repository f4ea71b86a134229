"""Launch wrapper of ring-buffer decode attention for offset policies: checks and block sizes."""
from __future__ import annotations

import torch
import triton

from ._ring import ring_decode_kernel

#: Launch options (chosen by a sweep on an H200, see BENCHMARKS.md).
LAUNCH = dict(num_warps=2)


def ring_decode_attention(q, prompt_k, prompt_v, sink_k, sink_v, ring_k, ring_v, offsets, pos,
                          n_sinks: int, scale: float | None = None) -> torch.Tensor:
    """Decode attention of an offset policy, reading only its read set.

    Parameters
    ----------
    q : (B, H, D) query of the step (unit last stride)
    prompt_k, prompt_v : (B, Hkv, P, D) the prompt's keys and values
    sink_k, sink_v : (B, Hkv, >= n_sinks, D) sink buffers (sink j holds position P + j)
    ring_k, ring_v : (B, Hkv, W, D) ring buffer: position p lives in slot (p - P) % W
    offsets : (H, n) int64 backward offsets of each head, -1 for padding
    pos : int64 scalar tensor, the query's position
    Returns (B, H, D) in q's dtype; fp32 arithmetic.
    """
    B, H, D = q.shape
    Hkv, P = prompt_k.shape[1], prompt_k.shape[2]
    W = ring_k.shape[2]
    tensors = dict(prompt_k=prompt_k, prompt_v=prompt_v, sink_k=sink_k, sink_v=sink_v, ring_k=ring_k, ring_v=ring_v)
    for name, t in tensors.items():
        if t.dim() != 4 or t.shape[0] != B or t.shape[1] != Hkv or t.shape[3] != D:
            raise ValueError(f"{name} must be (B={B}, Hkv={Hkv}, *, D={D}), got {tuple(t.shape)}")
        if t.dtype != q.dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} must have q's dtype ({q.dtype}) and a unit last stride")
    for k, v in (("prompt", (prompt_k, prompt_v)), ("sink", (sink_k, sink_v)), ("ring", (ring_k, ring_v))):
        if v[0].stride() != v[1].stride() or v[0].shape != v[1].shape:
            raise ValueError(f"{k} keys and values must have the same shape and strides")
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of kv heads ({Hkv})")
    if offsets.dim() != 2 or offsets.shape[0] != H or offsets.dtype != torch.long:
        raise ValueError(f"offsets must be an int64 (H={H}, n) table, got {offsets.dtype} {tuple(offsets.shape)}")
    if sink_k.shape[2] < n_sinks:
        raise ValueError(f"sink buffers hold {sink_k.shape[2]} entries, fewer than n_sinks={n_sinks}")
    if q.stride(-1) != 1 or not offsets.is_contiguous():
        raise ValueError("q needs a unit last stride and offsets must be contiguous")
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    n_off = offsets.shape[1]
    ring_decode_kernel[(B, H)](
        q, prompt_k, prompt_v, sink_k, sink_v, ring_k, ring_v, offsets, pos, out,
        q.stride(0), q.stride(1), prompt_k.stride(0), prompt_k.stride(1), prompt_k.stride(2),
        sink_k.stride(0), sink_k.stride(1), sink_k.stride(2), ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
        offsets.stride(0), out.stride(0), out.stride(1),
        P, n_sinks, W, n_off, D**-0.5 if scale is None else scale, D,
        G=H // Hkv, BLOCK_P=triton.next_power_of_2(max(P, 1)), BLOCK_S=triton.next_power_of_2(max(n_sinks, 1)),
        BLOCK_O=triton.next_power_of_2(max(n_off, 1)), BLOCK_D=triton.next_power_of_2(D), **LAUNCH,
    )
    return out
