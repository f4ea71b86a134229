#!/bin/bash
# Launch-option sweep of the three decode kernels at GPT-XL / 576 tokens / batch 256 with guidance
# (512 rows, 20 heads, head_dim 64, bf16), mid-generation (query at position 300). On the H200:
#   bash docs/bench/kernel-sweep.sh      -> a table of us/call and GB/s, JSON in $OUT/kernel_sweep.json
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 - <<'PY'
import itertools, json, os, torch
from arsparse.kernels.triton import decode, ring, slots
from arsparse.kernels.triton import decode_attention, ring_decode_attention, slot_decode_attention
from arsparse.layout import Layout
from arsparse.policies import get

dev, dt = "cuda", torch.bfloat16
B, H, D, S, pos = 512, 20, 64, 577, 300
g = torch.Generator(device=dev).manual_seed(0)
r = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g)
q = r(B, H, D)

def timeit(fn, reps=100):
    for _ in range(5): fn()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); e0.record()
    for _ in range(reps): fn()
    e1.record(); torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps * 1e3  # us

rows = []
# dense: reads pos + 1 positions of K and V
k, v = r(B, H, S, D), r(B, H, S, D)
p = torch.tensor(pos, device=dev)
nbytes = B * H * (pos + 1) * D * 2 * 2
for bn, nw, ns in itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4)):
    decode.BLOCK_N, decode.SPLIT_LAUNCH = bn, dict(num_warps=nw, num_stages=ns)
    us = timeit(lambda: decode_attention(q, k, v, p))
    rows.append(dict(kernel="dense", BLOCK_N=bn, num_warps=nw, num_stages=ns, us=us, gb_s=nbytes / us / 1e3))
decode.BLOCK_N = 64
# ring: diagonal's default read set on the 24x24 grid
lay = Layout(1, 24, 24)
pol = get("diagonal")
offs = pol.offset_table(lay, 1, H)[0].to(dev)
Wn, Sn = pol.window(lay, 1, H), pol.sink_count(lay)
pk, pv, sk, sv, rk, rv = r(B, H, 1, D), r(B, H, 1, D), r(B, H, Sn + 1, D), r(B, H, Sn + 1, D), r(B, H, Wn, D), r(B, H, Wn, D)
nread = 1 + Sn + int((offs >= 0).sum(1).float().mean())
nbytes = B * H * nread * D * 2 * 2
for nw in (1, 2, 4, 8):
    ring.LAUNCH = dict(num_warps=nw)
    us = timeit(lambda: ring_decode_attention(q, pk, pv, sk, sv, rk, rv, offs, p, Sn))
    rows.append(dict(kernel="ring", num_warps=nw, us=us, gb_s=nbytes / us / 1e3, window=Wn, read=nread))
# slots: 83 kept + 1 spare, ~5% free
C = 84
ck, cv = r(B, H, C, D), r(B, H, C, D)
spos = torch.randint(2, S, (B, H, C), device=dev, generator=g)
spos[torch.rand(B, H, C, device=dev, generator=g) < 0.05] = -1
nbytes = B * H * (1 + C) * D * 2 * 2
for nw, ns, cw in itertools.product((1, 2, 4, 8), (2, 3), (1, 2, 4, 8)):
    slots.SPLIT_LAUNCH, slots.COMBINE_LAUNCH = dict(num_warps=nw, num_stages=ns), dict(num_warps=cw)
    us = timeit(lambda: slot_decode_attention(q, pk, pv, ck, cv, spos))
    rows.append(dict(kernel="slots", num_warps=nw, num_stages=ns, combine_warps=cw, us=us, gb_s=nbytes / us / 1e3))
json.dump(rows, open(os.environ["OUT"] + "/kernel_sweep.json", "w"), indent=1)
for kname in ("dense", "ring", "slots"):
    rs = sorted((x for x in rows if x["kernel"] == kname), key=lambda x: x["us"])
    default = [x for x in rs if x.get("num_warps") == 4 and x.get("num_stages", 3) == 3 and x.get("BLOCK_N", 64) == 64
               and x.get("combine_warps", 4) == 4][0]
    print(f"{kname}: default {default['us']:.1f} us ({default['gb_s']:.0f} GB/s)")
    for x in rs[:4]:
        print("   ", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in x.items()})
PY
