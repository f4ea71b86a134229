#!/usr/bin/env bash
# Train the shipped emoji-c2i model (VQ tokenizer, then GPT, then the bundle with its model card)
# on one GPU, in resumable chunks that each end before LIMIT seconds (default 540 = 9 minutes).
#
#   bash docs/models/emoji-train.sh [all|gpt|eval]  # from the repository root, on the GPU machine
#
# `all` does as much as fits in LIMIT and can simply be run again until it prints "emoji-train: DONE":
#   1. VQ:     arsparse train tokenizer --dataset emoji        (4000 steps of 128, 7.7 min)
#   2. GPT:    arsparse train model --dataset emoji            (2000 steps of 128 with dropout 0.1, est. 5.5 min
#                                                               + tokenising; keeps the best held-out weights)
#   3. export: arsparse train export --model emoji-c2i         (ships the best held-out step: sample grids at 3
#                                                               guidance scales, card; < 1 min)
# `gpt` is `all` on the shipped VQ: it first copies arsparse/weights/emoji-vq.safetensors and its log
#   docs/models/emoji-vq-train_log.json into out/emoji-vq (when no VQ is there), so only the GPT is trained
#   (and exported with that VQ, which its header names by sha256). A folder out/emoji-c2i or out/emoji-ship
#   left by an earlier recipe must be removed first (a checkpoint of another config does not resume).
#   With the VQ in place the GPT run fits one call; split over two machines, its best.safetensors is not in
#   state.tar (too big to carry with the rest), so best-checkpoint selection restarts at the resumed step
#   and the card says so.
# `eval` (optional, after DONE): arsparse eval --model emoji-c2i with the new weights (est. 3-5 min).
#
# Needs no network: the data is read from .data/emoji/emoji-64.npz (ARSPARSE_DATA=.data), which the
# caller carries (18 MB; make it once where npm works:
#   PYTHONPATH=. python -m arsparse.cli data fetch emoji && mkdir -p .data/emoji &&
#   cp ~/.cache/arsparse/emoji/emoji-64.npz .data/emoji/
# and carry ".data/emoji").
# State lives in out/emoji-vq, out/emoji-c2i, out/emoji-ship (kept between calls on a warm machine).
# Every call also leaves in $OUT one tar in parts of at most 15 MiB (reassemble: cat X.tar.part-* | tar xf -):
#   ship.tar  (once exported) out/emoji-ship/: emoji-c2i.safetensors, emoji-vq.safetensors, emoji-c2i.md,
#             emoji-c2i-samples*.png, *-train_log.json
#   state.tar (before that)   what resumes on a fresh machine: out/emoji-vq/{emoji-vq.safetensors or a portable
#             ckpt.pt, train_log.json}, out/emoji-c2i/{portable ckpt.pt, train_log.json}; extract it in the
#             repository root and carry out/emoji-vq, out/emoji-c2i and .data/emoji (63 MB at most: < 64 MiB).
#   eval.tar  (eval)          out/emoji-eval/: eval.json, eval.md, grid-*.png
#
# Knobs (environment): LIMIT (seconds per call), OUT, PYTHON, DEVICE (cuda), ARSPARSE_DATA (.data), and
# VQ_ARGS / GPT_ARGS / EXPORT_ARGS: extra flags for the three steps (e.g. a tiny CPU smoke run of this script).
set -euo pipefail
root=$(cd "$(dirname "$0")" && pwd)  # the repository root: the first folder up from here with pyproject.toml
while [ ! -f "$root/pyproject.toml" ] && [ "$root" != / ]; do root=$(dirname "$root"); done
cd "$root"
export PYTHONPATH=. ARSPARSE_DATA=${ARSPARSE_DATA:-.data}
PY=${PYTHON:-python}
LIMIT=${LIMIT:-540}
OUT=${OUT:-out/emoji-pack}
DEVICE=${DEVICE:-cuda}
VQ=out/emoji-vq GPT=out/emoji-c2i SHIP=out/emoji-ship
MODE=${1:-all}
case "$MODE" in all|gpt|eval) ;; *) echo "emoji-train: unknown mode '$MODE' (all, gpt or eval)" >&2; exit 2 ;; esac
mkdir -p "$OUT"
START=$SECONDS
left() { echo $((LIMIT - (SECONDS - START))); }
arsparse() { "$PY" -m arsparse.cli "$@"; }

# tar FILES (relative to ROOT) into $OUT/NAME.tar.part-N, 15 MiB each
pack() {
    local name=$1 root=$2; shift 2
    rm -f "$OUT/$name".tar.part-*
    tar cf - -C "$root" "$@" | split -b 15M -d -a 1 - "$OUT/$name.tar.part-"
    ls -l "$OUT"/"$name".tar.part-*
}

status() {
    "$PY" - <<'EOF'
import json, pathlib
for name, d in (("vq", "out/emoji-vq"), ("gpt", "out/emoji-c2i")):
    p = pathlib.Path(d) / "train_log.json"
    if p.is_file():
        r = json.loads(p.read_text())
        best = r["history"].get("best")
        print(f"emoji-train: {name} {'finished' if r['finished'] else 'at'} step {r['step']}/{r['steps']}, "
              f"{r['train_time_s'] / 60:.1f} min of training"
              + (f", best held-out {best['val_bpt']:.3f} bits/token at step {best['step']}" if best else ""))
    else:
        print(f"emoji-train: {name} not started")
EOF
}

