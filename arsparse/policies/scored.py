"""Scored policies: which entries stay depends on the attention seen so far.

Every scored policy keeps, per (sequence, layer, kv head), at most ``capacity`` image entries
besides the prompt, in a slot table of ``capacity + 1`` slots. A decode step

1. writes the new token into a free slot (there is always one),
2. attends over the prompt and the occupied slots (at most ``capacity + 1`` image entries),
3. updates the scores from that attention (``update``),
4. if more than ``capacity`` entries are held, evicts the lowest ``eviction score`` among the
   entries that are not protected (``protected``): recent tokens, sinks, anchors.

So after every step at most ``capacity`` entries are kept, and the freed slot takes the next token.
Subclasses define ``capacity``, ``update`` and ``protected`` (and may override the eviction
choice); the cache (``SlotKVCache``) does the mechanics.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layout import Layout
from .base import Budget, Policy, PolicyError, dense_entries, need_int, need_rho


@dataclass(frozen=True)
class ScoredPolicy(Policy):
    kind = "scored"

    def capacity(self, layout: Layout) -> int:
        """Image entries kept per (sequence, layer, kv head), besides the prompt."""
        rho = getattr(self, "rho")
        cap = int(rho * dense_entries(layout)) - layout.prefix_len
        if cap < self.min_capacity(layout):
            raise PolicyError(f"{self.name}: rho={rho} keeps {cap} image entries, fewer than the "
                              f"{self.min_capacity(layout)} its protected set needs")
        return min(cap, layout.image_tokens - 1)

    def min_capacity(self, layout: Layout) -> int:
        return 1

    def check(self, layout: Layout) -> None:
        self.capacity(layout)

    def head_capacity(self, layout: Layout, n_layer: int, n_kv: int) -> torch.Tensor:
        """(L, Hkv) capacities; uniform unless the policy gives heads different budgets."""
        return torch.full((n_layer, n_kv), self.capacity(layout), dtype=torch.long)

    def budget(self, layout: Layout, n_layer: int = 1, n_head: int = 1) -> Budget:
        cap = self.capacity(layout)
        P, N = layout.prefix_len, layout.image_tokens
        # Step for image index i holds min(i + 1, cap + 1) entries while attending.
        reads = [P + min(i + 1, cap + 1) for i in range(N - 1)]
        return Budget(read=sum(reads) / len(reads), kept=P + cap, dense=dense_entries(layout))

    # -- the three hooks --------------------------------------------------------------
    def update(self, score: torch.Tensor, weights: torch.Tensor, pos: torch.Tensor, q: torch.Tensor,
               layout: Layout) -> torch.Tensor:
        """New scores (B, Hkv, C) from this step's attention ``weights`` (B, Hkv, C) on the slots."""
        raise NotImplementedError

    def protected(self, pos: torch.Tensor, q: torch.Tensor, layout: Layout) -> torch.Tensor:
        """(B, Hkv, C) bool: occupied slots that may not be evicted at query position q."""
        return pos == q  # the token just written

    def eviction_score(self, score: torch.Tensor, pos: torch.Tensor, layout: Layout) -> torch.Tensor:
        """Lower is evicted first."""
        return score

    # -- per-head capacities that change while decoding (HeadKV, SSD) ---------------------------
    # Defaults: the capacity never changes, no statistics, one eviction per step. All of these run
    # inside the captured decode step: tensor ops only, no host syncs.
    def max_capacity(self, layout: Layout, n_layer: int, n_kv: int) -> int:
        """The most image entries any head may ever hold; the slot table has this + 1 slots."""
        return int(self.head_capacity(layout, n_layer, n_kv).max())

    def head_stats(self, n_layer: int, rows: int, n_kv: int, device) -> dict[str, torch.Tensor]:
        """Per-(sequence, kv head) statistics the cache keeps for the policy: name -> (L, rows, Hkv, ...).

        The cache zeroes them when a prompt is prefilled and hands one layer's slices to
        :meth:`update_capacity` and :meth:`evict`.
        """
        return {}

    def update_capacity(self, cap: torch.Tensor, stats: dict[str, torch.Tensor], weights: torch.Tensor,
                        pos: torch.Tensor, q: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This layer's capacities (B, Hkv) after the step at query position ``q``.

        ``weights`` (B, Hkv, C): this step's attention on the slots, averaged over the query heads
        of each kv group (with the prompt's share it sums to 1); ``pos`` (B, Hkv, C) the slots'
        positions (-1 free). ``stats`` holds this layer's slices of :meth:`head_stats`, which the
        policy may update in place. Entries above a lowered capacity are evicted in the same step.
        """
        return cap

    def evict(self, score: torch.Tensor, pos: torch.Tensor, evictable: torch.Tensor, excess: torch.Tensor,
              stats: dict[str, torch.Tensor], layout: Layout) -> torch.Tensor:
        """(B, Hkv, C) bool: the slots to free. ``excess`` (B, Hkv, 1): entries held minus capacity.

        Default: where over capacity, the evictable entry with the lowest :meth:`eviction_score`
        (one per step, which is all a constant capacity ever needs).
        """
        rank = torch.where(evictable, self.eviction_score(score, pos, layout), torch.full_like(score, float("inf")))
        victim = rank.argmin(-1, keepdim=True)  # (B, Hkv, 1)
        hit = (excess > 0) & evictable.any(-1, keepdim=True)
        return torch.zeros_like(evictable).scatter_(-1, victim, hit)

    def make_cache(self, cfg, rows: int, dtype, device, kernel: str = "torch"):
        from .caches import SlotKVCache

        return SlotKVCache(cfg, self, rows, dtype, device, kernel=kernel)

    def teacher_forced_logits(self, gpt, cond, tokens, prompt_mask=None):
        """Token by token through the evicting cache: the same computation as decoding."""
        from ..engine.generator import Generator

        p = next(gpt.parameters())
        gen = Generator(gpt, device=p.device, dtype=p.dtype, cuda_graphs=False, compile=False, policy=self)
        return gen.cached_logits(cond, tokens, prompt_mask=prompt_mask)


def _recent(pos, q, n):
    return (pos >= 0) & (q - pos < n)


@dataclass(frozen=True)
class H2OPolicy(ScoredPolicy):
    """H2O: a recent window plus the heavy hitters, entries with the largest accumulated attention.

    Score = the sum over all past queries of the attention an entry received (per kv head, summed
    over the query heads of its group). ``recent`` is the share of the budget given to the window
    (the paper splits the budget half and half).
    """

    source = "Zhang et al., H2O: Heavy-Hitter Oracle for Efficient Generative Inference of LLMs, NeurIPS 2023"
    rho: float = 0.125
    recent: float = 0.5

    def __post_init__(self):
        need_rho(self.name, self.rho)
        if not 0 <= self.recent < 1:
            raise PolicyError(f"{self.name}: recent (share of the budget for the recent window) must be in [0, 1), "
                              f"got {self.recent!r}")

    def n_recent(self, layout):
        return max(1, int(self.recent * self.capacity(layout)))

    def update(self, score, weights, pos, q, layout):
        return score + weights

    def protected(self, pos, q, layout):
        return _recent(pos, q, self.n_recent(layout))


@dataclass(frozen=True)
class TOVAPolicy(ScoredPolicy):
    """TOVA: when over budget, evict the entry the current query attends to least.

    The attention is averaged over all heads of the layer, so a layer evicts one position for all
    its heads (the paper's choice). The token just written is never evicted (our choice).
    """

    source = "Oren et al., Transformers are Multi-State RNNs (TOVA), EMNLP 2024"
    rho: float = 0.125

    def __post_init__(self):
        need_rho(self.name, self.rho)

    def update(self, score, weights, pos, q, layout):
        return weights.mean(dim=1, keepdim=True).expand_as(weights)  # (B, Hkv, C): mean over heads


@dataclass(frozen=True)
class ADSAPolicy(ScoredPolicy):
    """ADSA-style adaptive dynamic sparse attention: prefix, a local window, and the earlier tokens
    with the highest running importance.

    Importance is an exponential moving average of the attention an entry receives
    (``decay`` per step; 0 keeps only the last step, 1 is H2O's plain sum). ``local`` recent
    positions are always kept. Chosen here because the published method leaves the importance
    estimator open; configurable.
    """

    source = "Adaptive dynamic sparse attention for AR visual generation (ADSA), 2025"
    rho: float = 0.125
    local: int = 16
    decay: float = 0.9

    def __post_init__(self):
        need_rho(self.name, self.rho)
        need_int(self.name, "local", self.local, 1)
        if not 0 <= self.decay <= 1:
            raise PolicyError(f"{self.name}: decay must be in [0, 1], got {self.decay!r}")

    def min_capacity(self, layout):
        return self.local

    def update(self, score, weights, pos, q, layout):
        return self.decay * score + weights

    def protected(self, pos, q, layout):
        return _recent(pos, q, self.local)


@dataclass(frozen=True)
class LinesPolicy(ScoredPolicy):
    """LineAR: the prompt, ``anchors`` first image tokens, the most recent ``recent_rows`` rows, and of
    the older rows the tokens the last finished row attended to most.

    Scores are the attention accumulated over the queries of the current row and are reset when a
    row starts, so an eviction ranks entries by how much the last (finished or running) row
    attended to them: the line-wise rule. Total kept = rho * dense.
    """

    source = "LineAR: line-wise KV cache compression for autoregressive image generation, 2025"
    rho: float = 0.125
    recent_rows: int = 2
    anchors: int = 4

    def __post_init__(self):
        need_rho(self.name, self.rho)
        need_int(self.name, "recent_rows", self.recent_rows, 1)
        need_int(self.name, "anchors", self.anchors, 0)

    def min_capacity(self, layout):
        return self.anchors + self.recent_rows * layout.row_stride

    def update(self, score, weights, pos, q, layout):
        row_start = ((q - layout.prefix_len) % layout.row_stride) == 0
        return torch.where(row_start, torch.zeros_like(score), score) + weights

    def protected(self, pos, q, layout):
        P, W = layout.prefix_len, layout.row_stride
        first_recent = P + ((q - P) // W - (self.recent_rows - 1)) * W
        return (pos >= 0) & ((pos >= first_recent) | (pos < P + self.anchors))
