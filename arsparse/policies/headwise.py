"""Head-wise policies: heads get different budgets or different rules, fitted to their attention.

* :class:`HeadKVPolicy` (``headkv``) and :class:`SSHPolicy` (``ssh``) are scored policies that type
  every (sequence, layer, kv head) online, during the first ``calib_rows`` image rows, as *local*
  (its attention stays on the neighbourhood) or *broad*, then keep using that type. The typing and
  the budget split live in :mod:`arsparse.policies.calibration`; the slot-table mechanics (per-head
  capacities that change at the end of calibration, several evictions in one step) in
  :class:`~arsparse.policies.caches.SlotKVCache` through the hooks of
  :class:`~arsparse.policies.scored.ScoredPolicy`.
* :class:`DiagonalAdaptivePolicy` (``diagonal-adaptive``) is an offset policy whose offsets are
  chosen per (layer, head) from the attention of a short dense calibration run of the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..layout import Layout
from .base import Budget, PolicyError, dense_entries, need_int, need_rho
from .calibration import allocate, choose_offsets, classify, locality, offset_mass, sample_prefix
from .offset import OffsetPolicy
from .scored import ScoredPolicy, _recent


def _need_float(policy: str, name: str, value, lo: float, hi: float | None, lo_open: bool, hi_open: bool,
                what: str = "") -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        ok = (value > lo if lo_open else value >= lo) and (hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {'inf' if hi is None else hi}{')' if hi_open or hi is None else ']'}"
        raise PolicyError(f"{policy}: {name}{what} must be a number in {rng}, got {value!r}")


# -- scored: online head typing -------------------------------------------------------------------


def lowest_k(key: torch.Tensor, evictable: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(B, H, C) bool: the ``k`` (B, H, 1) evictable entries with the lowest ``key`` (ties: lower slot)."""
    key = key.masked_fill(~evictable, float("inf"))
    place = key.argsort(dim=-1, stable=True).argsort(-1)  # place of each slot in ascending order
    return evictable & (place < k)


