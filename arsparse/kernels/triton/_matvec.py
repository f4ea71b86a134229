"""Triton body of the small-batch projection ``y = op(x) @ W.T`` (launch in ``matvec.py``).

A decode step at batch 1 (2 rows with guidance) is a chain of matrix-vector products whose weights
are read once each; cuBLAS runs them at about a third of the copy bandwidth and each element-wise
op between them is a launch of its own (BENCHMARKS.md run 7). This kernel streams one block of
BLOCK_N weight rows per program and folds the ops around the product into it:

- ``HAS_F``: the input is ``x + f`` (the previous block's residual add); program 0 stores that sum
  to XS (the residual stream the block returns).
- ``HAS_NORM``: RMSNorm of the input first (a first pass over the rows for their mean square;
  ``ONE_CHUNK``, a row in one chunk: the weight tile is loaded first, then the input once).
- ``GLU``: a second weight W3 at the same rows: ``y = silu(x @ W.T) * (x @ W3.T)`` (SwiGLU's w1, w3).
- ``HAS_RES``: ``y = res + x @ W.T``.
- ``HAS_ROPE``: columns below ``rope_hi`` are rotated in interleaved pairs by the table (rows,
  D/2, 2) of cos/sin (q and k of a fused wqkv projection; pairs never straddle a block: BLOCK_N and
  the head size are even).
- ``PDL`` (``_pdl.py``): launched early beside the previous launch's last programs, a program asks for
  its weights (and RoPE table) and only then waits for the previous launch's output.

Roundings follow the PyTorch composition (``arsparse.models.gpt``): the product in fp32, rounded to
the input's dtype, then each op in fp32 and rounded again where PyTorch rounds.
"""
import triton
import triton.language as tl

from ._pdl import launch_next, wait_prior


@triton.jit
def _input(X, F, rm, kk, mask, sx_m, sf_m, HAS_F: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) input tile: x, or x + f in x's dtype."""
    x = tl.load(X + rm[:, None] * sx_m + kk[None, :], mask=mask, other=0.0)
    if HAS_F:
        x = (x.to(tl.float32) + tl.load(F + rm[:, None] * sf_m + kk[None, :], mask=mask, other=0.0).to(tl.float32)
             ).to(x.dtype)
    return x


@triton.jit
def _normed(x, rstd, NW, kk, kmask):
    """As rms_norm: x normalised in fp32 by rstd (BM,), rounded, times the weight (rounded)."""
    nw = tl.load(NW + kk, mask=kmask, other=0.0)
    return ((x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32) * nw.to(tl.float32)[None, :]).to(x.dtype)


