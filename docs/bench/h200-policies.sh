#!/bin/bash
# The policy benchmarks of BENCHMARKS.md, run from the repo root on the device machine (H200):
#   bash docs/bench/h200-policies.sh a|b|c|d|e   (device calls; c = after the kernel sweep; d = after fusing the K/V
#   writes into the dense and ring kernels; e = compile modes, compiled max batch, scored policies after
#   run 4; .llamagen = a LlamaGen checkout, carried)
# Each part has its own time limit; JSON under $OUT.
export PYTHONPATH=. TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
B() { timeout "$1" python3 -m arsparse.cli bench "${@:2}" 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it\|batch/s\|s/batch"; }
R576=0.1424  # diagonal's default keeps 82 of 576 positions (prompt + sinks + ring)
R1024=0.1035  # 106 of 1024
if [ "$1" = a ]; then
timeout 100 python3 -m pytest -q tests/test_cuda.py 2>&1 | tail -3
B 200 --image-tokens 576 --batch 256,max --policies "dense;diagonal;streaming:rho=$R576" --llamagen-src .llamagen \
    --out $OUT/bench576.json
B 80 --image-tokens 576 --batch 1 --compile --policies "dense;diagonal" --out $OUT/bench576_b1.json
B 80 --image-tokens 4096 --batch 1 --compile --policies "dense;diagonal" --out $OUT/bench4096_b1.json
B 130 --image-tokens 576 --batch 256 --policies "lines:rho=$R576;h2o:rho=$R576;tova:rho=$R576;headkv:rho=$R576" \
    --out $OUT/bench576_scored.json
elif [ "$1" = c ]; then
B 130 --image-tokens 576 --batch 256 --compile --policies "dense;diagonal;lines:rho=$R576;h2o:rho=$R576;tova:rho=$R576;headkv:rho=$R576" \
    --out $OUT/bench576_compiled.json
B 100 --image-tokens 4096 --batch 1 --compile --policies "diagonal;dense" --out $OUT/bench4096_b1.json
B 200 --image-tokens 1024 --batch max --policies "dense;diagonal" --out $OUT/bench1024.json
elif [ "$1" = d ]; then
# test_cuda alone (with the interpreter tests in the same session every kernel would run interpreted)
timeout 300 python3 -m pytest -q tests/test_cuda.py tests/test_serve_engine.py 2>&1 | tail -3
B 120 --image-tokens 576 --batch 256 --compile --profile --policies "dense;diagonal" --out $OUT/bench576_fused.json
B 80 --image-tokens 576 --batch 1 --compile --policies "dense;diagonal" --out $OUT/bench576_b1_fused.json
elif [ "$1" = e ]; then
B 150 --image-tokens 576 --batch 1 --compile max-autotune-no-cudagraphs --policies "dense;diagonal" \
    --out $OUT/bench576_b1_autotune.json
B 220 --image-tokens 1024 --batch max --compile --policies "dense;diagonal;streaming:rho=$R1024" \
    --out $OUT/bench1024_compiled.json
B 150 --image-tokens 576 --batch 256 --compile --profile \
    --policies "lines:rho=$R576;h2o:rho=$R576;tova:rho=$R576;headkv:rho=$R576" --out $OUT/bench576_scored.json
else
timeout 60 python3 -m pytest -q tests/test_cuda.py -k "slot_kernel or scored_policy_triton" 2>&1 | tail -2
timeout 90 python3 -c "
import json, torch
from arsparse.reference_sampler import time_llamagen
r = time_llamagen('.llamagen', 'GPT-XL', 576, 256, cfg_scale=4.0)
print(r); json.dump(dict(r, gpu=torch.cuda.get_device_name(), torch=torch.__version__), open('$OUT/llamagen576.json', 'w'))
" 2>&1 | grep -v Warn
B 100 --image-tokens 576 --batch 256 --compile --profile --policies "dense;diagonal" --out $OUT/bench576_compiled.json
B 80 --image-tokens 576 --batch 256 --profile --policies "lines:rho=$R576;h2o:rho=$R576;tova:rho=$R576;headkv:rho=$R576" \
    --out $OUT/bench576_scored.json
B 70 --image-tokens 4096 --batch 1 --compile --policies "dense;diagonal" --out $OUT/bench4096_b1.json
B 170 --image-tokens 1024 --batch max --policies "dense;diagonal;streaming:rho=$R1024" --out $OUT/bench1024.json
fi
