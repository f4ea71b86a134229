#!/bin/bash
# Launch-option sweep of the three decode kernels at GPT-XL / 576 tokens / batch 256 with guidance
# (512 rows, 20 heads, head_dim 64, bf16), mid-generation (query at position 300). On the H200:
#   bash docs/bench/kernel-sweep.sh [dense,ring,slots]   -> a table of us/call and GB/s (the kernels
#   named, default all; one at a time keeps a call short), JSON in $OUT/kernel_sweep_<kernels>_<rows>.json;
#   ring also writes its best setting of the engine's kernel to $OUT/ring_best.txt (the best three
#   to ring_top.txt), for `arsparse bench --ring-launch $(cat $OUT/ring_best.txt) ...` in the same call;
#   slots its best to $OUT/slots_best.txt, for `arsparse bench --variant $(cat $OUT/slots_best.txt) ...`
# ROWS=2 (environment) times batch 1 with guidance instead of 512 rows (batch 256).
# The dense and ring kernels write the step's K/V themselves (fused); "writes" times the separate
# index_copy_ launches the unfused step needed (2 per layer dense, 4 ring), for comparison with the
# kernels' times before fusing (BENCHMARKS.md run 3: dense 237 us, ring 55.5 us). The ring rows
# time the ring kernel (2-D tiles of one head, rows_per_program rows per program in a loop) by
# rows_per_program, heads_first (a grid of (heads, row blocks): the programs launched together share
# a row), late_cast (K/V tiles in bf16 until the products) and num_warps: every setting is built first, then timed in three
# interleaved rounds (median of each, and the spread between rounds: timed 100 times right after its
# compile, as before run 7, one setting took 74 us in one call and 124 us in the next); "ring-best": the
# fastest of each rows_per_program x heads_first x late_cast; "ring-rows" gives each row its own position
# (continuous batching): the engine's setting and the fastest one. (Runs 6 and 7 also timed forms
# since removed: 3-D tiles of a block of heads per program, one program per (rows, kv head)
# reading the ring in chunks, the next row's loads issued first by hand, and the offsets in two
# register tiles; all were slower; as was, in run 9, each program prefetching into the L2 the reads of
# the program 264-2112 launch places later, and the dense kernel's tiles prefetching those 1-2 ahead.)
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PARTS=${1:-dense,ring,slots}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 - <<'PY'
import itertools, json, os, torch
from arsparse.kernels.triton import decode, ring, slots
from arsparse.kernels.triton import decode_attention, ring_decode_attention, slot_decode_attention
from arsparse.layout import Layout
from arsparse.policies import get
from docs.bench.sweeptime import rotating, rounds, timeit  # (run from the repository root)

dev, dt = "cuda", torch.bfloat16
B, H, D, S, pos = int(os.environ.get("ROWS", 512)), 20, 64, 577, 300
g = torch.Generator(device=dev).manual_seed(0)
r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g)
q, k_new, v_new = r(B, H, D), r(B, H, D), r(B, H, D)
p = torch.tensor(pos, device=dev)
fmt = lambda x: {k: (round(v, 1) if isinstance(v, float) else v) for k, v in x.items()}

def report(rows, kname, engine, extra=()):
    """The engine's setting, the fastest four, and the extra rows."""
    rs = sorted((x for x in rows if x["kernel"] == kname), key=lambda x: x["us"])
    now = [x for x in rs if all(x.get(k) == v for k, v in engine.items())][0]
    print(f"{kname}: engine setting {now['us']:.1f} us ({now['gb_s']:.0f} GB/s)")
    for x in rs[:4]:
        print("   ", fmt(x))
    for x in extra:
        print("   ", fmt(x))

