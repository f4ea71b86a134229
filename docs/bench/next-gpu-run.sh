#!/bin/bash
# The next device calls, from the repo root on the device machine (H200), one part per call (each under
# 10 minutes), in this order of priority:
#   bash docs/bench/next-gpu-run.sh a   # GPU tests of the dense kernel's forms; 576 tokens, batch 256: its settings
#   bash docs/bench/next-gpu-run.sh b   # 1,024 tokens at max batch and batch 1: the dense kernel's variants
#   bash docs/bench/next-gpu-run.sh c   # 576 tokens, batch 256: every policy in one table (issue 4), compiled
# and the quality calls (issue 5; first, here: `bash docs/eval/fd-infinity.sh prepare fashion|emoji`, park
# what it lists, carry .ft): fashion's diagonal at 5,000 samples sampled at its entropy-matched temperature
# (session 15, CPU: KID MobileNetV2 4.8 -> 1.7 x 10^-3 against dense's 1.2), every policy at diagonal's memory,
# then where diagonal and streaming cross 2 %:
#   POLICIES=dense,diagonal EVAL_ARGS=--match-entropy bash docs/eval/fd-infinity.sh run fashion
#   SAMPLES=4000 POLICIES=diagonal,streaming,lines,h2o,tova,headkv bash docs/eval/fd-infinity.sh run fashion
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
D="dense.block_n=64,dense.prefetch=1"  # the dense split kernel loading its next tile first (untimed)
case ${1:?a, b or c} in
a)  # (the new kernel forms against the reference first: bench does not check outputs)
  timeout 120 python3 -m pytest -q tests/test_cuda.py -k "fused_dense or tensor_core" 2>&1 | tail -3 | tee "$OUT/test_cuda.txt"
  B 300 --image-tokens 576 --batch 256 --compile --profile --policies "dense;diagonal" --variant "$D" \
    --variant dense.block_n=64 --variant dense.num_warps=4 --variant "$D,dense.num_warps=4" --variant dense.num_stages=2 \
    --out "$OUT/b256-576-dense-launch.json" | grep -v "^  " | tail -14 ;;
c)
  B 500 --image-tokens 576 --batch 256 --compile --out "$OUT/b256-576-policies.json" \
    --policies "dense;diagonal;streaming:rho=$R;lines:rho=$R;h2o:rho=$R;tova:rho=$R;headkv:rho=$R" | tail -9 ;;
b)
  B 400 --image-tokens 1024 --batch max --compile --policies "dense;diagonal" --variant dense.dot=1 --variant "$D" \
    --out "$OUT/max1024.json" | tail -6
  B 150 --image-tokens 576 --batch 1 --matvec --profile --policies "dense;diagonal" --variant dense.prefetch=1 \
    --out "$OUT/b1-576.json" | grep -v "^  " | tail -6 ;;
*) echo "part a, b or c, got $1"; exit 2 ;;
esac
