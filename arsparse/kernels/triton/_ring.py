"""Triton bodies of decode attention for offset policies over a ring buffer (launch in ``ring.py``).

Both kernels do the ring cache's whole decode step for the new token (KN, VN): attend over the
read set, taking every read of a slot the step writes from registers (so no program reads memory
that another writes), then write the token (ring slot ``i % W``; sink slot ``i`` while ``i < S``)
from the program of the last query head of each kv head, after that program's reads. Run in
program order (the interpreter), a read of such a slot from memory would see the old entry, which
the tests poison.

The helpers work on a block of query heads of one row: ``hs`` (BH,) the heads, ``hk`` (BH,) their
kv heads (a block may span several), ``hmask`` (BH,) the real ones; tiles are (BH, rows, BD).
``LATE_CAST``: the gathered K/V tiles stay in the cache's dtype and are converted to fp32 only in
the products and sums (fewer registers); the arithmetic is fp32 either way.

The remainder entry's running sums (``HAS_REST``) are read-only here: the cache adds the new token
to them before the launch (one small element-wise op), so no program can see them half-updated.
"""
import triton
import triton.language as tl


@triton.jit
def _store_new_token(kn, vn, SK, SV, RK, RV, b, hk, i, write, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, S, W, offs_d,
                     dmask):
    """Where ``write`` (BH,): the new token (kn, vn (BH, BD), the cache's dtype) of (row b, kv head hk) into the cache."""
    wmask = tl.where(i >= 0, write, False)[:, None] & dmask[None, :]  # (BH, BD)
    r_off = b * sr_b + hk[:, None] * sr_h + (i % W) * sr_s + offs_d[None, :]
    tl.store(RK + r_off, kn, mask=wmask)
    tl.store(RV + r_off, vn, mask=wmask)
    s_off = b * ss_b + hk[:, None] * ss_h + i * ss_s + offs_d[None, :]
    tl.store(SK + s_off, kn, mask=tl.where(i < S, wmask, False))
    tl.store(SV + s_off, vn, mask=tl.where(i < S, wmask, False))


@triton.jit
def _gather(K, V, off, read, dmask, LATE_CAST: tl.constexpr):
    """Rows ``off`` (BH, BN, BD) of K and V where ``read`` (BH, BN), 0 elsewhere: fp32, or the cache's dtype."""
    lmask = read[:, :, None] & dmask[None, None, :]
    k = tl.load(K + off, mask=lmask, other=0.0)
    v = tl.load(V + off, mask=lmask, other=0.0)
    if not LATE_CAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v


@triton.jit
def _scores(q, k, read):
    """q (BH, BD) fp32 (pre-scaled) . k (BH, BN, BD) -> (BH, BN), -inf where not ``read``."""
    return tl.where(read, tl.sum(k.to(tl.float32) * q[:, None, :], axis=2), float("-inf"))


@triton.jit
def _read_rows(q, kn, vn, K, V, off, read, new, dmask, LATE_CAST: tl.constexpr):
    """Rows ``off`` of K and V where ``read``, the new token (kn, vn (BH, BD), from registers) where ``new``.

    -> scores (BH, BN) (-inf where not read), keys and values (BH, BN, BD) (0 where not read).
    """
    k, v = _gather(K, V, off, read & ~new, dmask, LATE_CAST)
    k = tl.where(new[:, :, None], kn.to(k.dtype)[:, None, :], k)
    v = tl.where(new[:, :, None], vn.to(v.dtype)[:, None, :], v)
    return _scores(q, k, read), k, v


