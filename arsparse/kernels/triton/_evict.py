"""Triton bodies of HeadKV's stratified eviction (launch in ``evict.py``; the rule and its PyTorch form:
:func:`arsparse.policies.headwise.stratified_evict`).

One (row, kv head) table of C slots at a time, without sorting (torch's segmented radix sorts of
64-bit keys cost 0.9 ms a layer at batch 256 on an H200). Two kernels, both launched every step,
each writing the tables whose ``k`` it owns:

- ``evict_one_kernel``, ``k <= 1`` (every step once a head is full: one entry in, one out), one program
  per table: the victim is the evictable entry of the fullest image row (the most slots in it), ties
  to the lowest (score, slot). The rows' counts are histograms of the slots' rows, and a slot's row
  is looked up among the fullest by a gather.
- ``evict_many_kernel``, ``k > 1`` (the step a head's capacity drops): each evictable entry's row
  rank (entries of its row that outlive it: its row's count less one, less its evictable row-mates
  below it in (score, slot) order) goes to ``RANK``; then an entry is freed when fewer than ``k``
  evictable entries come before it in (row rank descending, score and slot ascending) order. Slots
  are compared pairwise in (BLOCK_I, BLOCK_J) tiles. Its registers allow few programs per SM, and on
  most steps no table needs it, so each program takes ``TPP`` consecutive tables, reads their ``k``
  at once and returns when none is above 1 (one program per table: 20 us a layer for nothing, run 16).
"""
import triton
import triton.language as tl

_NONE = tl.constexpr(2147483647)  # (no slot)


