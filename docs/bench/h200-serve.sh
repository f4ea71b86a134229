#!/bin/bash
# The serving benchmark of BENCHMARKS.md (issue 7), from the repo root on the device machine (H200):
#   bash docs/bench/h200-serve.sh        (one device call of about 2 minutes for both policies; carry .whl)
# The GPU image has no fastapi/uvicorn/pydantic: .whl holds their wheels (py3.12; fetch them here with
# `pip download --no-deps --only-binary=:all: --python-version 3.12 ...` as the device README says:
# fastapi starlette pydantic pydantic_core uvicorn annotated-types typing-inspection typing_extensions
# opentelemetry-api, the versions of the CPU venv).
# What it measures: `arsparse serve-bench` starts the real server (uvicorn, loopback) on GPT-XL with
# random weights and a VQ-16 decoder at 384 px (576 tokens, guidance 4), drives it with a closed loop
# of CONC concurrent clients (in a process of their own) sending REQS requests of one image each
# after WARMUP untimed ones, and reports requests/s, p50/p99 latency, the largest running batch and
# where the decode worker's time went (step launches, waiting for the device, prefills, image decodes,
# idle), for dense and diagonal. The queue holds CONC requests, so a steady load gets no 429 (a 429 would be retried
# after Retry-After and counted in "retries"); "failures" are requests that never got images, the
# first few with their status and reason in "failure_details". JSON under $OUT.
# Knobs (environment): REQS (256), CONC (128), WARMUP (64), MAXB (256: images decoded at once), MODEL
# (random-gpt-xl-384), POLICIES ("dense diagonal"), DEVICE (cuda), EXTRA (more serve-bench flags,
# e.g. --client-in-process to compare with clients sharing the server's process), TIMEOUT (150 s
# per policy), WHEELS (.whl; "none" on a machine that has the serve extra, e.g. a CPU smoke run).
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
    rm -f "$OUT/serve-$p.json"
    timeout "${TIMEOUT:-150}" python3 -m arsparse.cli serve-bench --model "${MODEL:-random-gpt-xl-384}" --policy "$p" \
        --device "${DEVICE:-cuda}" --requests "${REQS:-256}" --concurrency "${CONC:-128}" --warmup "${WARMUP:-64}" \
        --max-batch "${MAXB:-256}" --out "$OUT/serve-$p.json" ${EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "it/s\|s/it"
    python3 - "$OUT/serve-$p.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except (OSError, ValueError) as e:
    sys.exit(f"no result: {e}")
w = d["worker"]
print(f"{d['policy']}: {d['requests_per_s']:.2f} req/s, p50 {d['latency_p50_s']:.2f} s, p99 {d['latency_p99_s']:.2f} s, "
      f"max running {d['max_running_images']} of {d['slots']} slots, {d['failures']} failures "
      f"{d['failure_details'][:2]}, {d['retries']} retries; worker per step: {w['busy_ms_per_step']:.2f} ms busy, "
      f"{w['step_ms']:.2f} ms launching; s: step {w['step_s']:.1f} device {w['device_s']:.1f} admit {w['admit_s']:.1f} finish {w['finish_s']:.1f} "
      f"idle {w['idle_s']:.1f} other {w['other_s']:.1f} of {w['worker_s']:.1f}")
PY
done
