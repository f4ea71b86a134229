"""Triton bodies of decode attention for offset policies over a ring buffer (launch in ``ring.py``).

Both kernels do the ring cache's whole decode step for the new token (KN, VN): attend over the
read set, taking every read of a slot the step writes from registers (so no program reads memory
that another writes), then write the token (ring slot ``i % W``; sink slot ``i`` while ``i < S``)
from one program per (row, kv head), after that program's reads. Run in program order (the
interpreter), a read of such a slot from memory would see the old entry, which the tests poison.

The remainder entry's running sums (``HAS_REST``) are read-only here: the cache adds the new token
to them before the launch (one small element-wise op), so no program can see them half-updated.
"""
import triton
import triton.language as tl


@triton.jit
def _store_new_token(kn, vn, SK, SV, RK, RV, b, hk, i, write, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, S, W, offs_d,
                     dmask):
    """When ``write``: the new token (kn, vn (BD,), the cache's dtype) of (row b, kv head hk) into the cache."""
    wmask = tl.where(write & (i >= 0), dmask, False)  # (not block & scalar: the interpreter mistypes it)
    r_off = b * sr_b + hk * sr_h + (i % W) * sr_s + offs_d
    tl.store(RK + r_off, kn, mask=wmask)
    tl.store(RV + r_off, vn, mask=wmask)
    s_off = b * ss_b + hk * ss_h + i * ss_s + offs_d
    tl.store(SK + s_off, kn, mask=tl.where(i < S, wmask, False))
    tl.store(SV + s_off, vn, mask=tl.where(i < S, wmask, False))


@triton.jit
def _read_rows(q, kn, vn, K, V, off, read, new, dmask):
    """Rows ``off`` of K and V where ``read``, the new token (kn, vn, from registers) where ``new``.

    -> scores (BN,) (-inf where not read), keys and values (BN, BD) in fp32 (0 where not read).
    """
    lmask = (read & ~new)[:, None] & dmask[None, :]
    k = tl.load(K + off, mask=lmask, other=0.0).to(tl.float32)
    v = tl.load(V + off, mask=lmask, other=0.0).to(tl.float32)
    k = tl.where(new[:, None], kn[None, :], k)
    v = tl.where(new[:, None], vn[None, :], v)
    return tl.where(read, tl.sum(k * q[None, :], axis=1), float("-inf")), k, v


