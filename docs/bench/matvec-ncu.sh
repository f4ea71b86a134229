#!/bin/bash
# Hardware counters of the latency mode's kernels at batch 1 (2 rows with guidance), GPT-XL's shapes in
# bf16, the engine's launch settings: each matrix-vector form of a block (wqkv + residual add + norm +
# RoPE, wo + residual, w1/w3 + norm + SiLU, w2, the output head) and the dense split + combine at position 300 of
# 577. Why: these kernels stream their weights at 1.4 TB/s over a step (BENCHMARKS runs 8-10), a third
# of the copy bandwidth, and timing alone had not said what holds them back (run 28: it is latency). On the H200
# (Nsight Compute reads the counters on the Firecracker machines only: see the device notes):
#   OUT=$OUT bash docs/bench/matvec-ncu.sh
# -> $OUT/matvec_ncu.csv (every metric of the sections below, per launch) and a short table printed last:
# duration, DRAM bytes and throughput, achieved and theoretical occupancy, registers, and the three
# largest warp-stall reasons. Launched plainly (not from a CUDA graph, no PDL): each kernel alone.
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
cat > /tmp/matvec_ncu.py <<'PY'
import torch
from arsparse.kernels.triton import decode_attention
from arsparse.kernels.triton import _pdl
from arsparse.kernels.triton.matvec import matvec

_pdl.ENABLED = 0  # (each kernel alone)
M, dt, dev = 2, torch.bfloat16, "cuda"
g = torch.Generator(device=dev).manual_seed(0)
r = lambda *s: (torch.randn(*s, device=dev, generator=g) * 0.02).to(dt)  # noqa: E731
x, f, nw, h = r(M, 1280), r(M, 1280), 1 + r(1280), r(M, 3584)
table = torch.rand(1, 32, 2, device=dev)
wqkv, wo, w1, w3, w2, head = r(3840, 1280), r(1280, 1280), r(3584, 1280), r(3584, 1280), r(1280, 3584), r(16384, 1280)
q, kn, vn = r(M, 20, 64), r(M, 20, 64), r(M, 20, 64)
kc, vc = r(M, 20, 577, 64), r(M, 20, 577, 64)
pos = torch.tensor(300, device=dev)
flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # (ncu flushes the caches itself; this is for the warm-up)
for _ in range(2):  # (the first round compiles; ncu counts --launch-skip past it)
    matvec(x, wqkv, add=f, norm=(nw, 1e-5), rope=(table, 2560, 64))
    matvec(x, wo, residual=x)
    matvec(x, w1, norm=(nw, 1e-5), w_up=w3)
    matvec(h, w2)
    matvec(x, head)
    decode_attention(q, kn, vn, kc, vc, pos)
    flush.zero_()
torch.cuda.synchronize()
PY
"$NCU" --clock-control none --kernel-name regex:"matvec_kernel|decode_split_kernel|combine_kernel" --launch-skip 7 \
  --launch-count 7 --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  --section MemoryWorkloadAnalysis --metrics "dram__bytes_read.sum,$(for w in long_scoreboard short_scoreboard \
  barrier wait lg_throttle mio_throttle math_pipe_throttle no_instruction drain membar not_selected selected; do
    printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' $w; done | sed 's/,$//')" \
  --csv --page details python3 /tmp/matvec_ncu.py > "$OUT/matvec_ncu.csv" 2> "$OUT/matvec_ncu.err" \
  || { echo "ncu failed:"; tail -5 "$OUT/matvec_ncu.err"; head -5 "$OUT/matvec_ncu.csv"; exit 1; }
python3 - "$OUT/matvec_ncu.csv" <<'PY'
import collections, csv, sys

lines = open(sys.argv[1]).read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
rows = list(csv.DictReader(lines[start:]))
names = ["wqkv+norm+rope", "wo+residual", "w1w3+norm+silu", "w2", "head", "dense split", "combine"]
by = collections.OrderedDict()
for row in rows:
    by.setdefault(int(row["ID"]), {})[(row["Section Name"], row["Metric Name"])] = (row["Metric Value"], row["Metric Unit"])
want = [("duration", "GPU Speed Of Light Throughput", "Duration"), ("DRAM %", "GPU Speed Of Light Throughput", "DRAM Throughput"),
        ("memory %", "GPU Speed Of Light Throughput", "Memory Throughput"),
        ("achieved occ %", "Occupancy", "Achieved Occupancy"), ("theoretical occ %", "Occupancy", "Theoretical Occupancy"),
        ("registers", "Launch Statistics", "Registers Per Thread"), ("grid", "Launch Statistics", "Grid Size"),
        ("waves", "Launch Statistics", "Waves Per SM")]
def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


print("| kernel | " + " | ".join(w[0] for w in want) + " | DRAM read | largest stalls (warps per issue) |")
print("|---" * (len(want) + 3) + "|")
for name, (kid, m) in zip(names, by.items()):
    vals = [" ".join(m.get((s, n), ("?", ""))) for _, s, n in want]
    stalls = sorted(((number(v[0]), n.split("stalled_")[1].split("_per_")[0]) for (s, n), v in m.items()
                     if "stalled_" in n and number(v[0]) is not None), reverse=True)[:3]
    dram = m.get(("Command line profiler metrics", "dram__bytes_read.sum"), ("?", ""))
    print(f"| {name} | " + " | ".join(vals) + f" | {' '.join(dram)} | " + "; ".join(f"{n} {v:.2f}" for v, n in stalls) + " |")
PY
