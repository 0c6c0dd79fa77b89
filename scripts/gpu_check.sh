#!/usr/bin/env bash
# One prepared check for a CUDA machine, in one call that ends within 8 minutes: everything but the final
# report ends GPU_CHECK_BUDGET_S (default 450) seconds after the start; each run is capped, and a run
# that no longer fits is skipped with the reason recorded. On synthetic data (tests/validated_tables.py),
# bf16-mixed, per-device batch 12, `--devices auto` (every GPU), it trains in this order:
#   text-ddp, text-zero2, text-zero3    resnet18 (64 px) + a BERT-style text transformer (train.text_model:
#                                       hidden 256, 4 layers, built offline here by tests/tiny_text_model.py,
#                                       64 tokens), 40 steps on ddp, DeepSpeed ZeRO-2 and ZeRO-3
#   large-zero3                         vit_base_patch16_224 (224 px, random init) + a hidden-768, 12-layer
#                                       text transformer (~145M parameters in all), 10 steps on ZeRO-3
#   resnet18-ddp, resnet18-zero2, resnet18-ddp_spawn    resnet18 alone, 60 steps
#   text-zero2-fp16                     as text-zero2 in 16-mixed (DeepSpeed's fp16 with loss scaling, which
#                                       its CPU accelerator lacks, so the tests cannot run it)
# Each run is then converted (`python -m tasks convert`) and the test table predicted from the converted
# folder (fusion_model.predict.Predictor), on the CPU with the GPU hidden, while the next run trains.
# Printed and written to $OUT/gpu_check.json: it/s and samples/s per run (train_summary.json), each GPU's
# peak memory.used while the run trained (nvidia-smi every 200 ms; what that number is and is not:
# "memory_method" in the JSON), each rank's held bytes where train_summary.json has them, the conversion
# (parameters, bytes, seconds), the prediction, and the listening TCP sockets (those the run's own
# processes opened while it trained; all of them at the end: ss -ltnp). $OUT/gpu_check.log holds this output, $OUT/gpu_check_logs.tar.gz every run's
# logs. Never touches the GPU's settings.
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# Environment: GPU_CHECK_RUNS (some of the names above, run in the order given), GPU_CHECK_BUDGET_S,
# GPU_CHECK_RUN_TIMEOUT_S (each run's cap, 150; large-zero3: GPU_CHECK_LARGE_TIMEOUT_S, 180),
# GPU_CHECK_STEPS / GPU_CHECK_TEXT_STEPS / GPU_CHECK_LARGE_STEPS, GPU_CHECK_BATCH, GPU_CHECK_TEXT and
# GPU_CHECK_LARGE_TEXT (HIDDENxLAYERS), GPU_CHECK_TEXT_TOKENS, GPU_CHECK_IMAGE_MODEL, GPU_CHECK_LARGE_IMAGE
# (and _SIZE), GPU_CHECK_WORK (scratch: data, checkpoints, models; removed at the end unless GPU_CHECK_KEEP=1).
# GPU_CHECK_PRECISION (bf16-mixed). GPU_CHECK_CPU=1 runs the same commands on 2 CPU ranks (32-true unless
# GPU_CHECK_PRECISION says otherwise) without GPU numbers, to try them on a machine without a GPU, with
# small sizes, e.g.
#   GPU_CHECK_CPU=1 GPU_CHECK_WHL=0 GPU_CHECK_STEPS=3 GPU_CHECK_TEXT_STEPS=3 GPU_CHECK_LARGE_STEPS=4 \
#   GPU_CHECK_BATCH=4 GPU_CHECK_TEXT=32x2 GPU_CHECK_LARGE_TEXT=64x2 GPU_CHECK_LARGE_IMAGE=vit_tiny_patch16_224 \
#   bash scripts/gpu_check.sh
# (it/s leaves out each run's first 2 steps: give a run at least 3; the CPU runs leave out text-zero2-fp16)
#
# ./.whl (Python 3.12 x86-64 wheels: bash scripts/gpu_wheels.sh), when present, is pip-installed offline
# into GPU_CHECK_SITE (/tmp/site), first on PYTHONPATH (GPU_CHECK_WHL=0: not). Then installs only what is
# still missing: from ./wheelhouse when present (no network needed), else from the package registry with the
# pinned versions of pyproject.toml.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
START=$(date +%s)
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
RESULT="$OUT/gpu_check.json"
LOG="$OUT/gpu_check.log"
CPU_DRY="${GPU_CHECK_CPU:-0}"
BATCH="${GPU_CHECK_BATCH:-12}"
STEPS="${GPU_CHECK_STEPS:-60}"
TEXT_STEPS="${GPU_CHECK_TEXT_STEPS:-40}"
LARGE_STEPS="${GPU_CHECK_LARGE_STEPS:-10}"
IMAGE_MODEL="${GPU_CHECK_IMAGE_MODEL:-resnet18}"
IMAGE_SIZE="${GPU_CHECK_IMAGE_SIZE:-64}"
LARGE_IMAGE="${GPU_CHECK_LARGE_IMAGE:-vit_base_patch16_224}"
LARGE_IMAGE_SIZE="${GPU_CHECK_LARGE_IMAGE_SIZE:-224}"
TEXT_SIZE="${GPU_CHECK_TEXT:-256x4}"
LARGE_TEXT="${GPU_CHECK_LARGE_TEXT:-768x12}"
TEXT_TOKENS="${GPU_CHECK_TEXT_TOKENS:-64}"  # the built models have 64 positions
RUNS="text-ddp text-zero2 text-zero3 large-zero3 resnet18-ddp resnet18-zero2 resnet18-ddp_spawn"
RUN_TIMEOUT_S="${GPU_CHECK_RUN_TIMEOUT_S:-150}"
LARGE_TIMEOUT_S="${GPU_CHECK_LARGE_TIMEOUT_S:-180}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-450}"
END=$(( START + BUDGET_S ))   # every run, conversion and prediction ends by then; the report follows
POST_RESERVE_S=30             # kept after the last training for its conversion and prediction
SITE="${GPU_CHECK_SITE:-/tmp/site}"
WORK="${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check_work.$$}"
if [ "$CPU_DRY" = 1 ]; then
  ACCEL=cpu DEVICES=2 PRECISION="${GPU_CHECK_PRECISION:-32-true}" THREADS=1 MODE=cpu