if [ ! -f "$ARSPARSE_DATA/emoji/emoji-64.npz" ]; then
    echo "emoji-train: $ARSPARSE_DATA/emoji/emoji-64.npz is missing: make it with" \
         "'PYTHONPATH=. python -m arsparse.cli data fetch emoji && mkdir -p .data/emoji &&" \
         "cp ~/.cache/arsparse/emoji/emoji-64.npz .data/emoji/' and carry .data/emoji" >&2
    exit 2
fi

if [ "$MODE" = eval ]; then
    [ -f "$SHIP/emoji-c2i.md" ] || { echo "emoji-train: no exported bundle in $SHIP: run 'all' first" >&2; exit 2; }
    cp "$SHIP/emoji-c2i.safetensors" "$SHIP/emoji-vq.safetensors" arsparse/weights/  # this machine's copy only
    arsparse eval --model emoji-c2i --num-samples 500 --device "$DEVICE" --out out/emoji-eval --quiet
    pack eval out emoji-eval
    exit 0
fi

# 1. the VQ tokenizer (`gpt`: the shipped one)
if [ "$MODE" = gpt ] && [ ! -f "$VQ/emoji-vq.safetensors" ]; then
    mkdir -p "$VQ"
    cp arsparse/weights/emoji-vq.safetensors "$VQ/"
    cp docs/models/emoji-vq-train_log.json "$VQ/train_log.json"
    echo "emoji-train: using the shipped VQ (arsparse/weights/emoji-vq.safetensors)"
fi
if [ ! -f "$VQ/emoji-vq.safetensors" ]; then
    arsparse train tokenizer --dataset emoji --device "$DEVICE" --out "$VQ" --time-limit "$(left)" --resume --quiet \
        ${VQ_ARGS:-}
fi
# 2. the GPT (tokenises the data with the VQ first, once, cached in .data/emoji)
if [ -f "$VQ/emoji-vq.safetensors" ] && [ ! -f "$GPT/model.safetensors" ] && [ "$(left)" -gt 150 ]; then
    arsparse train model --dataset emoji --device "$DEVICE" --vq "$VQ/emoji-vq.safetensors" --out "$GPT" \
        --time-limit "$(left)" --resume --quiet ${GPT_ARGS:-}
fi
# 3. the bundle: weights under their shipped names, sample grids, logs, model card
if [ -f "$GPT/model.safetensors" ] && [ ! -f "$SHIP/emoji-c2i.md" ] && [ "$(left)" -gt 60 ]; then
    arsparse train export --model emoji-c2i --gpt-dir "$GPT" --vq-dir "$VQ" --out "$SHIP" --device "$DEVICE" --quiet \
        ${EXPORT_ARGS:-} \
        --command "ARSPARSE_DATA=.data arsparse data fetch emoji" \
        --command "arsparse train tokenizer --dataset emoji --device cuda --out $VQ --time-limit 540 --resume" \
        --command "arsparse train model --dataset emoji --device cuda --vq $VQ/emoji-vq.safetensors --out $GPT --time-limit 540 --resume" \
        --command "arsparse train export --model emoji-c2i --gpt-dir $GPT --vq-dir $VQ --out $SHIP"
fi

status
if [ -f "$SHIP/emoji-c2i.md" ]; then
    pack ship out emoji-ship
    echo "emoji-train: DONE (in \$OUT: ship.tar.part-*; optional next: bash docs/models/emoji-train.sh eval)"
else
    rm -rf out/emoji-state && mkdir -p out/emoji-state/out/emoji-vq out/emoji-state/out/emoji-c2i
    files=()
    for d in "$VQ" "$GPT"; do
        [ -f "$d/train_log.json" ] && cp "$d/train_log.json" "out/emoji-state/$d/" && files+=("$d/train_log.json")
    done
    if [ -f "$VQ/emoji-vq.safetensors" ]; then
        cp "$VQ/emoji-vq.safetensors" out/emoji-state/$VQ/ && files+=("$VQ/emoji-vq.safetensors")
    fi
    for d in "$VQ" "$GPT"; do  # unfinished runs: a portable checkpoint (fp16 weights, no optimiser state)
        if [ -f "$d/ckpt.pt" ] && { [ "$d" = "$GPT" ] || [ ! -f "$VQ/emoji-vq.safetensors" ]; }; then
            "$PY" -c "import sys; from arsparse.training.trainer import portable_checkpoint as p; p(*sys.argv[1:])" \
                "$d/ckpt.pt" "out/emoji-state/$d/ckpt.pt"
            files+=("$d/ckpt.pt")
        fi
    done
    [ ${#files[@]} -gt 0 ] && pack state out/emoji-state "${files[@]}"
    echo "emoji-train: NOT DONE: run 'bash docs/models/emoji-train.sh $MODE' again"
fi
