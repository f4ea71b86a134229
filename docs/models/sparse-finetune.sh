#!/usr/bin/env bash
# Sparse-aware fine-tuning of a shipped model on one GPU, in one device call, then its quality under
# dense and the policy (issue 5: diagonal within 2 % of dense):
#
#   bash docs/models/sparse-finetune.sh prepare fashion   # here: packs what the call needs into .ft/
#   bash docs/models/sparse-finetune.sh run fashion       # on the GPU machine (carry .ft)
#
# The shipped weights came from `run fashion` (the defaults below) and `STEPS=500 WEIGHT=0.95 ... run
# emoji` (at 0.8 the emoji gap stalled at +2.8 %), on an H200 on 2026-11-30 (BENCHMARKS.md).
#
# run: `arsparse train model --init-from <shipped GPT> --sparse-policy $POLICY --sparse-weight $WEIGHT
# --sparse-mix $MIX --sparse-loss $LOSS` (data: cross-entropy on the images; distill: on-policy distillation from the
# shipped weights, a pool of $POOL sequences sampled under the policy at a time, KL $DIVERGENCE)
# for $STEPS steps (lr $LR), then `arsparse eval --gpt-ckpt <best weights>` with dense and the policy
# (teacher-forced NLL on $NLL_IMAGES held-out images; $SAMPLES samples per policy for the Fréchet
# distances and class accuracy, on each set of seeds in $SEEDS) and the same eval of the weights it
# started from. Returns in $OUT: train.txt, train_log.json, eval-tuned-s<seed>.json, eval-shipped-s<seed>.json
# (tables in the log), and the tuned weights as tuned.safetensors.xz.0, .1[, .2] (xz, cut under the
# 16 MiB a returned file may have; `cat tuned.* | xz -d`).
#
# Why the packing: the call's tree may carry 64 MiB. prepare packs with xz: the shipped GPT (fashion 35 ->
# 25 MB, emoji 37 -> 33 MB) and the data (Fashion-MNIST at the palette's 32 levels, the tokens unchanged:
# 15 MB; emoji-64.npz as it is, 18.5 MB; the emoji VQ, 7.7 MB, stays in the tree) and, for fashion,
# MobileNetV2's weights (14 MB) for the eval's second Fréchet distance (emoji leaves it out: no room).
# It lists what to park (the other models' weights) so that the tree fits.
set -euo pipefail
what=${1:?prepare|run} ds=${2:-fashion}
# SCRATCH=1: no --init-from: a fresh model trained with the policy's read set from its first step, on the
# recipe's schedule (lr 1e-3, 300 warm-up steps) shortened to STEPS_SCRATCH (default 3,400: the recipe's
# held-out loss was best at step 3,000 of 5,000) so that its schedule ends inside one call (at a sparse
# share of 0.8 it ran at 840-920 images/s on an H200 on 2026-12-02: 3,595 steps in 545 s), with the
# sparse share as split rows ($MIX split: each row trained one way, no second pass). Its evals do not fit
# the call: it returns the weights (best.safetensors, xz, in chunks) and train_log.json; evaluate them in
# the next call with `INIT=<the weights> bash docs/eval/fd-infinity.sh prepare fashion` and `... run`.
# A scratch run longer than one call resumes in the next: a call the time limit stops returns a portable
# checkpoint (fp16 weights and the run's state, no optimiser state: the 210 MB checkpoint cannot travel)
# as ckpt.pt.xz.0, .1 in $OUT; put them in .ft/ and carry them, and the same command resumes from them.
# A call that finds the last call's machine still warm resumes from its own /tmp/ft/ckpt.pt instead
# (optimiser state kept: on 2026-12-03 the second of two chained calls did; on 2026-12-02 three each
# found a fresh machine). Run 26 (BENCHMARKS.md) trained fashion's 5,000 steps so, then the remainder
# fine-tune in the second call: `START=/tmp/ft/model.safetensors FT_DIR=/tmp/ft2 POLICY=... run fashion`.
# START=<a path on the GPU machine>: the weights to start from instead of .ft/gpt.safetensors.xz (say
# the scratch run's /tmp/ft/model.safetensors, fine-tuned in the same call); WEIGHTS=model: the final
# weights are the result (and the eval's) instead of the best held-out ones; FT_DIR: the run's folder.
SCRATCH=${SCRATCH:-0} START=${START:-} WEIGHTS=${WEIGHTS:-best} FT_DIR=${FT_DIR:-/tmp/ft}
# (sparse share 0.8 closed the gap faster than 0.5 on the CPU: BENCHMARKS)
POLICY=${POLICY:-diagonal} WEIGHT=${WEIGHT:-0.8} MIX=${MIX:-$([ $SCRATCH = 1 ] && echo split || echo sum)} LOSS=${LOSS:-data} POOL=${POOL:-1024} DIVERGENCE=${DIVERGENCE:-reverse} STEPS=${STEPS:-1000} LR=${LR:-2e-4} BATCH=${BATCH:-128}
NLL_IMAGES=${NLL_IMAGES:-512} SAMPLES=${SAMPLES:-1000} PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)} EVAL_SAMPLES=${EVAL_SAMPLES:-2000}
TRAIN_S=${TRAIN_S:-$([ $SCRATCH = 1 ] && echo 545 || echo 360)}
DEVICE=${DEVICE:-cuda} EVAL_ARGS=${EVAL_ARGS:-}  # (more flags for the evals)
BASELINE=${BASELINE:-1}  # (0: no eval of the starting weights, whose numbers are known: more time to train)
# (a CPU smoke test: DEVICE=cpu STEPS=4 BATCH=2 EVAL_SAMPLES=8 NLL_IMAGES=4 SAMPLES=2 SEEDS="0 7" EVAL_ARGS="--ref-images 40")
case $ds in fashion|emoji) ;; *) echo "data set: fashion or emoji, got $ds"; exit 2;; esac
model=$ds-c2i
# (emoji: one set, since its weights come back in 3 chunks and a call returns at most 8 files)
# (SEEDS= set and empty: no eval, the weights and the training log alone)
SEEDS=${SEEDS-$([ $ds = fashion ] && echo "0 10000 20000" || echo 0)}
if [ "$what" = prepare ]; then
  rm -rf .ft && mkdir -p .ft && { grep -qx '/.ft/' .git/info/exclude || echo /.ft/ >> .git/info/exclude; }
  xz -T0 -6 -c "${INIT:-arsparse/weights/$model.safetensors}" > .ft/gpt.safetensors.xz  # (INIT: other weights to start from)
  if [ $ds = fashion ]; then
    # The images as the palette tokenizer sees them (each byte -> its level's byte: the same tokens, so
    # training and every eval are unchanged) pack to 15 MB instead of 26.5, which leaves room for
    # MobileNetV2's weights (the eval's second Fréchet distance).
    ARSPARSE_DATA=.data $PY - <<'PYEOF'