else
  ACCEL=gpu DEVICES=auto PRECISION="${GPU_CHECK_PRECISION:-bf16-mixed}" THREADS=4 MODE=cuda
  RUNS="$RUNS text-zero2-fp16"
fi
RUNS="${GPU_CHECK_RUNS:-$RUNS}"
exec > >(tee -a "$LOG") 2>&1

fail() {  # fail REASON: record why in the JSON, so a failed check still says something
  printf '{"ok": false, "error": %s}\n' "$(printf '%s' "$1" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')" > "$RESULT"
  echo "gpu_check: FAILED: $1"
  exit 1
}
left() { echo $(( END - $(date +%s) )); }

BG_PIDS=()  # samplers and conversions this script started in the background
cleanup() {
  for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
  if [ -d "$WORK" ]; then
    (cd "$WORK" && tar czf "$OUT/gpu_check_logs.tar.gz" --ignore-failed-read logs post samples runs env.json versions.json \
      $(find ckpt -maxdepth 2 -name train_summary.json 2>/dev/null) 2>/dev/null)
    [ "${GPU_CHECK_KEEP:-0}" = 1 ] || rm -rf "$WORK"
  fi
}
trap cleanup EXIT

echo "== gpu_check $(date -u +%FT%TZ) in $ROOT ($MODE), results in $RESULT, scratch in $WORK, budget ${BUDGET_S}s"
if [ "$MODE" = cuda ]; then
  command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: this script needs a CUDA machine (GPU_CHECK_CPU=1 tries the commands on the CPU)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "nvidia-smi failed"
fi
mkdir -p "$WORK"/{logs,runs,samples,post,ckpt,model,live} || fail "cannot create $WORK"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3.11 || command -v python3)"; fi
fi
echo "python: $PY ($("$PY" --version 2>&1))"
HELPER=("$PY" "$ROOT/scripts/gpu_check.py")

