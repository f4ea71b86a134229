#!/usr/bin/env bash
# Quality of every policy on a shipped model, on one GPU, in one device call of at most LIMIT seconds
# (default 560 = 9 min 20 s):
#
#   bash docs/eval/gpu-eval.sh [fashion|emoji]      # from the repository root, on the GPU machine
#
# 1. check  GPU tests: teacher forcing of scored policies replayed from a CUDA graph == the eager
#           loop (tests/test_eval_sweep.py -k cuda). If they fail, 2 and 3 run with --no-cuda-graphs
#           (eager, several times slower) on fewer budgets, and the log says so.
# 2. sweep  arsparse eval --sweep-rho RHOS: teacher-forced NLL of every policy at each budget on
#           NLL_IMAGES held-out images; where each comes within 2% of dense -> sweep.json/.md/.png
# 3. eval   arsparse eval --match-budget: every policy at diagonal's default budget, SAMPLES images per
#           policy (Fréchet distances in the classifier's and MobileNetV2's features, class accuracy,
#           NLL/KL/top-1 on the same NLL_IMAGES) -> eval.json, eval.md, grids.tar (grid-POLICY.png)
# then a short table of both. Both runs write their JSON after every policy, so a run cut short by its
# time limit still returns what it measured (marked partial).
#
# Policies: dense,diagonal,streaming,h2o,tova,lines,headkv,adsa. fp32 throughout (DTYPE), so bf16
# rounding does not blur a 2% criterion.
#
# Measured on an H200 (2026-11-30, BENCHMARKS.md "Quality on the GPU"): fashion-c2i 265 s in all
# (check 11 s, sweep 151 s, eval 96 s: 1,000 samples x 8 policies); emoji-c2i (1,024 steps) check 13 s,
# sweep cut at 190 s with adsa still to run (about 240 s needed), eval 126 s. The default limits below
# give both models their whole sweep in one call.
# The sweep gets at most SWEEP_S seconds (default 300) and the eval what is left; the log has
# each stage's wall time for tuning the next call.
#
# Needs no network. Carry (ignored folders, ARSPARSE_DATA=.data):
#   fashion: .data/fashion-mnist (the four Fashion-MNIST .gz files), .evalassets
#            (mobilenet_v2-b0353104.pth: ARSPARSE_MOBILENET)                       ~45 MB
#   emoji:   .data/emoji (emoji-64.npz), .evalassets, and the emoji-c2i weights in arsparse/weights
#            (emoji-c2i.safetensors, emoji-vq.safetensors; they travel as files of the tree)
# Output in $OUT, 7 files (each far below 16 MiB): sweep.json sweep.md sweep.png eval.json eval.md
# grids.tar log.txt.
# Knobs (environment): SAMPLES (1000), NLL_IMAGES (512), RHOS (0.06,0.09,0.12,0.18,0.25,0.35,0.5),
# FD_BOOTSTRAP (0; e.g. 100: the eval's 95% intervals of the Fréchet gaps; 100 resamples of 1,000 MobileNetV2
# features took 18 s per policy on 2 CPU cores), FD_INFINITY (0; 1: the eval's Fréchet distances also
# extrapolated to infinitely many samples, whose gaps are not shrunk by the finite-sample bias: BENCHMARKS
# session 12; wants SAMPLES of a few times 1,280, MobileNetV2's dimension), LIMIT (560), SWEEP_S (300), STAGES (check,sweep,eval: e.g.
# STAGES=sweep SWEEP_S=500 gives a call to the
# sweep alone), DTYPE (fp32), POLICIES, PYTHON (python3), OUT, EVAL_ARGS (more flags for
# both runs; a CPU smoke test of this script: EVAL_ARGS="--device cpu --ref-images 200" SAMPLES=4 ...),
# SWEEP_ARGS (more flags for the sweep alone: e.g. "--sweep-frechet --num-samples 1000" for the Fréchet
# distances at every budget, a generation each).
set -uo pipefail
root=$(cd "$(dirname "$0")" && pwd)
while [ ! -f "$root/pyproject.toml" ] && [ "$root" != / ]; do root=$(dirname "$root"); done
cd "$root"
WHICH=${1:-fashion}
case "$WHICH" in
    fashion) MODEL=fashion-c2i ;;
    emoji) MODEL=emoji-c2i ;;
    *) echo "gpu-eval: unknown model '$WHICH': use fashion or emoji" >&2; exit 2 ;;