@triton.jit
def _fixed_scores(q, kn, vn, PK, PV, SK, SV, SPAN, b, hk, hmask, i, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, P, S,
                  offs_d, dmask, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SPAN: tl.constexpr,
                  LATE_CAST: tl.constexpr):
    """Scores and values of the prompt and of the sinks reached so far (sink j holds position P + j).

    ``HAS_SPAN``: only the prompt positions SPAN[b] = [lo, hi) are read (caption padding).
    -> s_p (BH, BP), v_p (BH, BP, BD), s_s (BH, BS), v_s (BH, BS, BD); -inf scores where not read.
    """
    jp = tl.arange(0, BLOCK_P)
    pmask = jp < P
    if HAS_SPAN:
        pmask = pmask & (jp >= tl.load(SPAN + 2 * b)) & (jp < tl.load(SPAN + 2 * b + 1))
    pmask = hmask[:, None] & pmask[None, :]  # (BH, BP)
    p_off = b * sp_b + hk[:, None, None] * sp_h + jp[None, :, None] * sp_s + offs_d[None, None, :]
    kp, vp = _gather(PK, PV, p_off, pmask, dmask, LATE_CAST)
    s_p = _scores(q, kp, pmask)

    js = tl.arange(0, BLOCK_S)
    smask = hmask[:, None] & ((js < S) & (js <= i))[None, :]  # (BH, BS)
    new = smask & (js == i)[None, :]  # sink i is the new token: from registers
    s_off = b * ss_b + hk[:, None, None] * ss_h + js[None, :, None] * ss_s + offs_d[None, None, :]
    s_s, ks, vs = _read_rows(q, kn, vn, SK, SV, s_off, smask, new, dmask, LATE_CAST)
    return s_p, vp, s_s, vs


@triton.jit
def _ring_scores(q, kn, vn, RK, RV, OFF, b, hs, hk, hmask, pos, jo, sr_b, sr_h, sr_s, so_h, P, S, W, n_off, offs_d,
                 dmask, LATE_CAST: tl.constexpr):
    """Scores and values of the ring entries ``pos - OFF[h, jo]`` (jo (BO,)) that are image positions past the sinks.

    -> s_r (BH, BO), k_r, v_r (BH, BO, BD), read (BH, BO); -inf scores where not read, 0 keys and
    values. The slot being written (``(pos - P) % W``) comes from registers.
    """
    o = tl.load(OFF + hs[:, None] * so_h + jo[None, :], mask=hmask[:, None] & (jo < n_off)[None, :], other=-1)
    kpos = pos - o  # (BH, BO)
    omask = (o >= 0) & (kpos >= P + S)
    slot = tl.where(omask, (kpos - P) % W, 0)
    new = omask & (slot == (pos - P) % W)
    r_off = b * sr_b + hk[:, None, None] * sr_h + slot[:, :, None] * sr_s + offs_d[None, None, :]
    s_r, kr, vr = _read_rows(q, kn, vn, RK, RV, r_off, omask, new, dmask, LATE_CAST)
    return s_r, kr, vr, omask


@triton.jit
def _rest_entry(q, kr, vr, omask, KSUM, VSUM, b, hk, hdmask, i, ssum_b, ssum_h, S, offs_d):
    """The mean-field remainder entry (see :mod:`arsparse.policies.remainder`): the running sums over
    the image keys past the sinks written so far (the new token included), less the ring entries read
    (kr, vr (BH, BO, BD) are 0 where not read), averaged over the rest. -> logit (BH,) (q is
    pre-scaled; -inf when nothing is left), value (BH, BD)."""
    count = tl.maximum(i + 1 - S, 0) - tl.sum(omask.to(tl.int32), axis=1)  # (BH,)
    n = tl.maximum(count, 1).to(tl.float32)
    off = b * ssum_b + hk[:, None] * ssum_h + offs_d[None, :]
    k_rest = (tl.load(KSUM + off, mask=hdmask, other=0.0) - tl.sum(kr.to(tl.float32), axis=1)) / n[:, None]
    v_rest = (tl.load(VSUM + off, mask=hdmask, other=0.0) - tl.sum(vr.to(tl.float32), axis=1)) / n[:, None]
    s_e = tl.sum(q * k_rest, axis=1) + tl.log(n)
    return tl.where(count > 0, s_e, float("-inf")), v_rest


