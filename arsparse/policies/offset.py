"""Offset policies: the prompt, a few sinks, and a fixed set of backward offsets from the query.

The read set of a query at position ``q`` (an image position, ``q >= P``) is

    {0 .. P-1}  U  {P .. P+sinks-1}  U  {q - o : o in offsets(layer, head), q - o >= P + sinks}

with ``0`` always among the offsets (a token reads itself). The oldest position any offset
reaches bounds a ring buffer of ``max(offsets) + 1`` image positions: anything older, prompt and
sinks aside, is never read again and its memory is reused.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import Layout
from .base import Budget, Policy, PolicyError, dense_entries, need_int, need_rho


#: Budget entries the remainder's two fp32 running sums (K and V, per kv head) weigh: a kept entry is
#: one K and one V vector in the usual 16-bit cache dtype, so the fp32 pair counts as two.
REMAINDER_ENTRIES = 2


def need_flag(policy: str, name: str, value, what: str = "") -> bool:
    """A boolean parameter: True/False, or 1/0 (what ``name=1`` parses to on the command line)."""
    if value is True or value is False or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise PolicyError(f"{policy}: {name}{what} must be true/false (or 1/0), got {value!r}")


@dataclass(frozen=True)
class OffsetPolicy(Policy):
    """Base of the offset policies. Subclasses declare ``remainder: bool = False`` (see the module doc)
    and call :meth:`_check_remainder` from ``__post_init__``."""

    kind = "offset"
    remainder = False  # a class default; subclasses make it a dataclass field

    def _check_remainder(self) -> None:
        object.__setattr__(self, "remainder", need_flag(self.name, "remainder", self.remainder,
                                                        " (add the mean-field remainder entry)"))

    def extra_entries(self) -> int:
        """Budget entries beyond the read set: the remainder's running sums, if any."""
        return REMAINDER_ENTRIES if self.remainder else 0

    # -- what subclasses define ------------------------------------------------
    def sink_count(self, layout: Layout) -> int:
        return 0

    def head_offsets(self, layout: Layout, n_layer: int, n_head: int) -> list[list[list[int]]]:
        """Offsets per [layer][head] (each containing 0). Uniform policies repeat one list."""
        offs = self.offsets(layout)
        return [[offs] * n_head for _ in range(n_layer)]

    def offsets(self, layout: Layout) -> list[int]:
        raise NotImplementedError

    # -- execution -----------------------------------------------------------------
    def make_cache(self, cfg, rows: int, dtype, device, kernel: str = "torch"):
        from .caches import RingKVCache

        return RingKVCache(cfg, self, rows, dtype, device, kernel=kernel)

    def teacher_forced_logits(self, gpt, cond, tokens, prompt_mask=None):
        """Attention restricted to each query's read set: what the ring cache computes, in one pass
        (with ``remainder``, plus the remainder entry: :class:`~arsparse.policies.remainder.RemainderAttention`).

        ``prompt_mask`` (B, P) bool (t2i caption padding, checked): the prompt block is the whole
        prompt, less its padded positions.
        """
        T = gpt.config.cls_token_num + tokens.shape[1] - 1
        return gpt.logits(cond, tokens, backend=self.attention_backend(gpt, T, tokens.device, prompt_mask))

    def attention_backend(self, gpt, T: int, device, prompt_mask=None):
        """The model's attention over ``T`` positions restricted to this policy's read sets (a backend for
        ``gpt.logits(..., backend=)``, differentiable: sparse-aware training builds it once)."""
        from ..models.gpt import MaskedAttention
        from ..prompt_mask import attention_mask

        cfg = gpt.config
        masks = self.mask(gpt.layout, T, cfg.n_layer, cfg.n_head).to(device)  # (L, H, T, T)
        rows = None if prompt_mask is None else attention_mask(prompt_mask.to(device), T)
        gqa = cfg.kv_heads != cfg.n_head
        if self.remainder:
            from .remainder import RemainderAttention

            first = gpt.layout.prefix_len + min(self.sink_count(gpt.layout), gpt.layout.image_tokens - 1)
            return RemainderAttention(masks, first, rows, gqa=gqa)
        return MaskedAttention(masks, rows, gqa=gqa)

    # -- derived -----------------------------------------------------------------
    def offset_table(self, layout: Layout, n_layer: int, n_head: int) -> torch.Tensor:
        """(L, H, n) int64 offsets, ascending, padded with -1."""
        per = self.head_offsets(layout, n_layer, n_head)
        n = max(len(o) for layer in per for o in layer)
        table = torch.full((n_layer, n_head, n), -1, dtype=torch.long)
        for li, layer in enumerate(per):
            for h, offs in enumerate(layer):
                table[li, h, : len(offs)] = torch.tensor(sorted(offs), dtype=torch.long)
        return table

    def window(self, layout: Layout, n_layer: int = 1, n_head: int = 1) -> int:
        """Ring-buffer length: image positions the cache holds (the largest offset + 1, at most N - 1)."""
        top = max(max(o) for layer in self.head_offsets(layout, n_layer, n_head) for o in layer)
        return min(top + 1, layout.image_tokens - 1)

    def read_positions(self, layout: Layout, q: int, layer: int = 0, head: int = 0,
                       n_layer: int = 1, n_head: int = 1) -> list[int]:
        """Sorted key positions a query at sequence position ``q`` reads."""
        P, S = layout.prefix_len, self.sink_count(layout)
        if q < P:
            return list(range(q + 1))  # prefill: dense causal
        offs = self.head_offsets(layout, n_layer, n_head)[layer][head]
        keep = set(range(min(P + S, q + 1)))
        keep.update(q - o for o in offs if P + S <= q - o <= q)
        return sorted(keep)

    def mask(self, layout: Layout, T: int, n_layer: int = 1, n_head: int = 1) -> torch.Tensor:
        """(L, H, T, T) bool read masks for teacher forcing over positions 0..T-1."""
        P, S = layout.prefix_len, self.sink_count(layout)
        table = self.offset_table(layout, n_layer, n_head)  # (L, H, n), -1 padded
        # has[l, h, d]: offset d is read by (l, h); index T is a dummy (padding, far offsets, the future)
        has = torch.zeros(n_layer, n_head, T + 1, dtype=torch.bool)
        has.scatter_(2, torch.where((table >= 0) & (table < T), table, T), True)
        has[..., T] = False
        qpos = torch.arange(T)[:, None]  # (T, 1)
        kpos = torch.arange(T)[None, :]  # (1, T)
        causal = kpos <= qpos
        hit = has[:, :, torch.where(causal, qpos - kpos, T)]  # (L, H, T, T)
        fixed = (kpos < P + S) & causal
        decode = (qpos >= P)
        return torch.where(decode, (hit & (kpos >= P + S)) | fixed, causal)

    def budget(self, layout: Layout, n_layer: int = 1, n_head: int = 1) -> Budget:
        self.check(layout)
        P, N = layout.prefix_len, layout.image_tokens
        S = min(self.sink_count(layout), N - 1)
        # Mean over decode queries and heads of read_positions' length, counted per distinct offsets row.
        rows, count = self.offset_table(layout, n_layer, n_head).flatten(0, 1).unique(dim=0, return_counts=True)
        q = torch.arange(P, P + N - 1)[:, None, None]  # (T, 1, 1)
        ring = ((rows >= 0) & (q - rows >= P + S)).sum(-1)  # (T, rows): offsets past the sinks
        reads = (ring + torch.clamp(q[:, :, 0] + 1, max=P + S)).double()  # (T, rows)
        read = float((reads * count).sum() / (count.sum() * reads.shape[0]))
        kept = min(P + S + self.window(layout, n_layer, n_head), dense_entries(layout))
        extra = self.extra_entries()  # the remainder's running sums: held, and read by every query
        return Budget(read=read + extra, kept=kept + extra, dense=dense_entries(layout))


