"""Launch wrapper of ring-buffer decode attention for offset policies: checks and block sizes."""
from __future__ import annotations

import torch
import triton

from ._pdl import pdl_args
from ._ring import ring_decode_kernel
from .decode import check_new_kv, check_offsets_fit, check_prompt_span, check_rope_table, position_stride

#: Settings of the kernel (chosen by sweeps on an H200 and checked in whole decode steps, BENCHMARKS.md
#: runs 6-8): rows of one query head per program, K/V tiles kept in the cache's dtype until the
#: products (``late_cast``), programs of one row launched together (``heads_first``; no faster, run 8),
#: with programmatic dependent launch the gathers issued before waiting for the previous kernel
#: (``early_loads``; batch 1, 576 tokens: diagonal 1.089 -> 1.042 ms per step, run 11), launch
#: options. (Prefetching the reads of the program N places later into the L2 was 0.37-0.41 ms slower
#: per step at batch 256, run 9, and was removed.) ``merged``: a row's prompt, sinks and ring entries
#: in one tile (batch 256, 576 tokens: diagonal 3.923 -> 3.781 ms per step, the ring kernel 1.956 ->
#: 1.828 ms, run 12).
#: ``rotate``: the ring cache hands this kernel q and k unrotated and the step's RoPE table (``rope=``),
#: taking the step's own RoPE kernel away (session 19; the cache reads this key, the kernel does not).
#: ``programs``: at most this many programs (0: one per (row block, head)), each taking those pairs in turn,
#: so that the kernel can hold part of the GPU beside the other half batch's products (``streams=2``).
LAUNCH = dict(rows_per_program=1, late_cast=False, heads_first=False, early_loads=True, merged=True, num_warps=1,
              rotate=True, programs=0)
#: ``merged`` puts a row's prompt, sinks and ring entries in one tile only up to this many rows (or the
#: ring's own tile size): a long caption prompt keeps its own tile.
MERGED_ROWS = 64
_BOOL = (lambda v: isinstance(v, bool), "a bool")
_VALID = dict(  # setting ``launch=`` may override -> (check, what is allowed)
    rows_per_program=(lambda v: type(v) is int and v >= 1, "an int >= 1"),
    programs=(lambda v: type(v) is int and v >= 0, "an int >= 0"),
    late_cast=_BOOL,
    heads_first=_BOOL,
    early_loads=_BOOL,
    merged=_BOOL,
    rotate=_BOOL,
    num_warps=(lambda v: v in (1, 2, 4, 8, 16), "1, 2, 4, 8 or 16"),
    num_stages=(lambda v: type(v) is int and v >= 1, "an int >= 1"),
)
LAUNCH_KEYS = set(_VALID)
_BOOLS = {k for k, v in _VALID.items() if v is _BOOL}


def _settings(given: dict | None, what: str) -> dict:
    """:data:`LAUNCH` overridden by ``given``: every key of ``given`` in :data:`LAUNCH_KEYS`, every value valid."""
    given = {} if given is None else given
    unknown = set(given) - LAUNCH_KEYS
    if unknown:
        raise ValueError(f"unknown {what} settings {sorted(unknown)}; allowed: {sorted(LAUNCH_KEYS)}")
    merged = {**LAUNCH, **given}
    for k, v in merged.items():
        check, allowed_values = _VALID[k]
        if not check(v):
            raise ValueError(f"{what} setting {k}={v!r} is invalid: must be {allowed_values}")
    return merged


def _row_alignment(*buffers: torch.Tensor) -> int:
    """The largest power of two up to 16 that divides, in bytes, every buffer's address and its strides
    but the last: the alignment of every (row, head, entry) vector the merged kernel gathers."""
    g = 16
    for t in buffers:
        for v in (t.data_ptr(), *(s * t.element_size() for s in t.stride()[:-1])):
            while v % g:
                g //= 2
    return g


def parse_launch(text: str) -> dict:
    """``"rows_per_program=4,late_cast=1,num_warps=8"`` -> :data:`LAUNCH` with those settings, checked
    (ints; the bools ``late_cast``, ``heads_first``, ``early_loads``, ``merged`` and ``rotate`` take
    1/0/true/false).
    For ``arsparse bench --ring-launch``."""
    given = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"ring launch settings are KEY=VALUE pairs separated by commas, got {item!r}")
        key, value = key.strip(), value.strip().lower()
        if key in _BOOLS:
            if value not in ("1", "0", "true", "false"):
                raise ValueError(f"{key} takes 1, 0, true or false, got {value!r}")
            given[key] = value in ("1", "true")
        else:
            try:
                given[key] = int(value)
            except ValueError:
                raise ValueError(f"ring launch setting {key} takes an integer, got {value!r}") from None
    return _settings(given, "ring launch")