@triton.jit
def _row_setup(Q, KN, VN, POS, b, hs, hk, hmask, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, spos, P, scale, offs_d,
               dmask):
    """Row b's position and image index, the heads' scaled queries (BH, BD) fp32 and the new token's
    keys and values (BH, BD) in the cache's dtype, the (BH, BD) mask of real heads."""
    pos = tl.load(POS + b * spos)
    hdmask = hmask[:, None] & dmask[None, :]
    q = tl.load(Q + b * sq_b + hs[:, None] * sq_h + offs_d[None, :], mask=hdmask, other=0.0).to(tl.float32)
    q = (q * scale).to(tl.float32)
    kn = tl.load(KN + b * skn_b + hk[:, None] * skn_h + offs_d[None, :], mask=hdmask, other=0.0)
    vn = tl.load(VN + b * svn_b + hk[:, None] * svn_h + offs_d[None, :], mask=hdmask, other=0.0)
    return pos, pos - P, q, kn, vn, hdmask


@triton.jit
def ring_decode_kernel(
    Q, KN, VN, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos,
    sout_b, sout_h, ssum_b, ssum_h,
    H, P, S, W, n_off, scale, D,
    G: tl.constexpr, HB: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SPAN: tl.constexpr, HAS_REST: tl.constexpr,
    LATE_CAST: tl.constexpr,
):
    """One (row, block of HB query heads): the prompt, the sinks written so far and the ring slots of
    pos - offsets, all in one tile each (BLOCK_H = next power of 2 >= HB heads, the extra masked).
    The last query head of each kv head writes the new token.

    The read set is computed here from each head's offsets: no index tensor is built per step.
    ``HAS_REST``: also the remainder entry from the running sums KSUM, VSUM, which this kernel only
    reads (they already hold the new token).
    """
    b = tl.program_id(0)
    jh = tl.arange(0, BLOCK_H)
    hs = tl.program_id(1) * HB + jh  # (BH,) query heads
    hmask = (jh < HB) & (hs < H)
    hk = hs // G  # (BH,) their kv heads
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    pos, i, q, kn, vn, hdmask = _row_setup(Q, KN, VN, POS, b, hs, hk, hmask, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                                           spos, P, scale, offs_d, dmask)
    s_p, vp, s_s, vs = _fixed_scores(q, kn, vn, PK, PV, SK, SV, SPAN, b, hk, hmask, i, sp_b, sp_h, sp_s, ss_b, ss_h,
                                     ss_s, P, S, offs_d, dmask, BLOCK_P, BLOCK_S, HAS_SPAN, LATE_CAST)
    s_r, kr, vr, omask = _ring_scores(q, kn, vn, RK, RV, OFF, b, hs, hk, hmask, pos, tl.arange(0, BLOCK_O), sr_b,
                                      sr_h, sr_s, so_h, P, S, W, n_off, offs_d, dmask, LATE_CAST)

    m = tl.maximum(tl.maximum(tl.max(s_p, axis=1), tl.max(s_s, axis=1)), tl.max(s_r, axis=1))  # (BH,)
    if HAS_REST:
        s_e, v_e = _rest_entry(q, kr, vr, omask, KSUM, VSUM, b, hk, hdmask, i, ssum_b, ssum_h, S, offs_d)
        m = tl.maximum(m, s_e)
    m = tl.where(hmask, m, 0.0)  # (masked heads read nothing: keep their exponentials finite)
    p_p = tl.exp(s_p - m[:, None])
    p_s = tl.exp(s_s - m[:, None])
    p_r = tl.exp(s_r - m[:, None])
    l = tl.sum(p_p, axis=1) + tl.sum(p_s, axis=1) + tl.sum(p_r, axis=1)  # (BH,)
    acc = (tl.sum(p_p[:, :, None] * vp.to(tl.float32), axis=1) + tl.sum(p_s[:, :, None] * vs.to(tl.float32), axis=1)
           + tl.sum(p_r[:, :, None] * vr.to(tl.float32), axis=1))  # (BH, BD)
    if HAS_REST:
        p_e = tl.exp(s_e - m)
        l = l + p_e
        acc = acc + p_e[:, None] * v_e
    out = (acc / tl.maximum(l, 1e-30)[:, None]).to(OUT.dtype.element_ty)
    tl.store(OUT + b * sout_b + hs[:, None] * sout_h + offs_d[None, :], out, mask=hdmask)
    _store_new_token(kn, vn, SK, SV, RK, RV, b, hk, i, hmask & (hs % G == G - 1), ss_b, ss_h, ss_s, sr_b, sr_h, sr_s,
                     S, W, offs_d, dmask)


