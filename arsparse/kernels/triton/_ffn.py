"""Triton body of a decode step's whole SwiGLU feed-forward in one launch, for a few rows (launch:
``matvec.ffn``).

The two-launch form (``matvec`` with ``w_up``, then ``matvec`` of w2) makes w2 wait for every program of
the first launch, since w2 reduces over the hidden units the first launch spreads over its programs.
Here program p takes hidden units ``r`` in [p * BLOCK_R, + BLOCK_R): the RMSNorm of its input, its rows of
w1 and w3, the gate ``g = silu(xn @ W1[r].T) * (xn @ W3[r].T)`` (M, BLOCK_R), then ``g @ W2[:, r].T``
added into an fp32 output (M, DIM) by atomics: w2's reduction split over the programs, with no barrier
between the halves. The output must be zero on entry (the wo launch before it zeroes it: ``matvec``'s
``zero``). The order of the sum varies from run to run (atomics), so the result is not bitwise
reproducible; its rounding otherwise follows the PyTorch composition up to w2's product, which stays in
fp32 (the consumer rounds it to the model's dtype: ``_matvec._input``).
"""
import triton
import triton.language as tl

from ._pdl import launch_next, wait_prior


@triton.jit
def ffn_kernel(H, NW, W1, W3, W2, ACC, M, NH, sh_m, sw1, sw3, sw2_r, sw2_n, sacc_m, eps,
               DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
               PDL: tl.constexpr = False):
    """ACC (M, DIM) += g[:, r] @ W2[:, r].T for this program's hidden units r (M <= BLOCK_M rows)."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    rr = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rr < NH
    rk = tl.arange(0, BLOCK_K)
    launch_next(PDL)
    kmask0 = rk < DIM  # the first chunk of w1 and w3 asked for before the wait (weights: no kernel writes them)
    w1_0 = tl.load(W1 + rr[:, None] * sw1 + rk[None, :], mask=rmask[:, None] & kmask0[None, :], other=0.0)
    w3_0 = tl.load(W3 + rr[:, None] * sw3 + rk[None, :], mask=rmask[:, None] & kmask0[None, :], other=0.0)
    wait_prior(PDL)
    dt = H.dtype.element_ty
    ss = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in tl.static_range(0, DIM, BLOCK_K):  # the rows' mean squares (a few KB, from the L2)
        kk = k0 + rk
        x = tl.load(H + rm[:, None] * sh_m + kk[None, :], mask=mmask[:, None] & (kk < DIM)[None, :], other=0.0)
        x = x.to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    rstd = 1.0 / tl.sqrt(ss / DIM + eps)  # (BM,)
    a = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    b = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    for k0 in tl.static_range(0, DIM, BLOCK_K):
        kk = k0 + rk
        kmask = kk < DIM
        x = tl.load(H + rm[:, None] * sh_m + kk[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
        nw = tl.load(NW + kk, mask=kmask, other=0.0)
        xn = ((x.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32) * nw.to(tl.float32)[None, :]).to(dt)
        xn = xn.to(tl.float32)[:, None, :]  # (BM, 1, BK)
        if k0 == 0:
            w1, w3 = w1_0, w3_0
        else:
            wmask = rmask[:, None] & kmask[None, :]
            w1 = tl.load(W1 + rr[:, None] * sw1 + kk[None, :], mask=wmask, other=0.0)  # (BR, BK)
            w3 = tl.load(W3 + rr[:, None] * sw3 + kk[None, :], mask=wmask, other=0.0)
        a += tl.sum(xn * w1.to(tl.float32)[None, :, :], axis=2)
        b += tl.sum(xn * w3.to(tl.float32)[None, :, :], axis=2)
    a = a.to(dt).to(tl.float32)  # as F.linear returns them, then silu(a) rounded, times b, rounded
    g = ((a / (1.0 + tl.exp(-a))).to(dt).to(tl.float32) * b.to(dt).to(tl.float32)).to(dt).to(tl.float32)
    for n0 in tl.static_range(0, DIM, BLOCK_K):
        nn = n0 + rk
        nmask = nn < DIM
        w2 = tl.load(W2 + rr[:, None] * sw2_r + nn[None, :] * sw2_n, mask=rmask[:, None] & nmask[None, :], other=0.0)
        part = tl.sum(g[:, :, None] * w2.to(tl.float32)[None, :, :], axis=1)  # (BM, BK)
        tl.atomic_add(ACC + rm[:, None] * sacc_m + nn[None, :], part, mask=mmask[:, None] & nmask[None, :],
                      sem="relaxed")
