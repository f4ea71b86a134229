"""Triton bodies of split-KV decode attention (launch logic lives in ``decode.py``)."""
import triton
import triton.language as tl

from ._pdl import launch_next, wait_prior


@triton.jit
def _finite_max(m, GUARD: tl.constexpr):
    """The running max as a subtraction reference: -inf (nothing read yet) becomes 0 when ``GUARD``."""
    if GUARD:
        m = tl.where(m == float("-inf"), 0.0, m)
    return m


@triton.jit
def _tile_mask(n, end, lo, hi, P, HAS_SPAN: tl.constexpr):
    """Which keys ``n`` (BN,) of a tile are read: below ``end`` and, with a caption span, inside it."""
    nmask = n < end
    if HAS_SPAN:
        nmask = nmask & (n >= lo) & ((n < hi) | (n >= P))
    return nmask


@triton.jit
def _load_tile(k_base, v_base, n, nmask, sk_s, sv_s, offs_d, dmask):
    """The K and V rows ``n`` (BN, BD) of a tile, in the cache's dtype (masked rows 0)."""
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(k_base + n[:, None] * sk_s + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + n[:, None] * sv_s + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _attend_tile(k, v, nmask, q, m, l, acc, GUARD: tl.constexpr, MHA: tl.constexpr, DOT: tl.constexpr = False,
                 scale=1.0, IEEE: tl.constexpr = False):
    """One tile (BN, BD) into an online softmax. ``MHA``: one query vector q (BD,), scalar running max
    and sum, (BD,) accumulator; else the group's q (BG, BD), (BG,) max and sum, (BG, BD) accumulator.
    ``GUARD``: the tile may hold no readable key (see :func:`_finite_max`). ``DOT``: the group's
    unscaled q in the cache's dtype (BG >= 16 rows, zeros past the group) and the two products on
    tensor cores, the probabilities in the cache's dtype (as FlashAttention); ``IEEE``: fp32 tiles
    multiply in full fp32, not tf32."""
    if DOT:  # (scores unscaled; the scale and log2(e) in one multiply-add with the shift of exp2)
        prec: tl.constexpr = "ieee" if IEEE else "tf32"
        LOG2E: tl.constexpr = 1.4426950408889634
        s = tl.where(nmask[None, :], tl.dot(q, tl.trans(k), input_precision=prec), float("-inf"))  # (BG, BN)
        m_new = tl.maximum(m, tl.max(s, axis=1) * scale)
        m_ref = _finite_max(m_new, GUARD)
        alpha = tl.exp(m - m_ref)
        p = tl.exp2(s * (scale * LOG2E) - (m_ref * LOG2E)[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=prec)
        return m_new, l, acc
    k, v = k.to(tl.float32), v.to(tl.float32)
    if MHA:  # 2-D tiles keep the reductions cheap
        s = tl.where(nmask, tl.sum(k * q[None, :], axis=1), float("-inf"))  # (BN,)
        m_new = tl.maximum(m, tl.max(s, axis=0))
        m_ref = _finite_max(m_new, GUARD)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref)
        l = l * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
    else:
        s = tl.where(nmask[None, :], tl.sum(q[:, None, :] * k[None, :, :], axis=2), float("-inf"))  # (BG, BN)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_ref = _finite_max(m_new, GUARD)
        alpha = tl.exp(m - m_ref)
        p = tl.exp(s - m_ref[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l, acc


@triton.jit
def decode_split_kernel(
    Q, KN, VN, K, V, POS, SPAN, O_PART, M_PART, L_PART, OUT,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, spos,
    so_b, so_h, so_s, sm_b, sm_h, sout_b, sout_h,
    S, scale, chunk, D, P,
    n_rows, n_kv, n_splits,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT: tl.constexpr,
    HAS_SPAN: tl.constexpr, PDL: tl.constexpr = False, DOT: tl.constexpr = False, IEEE: tl.constexpr = False,
    PREFETCH: tl.constexpr = False, PERSISTENT: tl.constexpr = False,
):
    """One (row, kv head, split): the G query heads of the group over cache[start, start + chunk) up to pos.

    The new token (KN, VN) belongs at ``pos``: the split that holds ``pos`` writes it to the cache
    and takes it from registers; every split reads from memory only positions below ``pos``, so no
    program reads the slot being written. ``DIRECT`` (one split): the normalised output goes to OUT.
    ``HAS_SPAN``: of the prompt positions (below P) only SPAN[b] = [lo, hi) are read (caption
    padding); a tile may then hold no readable position, so the running max is guarded.
    ``PDL`` (``_pdl.py``): launched beside the previous launch's last programs, it waits for them first.
    (Loading the first tile before that wait made the batch-1 dense step slower, 1.105 -> 1.188 ms:
    BENCHMARKS run 11.) ``DOT``: the products on tensor cores (BLOCK_G >= 16; see :func:`_attend_tile`),
    positions in 32 bits. ``PREFETCH``: each pass of the loop issues the next tile's loads before it
    reduces the current tile (two tiles in registers), so loads and arithmetic overlap.
    ``PERSISTENT``: a 1-D grid of fewer programs than (row, kv head, split) triples, each taking triples
    ``pid, pid + programs, ...`` in the order of the 3-D grid (rows fastest), so that the kernel holds
    only part of the GPU (n_rows, n_kv, n_splits: the triples' extents; unused otherwise).
    """
    launch_next(PDL)
    wait_prior(PDL)
    if PERSISTENT:
        for w in range(tl.program_id(0), n_rows * n_kv * n_splits, tl.num_programs(0)):
            _split_work(Q, KN, VN, K, V, POS, SPAN, O_PART, M_PART, L_PART, OUT, sq_b, sq_h, skn_b, skn_h, svn_b,
                        svn_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, spos, so_b, so_h, so_s, sm_b, sm_h, sout_b, sout_h,
                        S, scale, chunk, D, P, w % n_rows, (w // n_rows) % n_kv, w // (n_rows * n_kv),
                        G, BLOCK_G, BLOCK_N, BLOCK_D, DIRECT, HAS_SPAN, DOT, IEEE, PREFETCH)
    else:
        _split_work(Q, KN, VN, K, V, POS, SPAN, O_PART, M_PART, L_PART, OUT, sq_b, sq_h, skn_b, skn_h, svn_b, svn_h,
                    sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, spos, so_b, so_h, so_s, sm_b, sm_h, sout_b, sout_h,
                    S, scale, chunk, D, P, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                    G, BLOCK_G, BLOCK_N, BLOCK_D, DIRECT, HAS_SPAN, DOT, IEEE, PREFETCH)


@triton.jit
def _split_work(
    Q, KN, VN, K, V, POS, SPAN, O_PART, M_PART, L_PART, OUT,
    sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, spos,
    so_b, so_h, so_s, sm_b, sm_h, sout_b, sout_h,
    S, scale, chunk, D, P,
    b, hk, sp,
    G: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DIRECT: tl.constexpr,
    HAS_SPAN: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr, PREFETCH: tl.constexpr,
):
    """The split kernel's work for one (row ``b``, kv head ``hk``, split ``sp``)."""
    pos = tl.load(POS + b * spos)
    if DOT:  # (32-bit positions: the dot build's loop 973 -> 701 instructions. Not in the default form: there
        pos = pos.to(tl.int32)  # ptxas then interleaves each load with its use, 31 % slower on the H200, run 13)
    lo = 0
    hi = 0
    if HAS_SPAN:
        lo = tl.load(SPAN + 2 * b)
        hi = tl.load(SPAN + 2 * b + 1)
    start = sp * chunk
    end = tl.minimum(tl.minimum(start + chunk, pos), S)  # read [start, end) from memory
    own = (pos >= start) & (pos < start + chunk) & (pos < S)  # this split holds the new token

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    gmask = offs_g < G
    dmask = offs_d < D
    heads = hk * G + offs_g
    k_base = K + b * sk_b + hk * sk_h
    v_base = V + b * sv_b + hk * sv_h
    q_raw = tl.load(Q + b * sq_b + heads[:, None] * sq_h + offs_d[None, :],
                    mask=gmask[:, None] & dmask[None, :], other=0.0)  # (BG, BD)
    q = (q_raw.to(tl.float32) * scale).to(tl.float32)  # scale may arrive as fp64 from torch.compile

    wmask = tl.where(own, dmask, False)  # (not `dmask & own`: the interpreter mistypes block & scalar)
    kn = tl.load(KN + b * skn_b + hk * skn_h + offs_d, mask=wmask, other=0.0)  # (BD,)
    vn = tl.load(VN + b * svn_b + hk * svn_h + offs_d, mask=wmask, other=0.0)

    MHA: tl.constexpr = BLOCK_G == 1
    if MHA:  # one query vector: scalar max and sum, (BD,) accumulator
        qt = tl.sum(q, axis=0)  # (BD,)
        m = tl.max(tl.full((BLOCK_N,), float("-inf"), tl.float32), axis=0)
        l = tl.sum(tl.zeros((BLOCK_N,), tl.float32), axis=0)
        acc = tl.zeros((BLOCK_D,), tl.float32)
    else:
        qt = q_raw if DOT else q
        m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    if PREFETCH:  # each pass loads the next tile before it attends over this one (past the end: all masked)
        nmask = _tile_mask(start + offs_n, end, lo, hi, P, HAS_SPAN)
        k, v = _load_tile(k_base, v_base, start + offs_n, nmask, sk_s, sv_s, offs_d, dmask)
        for n_start in range(start + BLOCK_N, end + BLOCK_N, BLOCK_N):
            n = n_start + offs_n
            nmask_next = _tile_mask(n, end, lo, hi, P, HAS_SPAN)
            k_next, v_next = _load_tile(k_base, v_base, n, nmask_next, sk_s, sv_s, offs_d, dmask)
            m, l, acc = _attend_tile(k, v, nmask, qt, m, l, acc, HAS_SPAN, MHA, DOT, tl.cast(scale, tl.float32), IEEE)
            k, v, nmask = k_next, v_next, nmask_next
    else:
        for n_start in range(start, end, BLOCK_N):
            n = n_start + offs_n
            nmask = _tile_mask(n, end, lo, hi, P, HAS_SPAN)
            k, v = _load_tile(k_base, v_base, n, nmask, sk_s, sv_s, offs_d, dmask)
            m, l, acc = _attend_tile(k, v, nmask, qt, m, l, acc, HAS_SPAN, MHA, DOT, tl.cast(scale, tl.float32),
                                     IEEE)
    if MHA:  # (back to the group's shapes)
        m = tl.zeros((BLOCK_G,), tl.float32) + m
        l = tl.zeros((BLOCK_G,), tl.float32) + l
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32) + acc[None, :]

    # the new token, from registers (only in the split that holds pos); written after every read,
    # so a read of its slot from memory would see the old (in tests: poisoned) entry
    tl.store(k_base + pos * sk_s + offs_d, kn, mask=wmask)
    tl.store(v_base + pos * sv_s + offs_d, vn, mask=wmask)
    s_new = tl.where(own, tl.sum(q * kn.to(tl.float32)[None, :], axis=1), float("-inf"))  # (BG,)
    m_new = tl.maximum(m, s_new)
    m_ref = tl.maximum(m_new, -1e30)  # finite: an empty split (m = s_new = -inf) stays empty, not NaN
    alpha = tl.exp(m - m_ref)
    p_new = tl.exp(s_new - m_ref)
    l = l * alpha + p_new
    acc = acc * alpha[:, None] + p_new[:, None] * vn.to(tl.float32)[None, :]
    m = m_new

    hd_mask = gmask[:, None] & dmask[None, :]
    if DIRECT:
        out = acc / l[:, None]
        tl.store(OUT + b * sout_b + heads[:, None] * sout_h + offs_d[None, :], out.to(OUT.dtype.element_ty),
                 mask=hd_mask)
    else:
        tl.store(O_PART + b * so_b + heads[:, None] * so_h + sp * so_s + offs_d[None, :], acc, mask=hd_mask)
        tl.store(M_PART + b * sm_b + heads * sm_h + sp, m, mask=gmask)
        tl.store(L_PART + b * sm_b + heads * sm_h + sp, l, mask=gmask)


@triton.jit
def _combine(O_PART, M_PART, L_PART, OUT, b, heads, hmask, so_b, so_h, so_s, sm_b, sm_h, sout_b, sout_h,
             splits, D, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Merge the splits of row ``b``'s ``heads`` (BH,) by their log-sum-exp weights into OUT."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = hmask[:, None] & (offs_s < splits)[None, :]  # (BH, BS)
    ml_off = b * sm_b + heads[:, None] * sm_h + offs_s[None, :]
    m = tl.load(M_PART + ml_off, mask=smask, other=float("-inf"))
    l = tl.load(L_PART + ml_off, mask=smask, other=0.0)
    m_max = tl.max(m, axis=1)
    w = tl.where(l > 0, tl.exp(m - m_max[:, None]), tl.zeros_like(l))  # empty splits (m = -inf) weigh nothing
    acc = tl.load(O_PART + b * so_b + heads[:, None, None] * so_h + offs_s[None, :, None] * so_s
                  + offs_d[None, None, :], mask=smask[:, :, None] & (offs_d < D)[None, None, :], other=0.0)
    out = tl.sum(acc * w[:, :, None], axis=1) / tl.sum(l * w, axis=1)[:, None]  # (BH, BD)
    tl.store(OUT + b * sout_b + heads[:, None] * sout_h + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=hmask[:, None] & (offs_d < D)[None, :])


@triton.jit
def combine_kernel(
    O_PART, M_PART, L_PART, OUT,
    so_b, so_h, so_s, sm_b, sm_h, sout_b, sout_h,
    splits, D,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge the splits of one (row, head) by their log-sum-exp weights (``PDL`` as the split kernel)."""
    launch_next(PDL)
    wait_prior(PDL)
    heads = tl.program_id(1) + tl.arange(0, 1)
    _combine(O_PART, M_PART, L_PART, OUT, tl.program_id(0), heads, heads >= 0, so_b, so_h, so_s, sm_b, sm_h,
             sout_b, sout_h, splits, D, BLOCK_S, BLOCK_D)
