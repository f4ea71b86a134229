"""Attention statistics, accumulated on the fly as queries stream by.

Every metric is defined on one *query*: a row ``w`` of attention weights of one (sequence, layer,
head) at sequence position ``q`` over the keys ``0 .. q`` (summing to 1). Only image queries
(``q >= P``, the prompt length) are counted. :class:`AttentionStats` takes chunks of such rows,
``(B, H, Tq, S)``, and keeps only small per-(layer, head, query row) sums, never a ``T x T`` map
(unless asked to keep a few for plots).

Definitions (``W`` = ``layout.row_stride``, ``o = q - key`` the backward offset):

* **Key categories**, a partition of the keys of a query; the first that applies wins:
  ``prompt`` (key < P), ``sinks`` (the first ``sinks`` image tokens, P <= key < P + sinks),
  ``local`` (the last ``local`` positions, the query itself included: o < local), ``bands``
  (key = q - k*W + delta for some k in 1..``band_rows`` and |delta| <= ``band_width``), ``rest``.
* **Band map**: the mass at every cell (k, delta), key = q - k*W + delta, counted over image keys
  whatever their category (so a cell may overlap the sinks near the top of the image). delta = 0 is
  the token straight above, delta > 0 is to its right. ``band_width`` is clamped to (W - 1) // 2 so
  that every offset belongs to at most one cell.
* **Offset profile**: the mean mass at backward offset o over the queries that can reach it
  (image keys only).
* **Coverage**: the number of keys, taken by decreasing weight, that a query needs to cover a share
  ``p`` of its mass (``1 + #{j : cumsum_j < p}``; uniform attention over n keys needs ceil(p * n)).
* **Recall** of a read set (a policy's): the share of the dense mass that falls on the keys it
  reads. **Oracle top-k**: the mass of the k largest weights (all of them when q + 1 <= k).
* **Head classes**: *local* when the mean local + bands share is at least ``local_threshold``,
  else *broad*; *spatial* when the position-explained share (below) is at least
  ``spatial_threshold``, else *semantic*. The position-explained share of a head is, per query
  row r, ``sum_o m_r(o)^2 / sum_o E_r[w(o)^2]`` (m_r the mean weight at offset o over the queries of
  row r: 1 when every query of the row puts the same weight at the same offsets, ~1/n when each
  puts it on different, content-chosen keys), averaged over rows weighted by their queries.
  **Stability** is the share of queries whose row gives the head the same class as the whole.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch

from ..layout import Layout

CATEGORIES: tuple[str, ...] = ("prompt", "sinks", "local", "bands", "rest")
_INVALID = len(CATEGORIES)  # keys after the query (masked)


@dataclass(frozen=True)
class MetricConfig:
    """Parameters of the metrics (see the module docstring for the definitions)."""

    sinks: int = 4
    local: int = 16
    band_rows: int = 4
    band_width: int = 4
    coverage: tuple[float, ...] = (0.9, 0.95, 0.99)
    local_threshold: float = 0.5
    spatial_threshold: float = 0.5

    def __post_init__(self):
        for name, lo in (("sinks", 0), ("local", 1), ("band_rows", 0), ("band_width", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"MetricConfig: {name} must be an integer >= {lo}, got {v!r}")
        object.__setattr__(self, "coverage", tuple(float(p) for p in self.coverage))
        if not self.coverage or any(not 0 < p <= 1 for p in self.coverage):
            raise ValueError(f"MetricConfig: coverage shares must be in (0, 1], got {self.coverage}")
        for name in ("local_threshold", "spatial_threshold"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"MetricConfig: {name} must be in [0, 1], got {getattr(self, name)}")

    def fit(self, layout: Layout) -> "MetricConfig":
        """This config with the bands clamped to the layout: at most grid_h - 1 rows back and
        ``band_width <= (row_stride - 1) // 2`` (so the (k, delta) cells do not overlap)."""
        return replace(self, band_rows=min(self.band_rows, layout.grid_h - 1),
                       band_width=min(self.band_width, (layout.row_stride - 1) // 2))


# -- geometry of one chunk of queries -------------------------------------------------------------


def band_cells(layout: Layout, cfg: MetricConfig, off: torch.Tensor) -> torch.Tensor:
    """Band-map cell of each backward offset: ``(k - 1) * (2D + 1) + (delta + D)``, -1 outside.

    ``off`` = q - key (any shape). key = q - k*W + delta, so delta = k*W - off.
    """
    W, K, D = layout.row_stride, cfg.band_rows, cfg.band_width
    k = torch.div(off + D, W, rounding_mode="floor")
    delta = k * W - off
    ok = (k >= 1) & (k <= K) & (delta.abs() <= D) & (off >= 1)
    return torch.where(ok, (k - 1) * (2 * D + 1) + delta + D, torch.full_like(off, -1))


def key_categories(layout: Layout, cfg: MetricConfig, qpos: torch.Tensor, S: int) -> torch.Tensor:
    """(Tq, S) long: the category (index into :data:`CATEGORIES`) of every key 0..S-1 of each query;
    ``len(CATEGORIES)`` for keys after the query."""
    P = layout.prefix_len
    key = torch.arange(S, device=qpos.device)[None, :]
    off = qpos[:, None] - key
    cat = torch.full(off.shape, CATEGORIES.index("rest"), dtype=torch.long, device=qpos.device)
    cat = torch.where(band_cells(layout, cfg, off) >= 0, CATEGORIES.index("bands"), cat)
    cat = torch.where(off < cfg.local, CATEGORIES.index("local"), cat)
    cat = torch.where((key >= P) & (key < P + cfg.sinks), CATEGORIES.index("sinks"), cat)
    cat = torch.where(key < P, CATEGORIES.index("prompt"), cat)
    return torch.where(off < 0, _INVALID, cat)


def query_rows(layout: Layout, qpos: torch.Tensor) -> torch.Tensor:
    """Image row of each (image) query position."""
    return torch.div(qpos - layout.prefix_len, layout.row_stride, rounding_mode="floor").clamp(0, layout.grid_h - 1)


# -- read sets ------------------------------------------------------------------------------------


class ReadSet:
    """The keys a policy reads, per (layer, head) and query, in a form that yields a chunk's mask.

    Built by :meth:`from_policy` from a registered policy (``dense``: every causal key; offset
    policies: their prompt, sinks and offsets table, checked against ``read_positions``) or from
    any object with ``read_positions(layout, q, layer, head, n_layer, n_head)`` (explicit masks;
    small models only).
    """

    def __init__(self, name: str, layout: Layout, n_layer: int, n_head: int, *, dense: bool = False,
                 sinks: int = 0, member: torch.Tensor | None = None, masks: torch.Tensor | None = None,
                 info: dict | None = None):
        self.name, self.layout, self.n_layer, self.n_head = name, layout, n_layer, n_head
        self.dense, self.sinks, self.member, self.masks = dense, sinks, member, masks
        self.info = info or {}

    @classmethod
    def from_policy(cls, name: str, policy, layout: Layout, n_layer: int, n_head: int, check: int = 8,
                    seed: int = 0) -> "ReadSet":
        """Read set of ``policy`` (prepared already, e.g. calibrated).

        ``check`` random (query, layer, head) triples are compared with ``policy.read_positions``
        when the fast offsets path is used; a mismatch raises ``RuntimeError``.
        """
        info = {}
        if hasattr(policy, "budget"):
            try:
                b = policy.budget(layout, n_layer, n_head)
                info = dict(read=float(b.read), kept=int(b.kept), dense=int(b.dense), rho=float(b.rho))
            except TypeError:
                b = policy.budget(layout)
                info = dict(read=float(b.read), kept=int(b.kept), dense=int(b.dense), rho=float(b.rho))
        if getattr(policy, "kind", None) == "dense":
            return cls(name, layout, n_layer, n_head, dense=True, info=info)
        N, P = layout.image_tokens, layout.prefix_len
        if hasattr(policy, "offset_table") and hasattr(policy, "sink_count"):
            table = policy.offset_table(layout, n_layer, n_head)  # (L, H, n), -1 padded
            member = torch.zeros(n_layer, n_head, N + 1, dtype=torch.bool)
            idx = torch.where((table >= 0) & (table < N), table, torch.full_like(table, N))
            member.scatter_(2, idx, torch.ones_like(idx, dtype=torch.bool))
            rs = cls(name, layout, n_layer, n_head, sinks=int(policy.sink_count(layout)), member=member[..., :N],
                     info=info)
            rs._check(policy, check, seed)
            return rs
        if not hasattr(policy, "read_positions"):
            raise TypeError(f"{name}: a read set needs a dense policy, an offset policy or read_positions()")
        T = P + N - 1
        if n_layer * n_head * T * T > 1 << 28:
            raise ValueError(f"{name}: explicit read masks for {n_layer}x{n_head} heads of {T} positions are too large")
        masks = torch.zeros(n_layer, n_head, T, T, dtype=torch.bool)
        for li in range(n_layer):
            for h in range(n_head):
                for q in range(T):
                    masks[li, h, q, policy.read_positions(layout, q, li, h, n_layer, n_head)] = True
        return cls(name, layout, n_layer, n_head, masks=masks, info=info)

    def _check(self, policy, n: int, seed: int) -> None:
        if not hasattr(policy, "read_positions") or n <= 0:
            return
        g = torch.Generator().manual_seed(seed)
        P, N = self.layout.prefix_len, self.layout.image_tokens
        for _ in range(n):
            q = P + int(torch.randint(N - 1, (1,), generator=g))
            li = int(torch.randint(self.n_layer, (1,), generator=g))
            h = int(torch.randint(self.n_head, (1,), generator=g))
            want = sorted(policy.read_positions(self.layout, q, li, h, self.n_layer, self.n_head))
            got = self.mask(li, [h], torch.tensor([q]), q + 1)[0, 0].nonzero()[:, 0].tolist()
            if got != want:
                raise RuntimeError(f"{self.name}: read set from the offsets table differs from read_positions at "
                                   f"q={q}, layer {li}, head {h}: {got} vs {want}")

    def mask(self, layer: int, heads, qpos: torch.Tensor, S: int) -> torch.Tensor:
        """(Hs, Tq, S) bool: keys 0..S-1 read by the queries ``qpos`` of ``heads`` in ``layer``."""
        dev = qpos.device
        key = torch.arange(S, device=dev)[None, :]
        causal = key <= qpos[:, None]  # (Tq, S)
        Hs = len(heads)
        if self.dense:
            return causal[None].expand(Hs, -1, -1)
        if self.masks is not None:
            m = self.masks[layer][list(heads)].to(dev)  # (Hs, T, T)
            return m[:, qpos][:, :, :S] & causal
        P, N = self.layout.prefix_len, self.layout.image_tokens
        off = (qpos[:, None] - key).clamp(0, N - 1)  # (Tq, S)
        member = self.member[layer][list(heads)].to(dev)  # (Hs, N)
        hit = member[:, off]  # (Hs, Tq, S)
        fixed = key < P + self.sinks
        image_q = (qpos >= P)[:, None]
        read = torch.where(image_q, fixed | (hit & (key >= P + self.sinks)), torch.ones_like(fixed))
        return read & causal


# -- the accumulator ------------------------------------------------------------------------------


class _Acc:
    """Sums for one (phase, layer)."""

    def __init__(self, Hs: int, R: int, N: int, nb: int, nc: int, ns: int, no: int, device):
        f64 = dict(dtype=torch.float64, device=device)
        self.n = torch.zeros(R, **f64)  # counted queries (x sequences) per row
        self.cat = torch.zeros(Hs, R, len(CATEGORIES), **f64)
        self.cov = torch.zeros(Hs, R, nc, **f64)
        self.covfrac = torch.zeros(Hs, R, nc, **f64)
        # flat, with a last "dump" bin that collects what falls outside (sliced off by the views below)
        self._band = torch.zeros(Hs, nb + 1, **f64)
        self._off_sum = torch.zeros(Hs, R * N + 1, dtype=torch.float32, device=device)
        self._off_sq = torch.zeros(Hs, R * N + 1, dtype=torch.float32, device=device)
        self._off_n = torch.zeros(R * N + 1, **f64)
        self.R, self.N, self.nb = R, N, nb
        self.recall = torch.zeros(Hs, ns, **f64)
        self.oracle = torch.zeros(Hs, no, **f64)
        self.seq_cat: torch.Tensor | None = None  # (B, C) per sequence, summed over heads and queries
        self.seq_cov: torch.Tensor | None = None  # (B, nc)
        self.seq_n: torch.Tensor | None = None  # (B,) queries per sequence

    @property
    def band(self) -> torch.Tensor:  # (Hs, nb)
        return self._band[:, : self.nb]

    @property
    def off_sum(self) -> torch.Tensor:  # (Hs, R, N)
        return self._off_sum[:, :-1].view(-1, self.R, self.N)

    @property
    def off_sq(self) -> torch.Tensor:  # (Hs, R, N)
        return self._off_sq[:, :-1].view(-1, self.R, self.N)

    @property
    def off_n(self) -> torch.Tensor:  # (R, N)
        return self._off_n[:-1].view(self.R, self.N)


class AttentionStats:
    """Streaming statistics of attention, per phase, layer and head.

    Parameters
    ----------
    layout : Layout
        The model's geometry (``gpt.layout``).
    n_layer, n_head : int
        The model's sizes (read sets are indexed by them).
    layers, heads : sequence of int, optional
        The layers and heads that will be added (default all).
    config : MetricConfig, optional
        Clamped to the layout with :meth:`MetricConfig.fit`.
    read_sets : sequence of ReadSet, optional
        Policies whose recall to measure.
    oracle_budgets : sequence of int, optional
        Keys k for the oracle top-k recall.
    keep : "all" or sequence of (layer, head), optional
        Keep the full attention maps of these heads for the first ``keep_rows`` sequences of each
        phase (``maps[(phase, layer, head)]``: (keep_rows, T, T), NaN where no query was recorded).
    device : torch.device, optional
        Where the sums live (default: that of the first chunk).
    """

    def __init__(self, layout: Layout, n_layer: int, n_head: int, layers=None, heads=None,
                 config: MetricConfig | None = None, read_sets=(), oracle_budgets=(), keep=(), keep_rows: int = 1,
                 device=None):
        self.layout = layout
        self.n_layer, self.n_head = n_layer, n_head
        self.layers = list(range(n_layer)) if layers is None else [int(x) for x in layers]
        self.heads = list(range(n_head)) if heads is None else [int(x) for x in heads]
        for x in self.layers:
            if not 0 <= x < n_layer:
                raise ValueError(f"layer {x} out of range 0..{n_layer - 1}")
        for x in self.heads:
            if not 0 <= x < n_head:
                raise ValueError(f"head {x} out of range 0..{n_head - 1}")
        self.config = (config or MetricConfig()).fit(layout)
        self.read_sets = list(read_sets)
        self.oracle_budgets = sorted({int(b) for b in oracle_budgets if int(b) >= 1})
        self.keep = {(li, h) for li in self.layers for h in self.heads} if keep == "all" else {tuple(k) for k in keep}
        self.keep_rows = keep_rows
        self.maps: dict[tuple[str, int, int], torch.Tensor] = {}
        self.device = device
        self._acc: dict[tuple[str, int], _Acc] = {}
        self.phases: list[str] = []
        D = self.config.band_width
        self._nb = self.config.band_rows * (2 * D + 1)
        self.T = layout.prefix_len + layout.image_tokens - 1  # every position that is ever an input

    # -- adding ---------------------------------------------------------------------------------
    def _acc_for(self, phase: str, layer: int, device) -> _Acc:
        if (phase, layer) not in self._acc:
            if phase not in self.phases:
                self.phases.append(phase)
            if self.device is None:
                self.device = device
            self._acc[(phase, layer)] = _Acc(len(self.heads), self.layout.grid_h, self.layout.image_tokens, self._nb,
                                             len(self.config.coverage), len(self.read_sets), len(self.oracle_budgets),
                                             self.device)
        return self._acc[(phase, layer)]

    @torch.no_grad()
    def add(self, phase: str, layer: int, qpos: torch.Tensor, w: torch.Tensor) -> None:
        """Add the attention of queries at positions ``qpos`` (Tq,) of ``layer``.

        ``w`` (B, Hs, Tq, S): weights of the selected heads (``self.heads``, in that order) over keys
        0..S-1 (zero after the query), for B sequences. Prompt queries are ignored.
        """
        if layer not in self.layers:
            raise ValueError(f"layer {layer} was not selected ({self.layers})")
        if w.dim() != 4 or w.shape[1] != len(self.heads) or w.shape[2] != qpos.numel():
            raise ValueError(f"weights must be (B, {len(self.heads)}, {qpos.numel()}, S), got {tuple(w.shape)}")
        lay, cfg = self.layout, self.config
        P, N, R = lay.prefix_len, lay.image_tokens, lay.grid_h
        qpos = qpos.to(w.device).long()
        image = qpos >= P
        if not bool(image.all()):
            qpos, w = qpos[image], w[:, :, image]
        if qpos.numel() == 0 or w.shape[0] == 0:
            return
        if int(qpos.max()) >= w.shape[-1]:
            raise ValueError(f"weights hold {w.shape[-1]} keys, fewer than query position {int(qpos.max())} + 1")
        self._keep(phase, layer, qpos, w)
        dev = self.device if self.device is not None else w.device
        acc = self._acc_for(phase, layer, dev)
        w = w.float().to(dev)
        qpos = qpos.to(dev)
        B, Hs, Tq, S = w.shape
        row = query_rows(lay, qpos)  # (Tq,)
        acc.n.index_add_(0, row, torch.full((Tq,), float(B), dtype=torch.float64, device=dev))
        wsum = w.sum(0)  # (Hs, Tq, S)

        # categories
        cat = key_categories(lay, cfg, qpos, S)  # (Tq, S)
        per = torch.zeros(B, Hs, Tq, len(CATEGORIES) + 1, device=dev).scatter_add_(
            3, cat[None, None].expand(B, Hs, -1, -1), w)[..., : len(CATEGORIES)].double()  # (B, Hs, Tq, C)
        acc.cat.index_add_(1, row, per.sum(0))
        if acc.seq_n is None:
            acc.seq_cat = torch.zeros(B, len(CATEGORIES), dtype=torch.float64, device=dev)
            acc.seq_cov = torch.zeros(B, len(cfg.coverage), dtype=torch.float64, device=dev)
            acc.seq_n = torch.zeros(B, dtype=torch.float64, device=dev)
        if acc.seq_n.shape[0] != B:
            raise ValueError(f"phase {phase!r}, layer {layer}: {B} sequences, earlier chunks had {acc.seq_n.shape[0]}")
        acc.seq_cat += per.sum((1, 2)) / Hs
        acc.seq_n += Tq

        # offsets (image keys), per query row; and the band map
        key = torch.arange(S, device=dev)[None, :]
        off = qpos[:, None] - key  # (Tq, S)
        ok = (off >= 0) & (key >= P)
        dump = R * N
        oidx = torch.where(ok, row[:, None] * N + off.clamp(0, N - 1), torch.full_like(off, dump)).reshape(-1)
        src = wsum.reshape(Hs, -1)
        oidx_h = oidx[None].expand(Hs, -1)
        acc._off_sum.scatter_add_(1, oidx_h, src)
        acc._off_sq.scatter_add_(1, oidx_h, (w * w).sum(0).reshape(Hs, -1))
        acc._off_n.index_add_(0, oidx, ok.reshape(-1).double() * B)
        if self._nb:
            bidx = band_cells(lay, cfg, off)
            bidx = torch.where(ok & (bidx >= 0), bidx, torch.full_like(bidx, self._nb)).reshape(-1)
            acc._band.scatter_add_(1, bidx[None].expand(Hs, -1), src.double())

        # coverage and oracle top-k (sorted weights)
        cs = w.sort(dim=-1, descending=True).values.double().cumsum(-1)  # (B, Hs, Tq, S)
        nkeys = (qpos + 1).double()  # (Tq,)
        for j, p in enumerate(cfg.coverage):
            cnt = ((cs < p - 1e-6).sum(-1) + 1).double().minimum(nkeys)  # (B, Hs, Tq)
            acc.cov[:, :, j].index_add_(1, row, cnt.sum(0))
            acc.seq_cov[:, j] += cnt.sum((1, 2)) / Hs
            acc.covfrac[:, :, j].index_add_(1, row, (cnt / nkeys).sum(0))
        for j, b in enumerate(self.oracle_budgets):
            idx = (qpos.clamp(max=b - 1)).clamp(max=S - 1)  # min(b, q + 1) - 1
            got = cs.gather(-1, idx[None, None, :, None].expand(B, Hs, Tq, 1))[..., 0]
            acc.oracle[:, j] += got.sum((0, 2))
        del cs

        # recall of each read set
        for j, rs in enumerate(self.read_sets):
            m = rs.mask(layer, self.heads, qpos, S)  # (Hs, Tq, S)
            acc.recall[:, j] += (wsum * m).sum((1, 2)).double()

    def _keep(self, phase, layer, qpos, w):
        if not self.keep:
            return
        for hi, h in enumerate(self.heads):
            if (layer, h) not in self.keep:
                continue
            k = (phase, layer, h)
            if k not in self.maps:
                self.maps[k] = torch.full((self.keep_rows, self.T, self.T), float("nan"))
            m = self.maps[k]
            r = min(self.keep_rows, w.shape[0])
            S = min(w.shape[-1], self.T)
            rows = w[:r, hi, :, :S].float().cpu()
            keyp = torch.arange(S)
            for t, q in enumerate(qpos.tolist()):
                if q < self.T:
                    m[:r, q, :S] = torch.where(keyp <= q, rows[:, t], torch.zeros(()))
                    m[:r, q, S:] = 0.0

    # -- results --------------------------------------------------------------------------------
    def summary(self) -> dict:
        """Every statistic as plain Python (JSON-able): see :func:`summarize`."""
        return summarize(self)


def _mean(x: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    return x / n.clamp_min(1e-300)


def _r(x, nd: int = 6):
    """Round tensors / floats for JSON; NaN -> None."""
    if isinstance(x, torch.Tensor):
        return _r(x.tolist(), nd)
    if isinstance(x, list):
        return [_r(v, nd) for v in x]
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, nd)
    return x


def _sig(x, digits: int = 4):
    """Like :func:`_r` with ``digits`` significant digits (for small, wide-ranging values)."""
    if isinstance(x, torch.Tensor):
        return _sig(x.tolist(), digits)
    if isinstance(x, list):
        return [_sig(v, digits) for v in x]
    if isinstance(x, float):
        return None if math.isnan(x) else float(f"{x:.{digits}g}")
    return x


def _pes(off_sum: torch.Tensor, off_sq: torch.Tensor, off_n: torch.Tensor):
    """Position-explained share per (head, row): sum_o m^2 / sum_o E[w^2]. (Hs, R)"""
    n = off_n[None].clamp_min(1e-300)
    m = off_sum.double() / n
    e2 = off_sq.double() / n
    num, den = (m * m).sum(-1), e2.sum(-1)
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.full_like(num, float("nan")))


def summarize(stats: AttentionStats) -> dict:
    """Reduce the sums of :class:`AttentionStats` to per-phase summaries.

    Per phase: ``queries``; ``mass[cat]`` with ``overall``, ``per_layer`` (L), ``per_head`` (L x H)
    and ``by_row`` (R); ``bands`` (K x (2D+1) maps overall and per layer); ``offset_profile``
    (mean mass per reaching query at offsets 0..N-1, overall and per layer); ``coverage`` (keys and
    key fraction per share p: overall, per layer, per head, by row; plus the mean causal keys by
    row); ``recall`` per read set (overall, per layer, per head); ``oracle`` (recall of the top-k
    per budget k); ``heads`` (local + band share, class, position-explained share, class, and
    their per-row stability, per (layer, head)).
    """
    lay, cfg = stats.layout, stats.config
    out = dict(layout=dict(prefix_len=lay.prefix_len, grid_h=lay.grid_h, grid_w=lay.grid_w, row_stride=lay.row_stride),
               config=asdict(cfg), layers=stats.layers, heads=stats.heads, categories=list(CATEGORIES),
               read_sets={rs.name: rs.info for rs in stats.read_sets}, oracle_budgets=stats.oracle_budgets, phases={})
    ci = {c: i for i, c in enumerate(CATEGORIES)}
    for phase in stats.phases:
        accs = [stats._acc.get((phase, li)) for li in stats.layers]
        if any(a is None for a in accs):
            missing = [li for li, a in zip(stats.layers, accs) if a is None]
            raise RuntimeError(f"phase {phase!r}: no attention recorded for layers {missing}")
        n_row = accs[0].n  # (R,) the same for every layer
        nq = float(n_row.sum())
        cat = torch.stack([a.cat for a in accs])  # (L, Hs, R, C)
        per_head = cat.sum(2) / nq  # (L, Hs, C)
        by_row = _mean(cat.sum((0, 1)), n_row[:, None] * cat.shape[0] * cat.shape[1])  # (R, C)
        rows_seen = (n_row > 0).tolist()
        mass = {}
        for c, i in ci.items():
            mass[c] = dict(overall=float(per_head[..., i].mean()), per_layer=_r(per_head[..., i].mean(1)),
                           per_head=_r(per_head[..., i]),
                           by_row=_r([float(v) if s else float("nan") for v, s in zip(by_row[:, i], rows_seen)]))
        # bands
        D, K = cfg.band_width, cfg.band_rows
        band = torch.stack([a.band for a in accs]) / nq  # (L, Hs, nb)
        bands = dict(k=list(range(1, K + 1)), delta=list(range(-D, D + 1)),
                     overall=_r(band.mean((0, 1)).view(K, 2 * D + 1)) if K else [],
                     per_layer=_r(band.mean(1).view(len(accs), K, 2 * D + 1)) if K else [])
        # offsets
        off_sum = torch.stack([a.off_sum.double().sum(1) for a in accs])  # (L, Hs, N)
        off_n = accs[0].off_n.sum(0)  # (N,)
        prof = off_sum / off_n.clamp_min(1e-300)
        prof = torch.where(off_n > 0, prof, torch.full_like(prof, float("nan")))
        offset_profile = dict(overall=_sig(prof.mean((0, 1)), 5), per_layer=_sig(prof.mean(1), 4), reach=_r(off_n))
        # coverage
        cov = torch.stack([a.cov for a in accs])  # (L, Hs, R, nc)
        covf = torch.stack([a.covfrac for a in accs])
        coverage = dict(p=list(cfg.coverage))
        for name, t in (("keys", cov), ("fraction", covf)):
            ph = t.sum(2) / nq  # (L, Hs, nc)
            br = _mean(t.sum((0, 1)), n_row[:, None] * t.shape[0] * t.shape[1])  # (R, nc)
            br = torch.where(n_row[:, None] > 0, br, torch.full_like(br, float("nan")))
            coverage[name] = dict(overall=_r(ph.mean((0, 1))), per_layer=_r(ph.mean(1)), per_head=_r(ph), by_row=_r(br))
        # mean causal keys (q + 1) of the counted queries, by row: from the offset reach counts
        reach = accs[0].off_n  # (R, N): queries reaching offset o in row r (times B), image keys only
        nkeys_row = _mean(reach.sum(1), n_row) + lay.prefix_len
        coverage["causal_keys_by_row"] = _r(torch.where(n_row > 0, nkeys_row, torch.full_like(nkeys_row, float("nan"))))
        # recall
        recall = {}
        if stats.read_sets:
            rec = torch.stack([a.recall for a in accs]) / nq  # (L, Hs, ns)
            for j, rs in enumerate(stats.read_sets):
                recall[rs.name] = dict(overall=float(rec[..., j].mean()), per_layer=_r(rec[..., j].mean(1)),
                                       per_head=_r(rec[..., j]))
        oracle = {}
        if stats.oracle_budgets:
            orc = torch.stack([a.oracle for a in accs]) / nq  # (L, Hs, nb)
            oracle = dict(budgets=stats.oracle_budgets, overall=_r(orc.mean((0, 1))), per_layer=_r(orc.mean(1)))
        # head classes
        lb_row = _mean(cat[..., ci["local"]] + cat[..., ci["bands"]], n_row)  # (L, Hs, R)
        lb = per_head[..., ci["local"]] + per_head[..., ci["bands"]]  # (L, Hs)
        is_local = lb >= cfg.local_threshold
        w_row = n_row / max(nq, 1e-300)  # (R,)
        stab_local = ((lb_row >= cfg.local_threshold) == is_local[..., None]).double().mul(w_row).sum(-1)
        pes_row = torch.stack([_pes(a.off_sum, a.off_sq, a.off_n) for a in accs])  # (L, Hs, R)
        valid = ~torch.isnan(pes_row) & (n_row > 0)
        wv = torch.where(valid, w_row.expand_as(pes_row), torch.zeros_like(pes_row))
        pes = (torch.nan_to_num(pes_row) * wv).sum(-1) / wv.sum(-1).clamp_min(1e-300)
        pes = torch.where(wv.sum(-1) > 0, pes, torch.full_like(pes, float("nan")))
        is_spatial = pes >= cfg.spatial_threshold
        agree = (pes_row >= cfg.spatial_threshold) == is_spatial[..., None]
        stab_spatial = (agree.double() * wv).sum(-1) / wv.sum(-1).clamp_min(1e-300)
        heads = dict(local_band_share=_r(lb), local_class=[["local" if v else "broad" for v in r] for r in is_local.tolist()],
                     local_stability=_r(stab_local), local_band_share_by_row=_r(lb_row),
                     position_share=_r(pes), spatial_class=[["spatial" if v else "semantic" for v in r]
                                                            for r in is_spatial.tolist()],
                     spatial_stability=_r(stab_spatial),
                     counts=dict(local=int(is_local.sum()), broad=int((~is_local).sum()),
                                 spatial=int(is_spatial.sum()), semantic=int((~is_spatial).sum())),
                     mean_local_stability=float(stab_local.mean()), mean_spatial_stability=float(stab_spatial.mean()))
        # per sequence (mean over layers, heads and queries): the spread between images
        seq_n = accs[0].seq_n
        seq_cat = torch.stack([a.seq_cat for a in accs]).mean(0) / seq_n[:, None]  # (B, C)
        seq_cov = torch.stack([a.seq_cov for a in accs]).mean(0) / seq_n[:, None]  # (B, nc)
        per_seq = dict(mass={c: _r(seq_cat[:, i]) for c, i in ci.items()}, keys=_r(seq_cov.T))
        out["phases"][phase] = dict(queries=int(nq), queries_by_row=_r(n_row), mass=mass, bands=bands,
                                    per_sequence=per_seq,
                                    offset_profile=offset_profile, coverage=coverage, recall=recall, oracle=oracle,
                                    heads=heads)
    return out


def _diff(a, b):
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return round(a - b, 6)
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [_diff(x, y) for x, y in zip(a, b)]
    if a is None or b is None:
        return None
    return None


def _se(xa: list, xb: list, paired: bool = False) -> float | None:
    """Standard error of mean(xa) - mean(xb): of the pairwise differences when ``paired`` (sequence i of
    both phases shares its condition), else for independent samples. None with fewer than 2 each."""
    if len(xa) < 2 or len(xb) < 2 or (paired and len(xa) != len(xb)):
        return None

    def var(x):
        m = sum(x) / len(x)
        return sum((v - m) ** 2 for v in x) / (len(x) - 1)

    if paired:
        return round(math.sqrt(var([u - v for u, v in zip(xa, xb)]) / len(xa)), 6)
    return round(math.sqrt(var(xa) / len(xa) + var(xb) / len(xb)), 6)


def asymmetry(summary: dict, a: str = "decode", b: str = "prefill", paired: bool = False) -> dict:
    """Phase ``a`` minus phase ``b`` for every mass, band, coverage, recall and oracle statistic; ``stderr``:
    the standard error of the overall mass and keys differences from the spread between sequences (of the
    per-sequence differences when ``paired``: sequence i of both phases has the same condition)."""
    pa, pb = summary["phases"][a], summary["phases"][b]
    out = dict(of=a, minus=b, mass={}, recall={}, coverage={})
    for c in CATEGORIES:
        out["mass"][c] = {k: _diff(pa["mass"][c][k], pb["mass"][c][k]) for k in ("overall", "per_layer", "per_head", "by_row")}
    out["bands"] = _diff(pa["bands"]["overall"], pb["bands"]["overall"])
    for name in ("keys", "fraction"):
        out["coverage"][name] = {k: _diff(pa["coverage"][name][k], pb["coverage"][name][k])
                                 for k in ("overall", "per_layer", "per_head", "by_row")}
    for name in pa["recall"]:
        if name in pb["recall"]:
            out["recall"][name] = {k: _diff(pa["recall"][name][k], pb["recall"][name][k])
                                   for k in ("overall", "per_layer", "per_head")}
    sa, sb = pa["per_sequence"], pb["per_sequence"]
    out["stderr"] = dict(paired=paired, mass={c: _se(sa["mass"][c], sb["mass"][c], paired) for c in CATEGORIES},
                         keys=[_se(x, y, paired) for x, y in zip(sa["keys"], sb["keys"])])
    if pa["oracle"] and pb["oracle"]:
        out["oracle"] = _diff(pa["oracle"]["overall"], pb["oracle"]["overall"])
    out["local_band_share"] = _diff(pa["heads"]["local_band_share"], pb["heads"]["local_band_share"])
    out["position_share"] = _diff(pa["heads"]["position_share"], pb["heads"]["position_share"])
    la, lb = pa["heads"]["local_class"], pb["heads"]["local_class"]
    sa, sb = pa["heads"]["spatial_class"], pb["heads"]["spatial_class"]
    n = sum(len(r) for r in la)
    out["same_local_class"] = sum(x == y for ra, rb in zip(la, lb) for x, y in zip(ra, rb)) / max(n, 1)
    out["same_spatial_class"] = sum(x == y for ra, rb in zip(sa, sb) for x, y in zip(ra, rb)) / max(n, 1)
    return out


def summarize_attention(attn: torch.Tensor, layout: Layout, config: MetricConfig | None = None, read_sets=(),
                        oracle_budgets=(), phase: str = "attention") -> dict:
    """Statistics of explicit attention maps: ``attn`` (H, T, T) or (B, H, T, T), rows summing to 1
    over keys 0..q. One layer; returns :func:`summarize`'s dict for the single phase ``phase``."""
    if attn.dim() == 3:
        attn = attn[None]
    B, H, T, S = attn.shape
    stats = AttentionStats(layout, 1, H, config=config, read_sets=read_sets, oracle_budgets=oracle_budgets)
    stats.add(phase, 0, torch.arange(T), attn)
    return stats.summary()
