"""Triton body of decode attention for offset policies over a ring buffer (launch in ``ring.py``).

The kernel does the ring cache's whole decode step for the new token (KN, VN): attend over the read
set, taking every read of a slot the step writes from registers (so no program reads memory that
another writes), then write the token (ring slot ``i % W``; sink slot ``i`` while ``i < S``) from
the program of the last query head of each kv head, after that program's reads. Run in program
order (the interpreter), a read of such a slot from memory would see the old entry, which the tests
poison.

``LATE_CAST``: the gathered K/V tiles stay in the cache's dtype and are converted to fp32 only in
the products and sums (fewer registers); the arithmetic is fp32 either way. The remainder entry's
running sums (``HAS_REST``) are read-only here: the cache adds the new token to them before the
launch (one small element-wise op), so no program can see them half-updated.

Its form was chosen on an H200 (BENCHMARKS.md, run 6): 2-D tiles of one head per program took the
decode step of diagonal at batch 256 from 4.75 to 4.05 ms against 3-D tiles of a block of heads,
and against one program per (rows, kv head) reading the ring in chunks with an online softmax.
"""
import triton
import triton.language as tl


@triton.jit
def _gather_ring(RK, RV, o, pos, i, live, b, hk, sr_b, sr_h, sr_s, P, S, W, offs_d, dmask):
    """Load the ring entries pos - o (o (BO,) backward offsets, -1 for none) that are image positions
    past the sinks. -> their mask, which one is the slot this step writes (taken from registers
    later), K and V tiles (BO, BD) in the cache's dtype (0 where not loaded)."""
    kpos = pos - o
    omask = tl.where(live, (o >= 0) & (kpos >= P + S), False)
    slot = tl.where(omask, (kpos - P) % W, 0)
    rnew = omask & (slot == i % W)
    r_off = b * sr_b + hk * sr_h + slot[:, None] * sr_s + offs_d[None, :]
    kr = tl.load(RK + r_off, mask=(omask & ~rnew)[:, None] & dmask[None, :], other=0.0)
    vr = tl.load(RV + r_off, mask=(omask & ~rnew)[:, None] & dmask[None, :], other=0.0)
    return omask, rnew, kr, vr


@triton.jit
def _load_row(Q, KN, VN, PK, PV, SK, SV, RK, RV, KSUM, VSUM, o, o2, r, row0, end, jr, posv, lov, hiv, h, hk,
              sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s,
              ssum_b, ssum_h, P, S, W, jp, js, offs_d, dmask, HAS_SPAN: tl.constexpr, HAS_REST: tl.constexpr,
              HAS_O2: tl.constexpr):
    """Issue the loads of the block's row ``r`` (row ``row0 + r``) for query head h: its query, the
    new token, the read set (prompt, sinks written so far, ring slots of pos - o) and the remainder's
    running sums, without using any loaded value, so that the loads stay in flight while the caller
    works on another row. The row's position and caption span come from the block's vectors
    (``posv``, ``lov``, ``hiv`` over ``jr``, loaded before the loop). A row at or past ``end`` loads
    nothing (``live`` False). -> b, live, i (image index), q, kn, vn (BD,), then per part of the read
    set its mask and K/V tiles in the cache's dtype (0 where not loaded), which entries are the new
    token (``snew``, ``rnew``: taken from registers later), and the sums (BD,) fp32. ``HAS_O2``: the
    offsets come in two tiles (o, o2), so the registers hold 32 + 16 entries, say, not 64."""
    row = row0 + r
    live = row < end
    b = tl.minimum(row, end - 1)
    pos = tl.sum(tl.where(jr == r, posv, 0))  # (from registers: no load to wait for)
    i = pos - P  # image index of the query
    ld = tl.where(live, dmask, False)  # (BD,) (not block & scalar: the interpreter mistypes it)
    q = tl.load(Q + b * sq_b + h * sq_h + offs_d, mask=ld, other=0.0)
    kn = tl.load(KN + b * skn_b + hk * skn_h + offs_d, mask=ld, other=0.0)  # the new token, cache dtype
    vn = tl.load(VN + b * svn_b + hk * svn_h + offs_d, mask=ld, other=0.0)

    pmask = tl.where(live, jp < P, False)  # the prompt (BP,)
    if HAS_SPAN:
        pmask = pmask & (jp >= tl.sum(tl.where(jr == r, lov, 0))) & (jp < tl.sum(tl.where(jr == r, hiv, 0)))
    p_off = b * sp_b + hk * sp_h + jp[:, None] * sp_s + offs_d[None, :]
    kp = tl.load(PK + p_off, mask=pmask[:, None] & dmask[None, :], other=0.0)
    vp = tl.load(PV + p_off, mask=pmask[:, None] & dmask[None, :], other=0.0)

    smask = tl.where(live, (js < S) & (js <= i), False)  # the sinks written so far (BS,); sink i is the new token
    snew = js == i
    s_off = b * ss_b + hk * ss_h + js[:, None] * ss_s + offs_d[None, :]
    ks = tl.load(SK + s_off, mask=(smask & ~snew)[:, None] & dmask[None, :], other=0.0)
    vs = tl.load(SV + s_off, mask=(smask & ~snew)[:, None] & dmask[None, :], other=0.0)

    omask, rnew, kr, vr = _gather_ring(RK, RV, o, pos, i, live, b, hk, sr_b, sr_h, sr_s, P, S, W, offs_d, dmask)
    if HAS_O2:
        omask2, rnew2, kr2, vr2 = _gather_ring(RK, RV, o2, pos, i, live, b, hk, sr_b, sr_h, sr_s, P, S, W, offs_d,
                                               dmask)
    else:  # (unused)
        omask2, rnew2, kr2, vr2 = omask, rnew, kr, vr
    if HAS_REST:
        sum_off = b * ssum_b + hk * ssum_h + offs_d
        ksum = tl.load(KSUM + sum_off, mask=ld, other=0.0)
        vsum = tl.load(VSUM + sum_off, mask=ld, other=0.0)
    else:
        ksum = tl.zeros(offs_d.shape, tl.float32)  # (unused)
        vsum = ksum
    return b, live, i, q, kn, vn, pmask, kp, vp, smask, snew, ks, vs, omask, rnew, kr, vr, omask2, rnew2, kr2, vr2, \
        ksum, vsum