@triton.jit
def matvec_kernel(X, F, NW, W, W3, RES, ROPE, Y, XS,
                  M, N, K, sx_m, sf_m, sw_n, sw3_n, sres_m, srope_m, sy_m, sxs_m, eps, rope_hi, head_dim,
                  HAS_F: tl.constexpr, HAS_NORM: tl.constexpr, GLU: tl.constexpr, HAS_RES: tl.constexpr,
                  HAS_ROPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, ONE_CHUNK: tl.constexpr = False, PDL: tl.constexpr = False):
    """Columns [pid * BLOCK_N, + BLOCK_N) of y for all M (<= BLOCK_M) rows: each weight tile is read
    once and multiplied into every row (a (BM, BN, BK) product summed over BK)."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rk = tl.arange(0, BLOCK_K)
    launch_next(PDL)
    # what no kernel of the step writes (PDL: before the wait, beside the previous launch's last programs)
    if HAS_ROPE:  # the cos/sin of each interleaved pair (2j, 2j + 1) of a head
        col = pid * BLOCK_N + 2 * tl.arange(0, BLOCK_N // 2)  # the pair's first column
        pair = (col % head_dim) // 2
        tmask = mmask[:, None] & (col < rope_hi)[None, :]
        t_off = rm[:, None] * srope_m + 2 * pair[None, :]
        cos = tl.load(ROPE + t_off, mask=tmask, other=1.0)  # (BM, BN/2)
        sin = tl.load(ROPE + t_off + 1, mask=tmask, other=0.0)
    if ONE_CHUNK:  # the whole row in one chunk: the weights are asked for first, the input read once
        kmask = rk < K
        wmask = nmask[:, None] & kmask[None, :]
        w = tl.load(W + rn[:, None] * sw_n + rk[None, :], mask=wmask, other=0.0)  # (BN, BK)
        if GLU:
            w3 = tl.load(W3 + rn[:, None] * sw3_n + rk[None, :], mask=wmask, other=0.0)
    wait_prior(PDL)
    if HAS_RES:  # the epilogue's operand, asked for before the product waits on anything
        res = tl.load(RES + rm[:, None] * sres_m + rn[None, :], mask=mmask[:, None] & nmask[None, :], other=0.0)
    if ONE_CHUNK:
        mask = mmask[:, None] & kmask[None, :]
        x = _input(X, F, rm, rk, mask, sx_m, sf_m, HAS_F)  # (BM, BK)
        if HAS_F:
            tl.store(XS + rm[:, None] * sxs_m + rk[None, :], x, mask=tl.where(pid == 0, mask, False))
        if HAS_NORM:
            xf = x.to(tl.float32)
            x = _normed(x, 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / K + eps), NW, rk, kmask)
        xf = x.to(tl.float32)[:, None, :]  # (BM, 1, BK): a few rows, so FMAs, not tensor-core tiles
        acc = tl.sum(xf * w.to(tl.float32)[None, :, :], axis=2)
        if GLU:
            acc3 = tl.sum(xf * w3.to(tl.float32)[None, :, :], axis=2)
    else:
        if HAS_NORM:  # the rows' mean squares (the rows are a few KB: this pass reads them from cache)
            ss = tl.zeros((BLOCK_M,), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                mask = mmask[:, None] & (kk < K)[None, :]
                x = _input(X, F, rm, kk, mask, sx_m, sf_m, HAS_F).to(tl.float32)
                ss += tl.sum(x * x, axis=1)
            rstd = 1.0 / tl.sqrt(ss / K + eps)  # (BM,)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            kmask = kk < K
            mask = mmask[:, None] & kmask[None, :]
            x = _input(X, F, rm, kk, mask, sx_m, sf_m, HAS_F)  # (BM, BK)
            if HAS_F:
                tl.store(XS + rm[:, None] * sxs_m + kk[None, :], x, mask=tl.where(pid == 0, mask, False))
            if HAS_NORM:
                x = _normed(x, rstd, NW, kk, kmask)
            wmask = nmask[:, None] & kmask[None, :]
            w = tl.load(W + rn[:, None] * sw_n + kk[None, :], mask=wmask, other=0.0)  # (BN, BK)
            xf = x.to(tl.float32)[:, None, :]
            acc += tl.sum(xf * w.to(tl.float32)[None, :, :], axis=2)
            if GLU:
                w3 = tl.load(W3 + rn[:, None] * sw3_n + kk[None, :], mask=wmask, other=0.0)
                acc3 += tl.sum(xf * w3.to(tl.float32)[None, :, :], axis=2)
    out_dtype = Y.dtype.element_ty
    y = acc.to(out_dtype).to(tl.float32)  # (BM, BN): the product as F.linear returns it
    if GLU:  # silu(a) rounded, times b, rounded
        s = (y / (1.0 + tl.exp(-y))).to(out_dtype).to(tl.float32)
        y = s * acc3.to(out_dtype).to(tl.float32)
    if HAS_RES:
        y += res.to(tl.float32)
    if HAS_ROPE:  # a * cos - b * sin, b * cos + a * sin
        a, b = tl.split(tl.reshape(y, (BLOCK_M, BLOCK_N // 2, 2)))  # (BM, BN/2) each
        y = tl.reshape(tl.join(a * cos - b * sin, b * cos + a * sin), (BLOCK_M, BLOCK_N))
    tl.store(Y + rm[:, None] * sy_m + rn[None, :], y.to(out_dtype), mask=mmask[:, None] & nmask[None, :])