def ring_decode_attention(q, k_new, v_new, prompt_k, prompt_v, sink_k, sink_v, ring_k, ring_v, offsets, pos,
                          n_sinks: int, scale: float | None = None, launch: dict | None = None,
                          prompt_span: torch.Tensor | None = None,
                          rest_sums: tuple[torch.Tensor, torch.Tensor] | None = None,
                          rope: torch.Tensor | None = None, update_sums: bool = False) -> torch.Tensor:
    """The decode step of an offset policy's ring cache in one kernel: attend over the policy's read
    set (reading nothing else) and write the new token.

    The new token of image index ``i = pos - P`` goes to ring slot ``i % W`` and, while
    ``i < n_sinks``, to sink slot ``i`` (the cache's scratch sink slot is not written); reads of
    those slots take it from registers, as if it had been written first.

    Parameters
    ----------
    q : (B, H, D) query of the step (unit last stride)
    k_new, v_new : (B, Hkv, D) the new token's keys and values (unit last stride)
    prompt_k, prompt_v : (B, Hkv, P, D) the prompt's keys and values, P >= 1
    sink_k, sink_v : (B, Hkv, >= n_sinks, D) sink buffers (sink j holds position P + j)
    ring_k, ring_v : (B, Hkv, W, D) ring buffer: position p lives in slot (p - P) % W
    offsets : (H, n) int64 backward offsets of each head, -1 for padding
    pos : integer tensor, the query's position (>= P): one for every row, or (B,) one per row
    launch : overrides of :data:`LAUNCH` (for the launch sweep): ``rows_per_program`` rows of one query
        head per program (its offsets loaded once, a loop over the rows), ``late_cast`` (K/V tiles in
        the cache's dtype until the products), ``heads_first`` (a grid of (heads, row blocks)),
        ``early_loads`` (with PDL: each row's gathers before the wait for the previous kernel),
        ``merged`` (a row's prompt, sinks and ring entries in one tile and one softmax, where that tile has at
        most :data:`MERGED_ROWS` rows or no more than the ring's alone), ``programs`` (at most that many
        programs, each taking (row block, head) pairs in turn; 0: one per pair), ``num_warps``, ``num_stages``
    prompt_span : optional (B, 2) int32, t2i caption padding: row ``b`` reads only prompt positions
        ``[prompt_span[b, 0], prompt_span[b, 1])``, a non-empty range. None: the whole prompt, no extra loads.
    rest_sums : optional (k_sum, v_sum), each (B, Hkv, D) fp32 with a unit last stride: the sums of K
        and V over the image positions past the sinks up to ``pos``, *the new token included* (the
        caller adds it before the launch; the kernel only reads them) unless ``update_sums``. Each head
        then also attends to the mean-field remainder entry of :mod:`arsparse.policies.remainder`.
    rope : optional (1 or B, D/2, 2) contiguous fp32 cos/sin table (one shared, or one per row): ``q`` and
        ``k_new`` are unrotated and the kernel rotates them as :func:`arsparse.models.rope.apply_rope`
        would (the cache gets the rotated key). With ``rest_sums`` it needs ``update_sums`` (the sums
        hold rotated keys, which only the kernel has).
    update_sums : with ``rest_sums``, which then hold the sums *before* the new token: the kernel adds the
        new token (rotated) to them where its image index is past the sinks, and stores them back.
        Needs one query head per kv head (H == Hkv): each row's sums then have one reader, its writer.
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
    if P < 1 or W < 1:
        raise ValueError(f"the prompt and the ring need at least one position each, got P={P}, W={W}")
    if offsets.dim() != 2 or offsets.shape[0] != H or offsets.dtype != torch.long:
        raise ValueError(f"offsets must be an int64 (H={H}, n) table, got {offsets.dtype} {tuple(offsets.shape)}")
    if sink_k.shape[2] < n_sinks:
        raise ValueError(f"sink buffers hold {sink_k.shape[2]} entries, fewer than n_sinks={n_sinks}")
    if q.stride(-1) != 1 or not offsets.is_contiguous():
        raise ValueError("q needs a unit last stride and offsets must be contiguous")
    check_new_kv(k_new, v_new, B, Hkv, D, q.dtype)
    check_offsets_fit(**tensors)
    spos = position_stride(pos, B, q.device)
    if prompt_span is not None:
        check_prompt_span(prompt_span, B, q.device)
    if rest_sums is not None:
        for name, t in zip(("k_sum", "v_sum"), rest_sums):
            if tuple(t.shape) != (B, Hkv, D) or t.dtype != torch.float32 or t.stride(-1) != 1:
                raise ValueError(f"rest_sums' {name} must be fp32 (B={B}, Hkv={Hkv}, D={D}) with a unit last "
                                 f"stride, got {t.dtype} {tuple(t.shape)}")
        if rest_sums[0].stride() != rest_sums[1].stride():
            raise ValueError("rest_sums' k_sum and v_sum must have the same strides")
    if update_sums and (rest_sums is None or H != Hkv):
        raise ValueError(f"update_sums=True needs rest_sums= and one query head per kv head, got "
                         f"{'no rest_sums' if rest_sums is None else f'H={H}, Hkv={Hkv}'}: with grouped "
                         "heads several programs read a row's sums, so the caller adds the new token")
    if rope is not None:
        check_rope_table(rope, B, D, q.device)
        if rest_sums is not None and not update_sums:
            raise ValueError("rope= (rotation in the kernel) and rest_sums= need update_sums=True: running "
                             "sums the caller updates would need the rotated key before the launch")
    sums = (q, q) if rest_sums is None else rest_sums  # (unused pointers without the remainder)
    out = torch.empty(B, H, D, device=q.device, dtype=q.dtype)
    n_off = offsets.shape[1]
    srope = 0 if rope is None or rope.shape[0] == 1 else rope.stride(0)
    args = (q, k_new, v_new, q if rope is None else rope, prompt_k, prompt_v, sink_k, sink_v, ring_k, ring_v,
            offsets, pos, pos if prompt_span is None else prompt_span, out, *sums,
            q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1), srope,
            prompt_k.stride(0), prompt_k.stride(1), prompt_k.stride(2), sink_k.stride(0), sink_k.stride(1),
            sink_k.stride(2), ring_k.stride(0), ring_k.stride(1), ring_k.stride(2), offsets.stride(0), spos,
            out.stride(0), out.stride(1), sums[0].stride(0), sums[0].stride(1))
    blocks = dict(BLOCK_P=triton.next_power_of_2(P), BLOCK_S=triton.next_power_of_2(max(n_sinks, 1)),
                  BLOCK_D=triton.next_power_of_2(D), HAS_SPAN=prompt_span is not None)
    scale = D**-0.5 if scale is None else scale
    cfg = dict(LAUNCH) if launch is None else _settings(launch, "launch")
    cfg.pop("rotate")  # (the cache's choice: it passes rope= or not)
    rows = cfg.pop("rows_per_program")
    heads_first = cfg.pop("heads_first")
    ring_tile = triton.next_power_of_2(max(n_off, 1))
    merged_tile = triton.next_power_of_2(n_off + n_sinks + P)
    merged = cfg.pop("merged") and merged_tile <= max(MERGED_ROWS, ring_tile)
    grid = (H, triton.cdiv(B, rows)) if heads_first else (triton.cdiv(B, rows), H)
    programs = cfg.pop("programs")
    persistent = 0 < programs < grid[0] * grid[1]
    ring_decode_kernel[(programs,) if persistent else grid](
        *args, B, P, n_sinks, W, n_off, scale, D, H, G=H // Hkv, ROWS=rows, PERSISTENT=persistent,
        BLOCK_O=merged_tile if merged else ring_tile,
        HAS_REST=rest_sums is not None, HAS_ROPE=rope is not None, ADD_NEW=update_sums,
        LATE_CAST=cfg.pop("late_cast"), HEADS_FIRST=heads_first,
        EARLY=cfg.pop("early_loads"), MERGED=merged, ALIGN=_row_alignment(*tensors.values()) if merged else 1,
        **blocks,
        **pdl_args(q.device), **cfg)
    return out