@triton.jit
def _entries(SCORE, POS, EV, idx, C, P, W):
    """Score, image row (-1 for a free slot) and evictable flag of slots ``idx`` (BLOCK,)."""
    inside = idx < C
    s = tl.load(SCORE + idx, mask=inside, other=0.0)
    pos = tl.load(POS + idx, mask=inside, other=-1).to(tl.int32)  # (positions < 2^31)
    row = tl.where(pos >= 0, (pos - P) // W, -1)
    ev = tl.load(EV + idx, mask=inside, other=0) != 0
    return s, row, ev


@triton.jit
def _table(SCORE, POS, EV, OUT, K, r, H, s_b, s_h, p_b, p_h, e_b, e_h, k_b, k_h, C):
    """Pointers to program ``r``'s (row, kv head) table, and its ``k``."""
    b, h = r // H, r % H
    k = tl.load(K + b.to(tl.int64) * k_b + h * k_h)
    return (SCORE + b.to(tl.int64) * s_b + h * s_h, POS + b.to(tl.int64) * p_b + h * p_h,
            EV + b.to(tl.int64) * e_b + h * e_h, OUT + r.to(tl.int64) * C, k)


@triton.jit
def evict_one_kernel(SCORE, POS, EV, K, OUT, s_b, s_h, p_b, p_h, e_b, e_h, k_b, k_h, H, C, P, W,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    SCORE, POS, EV, OUT, k = _table(SCORE, POS, EV, OUT, K, tl.program_id(0), H, s_b, s_h, p_b, p_h, e_b, e_h,
                                    k_b, k_h, C)
    best_i = tl.full((), _NONE, tl.int32)  # the victim's slot (none while the head is not over capacity)
    if k == 1:
        count = tl.zeros((BLOCK_R,), dtype=tl.int32)  # slots of each image row (bin: row + 1; bin 0 unused)
        has = tl.zeros((BLOCK_R,), dtype=tl.int32)  # evictable slots of each
        for c0 in range(0, C, BLOCK_C):
            s, row, ev = _entries(SCORE, POS, EV, c0 + tl.arange(0, BLOCK_C), C, P, W)
            counted = (row >= 0) & (row < BLOCK_R - 1)
            count += tl.histogram(row + 1, BLOCK_R, mask=counted)
            has += tl.histogram(row + 1, BLOCK_R, mask=counted & ev)
        top = tl.max(tl.where(has > 0, count, -1), axis=0)
        fullest = ((has > 0) & (count == top)).to(tl.int32)  # (BLOCK_R,)
        best_s = tl.full((), float("inf"), tl.float32)
        for c0 in range(0, C, BLOCK_C):
            ii = c0 + tl.arange(0, BLOCK_C)
            s, row, ev = _entries(SCORE, POS, EV, ii, C, P, W)
            there = tl.gather(fullest, tl.minimum(tl.maximum(row + 1, 0), BLOCK_R - 1), 0) > 0  # (bin 0: none)
            cand = ev & there & (row < BLOCK_R - 1)
            cs = tl.min(tl.where(cand, s, float("inf")), axis=0)
            ci = tl.min(tl.where(cand & (s == cs), ii, _NONE), axis=0)
            better = (cs < best_s) | ((cs == best_s) & (ci < best_i))
            best_s = tl.where(better, cs, best_s)
            best_i = tl.where(better, ci, best_i)
    if k <= 1:
        for c0 in range(0, C, BLOCK_C):
            ii = c0 + tl.arange(0, BLOCK_C)
            tl.store(OUT + ii, (ii == best_i).to(tl.int8), mask=ii < C)


@triton.jit
def _before(si, ii, sj, jj):
    """(BLOCK_I, BLOCK_J): slot j comes before slot i in ascending (score, slot) order."""
    return (sj[None, :] < si[:, None]) | ((sj[None, :] == si[:, None]) & (jj[None, :] < ii[:, None]))


@triton.jit
def _evict_many(SCORE, POS, EV, K, RANK, OUT, r, s_b, s_h, p_b, p_h, e_b, e_h, k_b, k_h, H, C, P, W,
                BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """Table ``r``, whose ``k`` is above 1: the slots to free into OUT (RANK: its row ranks, scratch)."""
    SCORE, POS, EV, OUT, k = _table(SCORE, POS, EV, OUT, K, r, H, s_b, s_h, p_b, p_h, e_b, e_h, k_b, k_h, C)
    RANK += r.to(tl.int64) * C
    for i0 in range(0, C, BLOCK_I):
        ii = i0 + tl.arange(0, BLOCK_I)
        si, rowi, evi = _entries(SCORE, POS, EV, ii, C, P, W)
        n = tl.zeros((BLOCK_I,), dtype=tl.int32)
        weaker = tl.zeros((BLOCK_I,), dtype=tl.int32)
        for j0 in range(0, C, BLOCK_J):
            jj = j0 + tl.arange(0, BLOCK_J)
            sj, rowj, evj = _entries(SCORE, POS, EV, jj, C, P, W)
            same = (rowj[None, :] == rowi[:, None]) & (jj < C)[None, :]
            n += tl.sum(same.to(tl.int32), axis=1)
            weaker += tl.sum((same & evj[None, :] & _before(si, ii, sj, jj)).to(tl.int32), axis=1)
        tl.store(RANK + ii, n - 1 - weaker, mask=ii < C)
    tl.debug_barrier()  # (every slot's row rank is in RANK before any is read back)
    for i0 in range(0, C, BLOCK_I):
        ii = i0 + tl.arange(0, BLOCK_I)
        si, rowi, evi = _entries(SCORE, POS, EV, ii, C, P, W)
        ri = tl.load(RANK + ii, mask=ii < C, other=0)
        ahead = tl.zeros((BLOCK_I,), dtype=tl.int32)
        for j0 in range(0, C, BLOCK_J):
            jj = j0 + tl.arange(0, BLOCK_J)
            sj, rowj, evj = _entries(SCORE, POS, EV, jj, C, P, W)
            rj = tl.load(RANK + jj, mask=jj < C, other=0)
            first = (rj[None, :] > ri[:, None]) | ((rj[None, :] == ri[:, None]) & _before(si, ii, sj, jj))
            ahead += tl.sum((evj[None, :] & first).to(tl.int32), axis=1)
        tl.store(OUT + ii, (evi & (ahead < k)).to(tl.int8), mask=ii < C)


@triton.jit
def evict_many_kernel(SCORE, POS, EV, K, RANK, OUT, s_b, s_h, p_b, p_h, e_b, e_h, k_b, k_h, H, C, P, W, NT, TPP,
                      BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    first_t = tl.program_id(0) * TPP  # this program's tables: first_t .. first_t + TPP - 1 (below NT)
    tt = tl.arange(0, BLOCK_T)
    t = first_t + tt
    ks = tl.load(K + (t // H).to(tl.int64) * k_b + (t % H) * k_h, mask=(tt < TPP) & (t < NT), other=0)
    if tl.max(ks, axis=0) > 1:
        for i in range(0, TPP):
            if tl.sum(tl.where(tt == i, ks, 0), axis=0) > 1:
                _evict_many(SCORE, POS, EV, K, RANK, OUT, first_t + i, s_b, s_h, p_b, p_h, e_b, e_h, k_b, k_h, H, C,
                            P, W, BLOCK_I, BLOCK_J)