def sweep_dense(rows):
    """Reads pos positions of K and V (the new token comes from registers)."""
    kvs = rotating(lambda: (r(B, H, S, D), r(B, H, S, D)), 2 * B * H * S * D * 2)
    k, v = next(kvs)
    nbytes = B * H * (pos + 1) * D * 2 * 2
    saved = decode.LAUNCH
    engine = (decode.block_n(B, H, q.device), {k: saved[k] for k in ("num_warps", "num_stages")})
    # (num_stages: runs 3-7 found no difference)
    for bn, nw, ns in itertools.product((32, 64, 128), (2, 4, 8), (3,)):
        # (the tile whatever the number of rows)
        decode.LAUNCH = dict(saved, block_n=bn, small_block_n=bn, num_warps=nw, num_stages=ns)
        us = timeit(lambda: decode_attention(q, k_new, v_new, *next(kvs), p))
        rows.append(dict(kernel="dense", BLOCK_N=bn, num_warps=nw, num_stages=ns, us=us, gb_s=nbytes / us / 1e3))
    decode.LAUNCH = saved
    p_rows = torch.randint(S // 4, S, (B,), device=dev, generator=g)  # continuous batching: a position per row
    us = timeit(lambda: decode_attention(q, k_new, v_new, *next(kvs), p_rows))
    rows_bytes = B * H * (p_rows.float().mean().item() + 1) * D * 2 * 2
    extra = [dict(kernel="dense-rows", us=us, gb_s=rows_bytes / us / 1e3)]
    at = p.view(1)
    us = timeit(lambda: (k.index_copy_(2, at, k_new[:, :, None]), v.index_copy_(2, at, v_new[:, :, None])))
    extra.append(dict(kernel="dense-writes", us=us))
    rows += extra
    report(rows, "dense", dict(BLOCK_N=engine[0], **engine[1]), extra)

def sweep_ring(rows):
    """diagonal's default read set on the 24x24 grid: the kernel by rows per program, heads_first,
    late_cast and num_warps."""
    lay, pol = Layout(1, 24, 24), get("diagonal")
    offs = pol.offset_table(lay, 1, H)[0].to(dev)
    Wn, Sn = pol.window(lay, 1, H), pol.sink_count(lay)
    sizes = (1, 1, Sn + 1, Sn + 1, Wn, Wn)  # prompt, sink and ring K/V
    sets = rotating(lambda: [r(B, H, n, D) for n in sizes], B * H * sum(sizes) * D * 2)
    bufs = next(sets)  # (checks read this set; timings take the next set at each call)
    nread = 1 + Sn + int((offs >= 0).sum(1).float().mean())
    nbytes = B * H * nread * D * 2 * 2
    args = lambda pp, bufs=None: (q, k_new, v_new, *(bufs or next(sets)), offs, pp, Sn)
    engine = dict(ring.LAUNCH)
    want = ring_decode_attention(*args(p, bufs)).float()  # the engine's output: every setting must agree
    agrees = lambda out: bool(torch.allclose(out.float(), want, atol=1e-2, rtol=1e-2))
    # (num_stages left at its default: no setting's loop was pipelined, and 70 settings built and timed
    # from CUDA graphs ran past 300 s in run 8; 8 rows per program and 4 warps never won a round)
    settings = [dict(rows_per_program=rw, heads_first=hf, num_warps=nw)
                for rw, hf, nw in itertools.product((1, 2, 4), (False, True), (1, 2))]
    fns, oks = {}, {}
    for setting, late in itertools.product(settings, (False, True)):
        launch = dict(setting, late_cast=late, early_loads=engine["early_loads"])  # (early_loads: needs PDL chains)
        try:  # build and check every setting first
            key = tuple(launch.items())
            oks[key] = agrees(ring_decode_attention(*args(p, bufs), launch=launch))
            fns[key] = lambda launch=launch: ring_decode_attention(*args(p), launch=launch)
        except Exception as e:  # (a setting that does not compile is a row, not the end of the sweep)
            print("ring", launch, "failed:", type(e).__name__, str(e)[:300])
            rows.append(dict(kernel="ring-failed", **launch, error=f"{type(e).__name__}: {str(e)[:300]}"))
    print(f"ring: {len(fns)} settings built and checked", flush=True)
    for key, (us, spread) in rounds(fns).items():
        rows.append(dict(kernel="ring", **dict(key), us=us, spread_us=spread, gb_s=nbytes / us / 1e3, read=nread,
                         ok=oks[key]))
    ring_rows = [x for x in rows if x["kernel"] == "ring"]
    key = lambda x: (x["rows_per_program"], x["heads_first"], x["late_cast"])
    extra = [dict(min((x for x in ring_rows if key(x) == v), key=lambda x: x["us"]), kernel="ring-best")
             for v in sorted({key(x) for x in ring_rows})]
    top = sorted((x for x in ring_rows if x["ok"]), key=lambda x: x["us"])[:3]
    flag = lambda x: ",".join(f"{k}={int(x[k]) if isinstance(x[k], bool) else x[k]}" for k in sorted(ring.LAUNCH))
    open(f"{os.environ['OUT']}/ring_top.txt", "w").write("".join(flag(x) + "\n" for x in top))
    best = {k: top[0][k] for k in ring.LAUNCH}
    p_img = torch.randint(lay.prefix_len, S - 1, (B,), device=dev, generator=g)  # a position per row
    for name, kw in (("engine", {}), ("best", dict(launch=best))):
        us = timeit(lambda: ring_decode_attention(*args(p_img), **kw))
        extra.append(dict(kernel="ring-rows", variant=name, **kw, us=us, gb_s=nbytes / us / 1e3))
    i = pos - 1
    sink, slot = torch.tensor([min(i, Sn)], device=dev), torch.tensor([i % Wn], device=dev)
    writes = ((bufs[4], slot, k_new), (bufs[5], slot, v_new), (bufs[2], sink, k_new), (bufs[3], sink, v_new))
    us = timeit(lambda: [t.index_copy_(2, idx, x[:, :, None]) for t, idx, x in writes])
    extra.append(dict(kernel="ring-writes", us=us))
    rows += extra
    report(rows, "ring", engine, extra)
    open(f"{os.environ['OUT']}/ring_best.txt", "w").write(flag(best) + "\n")
    print(f"ring: the best setting of the engine's kernel, to time in whole steps: arsparse bench --ring-launch "
          f"{flag(best)} (the fastest three in $OUT/ring_top.txt)")

def sweep_slots(rows):
    """83 kept + 1 spare, ~5% free: the split pass by block_n, late_cast, num_warps and num_stages (the
    combine pass at the engine's setting; run 3 swept its warps)."""
    C = 84
    pk, ck, cv = r(B, H, 1, D), r(B, H, C, D), r(B, H, C, D)
    spos = torch.randint(2, S, (B, H, C), device=dev, generator=g)
    spos[torch.rand(B, H, C, device=dev, generator=g) < 0.05] = -1
    nbytes = B * H * (1 + C) * D * 2 * 2
    engine = dict(slots.LAUNCH)
    want = slot_decode_attention(q, pk, pk, ck, cv, spos)[0].float()  # every setting must agree
    for bn, lc, nw, ns in itertools.product((32, 64, 128), (0, 1), (1, 2, 4, 8), (2, 3)):
        slots.LAUNCH = dict(block_n=bn, late_cast=lc, num_warps=nw, num_stages=ns)
        ok = bool(torch.allclose(slot_decode_attention(q, pk, pk, ck, cv, spos)[0].float(), want, atol=1e-2, rtol=1e-2))
        us = timeit(lambda: slot_decode_attention(q, pk, pk, ck, cv, spos))
        rows.append(dict(kernel="slots", **slots.LAUNCH, us=us, gb_s=nbytes / us / 1e3, agrees=ok))
    slots.LAUNCH = engine
    report(rows, "slots", engine)
    bad = [x for x in rows if x["kernel"] == "slots" and not x["agrees"]]
    print("slots: settings that disagree with the engine's output:", bad or "none")
    best = min((x for x in rows if x["kernel"] == "slots" and x["agrees"]), key=lambda x: x["us"])
    open(f"{os.environ['OUT']}/slots_best.txt", "w").write(",".join(f"slots.{k}={best[k]}" for k in engine) + "\n")

rows = []
parts = os.environ["PARTS"].split(",")
for part in parts:
    dict(dense=sweep_dense, ring=sweep_ring, slots=sweep_slots)[part](rows)
json.dump(rows, open(f"{os.environ['OUT']}/kernel_sweep_{'_'.join(parts)}_{B}.json", "w"), indent=1)
PY
