#!/bin/bash
# The next device calls, from the repo root on the device machine (H200), one part per call (each under
# 10 minutes), in this order of priority:
#   bash docs/bench/next-gpu-run.sh c   # every policy at batch 256 in one process, at diagonal's memory (the
#                                       # issue-4 table so far joins runs 14-17; headkv's eviction and the ring
#                                       # kernel's RoPE are newer than most of its rows)
#   bash docs/bench/next-gpu-run.sh a   # the GPU tests of every kernel and the compiled step (run 17 ran a subset)
#   bash docs/bench/next-gpu-run.sh b   # each policy at its largest batch, 576 and 1,024 tokens
# and the quality calls (issue 5; first, here: `bash docs/eval/fd-infinity.sh prepare fashion|emoji`, park
# what it lists, carry .ft): streaming's budget sweep on fashion (run 16's sweep ran out of time after
# diagonal), then emoji's baselines and sweep at 3,000 samples:
#   SAMPLES=4000 POLICIES=streaming RHOS=0.18,0.25,0.35 bash docs/eval/fd-infinity.sh sweep fashion
#   SAMPLES=3000 POLICIES=diagonal,streaming,lines,h2o,tova,headkv bash docs/eval/fd-infinity.sh run emoji
#   SAMPLES=3000 POLICIES=diagonal,streaming RHOS=0.12,0.18,0.25 bash docs/eval/fd-infinity.sh sweep emoji
# and fashion trained with diagonal's read set from its first step (issue 5's route past +13-19 % FD; session
# 20's runs, cut short, were 0.4-0.7 % above dense training on held-out NLL). One call trains (3,800 steps,
# 80 % of each batch's rows under diagonal, the rest dense: a model good both ways; `prepare fashion` first)
# and returns the weights; the next evaluates them at 4,000 samples (each call may be a fresh machine):
#   SCRATCH=1 bash docs/models/sparse-finetune.sh run fashion
#   here: cat tuned.safetensors.xz.* | xz -d > /tmp/scratch.safetensors
#         INIT=/tmp/scratch.safetensors bash docs/eval/fd-infinity.sh prepare fashion
#   SAMPLES=4000 bash docs/eval/fd-infinity.sh run fashion   # (dense,diagonal; compare with session 16's rows)
# JSON under $OUT; the last lines printed are the tables. Run with `bash ... a` (not `python -m` from
# another tree: `python -m` imports the working directory's package ahead of PYTHONPATH).
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
B() { timeout "$1" python3 -m arsparse.cli bench "${@:2}" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it\|batch/s\|s/batch"; }
R=0.1424  # diagonal's default keeps 82 of 576 positions (prompt + sinks + ring)
case ${1:?a, b or c} in
a)  # (the kernels against the reference: bench does not check outputs; 115 of these took 253 s in run 17)
  timeout 560 python3 -m pytest -q tests/test_cuda.py tests/test_kernels.py 2>&1 | tail -3 | tee "$OUT/test_cuda.txt" ;;
c)
  B 560 --image-tokens 576 --batch 256 --compile --out "$OUT/b256-576-policies.json" \
    --policies "dense;diagonal;streaming:rho=$R;lines:rho=$R;h2o:rho=$R;tova:rho=$R;headkv:rho=$R" | grep "|" ;;
b)
  B 280 --image-tokens 576 --batch max --compile --policies "dense;diagonal;streaming:rho=$R" \
    --out "$OUT/max576.json" | grep "|"
  B 300 --image-tokens 1024 --batch max --compile --policies "dense;diagonal" --out "$OUT/max1024.json" | grep "|" ;;
*) echo "part a, b or c, got $1"; exit 2 ;;
esac
