#!/bin/bash
# Launch sweep of the small-batch projection kernel (arsparse/kernels/triton/matvec.py) at GPT-XL's
# shapes (dim 1280, wqkv 3840, SwiGLU 3584, output head 16384) in bf16, against cuBLAS (F.linear) and
# the PyTorch composition each fused form replaces. On the H200:
#   OUT=$OUT bash docs/bench/matvec-sweep.sh [ROWS]      (ROWS: 2 = batch 1 with guidance, default)
# Every call is timed inside a CUDA graph of 20 calls (the wrapper's host time would hide the
# kernel's few microseconds otherwise), settings built first, then three interleaved rounds of
# medians (triton.testing.do_bench_cudagraph). Prints per form: cuBLAS / composition us, the
# engine's setting, the fastest four, GB/s of weights; JSON in $OUT/matvec_sweep_<ROWS>.json; the
# best setting over all forms (by summed time, weighted as a block uses them) in $OUT/matvec_best.txt.
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 ROWS=${1:-2}
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 - <<'PY'
import itertools, json, os, torch, triton.testing
import torch.nn.functional as F
from arsparse.kernels.triton import matvec as mv
from arsparse.models.gpt import rms_norm

M, dt, dev = int(os.environ["ROWS"]), torch.bfloat16, "cuda"
g = torch.Generator(device=dev).manual_seed(0)
r = lambda *s: (torch.randn(*s, device=dev, generator=g) * 0.02).to(dt)
x, f, nw, h = r(M, 1280), r(M, 1280), 1 + r(1280), r(M, 3584)
wqkv, wo, w1, w3, w2, head = r(3840, 1280), r(1280, 1280), r(3584, 1280), r(3584, 1280), r(1280, 3584), r(16384, 1280)
table = torch.rand(1, 32, 2, device=dev)
forms = {  # name: (weight bytes, the fused call, the PyTorch composition it replaces)
    "wqkv+norm+rope": (wqkv.nbytes, lambda L: mv.matvec(x, wqkv, add=f, norm=(nw, 1e-5), rope=(table, 2560, 64), launch=L),
                       lambda: F.linear(rms_norm(x + f, nw, 1e-5), wqkv)),
    "wo+residual": (wo.nbytes, lambda L: mv.matvec(x, wo, residual=x, launch=L), lambda: x + F.linear(x, wo)),
    "w1w3+norm+silu": (w1.nbytes * 2, lambda L: mv.matvec(x, w1, norm=(nw, 1e-5), w_up=w3, launch=L),
                       lambda: F.silu(F.linear(rms_norm(x, nw, 1e-5), w1)) * F.linear(rms_norm(x, nw, 1e-5), w3)),
    "w2": (w2.nbytes, lambda L: mv.matvec(h, w2, launch=L), lambda: F.linear(h, w2)),
    "head": (head.nbytes, lambda L: mv.matvec(x, head, launch=L), lambda: F.linear(x, head)),
}
settings = [dict(block_n=bn, block_k=bk, max_tile=min(M * bn * bk, 16384), num_warps=nw_, num_stages=2)
            for bn, bk, nw_ in itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8)) if bn * bk <= 8192]
settings.append(dict(mv.LAUNCH))

def graphed(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return lambda: graph.replay()

fns = {}
for name, (nbytes, fused, plain) in forms.items():
    fns[(name, "cublas")] = graphed(plain)
    for s in settings:
        try:
            fns[(name, json.dumps(s))] = graphed(lambda fused=fused, s=s: fused(s))
        except Exception as e:
            print(name, s, "failed:", type(e).__name__, str(e)[:200])
times = {k: [] for k in fns}
for _ in range(3):
    for k, fn in fns.items():
        times[k].append(triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3 / 20)  # us per call
med = {k: sorted(t)[1] for k, t in times.items()}
rows = [dict(form=n, setting=s, us=med[(n, s)], spread_us=max(times[(n, s)]) - min(times[(n, s)]),
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
