"""Experiment (run 30): the batch-1 projection with its weights streamed through TMA, pipelined.

The engine's matrix-vector kernel (``arsparse/kernels/triton/_matvec.py``) loads each program's
weight tile into registers with ordinary loads: one tile in flight per program, a wave or two of
programs per launch (BENCHMARKS run 28's counters). Here a program takes TILES blocks of BLOCK_N
weight rows in turn, each as boxes of (BLOCK_N, 128) through a host TMA descriptor, and Triton's loop
pipeliner keeps STAGES boxes in flight in shared memory. (Run 30's first form, whole rows as one box
of a (N, K / 128, 128) view, was 4-5x slower than the engine's kernel.) Plain ``y = x @ W.T`` only:
if it wins on the GPT-XL shapes, the ops the engine folds in come next.

    PYTHONPATH=. python3 docs/bench/matvec_tma.py [--check] [--out FILE]

prints, per shape, the engine kernel's, cuBLAS's and each setting's microseconds per launch (20
launches captured in one CUDA graph, each on its own copy of the weight so that the L2 cache holds
none of them, the graph launched 50 times), against the floor: the weight's bytes over the copy
bandwidth.
``--check`` (also in the interpreter) compares each setting's output with F.linear.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from arsparse.kernels.triton._pdl import launch_next, pdl_args, wait_prior

CHUNK = tl.constexpr(128)  # a box's columns (a TMA box is at most 256 elements a dimension)


@triton.jit
def tma_matvec_kernel(X, w_desc, Y, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KC: tl.constexpr,
                      TILES: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr = False):
    """Columns [pid * TILES * BLOCK_N, + TILES * BLOCK_N) of y = x @ W.T for M <= BLOCK_M rows: one
    loop over (block, chunk of 128 columns), KC chunks a row, each chunk's (BLOCK_N, 128) box by TMA."""
    pid = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, CHUNK)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    launch_next(PDL)  # as the engine's kernel (the loop's first boxes are not asked for before the wait)
    wait_prior(PDL)
    for i in tl.range(0, TILES * KC, num_stages=STAGES):
        t = i // KC
        c = i - t * KC
        n0 = (pid * TILES + t) * BLOCK_N
        w = w_desc.load([n0, c * CHUNK]).to(tl.float32)  # (BN, 128); rows past N read as 0
        x = tl.load(X + rm[:, None] * K + c * CHUNK + rk[None, :], mask=(rm < M)[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)  # (BM, BN)
        if c == KC - 1:
            rn = n0 + tl.arange(0, BLOCK_N)
            tl.store(Y + rm[:, None] * N + rn[None, :], acc.to(Y.dtype.element_ty),
                     mask=(rm < M)[:, None] & (rn < N)[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)


def _desc(w: torch.Tensor, block_n: int) -> TensorDescriptor:
    N, K = w.shape
    return TensorDescriptor(w, shape=[N, K], strides=[K, 1], block_shape=[block_n, CHUNK.value])


def tma_matvec(x: torch.Tensor, w: torch.Tensor, block_n: int = 4, tiles: int = 2, stages: int = 3,
               num_warps: int = 4, desc: TensorDescriptor | None = None) -> torch.Tensor:
    """x (M, K) @ w.T (N, K); K a multiple of 128."""
    M, K = x.shape
    N = w.shape[0]
    if K % CHUNK.value:
        raise ValueError(f"K={K} must be a multiple of {CHUNK.value}")
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    tma_matvec_kernel[(triton.cdiv(N, block_n * tiles),)](x, desc or _desc(w, block_n), y, M, N, K,
                                                          BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n,
                                                          KC=K // CHUNK.value, TILES=tiles, STAGES=stages,
                                                          num_warps=num_warps, **pdl_args(x.device))
    return y


#: GPT-XL's projections at batch 1 with guidance (2 rows): (name, N, K); w1/w3 as one (7,168, 1,280).
SHAPES = [("wqkv", 3840, 1280), ("wo", 1280, 1280), ("w1+w3", 7168, 1280), ("w2", 1280, 3584), ("head", 16384, 1280)]
SETTINGS = [dict(block_n=bn, tiles=t, stages=s, num_warps=nw) for bn, t, s, nw in
            [(4, 1, 4, 4), (4, 1, 8, 4), (4, 2, 6, 4), (8, 1, 4, 4), (8, 1, 8, 4), (8, 2, 6, 4), (16, 1, 4, 4),
             (16, 1, 8, 8), (16, 2, 8, 4), (32, 1, 6, 4), (2, 2, 8, 4), (4, 4, 8, 4)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare each setting with F.linear first")
    ap.add_argument("--out", default=None, help="JSON of every time")
    args = ap.parse_args()
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    dev = "cpu" if interp else "cuda"
    dtype = torch.float32 if interp else torch.bfloat16
    g = torch.Generator().manual_seed(0)
    if args.check:
        for N, K in ((37, 256), (64, 384)) if interp else [(n, k) for _, n, k in SHAPES]:
            x = torch.randn(2, K, generator=g).to(dev, dtype)
            w = (torch.randn(N, K, generator=g) / K**0.5).to(dev, dtype)
            want = F.linear(x.float(), w.float())
            for cfg in SETTINGS[:4] if interp else SETTINGS:
                got = tma_matvec(x, w, **cfg).float()
                err = (got - want).abs().max().item()
                assert err < (1e-4 if interp else 3e-2), (N, K, cfg, err)
        print("check: every setting matches F.linear")
    if interp:
        return
    from arsparse.kernels.triton.matvec import matvec
    from arsparse.bench import copy_bandwidth, graph_call_us
    bw = copy_bandwidth(torch.device("cuda"))
    rows = []
    for name, N, K in SHAPES:
        x = torch.randn(2, K, device=dev, dtype=dtype)
        ws = [torch.randn(N, K, device=dev, dtype=dtype) / K**0.5 for _ in range(20)]  # (20 x the L2 or more)
        floor_us = N * K * 2 / bw * 1e6
        times = {"engine": graph_call_us(lambda i: matvec(x, ws[i])),
                 "cublas": graph_call_us(lambda i: F.linear(x, ws[i]))}
        for cfg in SETTINGS:
            descs = [_desc(w, cfg["block_n"]) for w in ws]
            key = "bn{block_n} t{tiles} s{stages} w{num_warps}".format(**cfg)
            try:
                times[key] = graph_call_us(lambda i: tma_matvec(x, ws[i], desc=descs[i], **cfg))
            except Exception as e:  # (a setting that does not fit shared memory)
                times[key] = None
                print(name, key, type(e).__name__, str(e)[:120])
        rows.append(dict(shape=name, N=N, K=K, floor_us=floor_us, us=times))
        best = min((v, k) for k, v in times.items() if v is not None)
        print(f"{name}: floor {floor_us:.2f} us; engine {times['engine']:.2f}, cublas {times['cublas']:.2f}, "
              f"best {best[1]} {best[0]:.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           copy_gb_s=bw / 1e9, rows=rows), f, indent=1)
    keys = list(rows[0]["us"])
    print("| setting | " + " | ".join(r["shape"] for r in rows) + " | sum |")
    print("|---|" + "---|" * (len(rows) + 1))
    print("| floor | " + " | ".join(f"{r['floor_us']:.2f}" for r in rows) + f" | {sum(r['floor_us'] for r in rows):.2f} |")
    for k in keys:
        vals = [r["us"][k] for r in rows]
        tot = sum(vals) if None not in vals else None
        print(f"| {k} | " + " | ".join("-" if v is None else f"{v:.2f}" for v in vals) +
              f" | {'-' if tot is None else f'{tot:.2f}'} |")


if __name__ == "__main__":
    main()