esac
export PYTHONPATH=. PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 ARSPARSE_DATA=${ARSPARSE_DATA:-.data}
MOBILENET=${ARSPARSE_MOBILENET:-.evalassets/mobilenet_v2-b0353104.pth}
unset ARSPARSE_MOBILENET
PY=${PYTHON:-python3}
LIMIT=${LIMIT:-560} SWEEP_S=${SWEEP_S:-300}
SAMPLES=${SAMPLES:-1000} NLL_IMAGES=${NLL_IMAGES:-512} DTYPE=${DTYPE:-fp32} FD_BOOTSTRAP=${FD_BOOTSTRAP:-0}
FD_INFINITY=${FD_INFINITY:-0}
case "$FD_INFINITY" in 0|1) ;; *) echo "gpu-eval: FD_INFINITY is 0 or 1, got '$FD_INFINITY'" >&2; exit 2 ;; esac
RHOS=${RHOS:-0.06,0.09,0.12,0.18,0.25,0.35,0.5}
POLICIES=${POLICIES:-dense,diagonal,streaming,h2o,tova,lines,headkv,adsa}
STAGES=,${STAGES:-check,sweep,eval},
want() { [[ $STAGES == *",$1,"* ]]; }
OUT=${OUT:-out/gpu-eval-pack}
WORK=out/gpu-eval/$WHICH
mkdir -p "$OUT" "$WORK"
rm -rf "$WORK"/sweep "$WORK"/eval
START=$SECONDS
left() { echo $((LIMIT - (SECONDS - START))); }
LOG=$OUT/log.txt
: > "$LOG"
say() { echo "$@" | tee -a "$LOG"; }
# progress bars -> lines, rates dropped (they make most of a bar's output)
quiet_bars() { tr '\r' '\n' | grep --line-buffered -v "it/s\|s/it\|batch/s\|s/batch\|pass/s\|s/pass\|tok/s\|s/tok"; }
stage() {  # stage NAME SECONDS CMD...: run with a time limit, log it, report rc and wall time
    local name=$1 t=$2; shift 2
    local s=$SECONDS
    say "== $name (limit ${t}s): $*"
    timeout --signal=TERM --kill-after=10 "$t" "$@" 2>&1 | quiet_bars >> "$LOG"
    local rc=${PIPESTATUS[0]}
    say "== $name: rc=$rc wall=$((SECONDS - s))s$([ "$rc" = 124 ] && echo ' (TIMED OUT: partial results)')"
    return "$rc"
}
pack() {  # copy what exists so far into $OUT
    for f in "$WORK"/sweep/sweep.{json,md,png} "$WORK"/eval/eval.{json,md}; do [ -f "$f" ] && cp "$f" "$OUT/"; done
    if ls "$WORK"/eval/grid-*.png >/dev/null 2>&1; then
        tar -C "$WORK/eval" -cf "$OUT/grids.tar" $(cd "$WORK/eval" && ls grid-*.png)
    fi
}

say "gpu-eval $WHICH: model $MODEL, policies $POLICIES, $SAMPLES samples, $NLL_IMAGES NLL images, rho $RHOS, $DTYPE"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$LOG"
if [ "$WHICH" = fashion ] && ! ls "$ARSPARSE_DATA"/fashion-mnist/t10k-images-idx3-ubyte* >/dev/null 2>&1; then
    say "gpu-eval: WARNING: no Fashion-MNIST in $ARSPARSE_DATA/fashion-mnist (carry .data/fashion-mnist): NLL and" \
        "the Fréchet reference fall back to the model's own samples"
