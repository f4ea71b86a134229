"""Triton bodies of decode attention over slot tables for scored policies (launch in ``slots.py``).

Pass 1 (``slots_split_kernel``) is split-KV over the slots, the prompt going to split 0; besides the
partial output and log-sum-exp of each split it stores every slot's logit (-inf for a free slot).
Pass 2 (``slots_combine_kernel``) merges the splits of the G query heads of a kv head and turns
the stored logits into the slots' attention weights, summed over the group.
"""
import triton
import triton.language as tl


@triton.jit
def _scores(q, k, BLOCK_G: tl.constexpr):
    """q (BG, BD), k (BN, BD) -> (BG, BN) dot products."""
    if BLOCK_G == 1:  # MHA: one query vector; 2-D tiles keep the reduction cheap
        s = tl.sum(k * tl.sum(q, axis=0)[None, :], axis=1)[None, :]
    else:
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    return s


@triton.jit
def _weighted(p, v, BLOCK_G: tl.constexpr):
    """p (BG, BN), v (BN, BD) -> (BG, BD) = p @ v."""
    if BLOCK_G == 1:
        o = tl.sum(tl.sum(p, axis=0)[:, None] * v, axis=0)[None, :]
    else:
        o = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return o


@triton.jit
def _online_block(q, k, v, valid, m, l, acc, BLOCK_G: tl.constexpr):
    """Fold one block of keys into the running (max, sum, output) of each query head.

    valid (BN,) masks the block; returns the updated state and the block's logits (-inf where invalid).
    """
    s = _scores(q, k, BLOCK_G)
    s = tl.where(valid[None, :], s, float("-inf"))  # (BG, BN)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no -inf - -inf
    alpha = tl.exp(m - m_ref)
    p = tl.exp(s - m_ref[:, None])  # 0 where invalid
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted(p, v, BLOCK_G)
    return m_new, l, acc, s


@triton.jit
def slots_split_kernel(
    Q, PK, PV, K, V, SPOS, SPAN, S_OUT, O_PART, M_PART, L_PART,
    sq_b, sq_h, sp_b, sp_h, sp_s, sk_b, sk_h, sk_s, ss_b, ss_h, sl_b, sl_h, so_b, so_h, so_s, sm_b, sm_h,
    P, C, chunk, scale, D,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SPAN: tl.constexpr,
    LATE_CAST: tl.constexpr,
):
    """One (row, kv head, split): the G query heads of the group over slots [start, start + chunk)
    (and the prompt, for split 0: all of it, or with ``HAS_SPAN`` only SPAN[b] = [lo, hi), the
    caption's real tokens). Free slots (position -1) are neither read nor counted. ``LATE_CAST``: the
    K/V tiles stay in the cache's dtype (fewer registers), promoted to fp32 in the products."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    sp = tl.program_id(2)
    start = sp * chunk
    end = tl.minimum(start + chunk, C)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = hk * G + offs_g
    q = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)  # (BG, BD)
    q = (q * scale).to(tl.float32)  # scale may arrive as fp64 from torch.compile

    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)

    # the prompt (its real tokens): always read, by split 0 only
    pk_base = PK + b * sp_b + hk * sp_h
    pv_base = PV + b * sp_b + hk * sp_h
    p_start = 0
    p_end = tl.where(sp == 0, P, 0)
    if HAS_SPAN:
        p_start = tl.load(SPAN + 2 * b)
        p_end = tl.where(sp == 0, tl.load(SPAN + 2 * b + 1), 0)
    for n0 in range(p_start, p_end, BLOCK_N):
        n = n0 + offs_n
        valid = n < p_end
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(pk_base + n[:, None] * sp_s + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(pv_base + n[:, None] * sp_s + offs_d[None, :], mask=kv_mask, other=0.0)
        if not LATE_CAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        m, l, acc, s = _online_block(q, k, v, valid, m, l, acc, BLOCK_G)

    # this split's slots; every slot's logit is stored for the weights pass
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sk_b + hk * sk_h
    s_base = S_OUT + b * sl_b + heads[:, None] * sl_h
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        inside = n < end
        spos = tl.load(SPOS + b * ss_b + hk * ss_h + n, mask=inside, other=-1)
        valid = spos >= 0
        kv_mask = valid[:, None] & dmask[None, :]
        k = tl.load(k_base + n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
        if not LATE_CAST:
            k, v = k.to(tl.float32), v.to(tl.float32)
        m, l, acc, s = _online_block(q, k, v, valid, m, l, acc, BLOCK_G)
        tl.store(s_base + n[None, :], s, mask=gmask[:, None] & inside[None, :])

    o_ptr = O_PART + b * so_b + heads[:, None] * so_h + sp * so_s + offs_d[None, :]
    tl.store(o_ptr, acc, mask=gmask[:, None] & dmask[None, :])
    tl.store(M_PART + b * sm_b + heads * sm_h + sp, m, mask=gmask)
    tl.store(L_PART + b * sm_b + heads * sm_h + sp, l, mask=gmask)


@triton.jit
def slots_combine_kernel(
    O_PART, M_PART, L_PART, S_OUT, OUT, W_OUT,
    so_b, so_h, so_s, sm_b, sm_h, sl_b, sl_h, sout_b, sout_h, sw_b, sw_h,
    splits, C, D,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One (row, kv head): merge the splits of its G query heads, then the slot weights
    exp(logit - lse) summed over the group. A head with nothing to read gets zeros."""
    b = tl.program_id(0)
    hk = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = hk * G + offs_g

    ml_off = b * sm_b + heads[:, None] * sm_h + offs_s[None, :]
    ml_mask = gmask[:, None] & (offs_s[None, :] < splits)
    m_all = tl.load(M_PART + ml_off, mask=ml_mask, other=float("-inf"))  # (BG, BS)
    l_all = tl.load(L_PART + ml_off, mask=ml_mask, other=0.0)
    m_max = tl.max(m_all, axis=1)  # (BG,)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.sum(l_all * tl.exp(m_all - m_ref[:, None]), axis=1)  # (BG,); empty splits (m = -inf) add 0
    seen = total > 0

    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for sp in range(0, splits):
        m_sp = tl.load(M_PART + b * sm_b + heads * sm_h + sp, mask=gmask, other=float("-inf"))
        o = tl.load(O_PART + b * so_b + heads[:, None] * so_h + sp * so_s + offs_d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)
        acc += o * tl.exp(m_sp - m_ref)[:, None]
    out = acc / tl.where(seen, total, 1.0)[:, None]
    tl.store(OUT + b * sout_b + heads[:, None] * sout_h + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=gmask[:, None] & dmask[None, :])

    lse = tl.where(seen, m_ref + tl.log(tl.where(seen, total, 1.0)), float("inf"))  # (BG,); inf: weights 0
    for c0 in range(0, C, BLOCK_C):
        c = c0 + offs_c
        cmask = c < C
        s = tl.load(S_OUT + b * sl_b + heads[:, None] * sl_h + c[None, :],
                    mask=gmask[:, None] & cmask[None, :], other=float("-inf"))  # (BG, BC)
        w = tl.sum(tl.exp(s - lse[:, None]), axis=0)  # exp(-inf) = 0 for free slots and padded heads
        tl.store(W_OUT + b * sw_b + hk * sw_h + c, w, mask=cmask)
