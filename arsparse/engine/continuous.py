"""Continuous batching: a pool of image slots, each at its own position, decoding side by side.

The fixed-batch engine (:mod:`.generator`) decodes every row at one shared position, so a batch
starts and ends together. Here each slot keeps its own position: a request is prefilled into free
slots between two decode steps and joins the running batch, and a finished slot is free at once.
Sampling is the engine's (counter-based per image, :mod:`.sampling`), so a slot's tokens are
exactly those ``Generator.sample_tokens`` gives for the same condition, key and parameters,
whatever else shares the pool.

Backends: :class:`RowDenseKVCache` (dense) and :class:`RowRingKVCache` (offset policies) are the
fixed-batch caches with one position per row, through either kernel (``torch`` or ``triton``).
Scored policies keep per-step state that assumes one shared position; they are served in cohorts
instead (:mod:`arsparse.serve.scheduler`).
"""
from __future__ import annotations

import logging
from collections import Counter

import torch
import torch.nn.functional as F

from ..models.config import GPTConfig
from ..prompt_mask import attention_mask, check_prompt_mask, prompt_span
from ..policies.base import PolicyError
from ..policies.caches import RingKVCache, _attend_gathered
from ..policies.offset import OffsetPolicy
from ..policies.remainder import remainder_entry
from .cache import DenseKVCache
from .generator import bucket
from .sampling import guide, sample

log = logging.getLogger(__name__)


def supports_continuous(policy) -> bool:
    """Whether sequences under ``policy`` can join a running batch (dense and offset policies)."""
    return policy is None or policy.kind == "dense" or isinstance(policy, OffsetPolicy)


def make_row_cache(policy, cfg: GPTConfig, rows: int, dtype: torch.dtype, device, kernel: str = "torch"):
    """A cache with one position per row for ``policy`` (None or dense, or an offset policy)."""
    if policy is None or policy.kind == "dense":
        return RowDenseKVCache(cfg, rows, dtype, device, kernel=kernel)
    if isinstance(policy, OffsetPolicy):
        return RowRingKVCache(cfg, policy, rows, dtype, device, kernel=kernel)
    raise PolicyError(f"{policy.name}: a {policy.kind} policy keeps state that assumes one shared position; "
                      "only dense and offset policies can join a running batch")


def to_device(values, device, dtype=None) -> torch.Tensor:
    """A list or CPU tensor on ``device`` without waiting for the device: a plain ``.to(device)`` from
    host memory synchronises the stream (all queued steps), a non-blocking one from pageable memory
    is staged at once and returns."""
    return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)


def _scatter_at(buf: torch.Tensor, slot: torch.Tensor, x: torch.Tensor) -> None:
    """buf (B, Hkv, S, D)[b, :, slot[b]] = x (B, Hkv, 1, D), in place."""
    B, Hkv, _, D = buf.shape
    buf.scatter_(2, slot.view(B, 1, 1, 1).expand(B, Hkv, 1, D), x)


class _RowMasks:
    """Mixin of the row caches: caption masks set row by row, as requests join (t2i).

    The mask buffers of :class:`~arsparse.engine.cache.CaptionMask` are made once for every row
    (all True) by :meth:`enable_prompt_masks`, before any step is captured; :meth:`set_row_masks`
    then overwrites the rows a request takes, so a captured step stays valid.
    """

    def enable_prompt_masks(self) -> None:
        if self.prompt_keep is None:
            self.set_prompt_mask(torch.ones(self.rows, self.P, dtype=torch.bool, device=self.pos.device))

    def set_row_masks(self, rows: torch.Tensor, mask: torch.Tensor) -> None:
        """``rows`` (k,) cache rows <- ``mask`` (k, P) bool, each one contiguous run of True."""
        mask = mask.to(self.prompt_keep.device, non_blocking=True)
        self.prompt_keep[rows] = mask
        self.prompt_span[rows] = prompt_span(mask)
        self.prefill_mask[rows] = attention_mask(mask, self.P)

    def _prefill_rows(self, q, k, v):
        """Attention among the prompt positions of the rows being prefilled (``prefill_rows``)."""
        if self.prefill_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.gqa)
        T = k.shape[2]
        mask = self.prefill_mask[self.prefill_rows, :, :T, :T]  # (k, 1, T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.gqa)