@dataclass(frozen=True)
class StreamingPolicy(OffsetPolicy):
    """StreamingLLM: attention sinks plus a window of the most recent tokens.

    ``sinks`` first image tokens stay (the prompt always stays too); ``recent`` tokens including
    the query. ``rho`` (kept / dense), when given, sets ``recent`` instead (the remainder's
    running sums count against it). ``remainder``: see the module doc.
    """

    source = "Xiao et al., Efficient Streaming Language Models with Attention Sinks, ICLR 2024"
    sinks: int = 4
    recent: int = 64
    rho: float | None = None
    remainder: bool = False

    def __post_init__(self):
        need_int(self.name, "sinks", self.sinks, 0)
        need_int(self.name, "recent", self.recent, 1)
        need_rho(self.name, self.rho, optional=True)
        self._check_remainder()

    def sink_count(self, layout):
        return self.sinks

    def n_recent(self, layout: Layout) -> int:
        if self.rho is None:
            return self.recent
        w = int(self.rho * dense_entries(layout)) - layout.prefix_len - self.sinks - self.extra_entries()
        if w < 1:
            raise PolicyError(f"{self.name}: rho={self.rho} leaves no room for a recent window after the "
                              f"prompt ({layout.prefix_len}), {self.sinks} sinks"
                              f"{' and the remainder sums' if self.remainder else ''}")
        return w

    def offsets(self, layout):
        return list(range(self.n_recent(layout)))