@triton.jit
def ring_decode_grouped_kernel(
    Q, KN, VN, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos,
    sout_b, sout_h, ssum_b, ssum_h,
    B, P, S, W, n_off, scale, D,
    G: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_SPAN: tl.constexpr, LATE_CAST: tl.constexpr,
):
    """Candidate (not used by the engine): one (block of ROWS rows, kv head) per program.

    Loops over its rows and the G query heads of the kv head, one head at a time (a block of one:
    BH = 1), so one program writes each new token, after its last head's reads, and more bytes per
    program amortise the fixed latency of a short program; reads the ring in chunks of BLOCK_O
    offsets with an online softmax (a smaller register tile: more programs resident per SM).
    """
    rb = tl.program_id(0)
    hk0 = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    one = tl.arange(0, 1)
    for it in range(0, ROWS * G):
        g = it % G
        row = rb * ROWS + it // G
        hmask = row + one < B  # (1,) a real row
        b = tl.minimum(row, B - 1)
        hs = hk0 * G + g + one  # (1,)
        hk = hk0 + one
        pos, i, q, kn, vn, hdmask = _row_setup(Q, KN, VN, POS, b, hs, hk, hmask, sq_b, sq_h, skn_b, skn_h, svn_b,
                                               svn_h, spos, P, scale, offs_d, dmask)
        s_p, vp, s_s, vs = _fixed_scores(q, kn, vn, PK, PV, SK, SV, SPAN, b, hk, hmask, i, sp_b, sp_h, sp_s, ss_b,
                                         ss_h, ss_s, P, S, offs_d, dmask, BLOCK_P, BLOCK_S, HAS_SPAN, LATE_CAST)
        # finite for real rows: the prompt (span) is never empty; 0 for a padding row (reads nothing)
        m = tl.where(hmask, tl.maximum(tl.max(s_p, axis=1), tl.max(s_s, axis=1)), 0.0)  # (1,)
        p_p = tl.exp(s_p - m[:, None])
        p_s = tl.exp(s_s - m[:, None])
        l = tl.sum(p_p, axis=1) + tl.sum(p_s, axis=1)
        acc = tl.sum(p_p[:, :, None] * vp.to(tl.float32), axis=1) + tl.sum(p_s[:, :, None] * vs.to(tl.float32),
                                                                            axis=1)  # (1, BD)
        for c in range(0, n_off, BLOCK_O):
            s_r, _kr, vr, _read = _ring_scores(q, kn, vn, RK, RV, OFF, b, hs, hk, hmask, pos, c + tl.arange(0, BLOCK_O),
                                               sr_b, sr_h, sr_s, so_h, P, S, W, n_off, offs_d, dmask, LATE_CAST)
            m_new = tl.maximum(m, tl.max(s_r, axis=1))
            alpha = tl.exp(m - m_new)
            p_r = tl.exp(s_r - m_new[:, None])
            l = l * alpha + tl.sum(p_r, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p_r[:, :, None] * vr.to(tl.float32), axis=1)
            m = m_new
        out = (acc / tl.maximum(l, 1e-30)[:, None]).to(OUT.dtype.element_ty)
        tl.store(OUT + b * sout_b + hs[:, None] * sout_h + offs_d[None, :], out, mask=hdmask)
        _store_new_token(kn, vn, SK, SV, RK, RV, b, hk, i, hmask & (hs % G == G - 1), ss_b, ss_h, ss_s, sr_b, sr_h,
                         sr_s, S, W, offs_d, dmask)
