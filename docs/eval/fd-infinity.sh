#!/usr/bin/env bash
# Fréchet distances of a shipped model's policies at many samples, and extrapolated to infinitely many
# (`arsparse eval --fd-infinity`), in one device call (BENCHMARKS session 12: at 1,000 samples the
# finite-sample bias shrinks the relative gaps to dense):
#
#   bash docs/eval/fd-infinity.sh prepare fashion|emoji   # here: packs what the call needs into .ft/
#   bash docs/eval/fd-infinity.sh run fashion|emoji       # on the GPU machine (carry .ft)
#   bash docs/eval/fd-infinity.sh sweep fashion|emoji     # the same, a budget sweep (carry .ft)
#
# prepare packs the model's GPT with xz (INIT=path: other weights of the same model), MobileNetV2's
# weights and the held-out images: fashion as docs/models/sparse-finetune.sh packs them (15 MB); emoji
# its held-out split alone (the call computes no Fréchet floor: --fd-floor 0), so that the emoji GPT
# (33 MB packed), its VQ and MobileNetV2 fit the 64 MiB a call's tree may carry. It lists what to park.
# (Emoji's reference is then its 794 held-out images: in MobileNetV2's 1,280 dimensions that reference
# adds a large bias of its own, the same for every policy, which --fd-infinity does not remove.)
# run: `arsparse eval --policies $POLICIES --match-budget --num-samples $SAMPLES --fd-infinity
# --fd-bootstrap $BOOTSTRAP --kid $KID --fd-floor 0` on seeds $SEED + i, fp32; returns eval.json, eval.md and
# log.txt in $OUT. The eval writes after every policy, so a call cut short keeps what it measured.
# sweep: `arsparse eval --policies $POLICIES --sweep-rho $RHOS --sweep-frechet --fd-infinity --kid $KID
# --num-samples $SAMPLES` (each policy at each budget; where each comes within 2 % of dense on NLL, the
# Fréchet distances, raw and extrapolated, and KID); returns sweep.json, sweep.md, sweep.png and log.txt.
# (A CPU smoke test: DEVICE=cpu SAMPLES=8 NLL_IMAGES=2 BOOTSTRAP=0 EVAL_ARGS="--ref-images 40" ... run.)
set -euo pipefail
what=${1:?prepare|run} ds=${2:-fashion}
POLICIES=${POLICIES:-dense,diagonal} SAMPLES=${SAMPLES:-5000} SEED=${SEED:-30000} BOOTSTRAP=${BOOTSTRAP:-100}
KID=${KID:-100}  # (kernel distances over this many subsets of 1,000: no finite-sample bias; 0: none)
NLL_IMAGES=${NLL_IMAGES:-256} DEVICE=${DEVICE:-cuda} PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)} LIMIT=${LIMIT:-540}
EVAL_ARGS=${EVAL_ARGS:-}  # (more flags for the eval)
case $ds in fashion|emoji) ;; *) echo "data set: fashion or emoji, got $ds"; exit 2;; esac
model=$ds-c2i
if [ "$what" = prepare ]; then
  if [ $ds = fashion ]; then
    exec bash docs/models/sparse-finetune.sh prepare fashion  # (GPT, both splits, MobileNetV2; INIT passes on)
  fi
  rm -rf .ft && mkdir -p .ft && { grep -qx '/.ft/' .git/info/exclude || echo /.ft/ >> .git/info/exclude; }
  xz -T0 -6 -c "${INIT:-arsparse/weights/$model.safetensors}" > .ft/gpt.safetensors.xz
  ARSPARSE_DATA=.data $PY -c "
from arsparse.data.emoji import load_emoji_table, save_emoji_table
d = load_emoji_table()
save_emoji_table(d.subset(d.test), '.ft/emoji')  # (the held-out split alone: a data set of its own)
print(f'{int(d.test.sum())} held-out emoji of {len(d.test)}')"
  mob=$($PY -c "from arsparse.eval.mobilenet import find_mobilenet_weights as f; print(f() or '')")
  if [ -n "$mob" ]; then cp "$mob" .ft/mobilenet.pth; else echo "no MobileNetV2 weights here: the eval leaves its FD out"; fi
  du -ch .ft/* | tail -1
  # (the tree then carries 66.5 MB of the 67.1 allowed with docs/analysis parked: park the rest of docs' pictures too)
  echo "park before the call (mv back after): arsparse/weights/emoji-c2i.safetensors" \
    "arsparse/weights/fashion-c2i.safetensors docs/analysis docs/models docs/eval/*/"
  exit 0
fi
case $what in run|sweep) ;; *) echo "prepare, run or sweep, got $what"; exit 2;; esac
export PYTHONPATH=. ARSPARSE_DATA=/tmp/fd-data TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/fd-data/fashion-mnist /tmp/fd-data/emoji
if [ $ds = fashion ]; then
  for f in .ft/*ubyte.xz; do xz -dc "$f" | gzip -1 > /tmp/fd-data/fashion-mnist/$(basename "$f" .xz).gz; done
else
  cp .ft/emoji/*.npz /tmp/fd-data/emoji/
fi
xz -dc .ft/gpt.safetensors.xz > /tmp/fd-gpt.safetensors && sha256sum /tmp/fd-gpt.safetensors
[ -f arsparse/weights/$model.safetensors ] || cp /tmp/fd-gpt.safetensors arsparse/weights/$model.safetensors  # (the bundle)
mob=--no-mobilenet; [ -f .ft/mobilenet.pth ] && { export ARSPARSE_MOBILENET=.ft/mobilenet.pth; mob=; }
if [ "$what" = sweep ]; then
  timeout "$LIMIT" $PY -m arsparse.cli eval --model $model --gpt-ckpt /tmp/fd-gpt.safetensors --policies "$POLICIES" \
    --sweep-rho "${RHOS:-0.12,0.18,0.25,0.35}" --sweep-frechet --fd-infinity --num-samples "$SAMPLES" --seed "$SEED" \
    --nll-images "$NLL_IMAGES" --kid "$KID" --fd-floor 0 $mob $EVAL_ARGS --dtype fp32 --device "$DEVICE" --quiet \
    --out "$OUT" > "$OUT/log.txt" 2>&1 || echo "sweep stopped early (status $?): see log.txt"
  grep -E "^\|" "$OUT/sweep.md" || tail -20 "$OUT/log.txt"
  exit 0
fi
timeout "$LIMIT" $PY -m arsparse.cli eval --model $model --gpt-ckpt /tmp/fd-gpt.safetensors --policies "$POLICIES" \
  --match-budget --num-samples "$SAMPLES" --seed "$SEED" --nll-images "$NLL_IMAGES" --fd-infinity \
  --fd-bootstrap "$BOOTSTRAP" --kid "$KID" --fd-floor 0 $mob $EVAL_ARGS --dtype fp32 --device "$DEVICE" --quiet --out "$OUT" \
  > "$OUT/log.txt" 2>&1 || echo "eval stopped early (status $?): see log.txt"
find "$OUT" -name 'grid-*.png' ! -name grid-dense.png ! -name grid-diagonal.png -delete  # (8 files a call at most)
grep -E "^\|" "$OUT/eval.md" || tail -20 "$OUT/log.txt"
