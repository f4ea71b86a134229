#!/bin/bash
# Launch sweep of the small-batch projection kernel (arsparse/kernels/triton/matvec.py) at GPT-XL's
# shapes (dim 1280, wqkv 3840, SwiGLU 3584, output head 16384) in bf16, against cuBLAS (F.linear) and
# the PyTorch composition each fused form replaces. On the H200:
#   OUT=$OUT bash docs/bench/matvec-sweep.sh [ROWS]      (ROWS: 2 = batch 1 with guidance, default)
# Every call is timed replayed from a CUDA graph (triton.testing.do_bench_cudagraph: the wrapper's
# host time would hide the kernel's few microseconds otherwise), settings built first, then three
# interleaved rounds of medians. Each call takes the next of several copies of its weights (more
# than the L2 holds), as a step reads each layer's weights once. Prints per form: cuBLAS / composition us, the
# engine's setting, the fastest four, GB/s of weights; JSON in $OUT/matvec_sweep_<ROWS>.json; the
# best setting over all forms (by summed time, weighted as a block uses them) in $OUT/matvec_best.txt.
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 ROWS=${1:-2}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 - <<'PY'
import itertools, json, os, torch
import torch.nn.functional as F
from arsparse.kernels.triton import matvec as mv
from arsparse.models.gpt import rms_norm
from docs.bench.sweeptime import rotating, rounds  # (run from the repository root)

M, dt, dev = int(os.environ["ROWS"]), torch.bfloat16, "cuda"
g = torch.Generator(device=dev).manual_seed(0)
r = lambda *s: (torch.randn(*s, device=dev, generator=g) * 0.02).to(dt)
x, f, nw, h = r(M, 1280), r(M, 1280), 1 + r(1280), r(M, 3584)
table = torch.rand(1, 32, 2, device=dev)

def copies(*shapes):
    """The form's weights, in enough copies to miss the L2 (a step reads each layer's once)."""
    return rotating(lambda: [r(*sh) for sh in shapes], sum(2 * a * b for a, b in shapes))

forms = {  # name: (weight bytes, the fused call, the PyTorch composition it replaces, weight copies)
    "wqkv+norm+rope": (3840 * 1280 * 2, lambda L, w: mv.matvec(x, w[0], add=f, norm=(nw, 1e-5), rope=(table, 2560, 64), launch=L),
                       lambda w: F.linear(rms_norm(x + f, nw, 1e-5), w[0]), copies((3840, 1280))),
    "wo+residual": (1280 * 1280 * 2, lambda L, w: mv.matvec(x, w[0], residual=x, launch=L),
                    lambda w: x + F.linear(x, w[0]), copies((1280, 1280))),
    "w1w3+norm+silu": (2 * 3584 * 1280 * 2, lambda L, w: mv.matvec(x, w[0], norm=(nw, 1e-5), w_up=w[1], launch=L),
                       lambda w: F.silu(F.linear(rms_norm(x, nw, 1e-5), w[0])) * F.linear(rms_norm(x, nw, 1e-5), w[1]),
                       copies((3584, 1280), (3584, 1280))),
    "w2": (1280 * 3584 * 2, lambda L, w: mv.matvec(h, w[0], launch=L), lambda w: F.linear(h, w[0]), copies((1280, 3584))),
    "head": (16384 * 1280 * 2, lambda L, w: mv.matvec(x, w[0], launch=L), lambda w: F.linear(x, w[0]),
             copies((16384, 1280))),
}
# (run 8: chunks as long as a row (K = 1280 or 3584: block_k 2048 / 4096) with 2-8 rows per program won;
# now also weights_first, which asks for the weight tile before reading the input: on since run 9)
settings = [dict(mv.LAUNCH, block_n=bn, block_k=bk, max_tile=min(M * bn * bk, 32768), num_warps=nw_, weights_first=wf)
            for bn, bk, nw_, wf in itertools.product((2, 4, 8), (2048, 4096), (4, 8), (0, 1))]
settings.append(dict(mv.LAUNCH))

def built(fn):
    fn()  # compile and check it runs, before any timing
    return fn

fns = {}
for name, (nbytes, fused, plain, ws) in forms.items():  # (each call takes the next copy of the weights)
    fns[(name, "cublas")] = built(lambda plain=plain, ws=ws: plain(next(ws)))
    for s in settings:
        try:
            fns[(name, json.dumps(s))] = built(lambda fused=fused, s=s, ws=ws: fused(s, next(ws)))
        except Exception as e:
            print(name, s, "failed:", type(e).__name__, str(e)[:200])
torch.cuda.synchronize()
timed = rounds(fns)  # (median, spread) us per call
med = {k: t[0] for k, t in timed.items()}
rows = [dict(form=n, setting=s, us=med[(n, s)], spread_us=timed[(n, s)][1],
             gb_s=forms[n][0] / med[(n, s)] / 1e3) for n, s in fns]
json.dump(dict(rows=rows, M=M, gpu=torch.cuda.get_device_name()), open(f"{os.environ['OUT']}/matvec_sweep_{M}.json", "w"), indent=1)
weight = {"wqkv+norm+rope": 1, "wo+residual": 1, "w1w3+norm+silu": 1, "w2": 1, "head": 1 / 36}  # per block
engine = json.dumps(dict(mv.LAUNCH))
total = {s: sum(weight[n] * med[(n, s)] for n in forms) for s in {s for _, s in fns if s != "cublas"}
         if all((n, s) in med for n in forms)}
best = min(total, key=total.get)
for n in forms:
    rs = sorted((x for x in rows if x["form"] == n and x["setting"] != "cublas"), key=lambda x: x["us"])
    cub = med[(n, "cublas")]
    print(f"{n}: PyTorch {cub:.1f} us ({forms[n][0] / cub / 1e3:.0f} GB/s); engine {med.get((n, engine), float('nan')):.1f} us; "
          f"best-overall {med[(n, best)]:.1f} us")
    for x in rs[:4]:
        print(f"    {x['us']:.1f} us {x['gb_s']:.0f} GB/s spread {x['spread_us']:.1f}  {x['setting']}")
print(f"per block (+ head/36): PyTorch {sum(weight[n] * med[(n, 'cublas')] for n in forms):.1f} us, engine "
      f"{total.get(engine, float('nan')):.1f} us, best {total[best]:.1f} us: {best}")
open(f"{os.environ['OUT']}/matvec_best.txt", "w").write(best + "\n")
PY
