"""Would an SM partition let attention and matrix products overlap? A microbenchmark with green contexts.

Run 38 found the two half batches' kernels overlapping, but each slowing the other by as much as they
overlapped. This asks whether splitting the SMs between them helps: half a batch-256 step's
attention (the dense split kernel over 577 positions, 256 rows) and half its matrix products (GPT-XL's
four projections at 256 rows, 36 layers of distinct weights), each timed alone on the whole GPU, alone
on a green context of some SMs, and both at once: on two ordinary streams, and on two green contexts
of the SM counts given (the driver places them; whether they are disjoint shows in the times). The
attention's 8 launches go eagerly, the products as one CUDA graph replayed on each stream, timed on the
host clock with every stream synchronised.

    PYTHONPATH=. python3 docs/bench/green_split.py --out $OUT/green.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from arsparse.kernels.triton.decode import decode_attention


def timed(jobs, reps: int = 5) -> float:
    """Median wall ms (host clock, every stream synchronised) of launching each ``(fn, green context or None,
    stream)`` job in turn, so that they run at once, over ``reps`` rounds after one warm-up."""
    out = []
    for _ in range(reps + 1):
        for _, _, st in jobs:
            st.synchronize()
        t0 = time.perf_counter()
        for fn, ctx, st in jobs:
            if ctx is not None:
                ctx.set_context()
            try:
                with torch.cuda.stream(st):
                    fn()
            finally:
                if ctx is not None:
                    ctx.pop_context()
        for _, _, st in jobs:
            st.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return sorted(out[1:])[reps // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--splits", default="32,48,64,80", help="SMs given to the products (the rest, rounded down "
                                                          "to a multiple of 8, to attention)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from torch.cuda.green_contexts import GreenContext

    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bf = dict(device=dev, dtype=torch.bfloat16)
    R, H, D, S, dim, ffn = a.rows, 20, 64, 577, 1280, 3584
    q, kn, vn = (torch.randn(R, H, D, **bf) for _ in range(3))
    kc, vc = torch.randn(R, H, S, D, **bf), torch.randn(R, H, S, D, **bf)
    pos = torch.full((1,), S - 1, device=dev, dtype=torch.long)
    calls = 8

    def attention():
        for _ in range(calls):
            decode_attention(q, kn, vn, kc, vc, pos)

    x, g = torch.randn(R, dim, **bf), torch.randn(R, ffn, **bf)
    layers = [(torch.randn(3 * dim, dim, **bf), torch.randn(dim, dim, **bf), torch.randn(2 * ffn, dim, **bf),
               torch.randn(dim, ffn, **bf)) for _ in range(36)]

    def eager_products():
        for wqkv, wo, w13, w2 in layers:
            x @ wqkv.T
            x @ wo.T
            x @ w13.T
            g @ w2.T

    def captured(ctx=None):
        """The products as one CUDA graph captured in ``ctx`` (144 eager launches would be bound by the host),
        -> its replay. Whether a replay keeps to a green context's SMs shows in the times."""
        if ctx is not None:
            ctx.set_context()
        try:
            graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                eager_products()
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(graph):
                eager_products()
        finally:
            if ctx is not None:
                ctx.pop_context()
        return graph.replay

    products = captured()

    attn_bytes = calls * 2 * kc.numel() * 2
    flops = 2 * R * sum(w.numel() for ws in layers for w in ws)
    plain = torch.cuda.Stream(), torch.cuda.Stream()
    rows = [dict(setting="whole GPU, each alone", attention_ms=timed([(attention, None, plain[0])]),
                 products_ms=timed([(products, None, plain[1])])),
            dict(setting="whole GPU, products launched eagerly (not a graph)",
                 products_ms=timed([(eager_products, None, plain[1])])),
            dict(setting="whole GPU, both at once on two streams",
                 both_ms=timed([(attention, None, plain[0]), (products, None, plain[1])]))]
    for k in (int(t) for t in a.splits.split(",")):
        rest = (sms - k) // 8 * 8
        row = dict(setting=f"products on {k} SMs, attention on {rest}")
        try:
            gp, ga = GreenContext.create(num_sms=k, device_id=0), GreenContext.create(num_sms=rest, device_id=0)
            P, A = (captured(gp), gp, gp.Stream()), (attention, ga, ga.Stream())
            row.update(attention_ms=timed([A]), products_ms=timed([P]), both_ms=timed([A, P]))
        except Exception as e:  # (what the driver or torch refused: reported, the other settings still run)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(row, flush=True)
    base = rows[0]
    for r in rows:
        if r.get("attention_ms"):
            r["attention_tb_s"] = attn_bytes / r["attention_ms"] / 1e9
        if r.get("products_ms"):
            r["products_tflop_s"] = flops / r["products_ms"] / 1e9
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, sms=sms, rows_per_call=R,
                attention_gb=attn_bytes / 1e9, products_tflop=flops / 1e12, results=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(meta, f, indent=2)
    print(f"\n{meta['gpu']} ({sms} SMs), torch {meta['torch']}: attention {attn_bytes / 1e9:.2f} GB "
          f"({calls} dense split calls, {R} rows x {S} positions), products {flops / 1e12:.3f} TFLOP "
          f"(36 layers at {R} rows); ms on the host clock")
    print("| setting | attention alone | products alone | both at once | sum alone | TB/s | TFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    fmt = (lambda v: f"{v:.3f}" if v is not None else "")  # noqa: E731
    for r in rows:
        al, pr, both = r.get("attention_ms"), r.get("products_ms"), r.get("both_ms")
        if "error" in r:
            print(f"| {r['setting']} | {r['error'][:120]} | | | | | |")
            continue
        print(f"| {r['setting']} | {fmt(al)} | {fmt(pr)} | {fmt(both)} | {fmt(al + pr if al and pr else None)} | "
              f"{fmt(r.get('attention_tb_s'))} | {fmt(r.get('products_tflop_s'))} |")
    print(f"(whole GPU, each alone: sum {base['attention_ms'] + base['products_ms']:.3f} ms)")


if __name__ == "__main__":
    main()
