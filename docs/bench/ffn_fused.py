"""Experiment (run 32): the whole SwiGLU feed-forward of a batch-1 decode step in one launch.

Result (BENCHMARKS run 32, H200): it loses at every setting, 1.6-12x the engine's two launches per block
(the atomics of many programs into the same 2 x 1280 outputs contend), and the engine step with it built
in (commit 5533517, since reverted) went 1.111 -> 2.194 ms at batch 1. Kept as the record of the idea.

The engine's latency mode runs a block's feed-forward as two matrix-vector launches
(``arsparse/models/matvec_blocks.py``): RMSNorm + w1 and w3 + SiLU * gate, then w2. w2 reduces over the
hidden units the first launch spreads over its programs, so the second launch waits for the whole of
the first. Here program p takes hidden units [p * BLOCK_R, + BLOCK_R): the RMSNorm of the block's
input, its rows of w1 and w3, the gate g (M, BLOCK_R), then its BLOCK_R columns of w2 times g, added
into an fp32 output (M, dim) with atomics: a split of w2's reduction over the programs, with no grid
barrier. The output must start at zero; program p also zeroes a slice of a second buffer (the one the
next block's launch adds into, read by this block's first launch, which has finished by then), so two
buffers in turn serve every block without a memset launch. The sum's order varies (atomics): the
result is not bitwise reproducible.

    PYTHONPATH=. python3 docs/bench/ffn_fused.py [--check] [--out FILE]

prints microseconds per block for a chain of 20 blocks captured in one CUDA graph (each block its own
weights, so that the L2 cache holds none of them; with PDL as the engine launches): the engine's
wo + (w1, w3) + w2 launches against wo + each fused setting, beside the floor (the four weights'
bytes over the copy bandwidth). ``--check`` (also in the interpreter) compares each setting with the
PyTorch composition ``arsparse.models.gpt.swiglu(rms_norm(h))``.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from arsparse.kernels.triton._pdl import launch_next, pdl_args, wait_prior


@triton.jit
def ffn_kernel(H, NW, W1, W3, W2, ACC, ZERO, M, NH, n_zero, sh_m, sw1, sw3, sw2_r, sw2_n, sacc_m, eps,
               DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_Z: tl.constexpr, PDL: tl.constexpr = False):
    """ACC (M, DIM) += g[:, r] @ W2[:, r].T for this program's hidden units r, where
    g = silu(xn @ W1[r].T) * (xn @ W3[r].T) and xn = rms_norm(H) (M <= BLOCK_M rows); ZERO's
    elements [pid * BLOCK_Z, + BLOCK_Z) (of n_zero, contiguous) set to 0."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    mmask = rm < M
    rr = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rr < NH
    rk = tl.arange(0, BLOCK_K)
    launch_next(PDL)
    kmask0 = rk < DIM  # the first chunk of w1 and w3 asked for before the wait, as the engine's kernel does
    w1_0 = tl.load(W1 + rr[:, None] * sw1 + rk[None, :], mask=rmask[:, None] & kmask0[None, :], other=0.0)
    w3_0 = tl.load(W3 + rr[:, None] * sw3 + rk[None, :], mask=rmask[:, None] & kmask0[None, :], other=0.0)
    wait_prior(PDL)
    rz = pid * BLOCK_Z + tl.arange(0, BLOCK_Z)
    tl.store(ZERO + rz, tl.zeros((BLOCK_Z,), tl.float32), mask=rz < n_zero)
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


def ffn(h: torch.Tensor, norm_w: torch.Tensor, eps: float, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
        acc: torch.Tensor, zero: torch.Tensor | None = None, block_r: int = 16, block_k: int = 256,
        num_warps: int = 4) -> torch.Tensor:
    """acc (M, dim) fp32, zero on entry, += swiglu(rms_norm(h)) for h (M, dim); w1, w3 (hidden, dim);
    w2 (dim, hidden) with any strides (row- or column-major). ``zero``: a contiguous fp32 buffer set to 0."""
    M, dim = h.shape
    NH = w1.shape[0]
    if w1.shape != (NH, dim) or w3.shape != (NH, dim) or w2.shape != (dim, NH) or acc.shape != (M, dim):
        raise ValueError(f"shapes: h {tuple(h.shape)}, w1 {tuple(w1.shape)}, w3 {tuple(w3.shape)}, "
                         f"w2 {tuple(w2.shape)}, acc {tuple(acc.shape)}")
    if acc.dtype != torch.float32 or acc.stride(1) != 1 or w1.stride(1) != 1 or w3.stride(1) != 1:
        raise ValueError("acc must be fp32 and acc, w1, w3 must have unit last strides")
    zero = acc if zero is None else zero
    if zero.dtype != torch.float32 or not zero.is_contiguous():
        raise ValueError("zero must be a contiguous fp32 tensor")
    grid = triton.cdiv(NH, block_r)
    n_zero = 0 if zero is acc else zero.numel()
    ffn_kernel[(grid,)](h, norm_w, w1, w3, w2, acc, zero, M, NH, n_zero, h.stride(0), w1.stride(0), w3.stride(0),
                        w2.stride(1), w2.stride(0), acc.stride(0), float(eps), DIM=dim,
                        BLOCK_M=triton.next_power_of_2(M), BLOCK_R=block_r, BLOCK_K=block_k,
                        BLOCK_Z=max(16, triton.next_power_of_2(triton.cdiv(n_zero, grid))),
                        num_warps=num_warps, **pdl_args(h.device))
    return acc