class RowDenseKVCache(_RowMasks, DenseKVCache):
    """The dense cache with a position per row: ``pos`` is (rows,).

    ``prefill`` writes the prompt of the rows in ``prefill_rows`` only (the others keep decoding
    state); ``decode`` runs the first ``B`` rows (B = the query's batch), row ``b`` writing and
    attending at ``pos[b]``: masked SDPA over the whole buffer (``torch``) or the split-KV kernel
    with a position per row (``triton``).
    """

    def __init__(self, cfg: GPTConfig, rows: int, dtype: torch.dtype, device, kernel: str = "torch"):
        super().__init__(cfg, rows, dtype, device, kernel=kernel)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)
        self.prefill_rows: torch.Tensor | None = None

    def attend(self, layer: int, q, k, v):
        if self.phase == "prefill":
            T = k.shape[2]
            self.k[layer, self.prefill_rows, :, :T] = k
            self.v[layer, self.prefill_rows, :, :T] = v
            return self._prefill_rows(q, k, v)
        B = q.shape[0]
        pos = self.pos[:B]  # (B,)
        kc, vc = self.k[layer, :B], self.v[layer, :B]  # (B, Hkv, S, D)
        if self.kernel == "triton":
            return self._decode_triton(q, k, v, kc, vc, pos)
        _scatter_at(kc, pos, k)
        _scatter_at(vc, pos, v)
        mask = (self._slots[None, :] <= pos[:, None])[:, None, None, :]  # (B, 1, 1, S)
        if self.prompt_keep is not None:  # padded caption positions are never read
            mask = mask & F.pad(self.prompt_keep[:B], (0, self.max_len - self.P), value=True)[:, None, None, :]
        return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=self.gqa)


