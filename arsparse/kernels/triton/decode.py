"""Launch wrapper of split-KV decode attention: checks, split choice, scratch buffers."""
from __future__ import annotations

import torch
import triton

from ._decode import combine_kernel, decode_split_kernel
from ._pdl import pdl_args
from .settings import parse_tile_launch

#: Settings of the split kernel (chosen by sweeps on an H200, BENCHMARKS.md). When the (row, kv head)
#: pairs fill the GPU: keys per tile ``block_n`` (run 14, 128 -> 64: dense at batch 256 9.66 -> 9.27 ms per
#: step at 576 tokens, 14.49 -> 14.15 ms at 1,024) and ``dot`` 1, the tile's two products on tensor cores
#: (the group's queries padded to 16 rows, probabilities in the input dtype; run 16, with 64-key tiles:
#: 576 tokens 9.28 -> 8.83 ms at batch 256, 3.53 -> 3.34 at 64, 1.78 -> 1.72 at 8, 1,024 tokens at max
#: batch 20.56 -> 19.50). Below one pair per SM (batch 1 in latency mode): tiles of ``small_block_n``
#: and twice the splits (sweep run 9, 2 rows: 6.4 against 8.6 us a call), and ``small_dot`` 0 (run 16:
#: batch 1 1.109 ms, 1.184 with tensor cores). Warps, stages. ``prefetch`` 1: each pass of the loop loads
#: the next tile before it attends over this one (registers for two tiles: use it with ``block_n`` 64 or
#: less, 128-key tiles spill; run 14, with 64-key tiles: 9.75 against 9.27 ms without, so off). (The
#: split that finishes last merging the splits, by tickets, in place of the combine launch: run 22, batch 1
#: 1.110 -> 1.096 ms at 576 tokens, 1.433 -> 1.440 at 4,096, batch 8 1.725 -> 1.757: removed. Fewer,
#: longer splits at batch 1, one per (row, head) below 640 keys with no combine launch: 1.286 ms, two
#: 1.263, run 23 at 2f1368a: removed.) ``small_splits``: at most this many splits below one pair per SM (0: as
#: :func:`choose_splits` picks; 1: one program per (row, head), no combine launch; run 29 on an H100, batch 1
#: dense: 1.238-1.531 ms with 128- or 256-key tiles against the engine's 1.170; 32-key tiles 1.278).
#: ``programs``: at most this many programs (0: one per (row, kv head, split)), each taking triples in turn,
#: so that the kernel holds part of the GPU and leaves the rest to work beside it (two half batches'
#: products: run 39 found the kernel keeping 97 % of its bandwidth on half the SMs; not yet timed in a step).
LAUNCH = dict(block_n=64, small_block_n=64, dot=1, small_dot=0, num_warps=2, num_stages=3, prefetch=0, small_splits=0,
              programs=0)


def parse_launch(text: str) -> dict:
    """``'{"block_n": 64, "prefetch": 1}'`` -> :data:`LAUNCH` with those settings (block sizes and warps
    powers of 2, tiles of 16 keys at least, ``dot``, ``small_dot`` and ``prefetch`` 0 or 1, ``small_splits`` and
    ``programs`` ints >= 0). For ``arsparse bench --variant dense.KEY=VALUE``."""
    return parse_tile_launch(text, LAUNCH, "dense launch", switches=("dot", "small_dot", "prefetch"),
                             counts=("small_splits", "programs"))


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (8 off CUDA, where the interpreter runs the kernels)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8


def fills_gpu(rows: int, kv_heads: int, device: torch.device) -> bool:
    """Whether ``rows`` x ``kv_heads`` (row, head) pairs give every SM one at least (8 off CUDA)."""
    return rows * kv_heads >= sm_count(device)


def block_n(rows: int, kv_heads: int, device: torch.device) -> int:
    """Keys per tile of the split kernel for ``rows`` x ``kv_heads`` (row, head) pairs."""
    big = LAUNCH["block_n"]
    return big if fills_gpu(rows, kv_heads, device) else min(big, LAUNCH["small_block_n"])


