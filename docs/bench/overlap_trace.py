"""Do two half batches' kernels run side by side? A kernel trace of the captured batch-256 step.

Run 36 timed two half batches on two streams (``Generator(streams=2)``) slower than one runner, without
knowing whether the halves' kernels overlapped at all. This traces a few CUDA-graph replays of the
step (torch.profiler, CUPTI kernel records) for one runner and for two halves, and reports, per step:
the attention kernels' and the matrix products' GPU time, the wall time during which some attention
kernel and some product kernel were running at once (from the records' start and end times, whatever
stream a record names; on the H100 of run 38 they named the streams captured in the graph), and the
time during which two or more kernels of any kind ran at once. ``--variant`` adds settings (as
``arsparse bench --variant``) to the two runs every call traces, one runner and two halves.

    PYTHONPATH=. python3 docs/bench/overlap_trace.py --out $OUT/overlap.json
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

from arsparse.bench import _applied, _random_gpt, parse_variant
from arsparse.engine.generator import Generator
from arsparse.models.config import gpt_config

ATTENTION = ("decode_split", "decode_combine", "ring_decode", "slots_")
PRODUCTS = ("nvjet", "gemm", "cutlass", "sm90_xmma")


def kind(name: str) -> str:
    if any(s in name for s in ATTENTION):
        return "attention"
    if any(s in name for s in PRODUCTS):
        return "products"
    return "other"


def union(iv: list) -> list:
    """Merged, sorted intervals [(start, end)]."""
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(iv: list) -> float:
    """Summed lengths (overlaps counted each time: union first for wall time)."""
    return sum(e - s for s, e in iv)


def intersect(a: list, b: list) -> float:
    """Total length where the unions of a and b overlap."""
    a, b, i, j, t = union(a), union(b), 0, 0, 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        t += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return t


def concurrent(iv: list) -> float:
    """Time during which two or more of the intervals run at once."""
    ev = sorted([(s, 1) for s, _ in iv] + [(e, -1) for _, e in iv])
    t, n, last = 0.0, 0, None
    for x, d in ev:
        if n >= 2:
            t += x - last
        n, last = n + d, x
    return t


def trace(run, cond, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    N = run.N
    with torch.no_grad():
        run.start(cond)
        for _ in range(N // 2):
            run.advance()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(20):
            run.advance()
        e1.record()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run.advance()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    iv = {k: [(e["ts"], e["ts"] + e["dur"]) for e in kernels if kind(e["name"]) == k]
          for k in ("attention", "products", "other")}
    allk = [x for v in iv.values() for x in v]
    span = max(e for _, e in allk) - min(s for s, _ in allk)
    per = 1e3 * steps  # us over `steps` -> ms per step
    return dict(
        ms_per_step=e0.elapsed_time(e1) / 20, kernels=len(kernels) // steps,
        trace_streams=sorted({e["args"].get("stream") for e in kernels}), wall_ms=span / per,
        **{f"{k}_ms": length(v) / per for k, v in iv.items()}, busy_ms=length(union(allk)) / per,
        attention_with_products_ms=intersect(iv["attention"], iv["products"]) / per,
        two_or_more_ms=concurrent(allk) / per)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--image-tokens", type=int, default=576)
    p.add_argument("--policies", default="dense,diagonal")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE,...",
                   help="also trace with these settings (as arsparse bench --variant); the runs always trace "
                        "streams=1 and streams=2")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    cfg = gpt_config("GPT-XL", image_tokens=a.image_tokens)
    gpt = _random_gpt(cfg, torch.device("cuda"), torch.bfloat16)
    cond = torch.arange(a.batch) % cfg.num_classes
    rows = []
    for policy in a.policies.split(","):
        for spec in ("streams=1", "streams=2", *a.variant):
            v = parse_variant(spec)
            with _applied(v):
                gen = Generator(gpt, device="cuda", dtype=torch.bfloat16, compile=True,
                                policy=None if policy == "dense" else policy, streams=v.streams or 1)
                run, c, _ = gen.prepare(cond, cfg_scale=4.0, seed=0)
                rows.append(dict(policy=policy, variant=spec, batch=a.batch, **trace(run, c, a.steps)))
                del run, c  # (the runner holds the cache: freed before the next one is built)
                gen.release()
                torch.cuda.empty_cache()
            print(rows[-1], flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, tokens=a.image_tokens, rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(meta, f, indent=2)
    print(f"\n{meta['gpu']}, torch {meta['torch']}, {a.image_tokens} tokens, batch {a.batch}, compiled; ms per step")
    print("| policy | variant | step | traced wall | busy | attention | products | other | attention beside products "
          "| 2+ kernels at once |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['variant']} | {r['ms_per_step']:.3f} | {r['wall_ms']:.3f} | {r['busy_ms']:.3f} | "
              f"{r['attention_ms']:.3f} | {r['products_ms']:.3f} | {r['other_ms']:.3f} | "
              f"{r['attention_with_products_ms']:.3f} | {r['two_or_more_ms']:.3f} |")


if __name__ == "__main__":
    main()