class RowRingKVCache(_RowMasks, RingKVCache):
    """The ring-buffer cache of offset policies with a position per row (see :class:`RowDenseKVCache`).

    With the policy's ``remainder``, each row's running sums restart at its prefill and take its new
    token once the row is past the sinks, so a row's remainder entry is the one it has alone.
    """

    def __init__(self, cfg: GPTConfig, policy, rows: int, dtype: torch.dtype, device, kernel: str = "torch"):
        super().__init__(cfg, policy, rows, dtype, device, kernel=kernel)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)
        self.prefill_rows: torch.Tensor | None = None

    def attend(self, layer: int, q, k, v, rope: torch.Tensor | None = None):
        if rope is not None:  # (a compiled model's decode step: each row's table, q and k unrotated)
            return self._decode_rotating(layer, q, k, v, self.pos[: q.shape[0]], rope)
        if self.phase == "prefill":
            T = k.shape[2]
            self.pk[layer, self.prefill_rows, :, :T] = k
            self.pv[layer, self.prefill_rows, :, :T] = v
            if self.remainder:  # no image keys yet
                self.ksum[layer].index_fill_(0, self.prefill_rows, 0.0)  # (a scalar put is a host copy)
                self.vsum[layer].index_fill_(0, self.prefill_rows, 0.0)
            return self._prefill_rows(q, k, v)
        B, H = q.shape[0], q.shape[1]
        pos = self.pos[:B]  # (B,)
        if self.remainder and not self.sums_in_kernel:  # each row's new token joins its sums once past the sinks
            past = (pos - self.P >= self.S).to(torch.float32)[:, None, None]  # (B, 1, 1)
            self.ksum[layer, :B].add_(k[:, :, 0].float() * past)
            self.vsum[layer, :B].add_(v[:, :, 0].float() * past)
        if self.kernel == "triton":  # (the kernel computes the image indices itself)
            return self._decode_triton(layer, q, k, v, pos)
        i = pos - self.P  # image index of each row's query
        _scatter_at(self.rk[layer, :B], i % self.W, k)
        _scatter_at(self.rv[layer, :B], i % self.W, v)
        sink_slot = torch.where(i < self.S, i, self.S)  # the last sink slot is scratch
        _scatter_at(self.sk[layer, :B], sink_slot, k)
        _scatter_at(self.sv[layer, :B], sink_slot, v)

        offs = self.offsets[layer]  # (H, n)
        kpos = pos[:, None, None] - offs[None]  # (B, H, n)
        ok = (offs >= 0)[None] & (kpos >= self.P + self.S)
        ring_slot = ((kpos - self.P) % self.W).clamp_min(0)
        rk, rv = self._heads(self.rk[layer, :B]), self._heads(self.rv[layer, :B])  # (B, H, W, D)
        idx = ring_slot[..., None].expand(B, H, -1, rk.shape[-1])
        keys = torch.cat([self._heads(self.pk[layer, :B]), self._heads(self.sk[layer, :B, :, : self.S]),
                          rk.gather(2, idx)], dim=2)
        values = torch.cat([self._heads(self.pv[layer, :B]), self._heads(self.sv[layer, :B, :, : self.S]),
                            rv.gather(2, idx)], dim=2)
        sinks = (self._sink_idx[None, :] <= i[:, None])[:, None, :].expand(B, H, self.S)
        prompt = torch.ones(B, H, self.P, dtype=torch.bool, device=q.device)
        if self.prompt_keep is not None:  # padded caption positions are never read
            prompt = prompt & self.prompt_keep[:B, None, :]
        valid = torch.cat([prompt, sinks, ok], dim=2)
        rest = None
        if self.remainder:
            n_ring = ring_slot.shape[-1]
            rest = remainder_entry(self._heads(self.ksum[layer, :B]), self._heads(self.vsum[layer, :B]),
                                   (i + 1 - self.S).clamp_min(0)[:, None], keys[:, :, -n_ring:], values[:, :, -n_ring:],
                                   ok)
        return _attend_gathered(q, keys, values, valid, rest)[0]


