"""Triton body of decode attention for offset policies over a ring buffer (launch in ``ring.py``).

The kernel does the ring cache's whole decode step for the new token (KN, VN): attend over the read
set, taking every read of a slot the step writes from registers (so no program reads memory that
another writes), then write the token (ring slot ``i % W``; sink slot ``i`` while ``i < S``) from
the program of the last query head of each kv head, after that program's reads. Run in program
order (the interpreter), a read of such a slot from memory would see the old entry, which the tests
poison.

``LATE_CAST``: the gathered K/V tiles stay in the cache's dtype and are converted to fp32 only in
the products and sums (fewer registers); the arithmetic is fp32 either way. The remainder entry's
running sums (``HAS_REST``) are either read-only here (the cache adds the new token to them before
the launch, one small element-wise op, so no program can see them half-updated), or, with
``ADD_NEW`` and one query head per kv head (then the only program that reads a row's sums is the one
that writes them), hold the sums before the new token, which the kernel adds itself (in registers
for the remainder entry, then stored back): that lets the key be rotated here (``HAS_ROPE``) with
the remainder entry too, and takes the step's PyTorch updates of the sums away. The entry costs no
pass over the tile: its score is q . (sums - read ring keys) / n, taken from the scores already
computed, and its value is folded into the weights of the one pass over the values (session 28:
the engine's sm_90 build went from 2,328 instructions, 255 registers and spills to 1,824 and 183).

Its form was chosen on an H200 (BENCHMARKS.md, runs 6 and 7): 2-D tiles of one head per program took
the decode step of diagonal at batch 256 from 4.75 to 4.05 ms against 3-D tiles of a block of heads,
and against one program per (rows, kv head) reading the ring in chunks with an online softmax; a
row loop that issued the next row's loads first (by hand) and the offsets in two register tiles
sized to them (32 + 16 for diagonal's 43, not 64) were each slower than this form (run 7). Since run
12 a row's prompt, sinks and ring entries share one tile (``MERGED``: fewer instructions, one softmax;
diagonal at batch 256 3.94 -> 3.74-3.80 ms per step); a long caption prompt keeps the three tiles.
Since session 13 both forms leave the new token's slot out of the gathers and add the token as one
term (no select per element), and positions and offsets are 32-bit (an int64 remainder is a call):
the engine's sm_90 build went from 2,040 instructions and 250 registers to 1,512 and 168, the
three-tile form from 2,256 and 255 to 1,600 and 188; the kernel's time per step at batch 256 fell from
1.84 to 1.52 ms (run 13). Its products on tensor cores (the query as row 0 of a 16-row tile) were
slower (1.61 ms) and were removed.
"""
import triton
import triton.language as tl

from ._pdl import launch_next, wait_prior


@triton.jit
def _rotated(X, x, cos, sin, offs_d, dmask):
    """x (BD,) = X[offs_d] rotated in interleaved pairs, as ``apply_rope``: element 2j becomes
    a cos - b sin, element 2j + 1 b cos + a sin (a, b = x[2j], x[2j + 1]), in fp32, rounded to x's dtype."""
    partner = tl.load(X + (offs_d ^ 1), mask=dmask, other=0.0).to(tl.float32)  # x[2j + 1] at 2j, x[2j] at 2j + 1
    sign = tl.where((offs_d & 1) == 0, -1.0, 1.0)
    return (x.to(tl.float32) * cos + sign * partner * sin).to(x.dtype)


