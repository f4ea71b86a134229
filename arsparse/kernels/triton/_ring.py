"""Triton body of decode attention for offset policies over a ring buffer (launch in ``ring.py``)."""
import triton
import triton.language as tl


@triton.jit
def ring_decode_kernel(
    Q, PK, PV, SK, SV, RK, RV, OFF, POS, OUT,
    sq_b, sq_h, sp_b, sp_h, sp_s, ss_b, ss_h, ss_s, sr_b, sr_h, sr_s, so_h, sout_b, sout_h,
    P, S, W, n_off, scale, D,
    G: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (row, query head): the prompt, the sinks written so far and the ring slots of pos - offsets.

    The read set is computed here from the head's offsets: no index tensor is built per step.
    """
    b = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // G
    pos = tl.load(POS)
    i = pos - P  # image index of the query
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + b * sq_b + h * sq_h + offs_d, mask=dmask, other=0.0).to(tl.float32)
    q = (q * scale).to(tl.float32)

    # prompt
    jp = tl.arange(0, BLOCK_P)
    pmask = jp < P
    kp = tl.load(PK + b * sp_b + hk * sp_h + jp[:, None] * sp_s + offs_d[None, :],
                 mask=pmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    vp = tl.load(PV + b * sp_b + hk * sp_h + jp[:, None] * sp_s + offs_d[None, :],
                 mask=pmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    s_p = tl.where(pmask, tl.sum(kp * q[None, :], axis=1), tl.full((BLOCK_P,), float("-inf"), tl.float32))

    # sinks: sink j holds position P + j once the query has reached it
    js = tl.arange(0, BLOCK_S)
    smask = (js < S) & (js <= i)
    ks = tl.load(SK + b * ss_b + hk * ss_h + js[:, None] * ss_s + offs_d[None, :],
                 mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    vs = tl.load(SV + b * ss_b + hk * ss_h + js[:, None] * ss_s + offs_d[None, :],
                 mask=smask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    s_s = tl.where(smask, tl.sum(ks * q[None, :], axis=1), tl.full((BLOCK_S,), float("-inf"), tl.float32))

    # ring: positions pos - o that are image positions past the sinks
    jo = tl.arange(0, BLOCK_O)
    o = tl.load(OFF + h * so_h + jo, mask=jo < n_off, other=-1)
    kpos = pos - o
    omask = (o >= 0) & (kpos >= P + S)
    slot = tl.where(omask, (kpos - P) % W, 0)
    kr = tl.load(RK + b * sr_b + hk * sr_h + slot[:, None] * sr_s + offs_d[None, :],
                 mask=omask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    vr = tl.load(RV + b * sr_b + hk * sr_h + slot[:, None] * sr_s + offs_d[None, :],
                 mask=omask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    s_r = tl.where(omask, tl.sum(kr * q[None, :], axis=1), tl.full((BLOCK_O,), float("-inf"), tl.float32))

    m = tl.maximum(tl.maximum(tl.max(s_p, axis=0), tl.max(s_s, axis=0)), tl.max(s_r, axis=0))
    p_p = tl.exp(s_p - m)
    p_s = tl.exp(s_s - m)
    p_r = tl.exp(s_r - m)
    l = tl.sum(p_p, axis=0) + tl.sum(p_s, axis=0) + tl.sum(p_r, axis=0)
    acc = tl.sum(p_p[:, None] * vp, axis=0) + tl.sum(p_s[:, None] * vs, axis=0) + tl.sum(p_r[:, None] * vr, axis=0)
    tl.store(OUT + b * sout_b + h * sout_h + offs_d, (acc / l).to(OUT.dtype.element_ty), mask=dmask)