class SlotDecoder:
    """A pool of ``slots`` images decoding side by side, each at its own step.

    Slot ``s`` owns cache rows ``2s`` (condition) and ``2s + 1`` (unconditional) when ``guidance``
    is on, else row ``s``; so any slot may use guidance, and a slot with ``cfg_scale == 1`` samples
    from its condition row alone. :meth:`admit` prefills new images into free slots and samples
    their first token; :meth:`step` advances every busy slot by one token; a slot is done when it
    holds all ``N`` tokens (:meth:`done`), and :meth:`release` frees it. Steps run over slots
    ``0 .. width-1`` (the highest busy slot), so take free slots lowest first.

    Parameters
    ----------
    gen : Generator
        Its model, device, dtype, kernel and policy (dense or offset) are used; nothing is copied.
    slots : int
        Images in flight at most.
    guidance : bool
        Two cache rows per slot (needs a model with a null condition).
    cuda_graphs : bool
        Replay each step shape (slots bucket, top-k bound, top-p on/off) from a CUDA graph once it
        has run twice (CUDA only; off: every step runs eagerly).
    """

    def __init__(self, gen, slots: int, guidance: bool, cuda_graphs: bool = False):
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        cfg = gen.config
        self.gen, self.gpt = gen, gen.gpt
        self.slots, self.G = slots, 2 if guidance else 1
        self.P, self.N, self.V = cfg.cls_token_num, cfg.image_tokens, cfg.vocab_size
        self.max_pos = cfg.seq_len - 1
        dev = gen.device
        self.cache = make_row_cache(gen.policy, cfg, slots * self.G, gen.gpt.dtype, dev, kernel=gen.kernel)
        if cfg.model_type == "t2i":  # caption masks, set per slot as requests join
            self.cache.enable_prompt_masks()
        z = dict(device=dev)
        self.cur = torch.zeros(slots, dtype=torch.long, **z)  # last sampled token per slot
        self.out = torch.zeros(slots, self.N + 1, dtype=torch.long, **z)  # (S, N + 1); column N: scratch
        self.step_idx = torch.full((slots,), self.N, dtype=torch.long, **z)  # next token to sample; N = idle
        self.keys = torch.zeros(slots, dtype=torch.long, **z)
        self.temperature = torch.ones(slots, **z)
        self.top_k = torch.zeros(slots, dtype=torch.long, **z)
        self.top_p = torch.full((slots,), float("inf"), **z)  # inf = off: the top-p filter keeps everything
        self.cfg_scale = torch.ones(slots, **z)
        self.cfg_on = torch.zeros(slots, dtype=torch.bool, **z)
        self.cfg_interval = torch.full((slots,), -1, dtype=torch.long, **z)
        self._prompt_pos = torch.arange(self.P, **z)
        self.cuda_graphs = cuda_graphs and torch.device(dev).type == "cuda"
        self._graphs: dict[tuple, object] = {}
        self._seen: dict[tuple, int] = {}
        self._graph_pool = None
        # Host bookkeeping, kept incrementally (no scan over the slots each step, no device sync):
        # a busy slot's tokens so far are 1 + the steps run since it joined.
        self._t = 0  # steps run so far
        self._born: list[int | None] = [None] * slots  # the step count when each busy slot joined; None = free
        self._free = set(range(slots))
        self._due: dict[int, list[int]] = {}  # step count -> the slots that hold N tokens then
        self._done: set[int] = set()  # busy slots holding all N tokens
        self._live = 0  # busy slots still sampling
        self._width = 0  # 1 + the highest busy slot
        self._k = [0] * slots  # per slot: top_k, top-p on (they fix the sampling ops' shapes)
        self._p = [False] * slots
        self._kcount: Counter = Counter()  # top_k values of the busy slots
        self._pcount = 0  # busy slots filtering by top-p

    # ---- bookkeeping ------------------------------------------------------------------
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    def free_count(self) -> int:
        return len(self._free)

    def busy(self) -> int:
        return self.slots - len(self._free)

    def width(self) -> int:
        return self._width

    def done(self) -> list[int]:
        return sorted(self._done)

    def sampled(self, slot: int) -> int:
        """Tokens ``slot`` holds (0: free)."""
        born = self._born[slot]
        return 0 if born is None else min(self.N, 1 + self._t - born)

    def tokens(self, slots: list[int]) -> torch.Tensor:
        """(k, N) tokens of ``slots`` (a copy, on the device)."""
        return self.out[to_device(slots, self.out.device), : self.N]

    def release(self, slots: list[int]) -> None:
        if not slots:
            return
        idx = to_device(slots, self.out.device)
        self.step_idx.index_fill_(0, idx, self.N)  # (fills: a scalar put copies a host tensor, a sync)
        self.top_p.index_fill_(0, idx, float("inf"))
        self.top_k.index_fill_(0, idx, 0)
        for s in slots:
            born = self._born[s]
            if born is not None:
                if s in self._done:
                    self._done.remove(s)
                else:
                    self._due[born + self.N - 1].remove(s)
                    self._live -= 1
                self._kcount[self._k[s]] -= 1
                if not self._kcount[self._k[s]]:
                    del self._kcount[self._k[s]]
                self._pcount -= self._p[s]
                self._born[s] = None
                self._free.add(s)
            self._k[s], self._p[s] = 0, False
        while self._width and self._born[self._width - 1] is None:
            self._width -= 1

    # ---- the two device phases ------------------------------------------------------------
    def _filters(self, slots) -> tuple[int, bool]:
        """(top-k bound, top-p on) over ``slots``: what fixes the shape of the sampling ops."""
        return min(max((self._k[s] for s in slots), default=0), self.V), any(self._p[s] for s in slots)

    def _sample(self, logits: torch.Tensor, idx, kmax: int, use_top_p: bool) -> torch.Tensor:
        """logits (G * k, V), rows interleaved per slot -> (k,) tokens for the slots ``idx``.

        ``kmax`` >= every top_k among them (any such bound gives the same tokens); ``use_top_p``
        when any of them filters by top-p (top_p = inf is off for the others).
        """
        step = self.step_idx[idx]
        if self.G == 2:
            lg = logits.view(-1, 2, logits.shape[-1])  # (k, 2, V): condition, unconditional
            interval = self.cfg_interval[idx]
            active = self.cfg_on[idx] & ((interval < 0) | (step <= interval + 1))
            logits = guide(torch.cat([lg[:, 0], lg[:, 1]]), self.cfg_scale[idx], active)
        return sample(logits, self.keys[idx], step, self.temperature[idx], self.top_k[idx] if kmax else None,
                      self.top_p[idx] if use_top_p else None, kmax)

    @torch.no_grad()
    def admit(self, slots: list[int], cond: torch.Tensor, keys: list[int], rows: dict[str, list],
              prompt_mask=None) -> None:
        """Prefill images into free ``slots`` and sample their first token.

        ``cond`` holds one condition per slot; ``keys`` the noise key of each image
        (:func:`~arsparse.engine.sampling.row_key`); ``rows`` the per-image sampling arguments as
        :func:`~arsparse.engine.generator.sampling_rows` returns them; ``prompt_mask`` (t2i) the
        caption mask of each slot, (k, P) bool as in :meth:`Generator.sample_tokens` (None: unpadded).
        """
        taken = [s for s in slots if s not in self._free]
        if taken or len(set(slots)) != len(slots):
            raise ValueError(f"slots {taken or slots} are busy or repeated")
        k = len(slots)
        if self.G == 1 and any(c != 1.0 for c in rows["cfg_scale"]):
            raise ValueError("this decoder has no guidance rows: cfg_scale must be 1")
        dev = self.out.device
        idx = to_device(slots, dev)
        cond = self.gen.as_cond(cond)
        if cond.shape[0] != k or len(keys) != k:
            raise ValueError(f"{cond.shape[0]} conditions and {len(keys)} keys for {k} slots")
        mask = check_prompt_mask(prompt_mask, k, self.P, self.gpt.config.model_type)
        self.keys[idx] = to_device(keys, dev, torch.long)
        self.temperature[idx] = to_device(rows["temperature"], dev, torch.float32)
        self.top_k[idx] = to_device(rows["top_k"], dev, torch.long)
        self.top_p[idx] = to_device([p if p < 1.0 else float("inf") for p in rows["top_p"]], dev, torch.float32)
        self.cfg_scale[idx] = to_device(rows["cfg_scale"], dev, torch.float32)
        self.cfg_on[idx] = to_device([c != 1.0 for c in rows["cfg_scale"]], dev, torch.bool)
        self.cfg_interval[idx] = to_device(rows["cfg_interval"], dev, torch.long)
        self.step_idx.index_fill_(0, idx, 0)
        for s, tk, tp in zip(slots, rows["top_k"], rows["top_p"]):
            self._k[s], self._p[s] = tk, tp < 1.0

        gpt, cache = self.gpt, self.cache
        if self.G == 2:
            cond = torch.stack([cond, gpt.null_cond(cond)], dim=1).flatten(0, 1)  # (2k, ...) interleaved
        cache.prefill_rows = (idx[:, None] * self.G + torch.arange(self.G, device=dev)).flatten()
        if cache.prompt_keep is not None:  # every slot's mask is (re)set: a slot may have held a padded caption
            mask = torch.ones(k, self.P, dtype=torch.bool) if mask is None else mask
            cache.set_row_masks(cache.prefill_rows, mask.repeat_interleave(self.G, dim=0))  # guidance rows alike
        cache.phase = "prefill"
        try:
            logits = gpt.next_logits(gpt.embed_cond(cond), self._prompt_pos, cache)  # (G * k, V)
        finally:
            cache.phase = "decode"
        tok = self._sample(logits, idx, *self._filters(slots))
        self.cur[idx] = tok
        self.out[idx, 0] = tok
        self.step_idx.index_fill_(0, idx, 1)
        for s in slots:  # busy from now on
            self._free.remove(s)
            self._born[s] = self._t
            self._kcount[self._k[s]] += 1
            self._pcount += self._p[s]
            if self.N == 1:
                self._done.add(s)
            else:
                self._due.setdefault(self._t + self.N - 1, []).append(s)
                self._live += 1
        self._width = max(self._width, max(slots) + 1)

    @torch.no_grad()
    def step(self) -> int:
        """One decode step for every busy slot; -> the number of tokens sampled."""
        if not self._live:
            return 0
        w = self._width
        kmax, use_top_p = min(max(self._kcount, default=0), self.V), self._pcount > 0
        if self.cuda_graphs:
            # Shapes from buckets, so that few graphs serve every mix: any bound >= the largest top_k
            # samples the same tokens, and slots past the busy ones are idle.
            plan = (min(bucket(w), self.slots), min(bucket(kmax), self.V) if kmax else 0, use_top_p)
            graph = self._graph_for(plan)
            if graph is not None:
                graph.replay()
            else:
                self._step_device(*plan)
        else:
            self._step_device(w, kmax, use_top_p)
        live, self._t = self._live, self._t + 1
        finished = self._due.pop(self._t, [])
        self._done.update(finished)
        self._live -= len(finished)
        return live

    def _step_device(self, w: int, kmax: int, use_top_p: bool) -> None:
        """The device side of a step over slots 0..w-1: no host syncs, static shapes (capturable)."""
        gpt, cache, G = self.gpt, self.cache, self.G
        step = self.step_idx[:w]  # (w,)
        running = step < self.N
        # Position of the token fed; idle slots (step N) decode garbage at the last position, which keeps
        # every row's writes and reads inside its own cache row.
        pos = (step + (self.P - 1)).clamp_max(self.max_pos)
        cache.pos[: G * w] = pos.repeat_interleave(G)
        h = gpt.tok_embeddings(self.cur[:w].repeat_interleave(G)[:, None])  # (G * w, 1, dim)
        logits = gpt.next_logits(h, cache.pos[: G * w, None], cache)
        tok = self._sample(logits, slice(0, w), kmax, use_top_p)
        col = torch.where(running, step, self.N)  # idle slots write the scratch column
        self.out[:w].scatter_(1, col[:, None], tok[:, None])
        self.cur[:w] = tok
        self.step_idx[:w] += running

    def _graph_for(self, plan):
        """The CUDA graph of ``plan``, captured the third time the plan runs (the first two run eagerly,
        which initialises everything the step touches; capturing records without running, so the
        busy slots are not disturbed). None while eager, or if capture failed (then always eager)."""
        if plan in self._graphs:
            return self._graphs[plan]
        self._seen[plan] = self._seen.get(plan, 0) + 1
        if self._seen[plan] <= 2:
            return None
        try:
            graph = torch.cuda.CUDAGraph()
            # thread_local: other threads (another policy's worker) may keep using the GPU meanwhile.
            with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
                self._step_device(*plan)
            self._graph_pool = graph.pool()
        except Exception:  # keep serving, eagerly
            log.warning("CUDA graph capture failed for plan %s; running it eagerly", plan, exc_info=True)
            graph = None
        self._graphs[plan] = graph
        return graph