@triton.jit
def _step_inputs(Q, KN, VN, ROPE, b, h, hk, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b, scale, offs_d, dmask,
                 HAS_ROPE: tl.constexpr):
    """What the step wrote for row ``b``: the scaled query of head ``h`` (fp32) and the new token's K/V.
    ``HAS_ROPE``: the query and key arrive unrotated and are rotated here by row ``b``'s (D/2, 2)
    cos/sin table (one load of it and of each vector's pair partners, from the cache)."""
    q_ptr = Q + b * sq_b + h * sq_h
    k_ptr = KN + b * skn_b + hk * skn_h
    q = tl.load(q_ptr + offs_d, mask=dmask, other=0.0)  # (BD,)
    kn = tl.load(k_ptr + offs_d, mask=dmask, other=0.0)  # the new token, cache dtype
    vn = tl.load(VN + b * svn_b + hk * svn_h + offs_d, mask=dmask, other=0.0)
    if HAS_ROPE:
        t_off = b * srope_b + (offs_d // 2) * 2
        cos = tl.load(ROPE + t_off, mask=dmask, other=1.0)  # (BD,): each pair's cos, twice
        sin = tl.load(ROPE + t_off + 1, mask=dmask, other=0.0)
        q = _rotated(q_ptr, q, cos, sin, offs_d, dmask)
        kn = _rotated(k_ptr, kn, cos, sin, offs_d, dmask)
    return q.to(tl.float32) * scale, kn, vn


@triton.jit
def _sums(KSUM, VSUM, b, hk, ssum_b, ssum_h, offs_d, dmask):
    """Row ``b``'s running sums of the remainder entry's keys and values (BD,) fp32 each."""
    sum_off = b * ssum_b + hk * ssum_h + offs_d
    return tl.load(KSUM + sum_off, mask=dmask, other=0.0), tl.load(VSUM + sum_off, mask=dmask, other=0.0)


@triton.jit
def _remainder(q, k_sum, i, S, n_read, qk_read):
    """The remainder entry: the mean of the running sums' keys and values (past the sinks, the new token
    included) less the ``n_read`` ring entries read. Its score comes from the scores already computed
    (q . mean = (q . k_sum - ``qk_read``) / n, ``qk_read`` the read ring entries' q . k), so no pass
    over the tile. Returns its score (-inf when nothing remains) and n: its value, (v_sum - the read
    ring entries' values) / n, the caller folds into the weights of its one pass over the values
    (:func:`_weights_less_remainder`)."""
    count = tl.maximum(i + 1 - S, 0) - n_read
    n = tl.maximum(count, 1).to(tl.float32)
    return tl.where(count > 0, (tl.sum(q * k_sum, axis=0) - qk_read) / n + tl.log(n), float("-inf")), n


@triton.jit
def _weights_less_remainder(p, ring, p_new, n_new_r, u_e, m, n):
    """The softmax weights with the remainder entry's value folded in: that entry, weight p_e, holds
    (VSUM - sum of the read ring values - n_new_r x the new value) / n, so each read ring entry's weight
    drops by c = p_e / n, the new token's by n_new_r c, and the output gains c VSUM. Returns those
    weights (BO,), the new token's, c and p_e."""
    p_e = tl.exp2(u_e - m)
    c = p_e / n
    return p - tl.where(ring, c, 0.0), p_new - n_new_r * c, c, p_e


@triton.jit
def _added(i, S, ADD_NEW: tl.constexpr):
    """1.0 where this kernel adds the new token (image index ``i``) to the running sums (``ADD_NEW``, past
    the sinks), else 0.0. The sums in memory then lack the token, so the remainder entry subtracts it
    once fewer than it is read from the ring (the same as adding it to the sums first)."""
    if ADD_NEW:
        return (i >= S).to(tl.float32)
    return 0.0


@triton.jit
def _merged_gather(PK, PV, SK, SV, RK, RV, SPAN, o, jo, b, hk, pos, i, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s,
                   sr_b, sr_h, sr_s, P, S, W, n_off, offs_d, dmask, HAS_SPAN: tl.constexpr, ALIGN: tl.constexpr):
    """Row ``b``'s read set as one tile (BO, BD): entry j < n_off is the ring entry at offset o[j], the
    next S entries the sinks, the next P the prompt (BO >= n_off + S + P), each row's address taken
    from its own buffer. Entries that hold the new token (offset 0; offset W, the slot it overwrites;
    its sink) are not loaded: the caller adds the token from registers, one term counted as often as
    they are read. Returns K and V (cache dtype; unread and new rows 0), which entries are ring
    entries (BO,), which hold the new token, and which were loaded. ``ALIGN``: every row of the three
    buffers starts at a multiple of ALIGN bytes (the launch computes it)."""
    kpos = pos - o  # ring entries (j < n_off): image positions past the sinks
    is_r = (o >= 0) & (kpos >= P + S)
    slot = tl.where(is_r, (kpos - P) % W, 0)
    js = tl.maximum(jo - n_off, 0)  # sink index of entries n_off.. (0 elsewhere: unread)
    is_s = (jo >= n_off) & (jo < n_off + S) & (js <= i)
    jp = tl.maximum(jo - n_off - S, 0)  # prompt index of entries n_off + S..
    is_p = (jo >= n_off + S) & (jp < P)
    if HAS_SPAN:
        is_p = is_p & (jp >= tl.load(SPAN + 2 * b)) & (jp < tl.load(SPAN + 2 * b + 1))
    new = (is_r & (slot == i % W)) | (is_s & (js == i))  # the slot this step writes
    old = (is_r | is_s | is_p) & ~new
    r_off = b * sr_b + hk * sr_h + slot * sr_s
    s_off = b * ss_b + hk * ss_h + js * ss_s
    p_off = b * sp_b + hk * sp_h + jp * sp_s
    # (a select of pointers loses what the compiler knows of their alignment: restated, or 2-byte loads)
    kptr = tl.multiple_of(tl.where(is_r, RK + r_off, tl.where(is_s, SK + s_off, PK + p_off)), ALIGN)  # (BO,)
    vptr = tl.multiple_of(tl.where(is_r, RV + r_off, tl.where(is_s, SV + s_off, PV + p_off)), ALIGN)
    lmask = old[:, None] & dmask[None, :]
    k = tl.load(kptr[:, None] + offs_d[None, :], mask=lmask, other=0.0)  # (BO, BD)
    v = tl.load(vptr[:, None] + offs_d[None, :], mask=lmask, other=0.0)
    return k, v, is_r, new, old


@triton.jit
def _merged_row(Q, KN, VN, ROPE, PK, PV, SK, SV, RK, RV, KSUM, VSUM, k_sum, v_sum, SPAN, o, jo, b, h, hk, pos, i,
                sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s,
                ssum_b, ssum_h, P, S, W, n_off, scale, offs_d, dmask,
                HAS_SPAN: tl.constexpr, HAS_REST: tl.constexpr, LATE_CAST: tl.constexpr, PDL: tl.constexpr,
                EARLY: tl.constexpr, ALIGN: tl.constexpr, HAS_ROPE: tl.constexpr, ADD_NEW: tl.constexpr):
    """Row ``b``'s read set in one tile (:func:`_merged_gather`) and one softmax over it and the new
    token. Returns the unnormalised output and its sum, (BD,) and a scalar, and the new token's K/V
    (for the caller's cache write). ``k_sum``, ``v_sum``: the remainder's sums as the caller loaded them
    (with ``ADD_NEW``), else loaded here after the wait."""
    if not EARLY:
        q, kn, vn = _step_inputs(Q, KN, VN, ROPE, b, h, hk, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b,
                                  scale, offs_d, dmask, HAS_ROPE)
    k, v, is_r, new, old = _merged_gather(PK, PV, SK, SV, RK, RV, SPAN, o, jo, b, hk, pos, i, sp_b, sp_h, sp_s,
                                          ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, P, S, W, n_off, offs_d, dmask,
                                          HAS_SPAN, ALIGN)
    if EARLY:
        wait_prior(PDL)
        q, kn, vn = _step_inputs(Q, KN, VN, ROPE, b, h, hk, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b,
                                  scale, offs_d, dmask, HAS_ROPE)
    LOG2E: tl.constexpr = 1.4426950408889634
    n_new = tl.sum(new.to(tl.float32), axis=0)  # the new token: one term, weighted by its reads
    qkn = tl.sum(q * kn.to(tl.float32), axis=0)
    u_new = tl.where(n_new > 0, qkn * LOG2E, float("-inf"))  # log2 units
    if not LATE_CAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    qk = tl.sum(k.to(tl.float32) * q[None, :], axis=1)  # (BO,)
    s = tl.where(old, qk, float("-inf")) * LOG2E
    m = tl.maximum(tl.max(s, axis=0), u_new)
    if HAS_REST:  # the remainder entry, less the ring entries read (the new token's as often as read)
        ring = is_r & old  # (the ring entries read from memory)
        n_new_r = tl.sum((is_r & new).to(tl.float32), axis=0) - _added(i, S, ADD_NEW)
        qk_read = tl.sum(tl.where(ring, qk, 0.0), axis=0) + n_new_r * qkn
        if not ADD_NEW:  # (the step wrote the new token into them: after the wait)
            k_sum, v_sum = _sums(KSUM, VSUM, b, hk, ssum_b, ssum_h, offs_d, dmask)
        s_e, n_e = _remainder(q, k_sum, i, S, tl.sum(is_r.to(tl.int32), axis=0), qk_read)
        u_e = s_e * LOG2E
        m = tl.maximum(m, u_e)
    p = tl.exp2(s - m)
    p_new = n_new * tl.exp2(u_new - m)
    l = tl.sum(p, axis=0) + p_new
    if HAS_REST:
        p, p_new, c, p_e = _weights_less_remainder(p, ring, p_new, n_new_r, u_e, m, n_e)
        l = l + p_e
    acc = tl.sum(p[:, None] * v.to(tl.float32), axis=0) + p_new * vn.to(tl.float32)  # (BD,)
    if HAS_REST:
        acc = acc + c * v_sum
    return acc, l, kn, vn


@triton.jit
def _three_tile_row(Q, KN, VN, ROPE, PK, PV, SK, SV, RK, RV, KSUM, VSUM, k_sum, v_sum, SPAN, o, jp, js, b, h, hk,
                    pos, i, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b,
                    sr_h, sr_s, ssum_b, ssum_h, P, S, W, scale, offs_d, dmask, HAS_SPAN: tl.constexpr,
                    HAS_REST: tl.constexpr, LATE_CAST: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
                    HAS_ROPE: tl.constexpr, ADD_NEW: tl.constexpr):
    """Row ``b``'s read set as three tiles (prompt (BP, BD), sinks (BS, BD), ring entries (BO, BD)) and one
    softmax over them and the new token, which (as in :func:`_merged_row`) is one term from registers,
    its slot left out of the gathers. Returns the unnormalised output (BD,), its sum and the new token."""
    if not EARLY:
        q, kn, vn = _step_inputs(Q, KN, VN, ROPE, b, h, hk, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b,
                                  scale, offs_d, dmask, HAS_ROPE)
    pmask = jp < P  # the prompt (BP,)
    if HAS_SPAN:
        pmask = pmask & (jp >= tl.load(SPAN + 2 * b)) & (jp < tl.load(SPAN + 2 * b + 1))
    p_off = b * sp_b + hk * sp_h + jp[:, None] * sp_s + offs_d[None, :]
    kp = tl.load(PK + p_off, mask=pmask[:, None] & dmask[None, :], other=0.0)
    vp = tl.load(PV + p_off, mask=pmask[:, None] & dmask[None, :], other=0.0)
    snew = (js < S) & (js == i)  # sink i is the new token
    smask = (js < S) & (js < i)  # the sinks read from memory (BS,)
    s_off = b * ss_b + hk * ss_h + js[:, None] * ss_s + offs_d[None, :]
    ks = tl.load(SK + s_off, mask=smask[:, None] & dmask[None, :], other=0.0)
    vs = tl.load(SV + s_off, mask=smask[:, None] & dmask[None, :], other=0.0)
    kpos = pos - o  # the ring entries read (BO,): image positions past the sinks
    is_r = (o >= 0) & (kpos >= P + S)
    slot = tl.where(is_r, (kpos - P) % W, 0)
    rnew = is_r & (slot == i % W)  # the slot this step writes
    rmask = is_r & ~rnew
    r_off = b * sr_b + hk * sr_h + slot[:, None] * sr_s + offs_d[None, :]
    kr = tl.load(RK + r_off, mask=rmask[:, None] & dmask[None, :], other=0.0)
    vr = tl.load(RV + r_off, mask=rmask[:, None] & dmask[None, :], other=0.0)
    if EARLY:
        wait_prior(PDL)
        q, kn, vn = _step_inputs(Q, KN, VN, ROPE, b, h, hk, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b,
                                  scale, offs_d, dmask, HAS_ROPE)
    if not LATE_CAST:
        kp, vp, ks, vs = kp.to(tl.float32), vp.to(tl.float32), ks.to(tl.float32), vs.to(tl.float32)
        kr, vr = kr.to(tl.float32), vr.to(tl.float32)
    LOG2E: tl.constexpr = 1.4426950408889634
    s_p = tl.where(pmask, tl.sum(kp.to(tl.float32) * q[None, :], axis=1), float("-inf")) * LOG2E  # log2 units
    s_s = tl.where(smask, tl.sum(ks.to(tl.float32) * q[None, :], axis=1), float("-inf")) * LOG2E
    qk_r = tl.sum(kr.to(tl.float32) * q[None, :], axis=1)  # (BO,)
    s_r = tl.where(rmask, qk_r, float("-inf")) * LOG2E
    n_new_r = tl.sum(rnew.to(tl.float32), axis=0)
    n_new = n_new_r + tl.sum(snew.to(tl.float32), axis=0)  # the new token: one term, weighted by its reads
    n_new_r -= _added(i, S, ADD_NEW)
    qkn = tl.sum(q * kn.to(tl.float32), axis=0)
    u_new = tl.where(n_new > 0, qkn * LOG2E, float("-inf"))
    m = tl.maximum(tl.maximum(tl.maximum(tl.max(s_p, axis=0), tl.max(s_s, axis=0)), tl.max(s_r, axis=0)), u_new)
    if HAS_REST:  # (the ring entries read from memory are the rows of kr; the new token's as often as read)
        qk_read = tl.sum(tl.where(rmask, qk_r, 0.0), axis=0) + n_new_r * qkn
        if not ADD_NEW:  # (the step wrote the new token into them: after the wait)
            k_sum, v_sum = _sums(KSUM, VSUM, b, hk, ssum_b, ssum_h, offs_d, dmask)
        s_e, n_e = _remainder(q, k_sum, i, S, tl.sum(is_r.to(tl.int32), axis=0), qk_read)
        u_e = s_e * LOG2E
        m = tl.maximum(m, u_e)
    p_p = tl.exp2(s_p - m)
    p_s = tl.exp2(s_s - m)
    p_r = tl.exp2(s_r - m)
    p_new = n_new * tl.exp2(u_new - m)
    l = tl.sum(p_p, axis=0) + tl.sum(p_s, axis=0) + tl.sum(p_r, axis=0) + p_new
    if HAS_REST:
        p_r, p_new, c, p_e = _weights_less_remainder(p_r, rmask, p_new, n_new_r, u_e, m, n_e)
        l = l + p_e
    acc = (tl.sum(p_p[:, None] * vp.to(tl.float32), axis=0) + tl.sum(p_s[:, None] * vs.to(tl.float32), axis=0)
           + tl.sum(p_r[:, None] * vr.to(tl.float32), axis=0) + p_new * vn.to(tl.float32))  # (BD,)
    if HAS_REST:
        acc = acc + c * v_sum
    return acc, l, kn, vn


@triton.jit
def ring_decode_kernel(
    Q, KN, VN, ROPE, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos,
    sout_b, sout_h, ssum_b, ssum_h,
    B, P, S, W, n_off, scale, D, n_heads,
    G: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_REST: tl.constexpr,
    LATE_CAST: tl.constexpr, HEADS_FIRST: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
    MERGED: tl.constexpr = False, ALIGN: tl.constexpr = 1, HAS_ROPE: tl.constexpr = False,
    ADD_NEW: tl.constexpr = False, PERSISTENT: tl.constexpr = False,
):
    """One query head of ROWS rows per program: the head's offsets are loaded once, then a loop over
    the rows (pipelined as the launch's ``num_stages`` says) attends, for each row, over the prompt,
    the sinks written so far and the ring slots of pos - offsets: all in one 2-D tile (entries, BD)
    with ``MERGED``, else each in a tile of its own. The last query head of each kv head writes the
    new token.

    ``HEADS_FIRST``: the grid is (heads, row blocks), so programs launched together share a row
    (whose heads' K/V are adjacent in memory) rather than a head.

    The read set is computed here from the head's offsets: no index tensor is built per step.
    ``HAS_REST``: also the remainder entry from the running sums KSUM, VSUM, which this kernel only
    reads (they already hold the new token); with ``ADD_NEW`` (G == 1) they do not, and the program
    adds the new token (past the sinks) and stores them back.
    ``PDL`` (``_pdl.py``): launched beside the previous launch's last programs, a program loads its
    head's offsets (which no kernel writes) and then waits for them. ``EARLY``: it waits later, after
    a row's gathers (prompt, sinks, ring entries other than the new token's slot: all written by
    earlier steps or the prefill, which ordinary launches at each step boundary have finished; its
    position likewise), and before anything the step writes (the query, the new token, the sums).
    ``MERGED``: that one tile and one softmax (:func:`_merged_row`; ``ALIGN``: see there) instead of
    three tiles and three softmax terms.
    ``HAS_ROPE``: the query and the new key arrive unrotated (views of the QKV projection's output) and
    are rotated here by ROPE (rows or 1, D/2, 2) (row stride ``srope_b``, 0 when shared); the cache
    gets the rotated key. This takes the step's separate RoPE kernel away (session 19).
    ``PERSISTENT``: a 1-D grid of fewer programs than (row block, head) pairs, each taking the pairs
    ``pid, pid + programs, ...`` in the 2-D grid's order (heads fastest with ``HEADS_FIRST``, else row
    blocks), so that the kernel holds only part of the GPU (``n_heads``: H; unused otherwise). Each
    pair loads its head's offsets again.
    """
    launch_next(PDL)
    scale = tl.cast(scale, tl.float32)  # (it may arrive as fp64 from torch.compile: no fp64 arithmetic)
    if PERSISTENT:
        n_blocks = tl.cdiv(B, ROWS)
        for w in range(tl.program_id(0), n_blocks * n_heads, tl.num_programs(0)):
            if HEADS_FIRST:
                h, block = w % n_heads, w // n_heads
            else:
                h, block = w // n_blocks, w % n_blocks
            _head_rows(Q, KN, VN, ROPE, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM, sq_b, sq_h, skn_b,
                       skn_h, svn_b, svn_h, srope_b, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos,
                       sout_b, sout_h, ssum_b, ssum_h, B, P, S, W, n_off, scale, D, h, block, G, ROWS, BLOCK_P,
                       BLOCK_S, BLOCK_O, BLOCK_D, HAS_SPAN, HAS_REST, LATE_CAST, PDL, EARLY, MERGED, ALIGN, HAS_ROPE,
                       ADD_NEW)
    else:
        h = tl.program_id(0 if HEADS_FIRST else 1)
        block = tl.program_id(1 if HEADS_FIRST else 0)  # the block of ROWS rows
        _head_rows(Q, KN, VN, ROPE, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM, sq_b, sq_h, skn_b, skn_h,
                   svn_b, svn_h, srope_b, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos, sout_b,
                   sout_h, ssum_b, ssum_h, B, P, S, W, n_off, scale, D, h, block, G, ROWS, BLOCK_P, BLOCK_S, BLOCK_O,
                   BLOCK_D, HAS_SPAN, HAS_REST, LATE_CAST, PDL, EARLY, MERGED, ALIGN, HAS_ROPE, ADD_NEW)

@triton.jit
def _head_rows(
    Q, KN, VN, ROPE, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos,
    sout_b, sout_h, ssum_b, ssum_h,
    B, P, S, W, n_off, scale, D,
    h, block,
    G: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_REST: tl.constexpr, LATE_CAST: tl.constexpr, PDL: tl.constexpr,
    EARLY: tl.constexpr, MERGED: tl.constexpr, ALIGN: tl.constexpr, HAS_ROPE: tl.constexpr, ADD_NEW: tl.constexpr,
):
    """The kernel's work for query head ``h`` over rows ``block * ROWS ..`` (see :func:`ring_decode_kernel`)."""
    hk = h // G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    jo = tl.arange(0, BLOCK_O)
    # (BO,) this head's backward offsets; offsets and positions in 32 bits (int64 remainders are a call;
    # an offset past 2**31 - 1, like any past the position, reads nothing)
    o = tl.minimum(tl.load(OFF + h * so_h + jo, mask=jo < n_off, other=-1), 2147483647).to(tl.int32)
    if not EARLY:
        wait_prior(PDL)
    jp = tl.arange(0, BLOCK_P)
    js = tl.arange(0, BLOCK_S)
    for r in tl.range(0, ROWS):
        row = block * ROWS + r
        live = row < B
        b = tl.minimum(row, B - 1)  # (a row past B is row B - 1 again, stored nowhere)
        pos = tl.load(POS + b * spos).to(tl.int32)
        i = pos - P  # image index of the query
        if ADD_NEW:  # (only this program writes row b's sums, at its previous step: safe before the wait)
            k_sum, v_sum = _sums(KSUM, VSUM, b, hk, ssum_b, ssum_h, offs_d, dmask)
        else:
            k_sum, v_sum = offs_d.to(tl.float32), offs_d.to(tl.float32)  # (unused)
        if MERGED:
            acc, l, kn, vn = _merged_row(Q, KN, VN, ROPE, PK, PV, SK, SV, RK, RV, KSUM, VSUM, k_sum, v_sum, SPAN, o,
                                         jo, b, h, hk, pos, i, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, srope_b, sp_b,
                                         sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, ssum_b, ssum_h, P, S, W, n_off,
                                         scale, offs_d, dmask, HAS_SPAN, HAS_REST, LATE_CAST, PDL, EARLY, ALIGN,
                                         HAS_ROPE, ADD_NEW)
        else:
            acc, l, kn, vn = _three_tile_row(Q, KN, VN, ROPE, PK, PV, SK, SV, RK, RV, KSUM, VSUM, k_sum, v_sum, SPAN,
                                             o, jp, js, b, h, hk, pos, i, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                                             srope_b, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, ssum_b,
                                             ssum_h, P, S, W, scale, offs_d, dmask, HAS_SPAN, HAS_REST, LATE_CAST,
                                             PDL, EARLY, HAS_ROPE, ADD_NEW)
        omask_d = tl.where(live, dmask, False)  # (not block & scalar: the interpreter mistypes it)
        tl.store(OUT + b * sout_b + h * sout_h + offs_d, (acc / l).to(OUT.dtype.element_ty), mask=omask_d)
        wmask = tl.where(live & (h % G == G - 1) & (i >= 0), dmask, False)  # the new token into the cache
        w_off = b * sr_b + hk * sr_h + (i % W) * sr_s + offs_d
        tl.store(RK + w_off, kn, mask=wmask)
        tl.store(RV + w_off, vn, mask=wmask)
        w_off = b * ss_b + hk * ss_h + i * ss_s + offs_d
        tl.store(SK + w_off, kn, mask=tl.where(i < S, wmask, False))
        tl.store(SV + w_off, vn, mask=tl.where(i < S, wmask, False))
        if ADD_NEW:  # (G == 1: this program was the only reader of row b's sums, above)
            amask = tl.where(live & (i >= S), dmask, False)
            a_off = b * ssum_b + hk * ssum_h + offs_d
            tl.store(KSUM + a_off, k_sum + kn.to(tl.float32), mask=amask)
            tl.store(VSUM + a_off, v_sum + vn.to(tl.float32), mask=amask)
