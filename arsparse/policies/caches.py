"""Compact KV caches that evict for real: a ring buffer for offset policies, slot tables for scored ones.

Both are attention backends of the model (``attend(layer, q, k, v)``) with the same two phases as
the dense cache: ``prefill`` (the prompt, dense and causal, kept for good) and ``decode`` (one token
at the device scalar ``pos``: static shapes, CUDA-graph friendly). Decode attention reads exactly
the entries the policy keeps, through ``kernel``: ``"torch"`` (gathered attention, the reference)
or ``"triton"`` (kernels that compute the read set in place, see :mod:`arsparse.kernels.triton`).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from ..engine.cache import KERNELS, CaptionMask
from ..kernels.reference import slot_decode_attention_ref
from ..layout import Layout
from ..models.config import GPTConfig
from .remainder import fold_in, remainder_entry


def _layout(cfg: GPTConfig) -> Layout:
    return Layout(cfg.cls_token_num, cfg.grid_h, cfg.grid_w)


def _attend_gathered(q, keys, values, valid, rest=None):
    """q (B, H, 1, D); keys/values (B, H, n, D); valid (B or 1, H, n) -> out (B, H, 1, D), weights (B, H, n).

    ``rest``: (k_rest, v_rest (B, H, D) fp32, count (B or 1, H)), the remainder entry
    (:mod:`arsparse.policies.remainder`) attended with the read entries.
    """
    scale = q.shape[-1] ** -0.5
    s = torch.einsum("bhqd,bhnd->bhqn", q.float(), keys.float())[:, :, 0] * scale  # (B, H, n)
    s = s.masked_fill(~valid, float("-inf"))
    if rest is None:
        w = s.softmax(-1)
        out = torch.einsum("bhn,bhnd->bhd", w, values.float())
    else:
        k_rest, v_rest, count = rest
        w = fold_in(s, q[:, :, 0].float(), k_rest, count.expand_as(s[..., 0]))  # (B, H, n + 1)
        out = torch.einsum("bhn,bhnd->bhd", w[..., :-1], values.float()) + w[..., -1:] * v_rest
        w = w[..., :-1]
    return out[:, :, None].to(q.dtype), w


class _PromptCache(CaptionMask):
    """Shared by both caches: the prompt's K/V (kept for good), its caption mask and the prefill phase."""

    def __init__(self, cfg: GPTConfig, rows: int, dtype, device):
        self.P = cfg.cls_token_num
        self.G = cfg.n_head // cfg.kv_heads
        shape = (cfg.n_layer, rows, cfg.kv_heads, self.P, cfg.head_dim)
        self.pk = torch.zeros(shape, dtype=dtype, device=device)
        self.pv = torch.zeros(shape, dtype=dtype, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.phase = "prefill"
        self.gqa = self.G > 1

    @property
    def rows(self) -> int:
        return self.pk.shape[1]

    def _prefill(self, layer, q, k, v):
        T = k.shape[2]
        self.pk[layer, :, :, :T] = k
        self.pv[layer, :, :, :T] = v
        return self._prefill_attention(q, k, v, self.gqa)

    def _heads(self, x):
        """(B, Hkv, ...) -> (B, H, ...) for grouped-query attention."""
        return x.repeat_interleave(self.G, dim=1) if self.G > 1 else x


class RingKVCache(_PromptCache):
    """Offset policies: prompt + sinks + a ring of the last ``window`` image positions.

    Image position ``p`` lives in ring slot ``(p - P) % window``; sink ``j`` (position ``P + j``)
    also in its own buffer, so it outlives the ring. A query reads the prompt, the sinks written
    so far, and the ring slots of ``pos - offset`` for the offsets of its (layer, head); with a
    caption mask, the prompt less its padded positions.

    With the policy's ``remainder``, ``ksum``/``vsum`` (L, rows, Hkv, D) fp32 hold the sums of K
    and V over the image positions past the sinks written so far (zeroed at prefill, added to as
    each token is written, branch-free); a query's remainder entry is those sums less the image
    keys it reads (both kernels). The Triton kernel updates the sums itself where each kv head has
    one query head (``sums_in_kernel``), so it can also rotate q and k; else they are updated in
    PyTorch before its launch.
    """

    def __init__(self, cfg: GPTConfig, policy, rows: int, dtype, device, kernel: str = "torch"):
        super().__init__(cfg, rows, dtype, device)
        self.kernel = kernel
        layout = _layout(cfg)
        self.S = min(policy.sink_count(layout), layout.image_tokens - 1)
        self.W = policy.window(layout, cfg.n_layer, cfg.n_head)
        self.offsets = policy.offset_table(layout, cfg.n_layer, cfg.n_head).to(device)  # (L, H, n)
        L, Hkv, D = cfg.n_layer, cfg.kv_heads, cfg.head_dim
        self.rk = torch.zeros(L, rows, Hkv, self.W, D, dtype=dtype, device=device)
        self.rv = torch.zeros_like(self.rk)
        self.sk = torch.zeros(L, rows, Hkv, self.S + 1, D, dtype=dtype, device=device)  # last slot: scratch
        self.sv = torch.zeros_like(self.sk)
        self._sink_idx = torch.arange(self.S, device=device)
        self.remainder = policy.remainder
        sums = (L, rows, Hkv, D) if self.remainder else (0,)
        self.ksum = torch.zeros(sums, dtype=torch.float32, device=device)
        self.vsum = torch.zeros_like(self.ksum)
        self.sums_in_kernel = self.remainder and kernel == "triton" and self.G == 1

    def nbytes(self) -> int:
        state = (self.pk, self.pv, self.rk, self.rv, self.sk, self.sv, self.ksum, self.vsum)
        return sum(t.numel() * t.element_size() for t in state)

    @property
    def rotates_qk(self) -> bool:
        """Whether ``attend`` takes ``rope=`` (the step's RoPE table, q and k unrotated) and rotates them
        in the decode kernel: decode steps of the Triton kernel (with the remainder entry, where the
        kernel updates its sums), while the kernel's ``LAUNCH["rotate"]`` says so (``arsparse bench
        --variant ring.rotate=0``: RoPE in the block)."""
        if self.phase != "decode" or self.kernel != "triton" or (self.remainder and not self.sums_in_kernel):
            return False
        from ..kernels.triton import ring
        return ring.LAUNCH["rotate"]

    def _decode_rotating(self, layer: int, q, k, v, pos, rope: torch.Tensor):
        """The fused path's decode step, q and k unrotated with the step's table (only when ``rotates_qk``)."""
        if not self.rotates_qk:
            raise ValueError("rope= needs a decode step of the triton kernel (with the remainder entry, "
                             "one query head per kv head)")
        return self._decode_triton(layer, q, k, v, pos, rope)

    def attend(self, layer: int, q, k, v, rope: torch.Tensor | None = None):
        if rope is not None:  # (the model passes a table only when rotates_qk says so)
            return self._decode_rotating(layer, q, k, v, self.pos, rope)
        if self.phase == "prefill":
            if self.remainder:
                self.ksum[layer].zero_()
                self.vsum[layer].zero_()
            return self._prefill(layer, q, k, v)
        if self.remainder and not self.sums_in_kernel:  # the new token joins the running sums if past the sinks
            past = (self.pos - self.P >= self.S).to(torch.float32)
            B = k.shape[0]
            self.ksum[layer, :B].add_(k[:, :, 0].float() * past)
            self.vsum[layer, :B].add_(v[:, :, 0].float() * past)
        if self.kernel == "triton":  # (the kernel computes the image index itself: no launch for it here)
            return self._decode_triton(layer, q, k, v, self.pos)
        i = self.pos - self.P  # image index of the query
        slot = (i % self.W).view(1)
        self.rk[layer].index_copy_(2, slot, k)
        self.rv[layer].index_copy_(2, slot, v)
        sink_slot = torch.where(i < self.S, i, self.S).view(1)
        self.sk[layer].index_copy_(2, sink_slot, k)
        self.sv[layer].index_copy_(2, sink_slot, v)

        offs = self.offsets[layer]  # (H, n)
        kpos = self.pos - offs  # (H, n)
        ok = (offs >= 0) & (kpos >= self.P + self.S)
        ring_slot = ((kpos - self.P) % self.W).clamp_min(0)  # (H, n)
        B, H = q.shape[0], q.shape[1]
        rk, rv = self._heads(self.rk[layer]), self._heads(self.rv[layer])  # (B, H, W, D)
        idx = ring_slot[None, :, :, None].expand(B, H, -1, rk.shape[-1])
        keys = torch.cat([self._heads(self.pk[layer]), self._heads(self.sk[layer][:, :, : self.S]),
                          rk.gather(2, idx)], dim=2)
        values = torch.cat([self._heads(self.pv[layer]), self._heads(self.sv[layer][:, :, : self.S]),
                            rv.gather(2, idx)], dim=2)
        valid = torch.cat([torch.ones(H, self.P, dtype=torch.bool, device=q.device),
                           (self._sink_idx <= i).expand(H, self.S), ok], dim=1)[None]  # (1, H, n_read)
        if self.prompt_keep is not None:  # (B, H, n_read): padded caption positions are not read
            valid = valid & F.pad(self.prompt_keep, (0, valid.shape[-1] - self.P), value=True)[:, None, :]
        rest = None
        if self.remainder:
            n_ring = ring_slot.shape[-1]
            rest = remainder_entry(self._heads(self.ksum[layer]), self._heads(self.vsum[layer]),
                                   (i + 1 - self.S).clamp_min(0), keys[:, :, -n_ring:], values[:, :, -n_ring:],
                                   ok[None])
        return _attend_gathered(q, keys, values, valid, rest)[0]

    def _decode_triton(self, layer: int, q, k, v, pos, rope=None):
        """One kernel writes k, v (B, Hkv, 1, D) and attends over the read set computed in-kernel from
        the offsets table, for the first B rows at ``pos`` (a scalar or (B,) tensor) -> (B, H, 1, D).
        It writes no scratch sink slot (that is the torch path's branch-free write). ``rope``: the step's
        table, (1, D/2, 2) shared or (B, 1, D/2, 2) one per row; q and k come unrotated."""
        from ..kernels.triton import ring_decode_attention

        B = q.shape[0]
        span = None if self.prompt_span is None else self.prompt_span[:B]
        sums = (self.ksum[layer, :B], self.vsum[layer, :B]) if self.remainder else None
        return ring_decode_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], self.pk[layer, :B], self.pv[layer, :B],
                                     self.sk[layer, :B], self.sv[layer, :B], self.rk[layer, :B], self.rv[layer, :B],
                                     self.offsets[layer], pos, self.S, prompt_span=span, rest_sums=sums,
                                     rope=None if rope is None else rope.reshape(-1, *rope.shape[-2:]),
                                     update_sums=self.sums_in_kernel).unsqueeze(2)