# ---- install what is missing (pins from pyproject.toml) ------------------------------------------
pin() { grep -oE "\"$1==[^\"]+\"" pyproject.toml | tr -d '"'; }
if [ -d "$ROOT/.whl" ] && [ "${GPU_CHECK_WHL:-1}" = 1 ]; then  # what the image lacks (pydantic, deepspeed, transformers, ...)
  echo "installing ./.whl ($(ls "$ROOT"/.whl/*.whl 2>/dev/null | wc -l) wheels) into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$ROOT"/.whl/*.whl && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" \
    || fail "pip install of ./.whl/*.whl into $SITE failed (wheels for another Python or platform than $("$PY" --version 2>&1)?)"
fi
missing=()  # found or not, without importing (the imports themselves are tried once, below)
for pkg in $("$PY" - <<'EOF'
import importlib.util
for mod, pkg in [("torch", "torch"), ("torchvision", "torchvision"), ("timm", "timm"), ("lightning", "lightning"),
                 ("torchmetrics", "torchmetrics"), ("deepspeed", "deepspeed"), ("pandas", "pandas"),
                 ("pyarrow", "pyarrow"), ("PIL", "pillow"), ("safetensors", "safetensors"), ("pydantic", "pydantic"),
                 ("yaml", "pyyaml"), ("psutil", "psutil"), ("transformers", "transformers"),
                 ("tokenizers", "tokenizers"), ("peft", "peft"), ("tabm", "tabm"),
                 ("rtdl_num_embeddings", "rtdl_num_embeddings"), ("dvclive", "dvclive")]:
    if importlib.util.find_spec(mod) is None:
        print(pkg)
EOF
); do missing+=("$(pin "$pkg" || echo "$pkg")"); done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "installing missing: ${missing[*]}"
  if [ -d "$ROOT/wheelhouse" ]; then
    "$PY" -m pip install -q --no-index --find-links "$ROOT/wheelhouse" "${missing[@]}" \
      || fail "pip install from ./wheelhouse failed for: ${missing[*]}"
  else
    "$PY" -m pip install -q "${missing[@]}" || fail "pip install failed for: ${missing[*]} (offline? bring a ./wheelhouse)"
  fi
fi
"$PY" -c "import fusion_model, tasks" 2>/dev/null || export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TORCH_EXTENSIONS_DIR="$WORK/torch_ext"
unset DS_ACCELERATOR  # the train stage picks DeepSpeed's accelerator (cuda here, cpu with GPU_CHECK_CPU=1)
MODE=$MODE "$PY" - "$WORK/versions.json" <<'EOF' || fail "torch cannot see a CUDA device, or an import failed: see the traceback above in the log"
import json, os, subprocess, sys
import torch
info = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
if os.environ["MODE"] == "cuda":
    if not torch.cuda.is_available():
        sys.exit("torch.cuda.is_available() is False")
    info.update(gpu_count=torch.cuda.device_count(), bf16_supported=torch.cuda.is_bf16_supported(),
                gpus=subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                     "--format=csv,noheader"], capture_output=True, text=True).stdout.splitlines())
import deepspeed, dvclive.lightning, lightning, peft, pydantic, rtdl_num_embeddings, tabm, timm, transformers
info.update(deepspeed=deepspeed.__version__, transformers=transformers.__version__, peft=peft.__version__,
            timm=timm.__version__, lightning=lightning.__version__)
open(sys.argv[1], "w").write(json.dumps(info))
EOF
PROBE=$(cat "$WORK/versions.json")
echo "versions: $PROBE"
NGPU=$("$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get('gpu_count') or 0)" "$WORK/versions.json")
[ "$MODE" = cuda ] || NGPU=$DEVICES
[ "${NGPU:-0}" -gt 0 ] 2>/dev/null || fail "could not read the GPU count from $WORK/versions.json"

# ---- the runs: name -> strategy, ZeRO stage, models, steps, cap -----------------------------------
run_config() {
  cap=$RUN_TIMEOUT_S; min_s=40; image=$IMAGE_MODEL; size=$IMAGE_SIZE; text=none; steps=$STEPS; zero=2
  prec=$PRECISION
  case "$1" in
    text-ddp) strategy=ddp; text=$TEXT_SIZE; steps=$TEXT_STEPS ;;
    text-zero2) strategy=deepspeed; text=$TEXT_SIZE; steps=$TEXT_STEPS ;;
    text-zero2-fp16) strategy=deepspeed; text=$TEXT_SIZE; steps=$TEXT_STEPS; prec=16-mixed ;;
    text-zero3) strategy=deepspeed; zero=3; text=$TEXT_SIZE; steps=$TEXT_STEPS ;;
    large-zero3) strategy=deepspeed; zero=3; image=$LARGE_IMAGE; size=$LARGE_IMAGE_SIZE; text=$LARGE_TEXT
                 steps=$LARGE_STEPS; cap=$LARGE_TIMEOUT_S; min_s=90 ;;
    resnet18-ddp_spawn) strategy=ddp_spawn ;;
    resnet18-ddp) strategy=ddp ;;
    resnet18-zero2) strategy=deepspeed ;;
    *) return 1 ;;
  esac
}
step_counts=(); texts=()
for name in $RUNS; do
  run_config "$name" || fail "unknown run '$name' in GPU_CHECK_RUNS"
  [[ " ${step_counts[*]} " == *" $steps "* ]] || step_counts+=("$steps")
  if [ "$text" != none ] && [[ " ${texts[*]} " != *" $text "* ]]; then texts+=("$text"); fi
done
echo "$RUNS" > "$WORK/runs_order.txt"

# ---- synthetic data and the text models ---------------------------------------------------------
# One table per step count, of exactly that many batches per GPU: the run's one epoch ends at its last step,
# so it validates (val AUC) and saves best.ckpt, which the conversion reads.
"$PY" - "$WORK" "$BATCH" "$NGPU" "${step_counts[@]}" <<'EOF' || fail "could not write the synthetic validated data"
import sys
from pathlib import Path
from tests.validated_tables import make_validated
work, batch, ngpu = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for steps in sys.argv[4:]:
    rows = int(steps) * batch * ngpu
    print(f"data for {steps} steps: {rows} training rows,", make_validated(work / f"data_{steps}", n_train=rows,
                                                                           n_val=96, n_test=16))
EOF
if [ "${#texts[@]}" -gt 0 ]; then
  specs=(); for t in "${texts[@]}"; do specs+=("$WORK/text_$t=$t"); done
  "${HELPER[@]}" text-models "$WORK/data_${step_counts[0]}/validated" "${specs[@]}" \
    || fail "could not build the text models ${texts[*]}"
fi
"${HELPER[@]}" listeners --json "$WORK/listeners_start.json" > /dev/null
if [ "$MODE" = cuda ]; then  # each GPU's memory.used before any run (one second of samples)
  "${HELPER[@]}" sample "$WORK/gpu_idle.json" "$WORK/gpu_idle.stop" --gpu & idle_pid=$!
  sleep 1; touch "$WORK/gpu_idle.stop"; wait "$idle_pid"
fi
"${HELPER[@]}" run-record "$WORK/env.json" mode="$MODE" precision="$PRECISION" per_device_batch="$BATCH" \
  budget_s="$BUDGET_S" run_timeout_s="$RUN_TIMEOUT_S" started_at_epoch="$START" setup_s=$(( $(date +%s) - START )) \
  versions="$PROBE" rows="{\"train\": \"steps x batch x GPUs\", \"val\": 96, \"test\": 16}" \
  || fail "could not write $WORK/env.json"
echo "set-up done in $(( $(date +%s) - START ))s; $(left)s of the budget left"

# ---- one run at a time; each one's conversion and prediction in the background ------------------
for name in $RUNS; do
  run_config "$name"
  avail=$(( $(left) - POST_RESERVE_S ))
  text_args=()
  if [ "$text" != none ]; then text_args=(--text-model "$WORK/text_$text" --text-max-tokens "$TEXT_TOKENS"); fi
  if [ "$avail" -lt "$min_s" ]; then
    echo "== $name: skipped, budget spent (${avail}s left for training, it needs ${min_s}s)"
    "${HELPER[@]}" run-record "$WORK/runs/$name.json" \
      skipped="budget spent: ${avail}s left for training, the run needs at least ${min_s}s"
    continue
  fi
  limit=$(( avail < cap ? avail : cap ))
  cmd=("$PY" -m tasks train --params params.yaml --data-dir "$WORK/data_$steps/validated" --out-dir "$WORK/ckpt/$name"
       --live-dir "$WORK/live/$name" --strategy "$strategy" --zero-stage "$zero" --precision "$prec"
       --batch-size "$BATCH" --accelerator "$ACCEL" --devices "$DEVICES" --max-epochs 1 --max-steps "$steps"
       --refit false --image-model "$image" --image-size "$size" --threads-per-rank "$THREADS" "${text_args[@]}")
  echo "== $name: $strategy$([ "$strategy" = deepspeed ] && echo " ZeRO-$zero"), $image ${size}px, text $text," \
       "$prec, batch $BATCH per device, $steps steps, limit ${limit}s"
  rm -f "$WORK/samples/$name.stop"
  started=$(date +%s)
  timeout --kill-after=15 "$limit" "${cmd[@]}" > "$WORK/logs/train_$name.log" 2>&1 &
  train_pid=$!
  "${HELPER[@]}" sample "$WORK/samples/$name.json" "$WORK/samples/$name.stop" --pid "$train_pid" \
    $([ "$MODE" = cuda ] && echo --gpu) &
  sampler=$!; BG_PIDS+=("$sampler")
  wait "$train_pid"
  rc=$?
  wall=$(( $(date +%s) - started ))
  touch "$WORK/samples/$name.stop"; wait "$sampler"
  "${HELPER[@]}" run-record "$WORK/runs/$name.json" strategy="$strategy" zero_stage="$zero" precision="$prec" \
    image_model="$image" \
    image_size="$size" text_model="$([ "$text" = none ] && echo null || echo "\"$text\"")" \
    text_max_tokens="$([ "$text" = none ] && echo null || echo "$TEXT_TOKENS")" steps_asked="$steps" \
    exit_code="$rc" wall_s="$wall" limit_s="$limit" command="${cmd[*]:1}"
  summary="$WORK/ckpt/$name/train_summary.json"
  if [ "$rc" -eq 0 ] && [ -f "$summary" ]; then
    "$PY" - "$summary" "$name" "$wall" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]}: {s['steps']} steps on {s['world_size']} {s['accelerator']} rank(s), {s['precision']}, "
      f"{s['steps_per_s'] or 0:.2f} it/s, {s['samples_per_s'] or 0:.0f} samples/s, val AUC {s['best_score']}, "
      f"{sys.argv[3]} s in all")
EOF
    post_s=$(( $(left) > 20 ? $(left) : 20 ))
    CUDA_VISIBLE_DEVICES="" timeout --kill-after=5 "$post_s" "${HELPER[@]}" post "$WORK/ckpt/$name" \
      "$WORK/model/$name" "$WORK/data_$steps/validated" "$WORK/post/$name.json" --timeout-s $(( post_s - 5 )) \
      > "$WORK/post/$name.log" 2>&1 &
    BG_PIDS+=("$!")
  else
    echo "$name: FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ": over its ${limit}s limit"), ${wall}s); last lines of its log:"
    tail -25 "$WORK/logs/train_$name.log"
  fi
done

# ---- the last conversions, then the report -----------------------------------------------------
echo "== waiting for the conversions and predictions ($(left)s of the budget left)"
for pid in "${BG_PIDS[@]}"; do wait "$pid" 2>/dev/null; done
for name in $RUNS; do
  [ -f "$WORK/post/$name.json" ] || continue
  "$PY" - "$WORK/post/$name.json" "$name" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
c, p = r["convert"], r["predict"]
conv = (f"converted {c.get('parameters')} parameters ({(c.get('bytes') or 0) / 2**20:.0f} MiB fp32) in "
        f"{c.get('wall_s')} s" if c.get("ok") else f"conversion FAILED: {c.get('error') or c.get('log_tail', [''])[-1:]}")
pred = (f"predicted {p['rows']} rows x {p['classes']} classes in {p['wall_s']} s" if p.get("ok")
        else f"prediction FAILED: {p.get('error')}")
print(f"{sys.argv[2]}: {conv}; {pred}")
EOF
done
"${HELPER[@]}" report "$RESULT" "$WORK"