import gzip, lzma, pathlib, torch
from arsparse.bundles import load_model
_, tok = load_model("fashion-c2i")
from arsparse.data.fashion import find_fashion_dir
for f in sorted(find_fashion_dir().glob("*.gz")):  # (.data/fashion-mnist, else the Debian package's; else an error)
    raw = gzip.open(f).read()
    if "images" in f.name:  # (16-byte idx header, then one byte per pixel)
        px = torch.frombuffer(bytearray(raw[16:]), dtype=torch.uint8)
        q = tok.tokens_to_bytes(tok.bytes_to_tokens(px))
        assert torch.equal(tok.bytes_to_tokens(q), tok.bytes_to_tokens(px))
        raw = raw[:16] + q.numpy().tobytes()
    (pathlib.Path(".ft") / (f.stem + ".xz")).write_bytes(lzma.compress(raw, preset=6))
PYEOF
    mob=$($PY -c "from arsparse.eval.mobilenet import find_mobilenet_weights as f; print(f() or '')")
    if [ -n "$mob" ]; then cp "$mob" .ft/mobilenet.pth; else echo "no MobileNetV2 weights here: the eval leaves its FD out"; fi
    park="emoji-c2i emoji-vq fashion-c2i"
  else  # (emoji-64.npz is compressed already; the VQ stays in the tree: the data is tokenised through it)
    cp .data/emoji/emoji-64.npz .ft/
    park="emoji-c2i fashion-c2i"
  fi
  du -ch .ft/* | tail -1
  echo "park before the call (mv back after):" $(for m in $park; do echo arsparse/weights/$m.safetensors; done) \
    $([ $ds = emoji ] && echo "docs/analysis docs/eval (the emoji GPT packs to 33 MB only)" \
      || echo "docs/analysis (with MobileNetV2's weights the tree is otherwise just over 64 MiB)")
  exit 0
fi
export PYTHONPATH=. ARSPARSE_DATA=/tmp/data TRITON_INTERPRET=0
OUT=${OUT:-/tmp/out}; mkdir -p $OUT /tmp/data/fashion-mnist /tmp/data/emoji
if [ $ds = fashion ]; then
  for f in .ft/*ubyte.xz; do xz -dc "$f" | gzip -1 > /tmp/data/fashion-mnist/$(basename "$f" .xz).gz; done
else
  cp .ft/emoji-64.npz /tmp/data/emoji/
fi
rm -f /tmp/shipped.safetensors  # (a scratch run needs no starting weights: prepare's may stay behind)
if [ -n "$START" ]; then cp "$START" /tmp/shipped.safetensors
elif [ -f .ft/gpt.safetensors.xz ]; then xz -dc .ft/gpt.safetensors.xz > /tmp/shipped.safetensors; fi
[ -f arsparse/weights/$model.safetensors ] || [ ! -f /tmp/shipped.safetensors ] \
  || cp /tmp/shipped.safetensors arsparse/weights/$model.safetensors  # (the bundle)
t0=$(date +%s)
vq=$([ $ds = emoji ] && echo "--vq arsparse/weights/emoji-vq.safetensors" || true)  # (the shipped VQ tokenises the images)
if [ "$SCRATCH" = 1 ]; then  # (the recipe's lr and warm-up)
  STEPS=${STEPS_SCRATCH:-3400}
  run_args="--steps $STEPS $([ $STEPS -lt 300 ] && echo --warmup 0 || true) --resume"
  if [ -f $FT_DIR/ckpt.pt ]; then echo "resuming from this machine's $FT_DIR/ckpt.pt (optimiser state kept)"
  elif [ -f .ft/ckpt.pt.xz.0 ]; then
    rm -rf $FT_DIR && mkdir -p $FT_DIR && cat .ft/ckpt.pt.xz.* | xz -dc > $FT_DIR/ckpt.pt
    echo "resuming from the carried portable checkpoint (AdamW moments restart)"
  else rm -rf $FT_DIR; fi
else
  rm -rf $FT_DIR
  run_args="--init-from /tmp/shipped.safetensors --steps $STEPS --lr $LR --warmup $(( STEPS < 200 ? 0 : 50 ))"
fi
$PY -m arsparse.cli train model --dataset $ds $vq --device $DEVICE --out $FT_DIR $run_args \
  --sparse-policy "$POLICY" --sparse-weight $WEIGHT --sparse-mix $MIX --sparse-loss $LOSS \
  $([ $LOSS = distill ] && echo --distill-pool $POOL --distill-divergence $DIVERGENCE || true) --batch-size $BATCH \
  --eval-every $(( (STEPS + 3) / 4 )) --eval-samples $EVAL_SAMPLES --time-limit $TRAIN_S --quiet > $OUT/train.txt 2>&1 \
  || { echo "train failed:"; tail -3 $OUT/train.txt; exit 1; }
echo "train: $(( $(date +%s) - t0 )) s"; tail -3 $OUT/train.txt; cp $FT_DIR/train_log.json $OUT/ 2>/dev/null || true
if [ "$SCRATCH" = 1 ] && [ ! -f $FT_DIR/model.safetensors ]; then  # (stopped by the time limit: what resumes)
  $PY -c "import sys; from arsparse.training.trainer import portable_checkpoint as p; p(*sys.argv[1:])" \
    $FT_DIR/ckpt.pt /tmp/portable.pt fp16
  xz -T0 -6 -c /tmp/portable.pt | split -b 15M -d -a 1 - $OUT/ckpt.pt.xz.
  echo "NOT FINISHED (the time limit): resume with $OUT/ckpt.pt.xz.* in .ft/"; ls -la $OUT; exit 0
fi
tuned=$FT_DIR/$WEIGHTS.safetensors; [ -f $tuned ] || { echo "no $WEIGHTS.safetensors: see train.txt"; exit 1; }
if [ "$SCRATCH" = 1 ]; then SEEDS= BASELINE=0; fi  # (no time left for evals: the weights alone come back)
# MobileNetV2 when prepare packed it; the tuned weights on each of $SEEDS (sets of $SAMPLES seeds: the
# Fréchet distances move between sets, BENCHMARKS), the shipped ones on the first
mob=--no-mobilenet; [ -f .ft/mobilenet.pth ] && { export ARSPARSE_MOBILENET=.ft/mobilenet.pth; mob=; }
first=${SEEDS%% *}
pname=${POLICY%%:*}  # (a POLICY with settings, e.g. diagonal:remainder=true, is one row of the eval)
for run in $(for s in $SEEDS; do echo tuned-s$s; done) $([ "$BASELINE" = 1 ] && [ -n "$first" ] && echo shipped-s$first); do
  which=${run%-s*} seed=${run##*-s}
  ckpt="--gpt-ckpt $([ $which = tuned ] && echo $tuned || echo /tmp/shipped.safetensors)"  # (shipped: the starting weights)
  $PY -m arsparse.cli eval --model $model $ckpt --policies "$POLICY" --nll-images $NLL_IMAGES --seed $seed \
    --num-samples $SAMPLES $mob $EVAL_ARGS --dtype fp32 --device $DEVICE --quiet --out /tmp/ev-$run > /tmp/eval-$run.txt 2>&1 || true
  cp /tmp/ev-$run/eval.json $OUT/eval-$run.json 2>/dev/null || true  # (a failed eval: its tail below)
  echo "== $run"; grep -E "^\| .(dense|$pname)" /tmp/eval-$run.txt || tail -5 /tmp/eval-$run.txt
done
xz -T0 -6 -c $tuned | split -b 15M -d -a 1 - $OUT/tuned.safetensors.xz.
ls -la $OUT  # (a call returns at most 8 files)