@triton.jit
def _with_new(kt, vt, new, kn, vn, LATE_CAST: tl.constexpr):
    """K/V tiles with the rows ``new`` replaced by the new token; fp32 unless LATE_CAST."""
    if not LATE_CAST:
        kt, vt = kt.to(tl.float32), vt.to(tl.float32)
    return tl.where(new[:, None], kn.to(kt.dtype)[None, :], kt), tl.where(new[:, None], vn.to(vt.dtype)[None, :], vt)


@triton.jit
def _finish_row(OUT, RK, RV, SK, SV, b, live, i, q, kn, vn, pmask, kp, vp, smask, snew, ks, vs, omask, rnew, kr, vr,
                omask2, rnew2, kr2, vr2, ksum, vsum, h, hk, sout_b, sout_h, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, S, W,
                scale, offs_d, dmask, G: tl.constexpr, HAS_REST: tl.constexpr, LATE_CAST: tl.constexpr,
                HAS_O2: tl.constexpr):
    """Attend over the row's loaded read set (:func:`_load_row`), store the output and, from the
    last query head of each kv head, write the new token into the cache."""
    q = q.to(tl.float32) * scale
    if not LATE_CAST:
        kp, vp = kp.to(tl.float32), vp.to(tl.float32)
    ks, vs = _with_new(ks, vs, snew, kn, vn, LATE_CAST)
    kr, vr = _with_new(kr, vr, rnew, kn, vn, LATE_CAST)

    s_p = tl.where(pmask, tl.sum(kp.to(tl.float32) * q[None, :], axis=1), float("-inf"))
    s_s = tl.where(smask, tl.sum(ks.to(tl.float32) * q[None, :], axis=1), float("-inf"))
    s_r = tl.where(omask, tl.sum(kr.to(tl.float32) * q[None, :], axis=1), float("-inf"))
    m = tl.maximum(tl.maximum(tl.max(s_p, axis=0), tl.max(s_s, axis=0)), tl.max(s_r, axis=0))
    if HAS_O2:  # the second tile of offsets
        kr2, vr2 = _with_new(kr2, vr2, rnew2, kn, vn, LATE_CAST)
        s_r2 = tl.where(omask2, tl.sum(kr2.to(tl.float32) * q[None, :], axis=1), float("-inf"))
        m = tl.maximum(m, tl.max(s_r2, axis=0))
    if HAS_REST:  # the remainder entry: the running sums less the ring entries read, averaged
        count = tl.maximum(i + 1 - S, 0) - tl.sum(omask.to(tl.int32), axis=0)
        k_read = tl.sum(kr.to(tl.float32), axis=0)  # (BD,) (0 where not read)
        v_read = tl.sum(vr.to(tl.float32), axis=0)
        if HAS_O2:
            count -= tl.sum(omask2.to(tl.int32), axis=0)
            k_read += tl.sum(kr2.to(tl.float32), axis=0)
            v_read += tl.sum(vr2.to(tl.float32), axis=0)
        n = tl.maximum(count, 1).to(tl.float32)
        k_e = (ksum - k_read) / n
        v_e = (vsum - v_read) / n
        s_e = tl.where(count > 0, tl.sum(q * k_e, axis=0) + tl.log(n), float("-inf"))
        m = tl.maximum(m, s_e)
    m = tl.where(live, m, 0.0)  # (a row past the end reads nothing: keep its exponentials finite)
    p_p = tl.exp(s_p - m)
    p_s = tl.exp(s_s - m)
    p_r = tl.exp(s_r - m)
    l = tl.sum(p_p, axis=0) + tl.sum(p_s, axis=0) + tl.sum(p_r, axis=0)
    acc = (tl.sum(p_p[:, None] * vp.to(tl.float32), axis=0) + tl.sum(p_s[:, None] * vs.to(tl.float32), axis=0)
           + tl.sum(p_r[:, None] * vr.to(tl.float32), axis=0))  # (BD,)
    if HAS_O2:
        p_r2 = tl.exp(s_r2 - m)
        l += tl.sum(p_r2, axis=0)
        acc += tl.sum(p_r2[:, None] * vr2.to(tl.float32), axis=0)
    if HAS_REST:
        p_e = tl.exp(s_e - m)
        l = l + p_e
        acc = acc + p_e * v_e
    out = (acc / tl.maximum(l, 1e-30)).to(OUT.dtype.element_ty)
    tl.store(OUT + b * sout_b + h * sout_h + offs_d, out, mask=tl.where(live, dmask, False))
    wmask = tl.where(live & (h % G == G - 1) & (i >= 0), dmask, False)  # the new token into the cache
    w_off = b * sr_b + hk * sr_h + (i % W) * sr_s + offs_d
    tl.store(RK + w_off, kn, mask=wmask)
    tl.store(RV + w_off, vn, mask=wmask)
    w_off = b * ss_b + hk * ss_h + i * ss_s + offs_d
    tl.store(SK + w_off, kn, mask=tl.where(i < S, wmask, False))
    tl.store(SV + w_off, vn, mask=tl.where(i < S, wmask, False))


