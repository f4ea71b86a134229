"""Experiment (run 32): the whole SwiGLU feed-forward of a batch-1 decode step in one launch.

The engine's latency mode runs a block's feed-forward as two matrix-vector launches by default
(``arsparse/models/matvec_blocks.py``): RMSNorm + w1 and w3 + SiLU * gate, then w2, which waits for the
whole of the first. ``matvec.ffn`` (``arsparse/kernels/triton/_ffn.py``; the engine's
``matvec.ffn_block_r`` launch setting) runs it as one: each program its hidden units through w1, w3 and
its columns of w2, the products added into an fp32 output by atomics, which the wo launch before it
zeroes.

    PYTHONPATH=. python3 docs/bench/ffn_fused.py [--check] [--out FILE]

prints microseconds per block for a chain of 20 blocks captured in one CUDA graph (each block its own
weights, so that the L2 cache holds none of them; with PDL as the engine launches): the engine's
wo + (w1, w3) + w2 launches against wo + the one launch at each setting (hidden units a program, chunk,
warps, and w2 as the model holds it, "rows", or stored transposed, "cols"), beside the floor (the four
weights' bytes over the copy bandwidth). ``--check`` first compares each setting with the PyTorch
composition ``gpt.swiglu(gpt.rms_norm(h))`` (the tests do the same in the interpreter).
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from arsparse.kernels.triton.matvec import ffn, matvec
from arsparse.models.gpt import rms_norm, swiglu

#: (ffn_block_r, ffn_block_k, num_warps, w2 stored transposed)
SETTINGS = [(16, 256, 4, 1), (32, 256, 4, 1), (8, 256, 4, 1), (64, 256, 8, 1), (16, 256, 8, 1), (16, 256, 4, 0),
            (32, 128, 4, 0)]


def _key(s) -> str:
    return "r{} k{} w{} {}".format(s[0], s[1], s[2], "cols" if s[3] else "rows")


def _launch(s) -> dict:
    return dict(ffn_block_r=s[0], ffn_block_k=s[1], num_warps=s[2])


def check(dtype, M, dim, NH, tol) -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(M, dim, generator=g).to("cuda", dtype)
    nw = (1 + 0.1 * torch.randn(dim, generator=g)).to("cuda", dtype)
    w1, w3 = ((torch.randn(NH, dim, generator=g) / dim**0.5).to("cuda", dtype) for _ in range(2))
    w2 = (torch.randn(dim, NH, generator=g) / NH**0.5).to("cuda", dtype)
    want = swiglu(rms_norm(h, nw, 1e-5), w1, w3, w2).float()
    for s in SETTINGS:
        print("check", (M, dim, NH), _key(s), flush=True)
        got = ffn(h, (nw, 1e-5), w1, w3, w2.t().contiguous().t() if s[3] else w2, torch.zeros(M, dim, device="cuda"),
                  launch=_launch(s))
        err = (got.to(dtype).float() - want).abs().max().item()
        assert err <= tol * want.abs().max().item(), ((M, dim, NH), _key(s), err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare each setting with the PyTorch composition first")
    ap.add_argument("--out", default=None, help="JSON of every time")
    args = ap.parse_args()
    from arsparse.bench import copy_bandwidth, graph_call_us

    M, dim, NH, eps, n, dtype = 2, 1280, 3584, 1e-5, 20, torch.bfloat16  # GPT-XL at batch 1 with guidance
    if args.check:
        check(dtype, M, dim, NH, 2e-2)  # (a compile per setting)
        print("check: every setting matches the PyTorch composition")
    bw = copy_bandwidth(torch.device("cuda"))
    attn, x = (torch.randn(M, dim, device="cuda", dtype=dtype) for _ in range(2))
    nw = torch.ones(dim, device="cuda", dtype=dtype)
    blocks = [dict(wo=torch.randn(dim, dim, device="cuda", dtype=dtype) / dim**0.5,
                   w1=torch.randn(NH, dim, device="cuda", dtype=dtype) / dim**0.5,
                   w3=torch.randn(NH, dim, device="cuda", dtype=dtype) / dim**0.5,
                   w2=torch.randn(dim, NH, device="cuda", dtype=dtype) / NH**0.5) for _ in range(n)]
    for b in blocks:
        b["w2t"] = b["w2"].t().contiguous().t()
    acc = torch.zeros(M, dim, device="cuda")  # (without wo's launch nothing zeroes it: the times hold)
    floor_us = (dim * dim + 3 * NH * dim) * 2 / bw * 1e6

    def engine(i, with_wo=True):
        b = blocks[i]
        h = matvec(attn, b["wo"], residual=x) if with_wo else x
        return matvec(matvec(h, b["w1"], norm=(nw, eps), w_up=b["w3"]), b["w2"])

    def fused(i, s, with_wo=True):
        b = blocks[i]
        h = matvec(attn, b["wo"], residual=x, zero=acc) if with_wo else x
        return ffn(h, (nw, eps), b["w1"], b["w3"], b["w2t"] if s[3] else b["w2"], acc, launch=_launch(s))

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