fi
if [ "$WHICH" = emoji ]; then
    if [ ! -f arsparse/weights/emoji-c2i.safetensors ] || [ ! -f arsparse/weights/emoji-vq.safetensors ]; then
        say "gpu-eval: arsparse/weights/emoji-c2i.safetensors or emoji-vq.safetensors is missing: train them" \
            "(docs/models/emoji-train.sh) and put them there first"
        exit 2
    fi
    [ -f "$ARSPARSE_DATA/emoji/emoji-64.npz" ] || say "gpu-eval: WARNING: no $ARSPARSE_DATA/emoji/emoji-64.npz (carry .data/emoji)"
fi
if [ -f "$MOBILENET" ]; then
    export ARSPARSE_MOBILENET=$MOBILENET
else
    say "gpu-eval: WARNING: no MobileNetV2 weights at $MOBILENET (carry .evalassets): fd_mobilenet stays empty"
fi

GRAPHS=()
if want check && ! stage check 120 "$PY" -m pytest -q -x tests/test_eval_sweep.py -k cuda -p no:cacheprovider; then
    say "gpu-eval: WARNING: graphed teacher forcing failed its check: running eagerly (--no-cuda-graphs) on 3 budgets"
    GRAPHS=(--no-cuda-graphs)
    RHOS=0.12,0.25,0.5
fi

common=(--model "$MODEL" --policies "$POLICIES" --nll-images "$NLL_IMAGES" --nll-batch "$NLL_IMAGES"
        --dtype "$DTYPE" ${GRAPHS[@]+"${GRAPHS[@]}"} ${EVAL_ARGS:-})
if want sweep; then
    t=$(left); t=$(( t - 60 < SWEEP_S ? t - 60 : SWEEP_S )); t=$(( t > 30 ? t : 30 ))
    want eval || t=$(( $(left) - 15 < SWEEP_S ? $(left) - 15 : SWEEP_S ))
    stage sweep "$t" "$PY" -m arsparse.cli eval "${common[@]}" --sweep-rho "$RHOS" ${SWEEP_ARGS:-} --out "$WORK/sweep"
    pack
fi
if want eval; then
    t=$(left); t=$(( t - 15 > 30 ? t - 15 : 30 ))
    stage eval "$t" "$PY" -m arsparse.cli eval "${common[@]}" --match-budget --num-samples "$SAMPLES" \
        --batch-size 500 --fd-bootstrap "$FD_BOOTSTRAP" $([ "$FD_INFINITY" = 1 ] && echo --fd-infinity) \
        --out "$WORK/eval"
    pack
fi

"$PY" - "$WORK" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path

work = Path(sys.argv[1])
ev = json.loads((work / "eval/eval.json").read_text()) if (work / "eval/eval.json").is_file() else None
sw = json.loads((work / "sweep/sweep.json").read_text()) if (work / "sweep/sweep.json").is_file() else None
def pct(v):
    return "—" if v is None else f"{v:+.1f}%"
print()
if ev:
    print(f"eval ({ev['model']}, {ev['config']['num_samples']} samples, {'complete' if ev.get('complete', True) else 'PARTIAL'}, {ev['wall_s']:.0f} s)")
    print(f"{'policy':<10} {'kept/dense':>10} {'NLL b/tok':>10} {'NLL':>8} {'FD clf':>8} {'FD mob':>8} {'cls acc':>8}")
    for r in ev["rows"]:
        nll = r["nll_bits_per_token"]
        print(f"{r['policy']:<10} {r['budget']['rho']:>10.3f} {nll if nll is None else round(nll, 4)!s:>10} "
              f"{pct(r['nll_bits_per_token_delta_pct']):>8} {pct(r['fd_classifier_delta_pct']):>8} "
              f"{pct(r['fd_mobilenet_delta_pct']):>8} {r['class_accuracy'] if r['class_accuracy'] is None else round(r['class_accuracy'], 3)!s:>8}")
if sw:
    print(f"\nsweep ({'complete' if sw['complete'] else 'PARTIAL'}, {sw['wall_s']:.0f} s): kept/dense from which each "
          f"policy stays within {100 * sw['tolerance']:g}% of dense")
    for name, per in sw["crossings"].items():
        print(f"{name:<10} " + "  ".join(f"{m}: {c['text']}" for m, c in per.items()))
EOF
say "gpu-eval: done in $((SECONDS - START)) s; files in $OUT:"
ls -l "$OUT" | tee -a "$LOG"