@triton.jit
def ring_decode_kernel(
    Q, KN, VN, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos,
    sout_b, sout_h, ssum_b, ssum_h,
    B, P, S, W, n_off, scale, D,
    G: tl.constexpr, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, PREFETCH: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_O2: tl.constexpr, HAS_O2: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SPAN: tl.constexpr, HAS_REST: tl.constexpr, LATE_CAST: tl.constexpr,
):
    """One query head of ROWS rows per program: the head's offsets are loaded once, then a loop over
    the rows attends, for each row, over the prompt, the sinks written so far and the ring slots of
    pos - offsets, each in one 2-D tile (entries, BD). The last query head of each kv head writes
    the new token. ``PREFETCH``: the loop issues the next row's loads before it works on the
    current row's (loaded the iteration before), so a program keeps a row's gathers in flight while
    it computes (software pipelining by hand: the gathers' addresses depend on a load, which
    Triton's pipeliner does not overlap). ``HAS_O2``: the offsets in two tiles, BLOCK_O then
    BLOCK_O2 of them (fewer registers than one tile of the next power of 2).

    The read set is computed here from the head's offsets: no index tensor is built per step.
    ``HAS_REST``: also the remainder entry from the running sums KSUM, VSUM, which this kernel only
    reads (they already hold the new token).
    """
    h = tl.program_id(1)
    hk = h // G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    jo = tl.arange(0, BLOCK_O)
    o = tl.load(OFF + h * so_h + jo, mask=jo < n_off, other=-1)  # (BO,) this head's backward offsets
    if HAS_O2:  # the rest of them in a second, smaller tile
        jo2 = BLOCK_O + tl.arange(0, BLOCK_O2)
        o2 = tl.load(OFF + h * so_h + jo2, mask=jo2 < n_off, other=-1)  # (BO2,)
    else:
        o2 = o  # (unused)
    jp = tl.arange(0, BLOCK_P)
    js = tl.arange(0, BLOCK_S)
    row0 = tl.program_id(0) * ROWS
    end = tl.minimum(row0 + ROWS, B)
    jr = tl.arange(0, BLOCK_R)
    rmask = row0 + jr < end
    posv = tl.load(POS + (row0 + jr) * spos, mask=rmask, other=0)  # (BR,) the block's positions
    if HAS_SPAN:  # and caption spans
        lov = tl.load(SPAN + 2 * (row0 + jr), mask=rmask, other=0)
        hiv = tl.load(SPAN + 2 * (row0 + jr) + 1, mask=rmask, other=0)
    else:
        lov = posv  # (unused)
        hiv = posv
    # (helpers get their arguments spelled out, not from tuples: constexprs inside a tuple stop being
    # constexprs, and Triton before 3.2 has no tuples)
    if PREFETCH:
        (b, live, i, q, kn, vn, pmask, kp, vp, smask, snew, ks, vs, omask, rnew, kr, vr, omask2, rnew2, kr2, vr2, ksum,
         vsum) = _load_row(Q, KN, VN, PK, PV, SK, SV, RK, RV, KSUM, VSUM, o, o2, 0, row0, end, jr, posv, lov, hiv, h, hk,
                           sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s,
                           ssum_b, ssum_h, P, S, W, jp, js, offs_d, dmask, HAS_SPAN, HAS_REST, HAS_O2)
        for r in tl.range(0, ROWS):
            (b_, live_, i_, q_, kn_, vn_, pmask_, kp_, vp_, smask_, snew_, ks_, vs_, omask_, rnew_, kr_, vr_, omask2_,
             rnew2_, kr2_, vr2_, ksum_, vsum_) = _load_row(
                Q, KN, VN, PK, PV, SK, SV, RK, RV, KSUM, VSUM, o, o2, r + 1, row0, end, jr, posv, lov, hiv, h, hk, sq_b,
                sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, ssum_b, ssum_h, P,
                S, W, jp, js, offs_d, dmask, HAS_SPAN, HAS_REST, HAS_O2)
            _finish_row(OUT, RK, RV, SK, SV, b, live, i, q, kn, vn, pmask, kp, vp, smask, snew, ks, vs, omask, rnew, kr,
                        vr, omask2, rnew2, kr2, vr2, ksum, vsum, h, hk, sout_b, sout_h, ss_b, ss_h, ss_s, sr_b, sr_h,
                        sr_s, S, W, scale, offs_d, dmask, G, HAS_REST, LATE_CAST, HAS_O2)
            b, live, i, q, kn, vn, pmask, kp, vp = b_, live_, i_, q_, kn_, vn_, pmask_, kp_, vp_
            smask, snew, ks, vs, omask, rnew, kr, vr = smask_, snew_, ks_, vs_, omask_, rnew_, kr_, vr_
            omask2, rnew2, kr2, vr2, ksum, vsum = omask2_, rnew2_, kr2_, vr2_, ksum_, vsum_
    else:
        for r in tl.range(0, ROWS):
            (b, live, i, q, kn, vn, pmask, kp, vp, smask, snew, ks, vs, omask, rnew, kr, vr, omask2, rnew2, kr2, vr2,
             ksum, vsum) = _load_row(
                Q, KN, VN, PK, PV, SK, SV, RK, RV, KSUM, VSUM, o, o2, r, row0, end, jr, posv, lov, hiv, h, hk, sq_b,
                sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, ssum_b, ssum_h, P,
                S, W, jp, js, offs_d, dmask, HAS_SPAN, HAS_REST, HAS_O2)
            _finish_row(OUT, RK, RV, SK, SV, b, live, i, q, kn, vn, pmask, kp, vp, smask, snew, ks, vs, omask, rnew, kr,
                        vr, omask2, rnew2, kr2, vr2, ksum, vsum, h, hk, sout_b, sout_h, ss_b, ss_h, ss_s, sr_b, sr_h,
                        sr_s, S, W, scale, offs_d, dmask, G, HAS_REST, LATE_CAST, HAS_O2)