def reference(h, norm_w, eps, w1, w3, w2):
    from arsparse.models.gpt import rms_norm, swiglu
    return swiglu(rms_norm(h, norm_w, eps), w1, w3, w2)


#: (block_r, block_k, num_warps, w2 by columns)
SETTINGS = [(16, 256, 4, 1), (32, 256, 4, 1), (8, 256, 4, 1), (64, 256, 8, 1), (16, 256, 8, 1), (16, 256, 4, 0)]


def _key(s) -> str:
    return "r{} k{} w{} {}".format(s[0], s[1], s[2], "cols" if s[3] else "rows")


def check(dev, dtype, shapes, settings, tol) -> None:
    g = torch.Generator().manual_seed(1)
    for M, dim, NH in shapes:
        h = torch.randn(M, dim, generator=g).to(dev, dtype)
        nw = (1 + 0.1 * torch.randn(dim, generator=g)).to(dev, dtype)
        w1, w3 = ((torch.randn(NH, dim, generator=g) / dim**0.5).to(dev, dtype) for _ in range(2))
        w2 = (torch.randn(dim, NH, generator=g) / NH**0.5).to(dev, dtype)
        want = reference(h, nw, 1e-5, w1, w3, w2).float()
        for br, bk, nwarps, by_cols in settings:
            print("check", (M, dim, NH), _key((br, bk, nwarps, by_cols)), flush=True)
            w2s = w2.t().contiguous().t() if by_cols else w2
            acc = torch.zeros(M, dim, device=dev)
            other = torch.full((M, dim), float("nan"), device=dev)
            got = ffn(h, nw, 1e-5, w1, w3, w2s, acc, zero=other, block_r=br, block_k=bk, num_warps=nwarps)
            err = (got.to(dtype).float() - want).abs().max().item()
            assert err <= tol * want.abs().max().item(), ((M, dim, NH), _key((br, bk, nwarps, by_cols)), err)
            assert bool((other == 0).all()), "the second buffer was not zeroed"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare each setting with the PyTorch composition first")
    ap.add_argument("--out", default=None, help="JSON of every time")
    args = ap.parse_args()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cpu" if interp else "cuda"
    dtype = torch.float32 if interp else torch.bfloat16
    if args.check:
        if interp:
            check(dev, dtype, [(2, 96, 80), (3, 64, 48)], [(16, 32, 4, 1), (8, 64, 4, 0)], 1e-5)
        else:
            check(dev, dtype, [(2, 1280, 3584)], SETTINGS, 2e-2)  # (each shape a compile per setting: minutes)
        print("check: every setting matches the PyTorch composition")
    if interp:
        return
    from arsparse.bench import copy_bandwidth, graph_call_us
    from arsparse.kernels.triton.matvec import matvec
    bw = copy_bandwidth(torch.device("cuda"))
    M, dim, NH, eps, n = 2, 1280, 3584, 1e-5, 20  # GPT-XL at batch 1 with guidance
    attn, x = (torch.randn(M, dim, device=dev, dtype=dtype) for _ in range(2))
    nw = torch.ones(dim, device=dev, dtype=dtype)
    blocks = [dict(wo=torch.randn(dim, dim, device=dev, dtype=dtype) / dim**0.5,
                   w1=torch.randn(NH, dim, device=dev, dtype=dtype) / dim**0.5,
                   w3=torch.randn(NH, dim, device=dev, dtype=dtype) / dim**0.5,
                   w2=torch.randn(dim, NH, device=dev, dtype=dtype) / NH**0.5) for _ in range(n)]
    for b in blocks:
        b["w2t"] = b["w2"].t().contiguous().t()
    accs = [torch.zeros(M, dim, device=dev) for _ in range(2)]
    floor_us = (dim * dim + 3 * NH * dim) * 2 / bw * 1e6

    def engine(i, with_wo=True):
        b = blocks[i]
        h = matvec(attn, b["wo"], residual=x) if with_wo else x
        return matvec(matvec(h, b["w1"], norm=(nw, eps), w_up=b["w3"]), b["w2"])

    def fused(i, s, with_wo=True):
        b = blocks[i]
        h = matvec(attn, b["wo"], residual=x) if with_wo else x
        return ffn(h, nw, eps, b["w1"], b["w3"], b["w2t"] if s[3] else b["w2"], accs[i % 2], zero=accs[1 - i % 2],
                   block_r=s[0], block_k=s[1], num_warps=s[2])

    def save():  # (after every row: a run cut short still returns what it timed)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                               copy_gb_s=bw / 1e9, floor_us=floor_us, rows=rows), f, indent=1)

    rows = [dict(setting="engine", with_wo=graph_call_us(engine),
                 ffn_only=graph_call_us(lambda i: engine(i, False)))]
    print(f"floor {floor_us:.2f} us a block (wo + w1 + w3 + w2); engine {rows[0]['with_wo']:.2f}", flush=True)
    save()
    for s in SETTINGS:
        try:
            rows.append(dict(setting=_key(s), with_wo=graph_call_us(lambda i: fused(i, s)),
                             ffn_only=graph_call_us(lambda i: fused(i, s, False))))
        except Exception as e:  # (a setting that does not compile or fit)
            print(_key(s), type(e).__name__, str(e)[:160])
            continue
        print(f"{_key(s)}: {rows[-1]['with_wo']:.2f}", flush=True)
        save()
    print(f"| setting | wo + feed-forward, us a block | feed-forward alone | (floor {floor_us:.2f} us with wo) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['setting']} | {r['with_wo']:.2f} | {r['ffn_only']:.2f} | {r['with_wo'] / floor_us:.2f}x |")


if __name__ == "__main__":
    main()