@dataclass(frozen=True)
class DiagonalPolicy(OffsetPolicy):
    """Diagonal-aware sparse attention: prompt, sinks, the last ``local`` tokens, and diagonal bands.

    A query at q reads j <= q when j is in the prompt, among the first ``sinks`` image tokens, in the
    last ``local`` positions (itself included), or within ``band`` of q - k*row_stride for some
    k in 1..``rows`` (the tokens above it in the previous ``rows`` rows). The bands are defined on
    the 1-D sequence, so at the left and right edges they wrap onto the neighbouring row, exactly
    as the definition says. ``rho`` (kept / dense), when given, picks ``rows`` (the largest that
    fits, at least 1) and keeps ``local``, ``band`` and ``sinks``. ``remainder``: see the module doc.

    Defaults (local 16, rows 3, band 4, sinks 4) come from the shipped fashion-c2i model: its
    decode attention peaks at offsets 1-3 and at W-2..W+1 (the tokens above and above-right) in
    the first rows back, with 2-3 % on the first image tokens; but it also spreads much of its
    mass thinly over the whole image, so narrow settings cost a lot there (teacher-forced NLL on
    32 test images: local 4/rows 3/band 2/no sinks +77 %; the defaults +11 % at rho 0.12 reading
    46 of 393 entries on average; streaming at the same rho +8 % reading 82).
    """

    source = "arsparse: diagonal-aware attention for raster-order AR image models (this project)"
    local: int = 16
    rows: int = 3
    band: int = 4
    sinks: int = 4
    rho: float | None = None
    remainder: bool = False

    def __post_init__(self):
        need_int(self.name, "local", self.local, 1)
        need_int(self.name, "rows", self.rows, 0)
        need_int(self.name, "band", self.band, 0)
        need_int(self.name, "sinks", self.sinks, 0)
        need_rho(self.name, self.rho, optional=True)
        self._check_remainder()

    def n_rows(self, layout: Layout) -> int:
        if self.rho is None:
            return self.rows
        W = layout.row_stride
        fixed = layout.prefix_len + self.sinks + self.band + 1 + self.extra_entries()
        rows = (int(self.rho * dense_entries(layout)) - fixed) // W
        if rows < 1:
            raise PolicyError(f"{self.name}: rho={self.rho} is too small for even one row of the "
                              f"{layout.grid_h}x{layout.grid_w} image (needs rho >= "
                              f"{(fixed + W) / dense_entries(layout):.3f})")
        return min(rows, layout.grid_h - 1)

    def check(self, layout):
        if self.rho is None and self.rows > layout.grid_h - 1:
            raise PolicyError(f"{self.name}: rows={self.rows} reaches beyond the {layout.grid_h}-row image "
                              f"(at most {layout.grid_h - 1})")
        if self.band >= layout.row_stride:
            raise PolicyError(f"{self.name}: band={self.band} must be below the row stride ({layout.row_stride})")

    def sink_count(self, layout):
        return self.sinks

    def offsets(self, layout):
        self.check(layout)
        W = layout.row_stride
        offs = set(range(self.local))
        for k in range(1, self.n_rows(layout) + 1):
            offs.update(k * W + d for d in range(-self.band, self.band + 1))
        return sorted(o for o in offs if o >= 0)
