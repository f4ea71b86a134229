#!/bin/bash
# The next device calls, from the repo root on the device machine (H200), one part per call (each under
# 10 minutes), in this order of priority:
#   bash docs/bench/next-gpu-run.sh c   # headkv's eviction kernels (session 17: one victim a step without pairwise
#                                       # ranks; untimed) checked on the GPU, then headkv beside dense at batch 256
#   bash docs/bench/next-gpu-run.sh a   # the GPU tests of the dense, slot and eviction kernels and the compiled step
#   bash docs/bench/next-gpu-run.sh b   # 1,024 tokens at max batch (dense.dot) and batch 1 at 576
# and the quality calls (issue 5; first, here: `bash docs/eval/fd-infinity.sh prepare fashion|emoji`, park
# what it lists, carry .ft): headkv at diagonal's memory (the one baseline missing at 4,000 samples), where
# diagonal and streaming cross 2 % (raw, extrapolated and KID), then emoji's baselines:
#   SAMPLES=4000 POLICIES=headkv bash docs/eval/fd-infinity.sh run fashion
#   SAMPLES=4000 POLICIES=diagonal,streaming bash docs/eval/fd-infinity.sh sweep fashion
#   SAMPLES=3000 POLICIES=diagonal,streaming,lines,h2o,tova,headkv bash docs/eval/fd-infinity.sh run emoji
#   SAMPLES=3000 POLICIES=diagonal,streaming RHOS=0.12,0.18,0.25 bash docs/eval/fd-infinity.sh sweep emoji
# JSON under $OUT; the last lines printed are the tables. Run with `bash ... a` (not `python -m` from
# another tree: `python -m` imports the working directory's package ahead of PYTHONPATH).
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
B() { timeout "$1" python3 -m arsparse.cli bench "${@:2}" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it\|batch/s\|s/batch"; }
R=0.1424  # diagonal's default keeps 82 of 576 positions (prompt + sinks + ring)
case ${1:?a, b or c} in
a)  # (the kernels against the reference: bench does not check outputs)
  timeout 400 python3 -m pytest -q tests/test_cuda.py -k "fused_dense or tensor_core or slot or scored or policy_caches or compiled_step or evict" 2>&1 | tail -3 | tee "$OUT/test_cuda.txt" ;;
c)
  timeout 90 python3 -m pytest -q tests/test_cuda.py -k "evict or scored_policy" 2>&1 | tail -2
  B 400 --image-tokens 576 --batch 256 --compile --profile --out "$OUT/b256-576-headkv.json" \
    --policies "dense;headkv:rho=$R" | grep -v "^  dense" | tail -12 ;;
b)
  B 400 --image-tokens 1024 --batch max --compile --policies "dense;diagonal" --variant dense.dot=1 \
    --out "$OUT/max1024.json" | tail -5
  B 150 --image-tokens 576 --batch 1 --matvec --profile --policies "dense;diagonal" \
    --out "$OUT/b1-576.json" | grep -v "^  " | tail -4 ;;
*) echo "part a, b or c, got $1"; exit 2 ;;
esac