@triton.jit
def _fixed_scores(q, kn, vn, PK, PV, SK, SV, SPAN, b, hk, i, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, P, S, offs_d, dmask,
                  BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, HAS_SPAN: tl.constexpr):
    """Scores and values of the prompt and of the sinks reached so far (sink j holds position P + j).

    ``HAS_SPAN``: only the prompt positions SPAN[b] = [lo, hi) are read (caption padding).
    -> s_p (BP,), v_p (BP, BD), s_s (BS,), v_s (BS, BD); -inf scores where not read.
    """
    jp = tl.arange(0, BLOCK_P)
    pmask = jp < P
    if HAS_SPAN:
        pmask = pmask & (jp >= tl.load(SPAN + 2 * b)) & (jp < tl.load(SPAN + 2 * b + 1))
    p_off = b * sp_b + hk * sp_h + jp[:, None] * sp_s + offs_d[None, :]
    kp = tl.load(PK + p_off, mask=pmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    vp = tl.load(PV + p_off, mask=pmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    s_p = tl.where(pmask, tl.sum(kp * q[None, :], axis=1), float("-inf"))

    js = tl.arange(0, BLOCK_S)
    smask = (js < S) & (js <= i)
    new = js == i  # sink i is the new token: from registers
    s_off = b * ss_b + hk * ss_h + js[:, None] * ss_s + offs_d[None, :]
    s_s, ks, vs = _read_rows(q, kn, vn, SK, SV, s_off, smask, new, dmask)
    return s_p, vp, s_s, vs


@triton.jit
def _ring_scores(q, kn, vn, RK, RV, OFF, b, hk, h, pos, jo, sr_b, sr_h, sr_s, so_h, P, S, W, n_off, offs_d, dmask):
    """Scores and values of the ring entries ``pos - OFF[h, jo]`` that are image positions past the sinks.

    -> s_r (BO,), v_r (BO, BD); -inf scores where not read. The slot being written
    (``(pos - P) % W``) comes from registers.
    """
    o = tl.load(OFF + h * so_h + jo, mask=jo < n_off, other=-1)
    kpos = pos - o
    omask = (o >= 0) & (kpos >= P + S)
    slot = tl.where(omask, (kpos - P) % W, 0)
    new = omask & (slot == (pos - P) % W)
    r_off = b * sr_b + hk * sr_h + slot[:, None] * sr_s + offs_d[None, :]
    s_r, kr, vr = _read_rows(q, kn, vn, RK, RV, r_off, omask, new, dmask)
    return s_r, kr, vr, omask


@triton.jit
def _rest_entry(q, kr, vr, omask, KSUM, VSUM, b, hk, i, ssum_b, ssum_h, S, offs_d, dmask):
    """The mean-field remainder entry (see :mod:`arsparse.policies.remainder`): the running sums over
    the image keys past the sinks written so far (the new token included), less the ring entries read
    (kr, vr are 0 where not read), averaged over the rest. -> logit (q is pre-scaled; -inf when nothing
    is left), value (BD,)."""
    count = tl.maximum(i + 1 - S, 0) - tl.sum(omask.to(tl.int32), axis=0)
    n = tl.maximum(count, 1).to(tl.float32)
    off = b * ssum_b + hk * ssum_h + offs_d
    k_rest = (tl.load(KSUM + off, mask=dmask, other=0.0) - tl.sum(kr, axis=0)) / n
    v_rest = (tl.load(VSUM + off, mask=dmask, other=0.0) - tl.sum(vr, axis=0)) / n
    s_e = tl.sum(q * k_rest, axis=0) + tl.log(n)
    return tl.where(count > 0, s_e, float("-inf")), v_rest


@triton.jit
def ring_decode_kernel(
    Q, KN, VN, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos,
    sout_b, sout_h, ssum_b, ssum_h,
    P, S, W, n_off, scale, D,
    G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SPAN: tl.constexpr, HAS_REST: tl.constexpr,
):
    """One (row, query head): the prompt, the sinks written so far and the ring slots of pos - offsets,
    all in one tile each. The last query head of each kv head writes the new token.

    The read set is computed here from the head's offsets: no index tensor is built per step.
    ``HAS_REST``: also the remainder entry from the running sums KSUM, VSUM, which this kernel only
    reads (they already hold the new token).
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // G
    pos = tl.load(POS + b * spos)
    i = pos - P  # image index of the query
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + b * sq_b + h * sq_h + offs_d, mask=dmask, other=0.0).to(tl.float32)
    q = (q * scale).to(tl.float32)
    kn_c = tl.load(KN + b * skn_b + hk * skn_h + offs_d, mask=dmask, other=0.0)  # the new token, cache dtype
    vn_c = tl.load(VN + b * svn_b + hk * svn_h + offs_d, mask=dmask, other=0.0)
    kn, vn = kn_c.to(tl.float32), vn_c.to(tl.float32)
    s_p, vp, s_s, vs = _fixed_scores(q, kn, vn, PK, PV, SK, SV, SPAN, b, hk, i, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s,
                                     P, S, offs_d, dmask, BLOCK_P, BLOCK_S, HAS_SPAN)
    s_r, kr, vr, omask = _ring_scores(q, kn, vn, RK, RV, OFF, b, hk, h, pos, tl.arange(0, BLOCK_O), sr_b, sr_h,
                                      sr_s, so_h, P, S, W, n_off, offs_d, dmask)

    m = tl.maximum(tl.maximum(tl.max(s_p, axis=0), tl.max(s_s, axis=0)), tl.max(s_r, axis=0))
    if HAS_REST:
        s_e, v_e = _rest_entry(q, kr, vr, omask, KSUM, VSUM, b, hk, i, ssum_b, ssum_h, S, offs_d, dmask)
        m = tl.maximum(m, s_e)
    p_p = tl.exp(s_p - m)
    p_s = tl.exp(s_s - m)
    p_r = tl.exp(s_r - m)
    l = tl.sum(p_p, axis=0) + tl.sum(p_s, axis=0) + tl.sum(p_r, axis=0)
    acc = tl.sum(p_p[:, None] * vp, axis=0) + tl.sum(p_s[:, None] * vs, axis=0) + tl.sum(p_r[:, None] * vr, axis=0)
    if HAS_REST:
        p_e = tl.exp(s_e - m)
        l = l + p_e
        acc = acc + p_e * v_e
    tl.store(OUT + b * sout_b + h * sout_h + offs_d, (acc / l).to(OUT.dtype.element_ty), mask=dmask)
    _store_new_token(kn_c, vn_c, SK, SV, RK, RV, b, hk, i, h % G == G - 1, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, S, W,
                     offs_d, dmask)


@triton.jit
def ring_decode_grouped_kernel(
    Q, KN, VN, PK, PV, SK, SV, RK, RV, OFF, POS, SPAN, OUT, KSUM, VSUM,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, spos,
    sout_b, sout_h, ssum_b, ssum_h,
    B, P, S, W, n_off, scale, D,
    G: tl.constexpr, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_SPAN: tl.constexpr,
):
    """Candidate (not used by the engine): one (block of ROWS rows, kv head) per program.

    Loops over its rows and the G query heads of the kv head (so one program writes each new token,
    after its last head's reads, and more bytes per program amortise the fixed latency of a short program), and
    reads the ring in chunks of BLOCK_O offsets with an online softmax (a smaller register tile:
    more programs resident per SM).
    """
    rb = tl.program_id(0)
    hk = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    for it in range(0, ROWS * G):
        g = it % G
        live = rb * ROWS + it // G < B
        b = tl.minimum(rb * ROWS + it // G, B - 1)
        h = hk * G + g
        pos = tl.load(POS + b * spos)
        i = pos - P
        q = tl.load(Q + b * sq_b + h * sq_h + offs_d, mask=dmask, other=0.0).to(tl.float32)
        q = (q * scale).to(tl.float32)
        kn_c = tl.load(KN + b * skn_b + hk * skn_h + offs_d, mask=dmask, other=0.0)
        vn_c = tl.load(VN + b * svn_b + hk * svn_h + offs_d, mask=dmask, other=0.0)
        kn, vn = kn_c.to(tl.float32), vn_c.to(tl.float32)
        s_p, vp, s_s, vs = _fixed_scores(q, kn, vn, PK, PV, SK, SV, SPAN, b, hk, i, sp_b, sp_h, sp_s, ss_b, ss_h,
                                         ss_s, P, S, offs_d, dmask, BLOCK_P, BLOCK_S, HAS_SPAN)
        m = tl.maximum(tl.max(s_p, axis=0), tl.max(s_s, axis=0))  # finite: the prompt (span) is never empty
        p_p = tl.exp(s_p - m)
        p_s = tl.exp(s_s - m)
        l = tl.sum(p_p, axis=0) + tl.sum(p_s, axis=0)
        acc = tl.sum(p_p[:, None] * vp, axis=0) + tl.sum(p_s[:, None] * vs, axis=0)
        for c in range(0, n_off, BLOCK_O):
            s_r, _kr, vr, _read = _ring_scores(q, kn, vn, RK, RV, OFF, b, hk, h, pos, c + tl.arange(0, BLOCK_O), sr_b, sr_h,
                                   sr_s, so_h, P, S, W, n_off, offs_d, dmask)
            m_new = tl.maximum(m, tl.max(s_r, axis=0))
            alpha = tl.exp(m - m_new)
            p_r = tl.exp(s_r - m_new)
            l = l * alpha + tl.sum(p_r, axis=0)
            acc = acc * alpha + tl.sum(p_r[:, None] * vr, axis=0)
            m = m_new
        tl.store(OUT + b * sout_b + h * sout_h + offs_d, (acc / l).to(OUT.dtype.element_ty),
                 mask=tl.where(live, dmask, False))
        _store_new_token(kn_c, vn_c, SK, SV, RK, RV, b, hk, i, live & (g == G - 1), ss_b, ss_h, ss_s, sr_b, sr_h,
                         sr_s, S, W, offs_d, dmask)
