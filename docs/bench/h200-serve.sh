#!/bin/bash
# The serving benchmark of BENCHMARKS.md (issue 7), from the repo root on the device machine (H200):
#   bash docs/bench/h200-serve.sh        (one device call of about 3-5 minutes; carry .whl)
# The GPU image has no fastapi/uvicorn/pydantic: .whl holds their wheels (py3.12; fetch them here with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` as the device README says:
# fastapi starlette pydantic pydantic_core uvicorn annotated-types typing-inspection typing_extensions
# opentelemetry-api, the versions of the CPU venv).
# What it measures: `arsparse serve-bench` starts the real server (uvicorn, loopback) on GPT-XL with
# random weights and a VQ-16 decoder at 384 px (576 tokens, guidance 4), drives it with a closed loop
# of CONC concurrent clients sending REQS requests of one image each, and reports requests/s,
# p50/p99 latency and the largest running batch, for dense and diagonal. JSON under $OUT.
# Knobs (environment): REQS (1024), CONC (512), MAXB (512: images decoded at once), MODEL
# (random-gpt-xl-384), POLICIES ("dense diagonal"), DEVICE (cuda), EXTRA (more serve-bench flags),
# WHEELS (.whl; "none" on a machine that has the serve extra, e.g. a CPU smoke run).
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -d "${WHEELS:-.whl}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${WHEELS:-.whl}"/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:.
else
    export PYTHONPATH=.
fi
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
for p in ${POLICIES:-dense diagonal}; do
    timeout 280 python3 -m arsparse.cli serve-bench --model "${MODEL:-random-gpt-xl-384}" --policy "$p" \
        --device "${DEVICE:-cuda}" --requests "${REQS:-1024}" --concurrency "${CONC:-512}" \
        --max-batch "${MAXB:-512}" --out "$OUT/serve-$p.json" ${EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it"
done