def tensor_cores(rows: int, kv_heads: int, device: torch.device) -> bool:
    """Whether the split kernel takes its products on tensor cores for ``rows`` x ``kv_heads`` pairs."""
    return bool(LAUNCH["dot"] if fills_gpu(rows, kv_heads, device) else LAUNCH["small_dot"])


def choose_splits(rows: int, kv_heads: int, max_len: int, device: torch.device, tile: int | None = None) -> int:
    """Enough (row, head, split) programs to fill the GPU about four times over, at least a tile each
    (``tile`` keys: the split kernel's :func:`block_n` unless given, as the slot kernel gives its own; without
    ``tile``, at most ``LAUNCH["small_splits"]`` when set and the pairs do not fill the GPU)."""
    want = max(1, -(-4 * sm_count(device) // (rows * kv_heads)))
    cap = LAUNCH["small_splits"] if tile is None and not fills_gpu(rows, kv_heads, device) else 0
    return max(1, min(want, -(-max_len // (tile or block_n(rows, kv_heads, device))), cap or 64))


def position_stride(pos: torch.Tensor, rows: int, device: torch.device) -> int:
    """Row stride of ``pos`` for a kernel: 0 for one position shared by the batch, else its stride.

    ``pos`` is an integer tensor on ``device``: one element (every row at that position) or
    ``(rows,)`` (row ``b`` at ``pos[b]``).
    """
    if pos.dtype not in (torch.int32, torch.int64) or pos.device != device:
        raise ValueError(f"pos must be an integer tensor on {device}, got {pos.dtype} on {pos.device}")
    if pos.numel() == 1 and pos.dim() <= 1:
        return 0
    if pos.dim() != 1 or pos.shape[0] != rows:
        raise ValueError(f"pos must hold one position or one per row ({rows},), got shape {tuple(pos.shape)}")
    return pos.stride(0)


def check_prompt_span(span, B: int, device: torch.device) -> None:
    """A caption mask as the kernels read it: (B, 2) contiguous int32 ``[start, end)`` per row, on ``device``.

    The values are not checked here (that would sync with the device): each row needs
    ``0 <= start < end <= P``, as :func:`arsparse.prompt_mask.prompt_span` makes them.
    """
    if span.dtype != torch.int32 or tuple(span.shape) != (B, 2) or not span.is_contiguous() or span.device != device:
        raise ValueError(f"prompt_span must be a contiguous int32 (B={B}, 2) tensor of [start, end) on {device}, "
                         f"got {span.dtype} {tuple(span.shape)} on {span.device}")


def check_offsets_fit(**tensors: torch.Tensor) -> None:
    """The kernels address a tensor with 32-bit element offsets: its farthest element must lie below 2**31."""
    for name, t in tensors.items():
        extent = sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n)
        if extent >= 2**31:
            raise ValueError(f"{name} spans {extent + 1:,} elements, past the 2**31 that the Triton kernels' 32-bit "
                             f"offsets reach: use a smaller batch (or the PyTorch kernels, kernel='torch')")


def check_rope_table(rope: torch.Tensor, B: int, D: int, device) -> None:
    """A step's RoPE table for a kernel that rotates q and k itself: (1 or B, D/2, 2) contiguous fp32."""
    if (rope.dim() != 3 or rope.shape[0] not in (1, B) or tuple(rope.shape[1:]) != (D // 2, 2) or D % 2
            or rope.dtype != torch.float32 or not rope.is_contiguous() or rope.device != device):
        raise ValueError(f"the rope table must be contiguous fp32 (1 or B={B}, D/2={D // 2}, 2) on {device}, "
                         f"got {rope.dtype} {tuple(rope.shape)} on {rope.device}")


def check_new_kv(k_new: torch.Tensor, v_new: torch.Tensor, B: int, Hkv: int, D: int, dtype: torch.dtype) -> None:
    """The new token's keys and values: (B, Hkv, D) each, the cache's dtype, unit last stride."""
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if t.shape != (B, Hkv, D):
            raise ValueError(f"{name} must be (B={B}, Hkv={Hkv}, D={D}), got {tuple(t.shape)}")
        if t.dtype != dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} must have the cache's dtype ({dtype}) and a unit last stride")


def decode_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, pos: torch.Tensor, scale: float | None = None,
                     num_splits: int | None = None, prompt_span: torch.Tensor | None = None,
                     prompt_len: int = 0) -> torch.Tensor:
    """Write the new token at ``pos`` and attend over cache positions ``0..pos``, in one kernel.

    The cache is read only below ``pos``; the new token's K/V are written to slot ``pos`` and used
    from registers, so nothing past ``pos`` (nor the old content of slot ``pos``) is read.

    Parameters
    ----------
    q : (B, H, D) tensor, fp16/bf16/fp32 (any strides with a unit last stride)
    k_new, v_new : (B, Hkv, D) the new token's keys and values (unit last stride)
    k_cache, v_cache : (B, Hkv, S, D) tensors, same dtype, unit last stride; H % Hkv == 0
    pos : integer tensor on the same device (read on the device): one position for every row, or
        (B,) one per row; a position outside ``0..S-1`` writes nothing
    prompt_span : optional (B, 2) int32, t2i caption padding: row ``b`` reads prompt positions
        (those below ``prompt_len``) only in ``[prompt_span[b, 0], prompt_span[b, 1])``, a non-empty
        range; padded positions are not read. None (the default): no padding, no extra loads.
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
    check_new_kv(k_new, v_new, B, Hkv, D, q.dtype)
    check_offsets_fit(k_cache=k_cache, v_cache=v_cache)
    spos = position_stride(pos, B, q.device)
    if prompt_span is not None:
        check_prompt_span(prompt_span, B, q.device)
        if not 1 <= prompt_len <= S:
            raise ValueError(f"prompt_len must be in 1..{S} (the cache length) with a prompt_span, got {prompt_len}")
    G = H // Hkv
    splits = num_splits or choose_splits(B, Hkv, S, q.device)
    bn = block_n(B, Hkv, q.device)
    chunk = -(-S // splits)
    chunk = -(-chunk // bn) * bn
    splits = -(-S // chunk)
    direct = splits == 1
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    if direct:  # the split kernel writes the output; no partials, no combine launch
        o_part = m_part = l_part = out.new_empty(1, 1, 1, dtype=torch.float32)
    else:
        o_part = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
        m_part = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
        l_part = torch.empty_like(m_part)
    dot = tensor_cores(B, Hkv, q.device)
    block_d = max(16 if dot else 1, triton.next_power_of_2(D))  # (tensor-core products: 16 rows and
    block_g = max(16 if dot else 1, triton.next_power_of_2(G))  # columns at least)
    scale = D**-0.5 if scale is None else scale
    triples = B * Hkv * splits
    persistent = 0 < LAUNCH["programs"] < triples
    decode_split_kernel[(LAUNCH["programs"],) if persistent else (B, Hkv, splits)](
        q, k_new, v_new, k_cache, v_cache, pos, pos if prompt_span is None else prompt_span,
        o_part, m_part, l_part, out,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), spos,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0), m_part.stride(1),
        out.stride(0), out.stride(1),
        S, scale, chunk, D, prompt_len, B, Hkv, splits,
        G=G, BLOCK_G=block_g, BLOCK_N=bn, BLOCK_D=block_d, DIRECT=direct, HAS_SPAN=prompt_span is not None,
        DOT=dot, IEEE=dot and q.dtype == torch.float32, PREFETCH=bool(LAUNCH["prefetch"]), PERSISTENT=persistent,
        **pdl_args(q.device),
        num_warps=LAUNCH["num_warps"], num_stages=LAUNCH["num_stages"],
    )
    if not direct:
        combine_kernel[(B, H)](
            o_part, m_part, l_part, out,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), m_part.stride(0), m_part.stride(1),
            out.stride(0), out.stride(1), splits, D,
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, **pdl_args(q.device),
        )
    return out
