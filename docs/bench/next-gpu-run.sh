#!/bin/bash
# The device calls that time what BENCHMARKS.md lists under "Changed since the last GPU run, not yet
# timed", from the repo root on the device machine (H200), one part per call (each under 10 minutes), in
# this order of priority:
#   bash docs/bench/next-gpu-run.sh a   # 576 tokens, batch 256: run 12's kernels, the new default, variants
#   bash docs/bench/next-gpu-run.sh b   # 1,024 tokens, each policy at its largest batch, variants
#   bash docs/bench/next-gpu-run.sh t   # GPU tests of the new kernel forms; batch 1 (latency mode), variants
# JSON and test logs under $OUT; the last lines printed are the tables. For the baseline of run 12's
# kernels in the same call, first (here): mkdir .run12 && git archive 5738a87 arsparse ':!arsparse/weights' |
# tar -x -C .run12 (untracked, so the call's tree carries it; remove it after).
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
B() { timeout "$1" python3 -m arsparse.cli bench "${@:2}" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it\|batch/s\|s/batch"; }
TC="ring.dot=1"  # the ring kernel's products on tensor cores
case ${1:?a, b or t} in
a)
  [ -d .run12 ] && PYTHONPATH=.run12 B 130 --image-tokens 576 --batch 256 --compile --profile \
    --policies "dense;diagonal" --out "$OUT/b256-576-run12-kernels.json" | tail -6
  B 420 --image-tokens 576 --batch 256 --compile --profile --policies "dense;diagonal" --variant "$TC" \
    --variant "$TC,ring.num_warps=2" --variant "$TC,ring.rows_per_program=4,ring.num_stages=2" \
    --variant dense_dot=1 --variant ring.rows_per_program=2 --out "$OUT/b256-576.json" | tail -20 ;;
b)
  B 560 --image-tokens 1024 --batch max --compile --policies "dense;diagonal" --variant "$TC" \
    --variant "$TC,dense_dot=1,streams=2" --out "$OUT/max1024.json" | tail -12 ;;
t)
  timeout 300 python3 -m pytest -q tests/test_cuda.py -k "fused_ring_kernel or masked_ring or tensor_core or fused_dense \
or folded or programmatic" 2>&1 | tail -4 | tee "$OUT/test_cuda.txt"
  B 240 --image-tokens 576 --batch 1 --matvec --profile --policies "dense;diagonal" --variant fold=1 \
    --variant "fold=1,dense_dot=1,$TC" --out "$OUT/b1-576.json" | tail -10 ;;
*) echo "part a, b or t, got $1"; exit 2 ;;
esac