def stratified_evict(score: torch.Tensor, pos: torch.Tensor, evictable: torch.Tensor, k: torch.Tensor,
                     layout: Layout) -> torch.Tensor:
    """Stratified eviction: ``k`` times, take the image row that holds the most kept entries (among rows
    with an evictable entry) and evict its evictable entry with the lowest ``score``.

    Computed in one pass, without a loop over evictions: an evictable entry's *row rank* is the
    number of kept entries of its row that would outlive it (its protected row-mates and the
    evictable ones with higher scores). The greedy rule evicts in decreasing row rank (the fullest
    row's weakest entry has the largest), ties between equally full rows going to the lower score,
    so the ``k`` entries with the largest (row rank, -score) are exactly what ``k`` greedy rounds free.
    Row ranks come from one sort by (row, score): O(C log C) per head, no C x C tables.

    Parameters
    ----------
    score, pos, evictable : (B, H, C) accumulated attention, positions (-1 free), evictable slots.
    k : (B, H, 1) long, entries to free (<= 0: none).

    Returns
    -------
    (B, H, C) bool, the slots to free.
    """
    C = score.shape[-1]
    row = torch.where(pos >= 0, (pos - layout.prefix_len) // layout.row_stride, torch.full_like(pos, -1))
    # Place of each slot in ascending (score, slot) order, protected and free slots last: a permutation.
    srank = score.masked_fill(~evictable, float("inf")).argsort(dim=-1, stable=True).argsort(-1)  # (B, H, C)
    # Sort by row, then by srank, both descending (keys are distinct): a row's entries are contiguous,
    # its protected ones first, then its evictable ones from the highest score down.
    order = ((row + 1) * C + srank).argsort(dim=-1, descending=True)
    row_sorted = row.gather(-1, order)
    idx = torch.arange(C, device=pos.device).expand_as(order)
    first = torch.ones_like(row_sorted, dtype=torch.bool)
    first[..., 1:] = row_sorted[..., 1:] != row_sorted[..., :-1]
    start = torch.where(first, idx, torch.zeros_like(idx)).cummax(-1).values  # where each slot's row starts
    row_rank = torch.empty_like(order).scatter_(-1, order, idx - start)  # kept row-mates that outlive it
    key = torch.where(evictable, row_rank * C + (C - 1 - srank), torch.full_like(row_rank, -1))
    place = key.argsort(dim=-1, descending=True, stable=True).argsort(-1)
    return evictable & (place < k)


@dataclass(frozen=True)
class _HeadTypedPolicy(ScoredPolicy):
    """Shared mechanics of HeadKV and SSD: online typing, then per-head capacities at a matched total.

    Until the end of calibration (the query at image index ``calib_rows * row_stride - 1``) every
    head has the uniform capacity ``u`` of ``rho``. At that step each head's mean locality (see
    :func:`~arsparse.policies.calibration.locality`: 1 = all image attention on the query's
    neighbourhood, 0 = uniform) above ``threshold`` makes it local; local
    heads get :meth:`small_capacity`, broad heads share the rest of ``n_kv * u`` (at most
    ``large_max * u`` each, see :func:`~arsparse.policies.calibration.allocate`). The slot table is
    padded to the largest capacity a head can reach, and :meth:`budget` reports that padded memory.
    Scores are H2O's accumulated attention (summed over the query heads of a kv group); the last
    :meth:`n_recent` positions (``recent``, or by default the query's neighbourhood: the query and
    the ``row_stride`` positions before it) are never evicted.
    """

    rho: float = 0.125
    calib_rows: int = 2
    threshold: float = 0.5
    recent: int | None = None
    large_max: float = 1.5

    def __post_init__(self):
        need_rho(self.name, self.rho)
        need_int(self.name, "calib_rows", self.calib_rows, 2,
                 what=" (image rows used to type the heads; the first row alone says nothing)")
        _need_float(self.name, "threshold", self.threshold, 0, 1, True, True, " (mean locality above which a head is local)")
        if self.recent is not None:
            need_int(self.name, "recent", self.recent, 1,
                     what=" (protected recent positions; none: the query and one row before it)")
        _need_float(self.name, "large_max", self.large_max, 1, None, False, False,
                    " (largest capacity of a broad head, in uniform capacities)")

    def n_recent(self, layout: Layout) -> int:
        """Protected recent positions, the query included: ``recent``, or ``row_stride + 1``.

        The default covers the query's neighbourhood, so the tokens above and above-left of the one
        the next query predicts stay. Image models lean on them (on fashion-c2i the token above the
        predicted one gets the most attention of any offset, 5.6% per query against 4.7% for the
        previous token and about 1% for each offset between), and neither eviction rule would keep
        them: stratified eviction takes from the fullest rows, which are the newest, and
        accumulated attention is lowest for the newest entries, which few queries have seen yet.
        With a window shorter than a row, both evict the previous row's newest entries.
        """
        return layout.row_stride + 1 if self.recent is None else self.recent

    # -- capacities -------------------------------------------------------------------
    def min_capacity(self, layout):
        return self.n_recent(layout)

    def small_capacity(self, layout: Layout) -> int:
        raise NotImplementedError

    def large_capacity(self, layout: Layout) -> int:
        u = self.capacity(layout)
        return min(max(u, int(self.large_max * u)), layout.image_tokens - 1)

    def calib_queries(self, layout: Layout) -> int:
        return self.calib_rows * layout.row_stride

    def check(self, layout):
        u = self.capacity(layout)
        if self.calib_rows > layout.grid_h - 1:
            raise PolicyError(f"{self.name}: calib_rows={self.calib_rows} must leave rows to decode after "
                              f"calibration (at most {layout.grid_h - 1} for the {layout.grid_h}-row image)")
        s = self.small_capacity(layout)
        if s > u:
            raise PolicyError(f"{self.name}: local heads would keep {s} entries, more than the uniform "
                              f"capacity {u} at rho={self.rho}; raise rho or shrink the local budget")

    def max_capacity(self, layout, n_layer, n_kv):
        return self.large_capacity(layout)

    def budget(self, layout: Layout, n_layer: int = 1, n_head: int = 1) -> Budget:
        """``kept``: the padded slot table (prompt + the largest capacity a head can reach), the memory
        actually allocated, so ``budget.rho`` is above ``self.rho`` whenever ``large_max > 1``.
        ``read``: the uniform policy's mean read, an upper bound here (the capacities keep the
        uniform total and the read of a head, min(i + 1, cap + 1), is concave in its capacity)."""
        self.check(layout)
        u = self.capacity(layout)
        P, N = layout.prefix_len, layout.image_tokens
        reads = [P + min(i + 1, u + 1) for i in range(N - 1)]
        return Budget(read=sum(reads) / len(reads), kept=P + self.large_capacity(layout), dense=dense_entries(layout))

    # -- the step ---------------------------------------------------------------------------
    def head_stats(self, n_layer, rows, n_kv, device):
        z = dict(device=device)
        shape = (n_layer, rows, n_kv)
        return {"local": torch.zeros(shape, dtype=torch.float32, **z),  # summed locality
                "count": torch.zeros(shape, dtype=torch.float32, **z),  # queries it was measurable for
                "is_local": torch.zeros(shape, dtype=torch.bool, **z)}  # the type, set when calibration ends

    def update(self, score, weights, pos, q, layout):
        return score + weights

    def protected(self, pos, q, layout):
        return _recent(pos, q, self.n_recent(layout))

    def update_capacity(self, cap, stats, weights, pos, q, layout):
        n = self.calib_queries(layout)
        i = q - layout.prefix_len  # image index of the query
        value, measurable = locality(weights, pos, q, layout)  # (B, Hkv)
        counted = measurable & (i < n)
        stats["local"].add_(torch.where(counted, value, torch.zeros_like(value)))
        stats["count"].add_(counted.to(stats["count"].dtype))
        done = i == n - 1
        is_local = classify(stats["local"], stats["count"], self.threshold)
        stats["is_local"].copy_(torch.where(done, is_local, stats["is_local"]))
        typed = allocate(is_local, self.capacity(layout), self.small_capacity(layout), self.large_capacity(layout))
        return torch.where(done, typed, cap)


@dataclass(frozen=True)
class HeadKVPolicy(_HeadTypedPolicy):
    """HeadKV: head-aware budgets, the head types found early and reused, stratified eviction.

    Locality-biased heads get ``small`` x the uniform capacity (at least the protected window),
    broad heads the rest of the layer's uniform total (see the base class for typing, padding and
    budget). Every head keeps the query's neighbourhood (the last row, as the line-wise methods the
    paper builds on keep recent lines); beyond it, eviction is stratified: among the evictable
    entries, from the image row that holds the most kept entries, the one with the lowest
    accumulated attention, so distant rows keep representatives (:func:`stratified_evict`).

    Choices where the paper leaves details open (ours): a head's type is its mean locality (the
    share of its image attention on the query and the ``row_stride`` positions before it, rescaled
    so uniform attention scores 0; the raw share is 1 for every head in the first row) over the
    first ``calib_rows`` rows, per sequence, layer and kv head; two budget levels (not a continuous
    allocation); row counts include protected entries; before the end of calibration all heads
    are uniform and already evict stratified; the protected window is one row plus the query
    (``recent`` overrides it; windows shorter than a row lose the token above the next one, see
    :meth:`n_recent`: on fashion-c2i ``recent=8`` costs +25% held-out NLL at rho 0.5, one row +1%).
    """

    source = ("Liang et al., Head-Aware Key-Value Compression for Efficient Autoregressive Image Generation "
              "(HeadKV), arXiv 2605.20600; per-head budgets after Fu et al., Not All Heads Matter (HeadKV), 2024")
    small: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        _need_float(self.name, "small", self.small, 0, 1, True, False,
                    " (capacity of a local head, in uniform capacities)")

    def small_capacity(self, layout):
        return max(self.n_recent(layout), int(self.small * self.capacity(layout)))

    def evict(self, score, pos, evictable, excess, stats, layout):
        if score.is_cuda:  # the same slots from Triton kernels (torch's sorts: 0.9 ms a layer at batch 256)
            from ..kernels.triton.evict import stratified_evict_slots

            return stratified_evict_slots(score, pos, evictable, excess, layout)
        return stratified_evict(score, pos, evictable, excess, layout)


@dataclass(frozen=True)
class SSHPolicy(_HeadTypedPolicy):
    """SSD: spatial/semantic head split. Spatial heads keep a short recent window, semantic heads
    their most attended tokens.

    Heads are typed as in HeadKV (local = spatial). A spatial head's capacity is
    ``spatial_window`` rows (``spatial_window * row_stride`` entries, so it reads back to the token
    ``spatial_window`` rows above) and it evicts the oldest entry; semantic heads share the rest of
    the layer's uniform total and evict the lowest accumulated attention outside the protected
    ``recent`` window (H2O's rule). If the broad heads' cap (``large_max``) binds, the spatial
    heads' windows grow by what is left, so the total stays matched to ``rho``.

    Choices where the paper leaves details open (ours): the online typing above (the paper's
    criterion differs per model); before the end of calibration every head follows the semantic
    rule at the uniform capacity; no separate sink set (the prompt is always kept).
    """

    source = "SSD: Spatial-Semantic Head Decoupling for Efficient Autoregressive Image Generation, 2025"
    spatial_window: int = 1
    recent: int = 4

    def __post_init__(self):
        super().__post_init__()
        need_int(self.name, "spatial_window", self.spatial_window, 1, what=" (image rows a spatial head keeps)")

    def small_capacity(self, layout):
        return min(self.spatial_window * layout.row_stride, layout.image_tokens - 1)

    def check(self, layout):
        if self.n_recent(layout) > self.small_capacity(layout):
            raise PolicyError(f"{self.name}: recent={self.n_recent(layout)} must fit in the spatial window "
                              f"({self.small_capacity(layout)} entries)")
        u = self.capacity(layout)
        if self.small_capacity(layout) > u:
            need = (layout.prefix_len + self.small_capacity(layout)) / dense_entries(layout)
            raise PolicyError(f"{self.name}: spatial_window={self.spatial_window} rows "
                              f"({self.small_capacity(layout)} entries) exceed the uniform capacity {u} at "
                              f"rho={self.rho}; lower spatial_window or use rho >= {need:.3f}")
        super().check(layout)

    def evict(self, score, pos, evictable, excess, stats, layout):
        spatial = stats["is_local"][..., None]  # (B, Hkv, 1)
        return lowest_k(torch.where(spatial, pos.to(score.dtype), score), evictable, excess)


# -- offset: calibrated per-head diagonals --------------------------------------------------------


def _uncalibrated(name: str) -> PolicyError:
    return PolicyError(f"{name}: this policy is not calibrated yet; call policy.calibrate(gpt) for a "
                       f"calibrated copy (Generator(gpt, policy=...) and gpt.logits(..., policy=...) do it "
                       f"automatically)")


@dataclass(frozen=True)
class DiagonalAdaptivePolicy(OffsetPolicy):
    """Diagonal attention with the bands chosen per (layer, head) from the model's own attention.

    ``calibrate(gpt)`` decodes the first ``calib_rows`` rows densely for ``calib_samples``
    conditions, measures each head's mean attention mass at every backward offset over those
    decode queries, and keeps per head the offsets 0..``local``-1 plus the offsets with the
    largest mean mass, subject to two budgets:

    * memory: every offset is below the window ``K = floor(rho * dense) - prompt - sinks``, so each
      head keeps (prompt + sinks + its window) <= rho * dense entries, and the ring buffer too;
    * reads: ``max(local, floor(read * K))`` offsets per head (``read=1`` reads the whole window,
      i.e. StreamingLLM; ``rho=1, read=1`` is dense).

    The result is a new frozen policy holding ``table``: per layer, per head, the ascending
    offsets. An uncalibrated policy cannot run; the engine and ``gpt.logits`` calibrate it
    through :meth:`prepare` (seed 0, default conditions).

    Choices (ours): the mean mass at an offset is over the queries that can reach it (past the
    sinks), so far offsets are not penalised for being reachable less often; offsets beyond the
    calibrated span rank last; ties go to the nearer offset; calibration samples at
    ``temperature`` (0: greedy) without guidance; without ``cond``, c2i uses random classes and
    t2i the unconditional caption. ``remainder``: the mean-field remainder entry of
    :mod:`arsparse.policies.offset` (its running sums count against ``rho``).
    """

    source = "arsparse: per-head diagonal attention calibrated on the model's attention (this project)"
    rho: float = 0.125
    read: float = 0.5
    calib_rows: int = 4
    calib_samples: int = 4
    local: int = 4
    sinks: int = 0
    temperature: float = 1.0
    remainder: bool = False
    table: tuple | None = field(default=None, repr=False)

    def __post_init__(self):
        need_rho(self.name, self.rho)
        _need_float(self.name, "read", self.read, 0, 1, True, False, " (share of the window each head reads)")
        need_int(self.name, "calib_rows", self.calib_rows, 1, what=" (image rows decoded for calibration)")
        # (capped: calibration decodes them at once, in memory and, in the server, before the request's deadline)
        need_int(self.name, "calib_samples", self.calib_samples, 1, 64, " (conditions decoded for calibration)")
        need_int(self.name, "local", self.local, 1, what=" (offsets 0..local-1 always kept)")
        need_int(self.name, "sinks", self.sinks, 0)
        _need_float(self.name, "temperature", self.temperature, 0, None, False, False,
                    " (calibration sampling; 0 is greedy)")
        self._check_remainder()
        if self.table is not None:
            self._check_table()

    def _check_table(self):
        t = self.table
        ok = isinstance(t, tuple) and len(t) > 0 and all(
            isinstance(layer, tuple) and len(layer) > 0 and all(
                isinstance(offs, tuple) and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offs)
                for offs in layer) for layer in t)
        if not ok:
            raise PolicyError(f"{self.name}: table must be a tuple (layers) of tuples (heads) of tuples of "
                              f"non-negative int offsets, as calibrate() makes it")
        for li, layer in enumerate(t):
            for h, offs in enumerate(layer):
                if not set(range(self.local)) <= set(offs):
                    raise PolicyError(f"{self.name}: table[{li}][{h}] lacks offsets 0..{self.local - 1}")

    # -- budgets ---------------------------------------------------------------------------
    def window_budget(self, layout: Layout) -> int:
        """K: the largest offset + 1 a head may use."""
        fixed = layout.prefix_len + self.sinks + self.extra_entries()
        K = min(int(self.rho * dense_entries(layout)) - fixed, layout.image_tokens - 1)
        if K < self.local:
            need = (fixed + self.local) / dense_entries(layout)
            raise PolicyError(f"{self.name}: rho={self.rho} leaves a window of {K} positions after the prompt "
                              f"({layout.prefix_len}) and {self.sinks} sinks, fewer than local={self.local} "
                              f"(needs rho >= {need:.3f})")
        return K

    def read_budget(self, layout: Layout) -> int:
        """Offsets each head reads."""
        return max(self.local, int(self.read * self.window_budget(layout)))

    def check(self, layout):
        K = self.window_budget(layout)
        if self.calib_rows > layout.grid_h - 1:
            raise PolicyError(f"{self.name}: calib_rows={self.calib_rows} must be at most {layout.grid_h - 1} "
                              f"for the {layout.grid_h}-row image")
        if self.table is not None:
            top = max(max(offs) for layer in self.table for offs in layer)
            if top >= K:
                raise PolicyError(f"{self.name}: the table reaches offset {top}, beyond the window {K} of "
                                  f"rho={self.rho}; calibrate for this layout")

    def budget(self, layout, n_layer=1, n_head=1):
        """Exact once calibrated; before, the bounds the calibration keeps (reads: every head
        reads ``read_budget`` offsets, a slight over-estimate near the image start)."""
        self.check(layout)
        P, S, N = layout.prefix_len, min(self.sinks, layout.image_tokens - 1), layout.image_tokens
        extra = self.extra_entries()
        if self.table is None:
            K = self.window_budget(layout)
            return Budget(read=P + S + self.read_budget(layout) + extra,
                          kept=min(P + S + K, dense_entries(layout)) + extra, dense=dense_entries(layout))
        # Query at image index i reads the prompt, min(S, i + 1) sinks and offset o when i - o >= S.
        heads = [offs for layer in self.table for offs in layer]
        sinks = sum(min(S, i + 1) for i in range(N - 1))
        offs = sum(max(0, N - 1 - o - S) for h in heads for o in h) / len(heads)
        window = self.window(layout, len(self.table), len(self.table[0]))
        return Budget(read=P + (sinks + offs) / (N - 1) + extra,
                      kept=min(P + S + window, dense_entries(layout)) + extra, dense=dense_entries(layout))

    # -- offsets -------------------------------------------------------------------------------
    @property
    def calibrated(self) -> bool:
        return self.table is not None

    def sink_count(self, layout):
        return self.sinks

    def offsets(self, layout):
        if self.table is None:
            raise _uncalibrated(self.name)
        raise PolicyError(f"{self.name}: offsets differ per (layer, head); use head_offsets")

    def head_offsets(self, layout, n_layer, n_head):
        if self.table is None:
            raise _uncalibrated(self.name)
        if len(self.table) != n_layer or any(len(layer) != n_head for layer in self.table):
            raise PolicyError(f"{self.name}: calibrated for {len(self.table)} layers x {len(self.table[0])} "
                              f"heads, asked for {n_layer} x {n_head}; calibrate on this model")
        return [[list(offs) for offs in layer] for layer in self.table]

    def prepare(self, gpt):
        return self if self.table is not None else self.calibrate(gpt)

    @torch.no_grad()
    def calibrate(self, gpt, cond=None, seed: int = 0) -> "DiagonalAdaptivePolicy":
        """A new policy holding the per-(layer, head) offsets measured on ``gpt``.

        ``cond``: the calibration conditions (class labels or caption features, any batch size);
        default ``calib_samples`` random classes (c2i, from ``seed``) or the unconditional caption
        (t2i). The first ``calib_rows`` rows are sampled with ``seed``.
        """
        layout, cfg = gpt.layout, gpt.config
        self.check(layout)
        device = next(gpt.parameters()).device
        if cond is None:
            if cfg.model_type == "c2i":
                g = torch.Generator().manual_seed(seed)
                cond = torch.randint(0, cfg.num_classes, (self.calib_samples,), generator=g)
            else:
                cond = gpt.cls_embedding.uncond_embedding[None].expand(self.calib_samples, -1, -1).float()
        cond = torch.as_tensor(cond)
        gpt.check_cond(cond, allow_null=True)
        n = self.calib_rows * layout.row_stride
        tokens = sample_prefix(gpt, cond.to(device), n, seed=seed, temperature=self.temperature)
        mean = offset_mass(gpt, cond.to(device), tokens, sinks=min(self.sinks, layout.image_tokens - 1))
        table = choose_offsets(mean, self.local, self.window_budget(layout), self.read_budget(layout))
        return replace(self, table=table)