class SlotKVCache(_PromptCache):
    """Scored policies: per (sequence, layer, kv head) a table of ``capacity + 1`` slots.

    ``spos`` holds each slot's sequence position (-1 when free) and ``score`` the policy's running
    score; see :mod:`arsparse.policies.scored` for the step (write, attend, update, evict).

    ``cap`` (L, Hkv) is the capacity each head starts a sequence with; ``head_cap`` (L, rows, Hkv)
    the live one, which the policy's ``update_capacity`` may change while decoding (per-head
    budgets); ``stats`` the per-head statistics it keeps for that (``head_stats``). The table has
    ``policy.max_capacity + 1`` slots, so a head whose capacity grows has room.

    ``kernel``: ``"torch"`` (gathered attention, the reference) or ``"triton"``
    (:func:`~arsparse.kernels.triton.slot_decode_attention`, split-KV over the slots, which also
    returns the slots' weights the policy scores with); the rest of the step is the same.
    """

    def __init__(self, cfg: GPTConfig, policy, rows: int, dtype, device, kernel: str = "torch"):
        if kernel not in KERNELS:
            raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {KERNELS}")
        super().__init__(cfg, rows, dtype, device)
        self.kernel = kernel
        self.policy = policy
        self.layout = _layout(cfg)
        L, Hkv, D = cfg.n_layer, cfg.kv_heads, cfg.head_dim
        cap = policy.head_capacity(self.layout, L, Hkv)  # (L, Hkv), on the CPU
        C = max(int(cap.max()), policy.max_capacity(self.layout, L, Hkv)) + 1
        self.cap = cap.to(device)
        self.head_cap = self.cap[:, None, :].expand(L, rows, Hkv).clone()  # (L, rows, Hkv)
        self.stats = policy.head_stats(L, rows, Hkv, device)  # name -> (L, rows, Hkv, ...)
        self.k = torch.zeros(L, rows, Hkv, C, D, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.spos = torch.full((L, rows, Hkv, C), -1, dtype=torch.long, device=device)
        self.score = torch.zeros(L, rows, Hkv, C, dtype=torch.float32, device=device)
        self._row_head = (torch.arange(rows, device=device)[:, None], torch.arange(Hkv, device=device))  # (for _write)
        if kernel == "triton":  # splits fixed per cache: the captured step has static launches
            from ..kernels.triton import slot_decode_attention, slots
            from ..kernels.triton.decode import choose_splits

            splits = choose_splits(rows, Hkv, C, torch.device(device), tile=slots.LAUNCH["block_n"])
            self._attend_slots = partial(slot_decode_attention, num_splits=splits)
        else:
            self._attend_slots = slot_decode_attention_ref

    def nbytes(self) -> int:
        state = (self.pk, self.pv, self.k, self.v, self.spos, self.score, self.head_cap, *self.stats.values())
        return sum(t.numel() * t.element_size() for t in state)

    def kept(self) -> torch.Tensor:
        """(L, B, Hkv) image entries held now."""
        return (self.spos >= 0).sum(-1)

    def attend(self, layer: int, q, k, v):
        if self.phase == "prefill":
            self.spos[layer].fill_(-1)
            self.score[layer].zero_()
            self.head_cap[layer].copy_(self.cap[layer][None].expand_as(self.head_cap[layer]))
            for t in self.stats.values():
                t[layer].zero_()
            return self._prefill(layer, q, k, v)
        kc, vc, spos, score = self.k[layer], self.v[layer], self.spos[layer], self.score[layer]
        self._write(kc, vc, spos, score, k, v)
        # 2. attend over the prompt (less its padded caption positions) and the occupied slots;
        # w_slots (B, Hkv, C): the slots' weights summed over the query heads of each kv head.
        out, w_slots = self._attend_slots(q[:, :, 0], self.pk[layer], self.pv[layer], kc, vc, spos,
                                          prompt_span=self.prompt_span)
        stats = {name: t[layer] for name, t in self.stats.items()}
        self._bookkeep(spos, score, self.head_cap[layer], stats, w_slots)
        return out.unsqueeze(2)

    def fuse(self, compiler) -> None:
        """Run the write and the score/evict bookkeeping through ``compiler`` (e.g. ``torch.compile``):
        a few fused kernels instead of dozens of small ones per layer."""
        self._write, self._bookkeep = compiler(self._write), compiler(self._bookkeep)

    def _write(self, kc, vc, spos, score, k, v) -> None:
        """1. the new token into the first free slot of each (row, kv head)."""
        # Indexed puts, not scatter_: compiled (fuse), a scatter_ into the (B, Hkv, C, D) cache
        # became a copy of the whole cache and back each layer; an index_put_ stays in place.
        slot = (spos < 0).to(torch.int8).argmax(-1)  # (B, Hkv)
        at = (*self._row_head, slot)
        B, Hkv = slot.shape
        kc.index_put_(at, k[:, :, 0])  # k, v: (B, Hkv, 1, D)
        vc.index_put_(at, v[:, :, 0])
        spos.index_put_(at, self.pos.expand(B, Hkv))
        score.index_put_(at, score.new_zeros(()))

    def _bookkeep(self, spos, score, cap, stats, w_slots) -> None:
        """3. update the scores (and the per-head capacities ``cap`` (B, Hkv)); 4. evict over capacity."""
        pol, lay = self.policy, self.layout
        score.copy_(torch.where(spos >= 0, pol.update(score, w_slots, spos, self.pos, lay), score))
        new_cap = pol.update_capacity(cap, stats, w_slots / self.G, spos, self.pos, lay)
        if new_cap is not cap:
            cap.copy_(new_cap)
        evictable = (spos >= 0) & ~pol.protected(spos, self.pos, lay)
        excess = (spos >= 0).sum(-1, keepdim=True) - cap[..., None]  # (B, Hkv, 1)
        # (the mask first: HeadKV's Triton eviction breaks the compiled graph, and a bound
        # ``spos.masked_fill_`` held across that break made every step recompile, then run eagerly)
        free = pol.evict(score, spos, evictable, excess, stats, lay)  # (B, Hkv, C)
        spos.masked_fill_(free, -1)
