#!/usr/bin/env bash
# One prepared check for a CUDA machine: trains each strategy (ddp_spawn, ddp, DeepSpeed ZeRO-2) with
# bf16-mixed on synthetic data (per-device batch 12), prints it/s per strategy and writes
# $OUT/gpu_check.json. Budget: < 8 minutes in total (each run is capped; the whole script too).
#
#   OUT=/some/dir bash scripts/gpu_check.sh
#
# ./.whl (Python 3.12 x86-64 wheels: bash scripts/gpu_wheels.sh), when present, is pip-installed offline
# into /tmp/site, first on PYTHONPATH.
# Installs only what is missing: from ./wheelhouse when present (no network needed), else from the
# package registry with the pinned versions of pyproject.toml. Never touches the GPU's settings.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
RESULT="$OUT/gpu_check.json"
LOG="$OUT/gpu_check.log"
STEPS="${GPU_CHECK_STEPS:-60}"
RUN_TIMEOUT_S="${GPU_CHECK_RUN_TIMEOUT_S:-150}"
DEADLINE=$(( $(date +%s) + ${GPU_CHECK_BUDGET_S:-450} ))
exec > >(tee -a "$LOG") 2>&1

fail() {  # fail REASON: record why in the JSON, so a failed check still says something
  printf '{"ok": false, "error": %s}\n' "$(printf '%s' "$1" | python3 -c 'import json,sys; print(json.dumps(sys.stdin.read()))')" > "$RESULT"
  echo "gpu_check: FAILED: $1"
  exit 1
}

echo "== gpu_check $(date -u +%FT%TZ) in $ROOT, results in $RESULT"
command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: this script needs a CUDA machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || fail "nvidia-smi failed"

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3.11 || command -v python3)"; fi
fi
echo "python: $PY ($("$PY" --version 2>&1))"

# ---- install what is missing (pins from pyproject.toml) ------------------------------------------
pin() { grep -oE "\"$1==[^\"]+\"" pyproject.toml | tr -d '"'; }
if [ -d "$ROOT/.whl" ]; then  # the project's packages the image lacks (pydantic, deepspeed, dvclive, tabm, ...)
  echo "installing ./.whl ($(ls "$ROOT"/.whl/*.whl 2>/dev/null | wc -l) wheels) into /tmp/site"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$ROOT"/.whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
    || fail "pip install of ./.whl/*.whl into /tmp/site failed (wheels for another Python or platform than $("$PY" --version 2>&1)?)"
  "$PY" -c "import pydantic, deepspeed, tabm, rtdl_num_embeddings, dvclive.lightning" \
    || fail "the packages from ./.whl (in /tmp/site) do not import with $PY: see the traceback above in the log"
fi
missing=()
for mod_pkg in torch:torch torchvision:torchvision timm:timm lightning:lightning torchmetrics:torchmetrics \
    deepspeed:deepspeed pandas:pandas pyarrow:pyarrow PIL:pillow safetensors:safetensors pydantic:pydantic \
    yaml:pyyaml psutil:psutil; do
  mod="${mod_pkg%%:*}"; pkg="${mod_pkg##*:}"
  "$PY" -c "import $mod" 2>/dev/null || missing+=("$(pin "$pkg" || echo "$pkg")")
done
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
"$PY" - <<'EOF' || fail "torch cannot see a CUDA device"
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s), "
      f"bf16 supported: {torch.cuda.is_bf16_supported()}")
EOF
export HF_HUB_OFFLINE=1 TORCH_EXTENSIONS_DIR="$OUT/torch_ext"
unset DS_ACCELERATOR  # DeepSpeed must pick its CUDA accelerator here

# ---- synthetic data: enough rows for STEPS steps of 12 per GPU -----------------------------------
NGPU=$("$PY" -c "import torch; print(torch.cuda.device_count())")
ROWS=$(( (STEPS + 6) * 12 * NGPU ))
WORK="$OUT/work"
"$PY" - "$WORK" "$ROWS" <<'EOF' || fail "could not write the synthetic validated data"
import sys
from pathlib import Path
from tests.validated_tables import make_validated
print("data:", make_validated(Path(sys.argv[1]), n_train=int(sys.argv[2]), n_val=96, n_test=16))
EOF

# ---- one run per strategy ----------------------------------------------------------------------
results=()
for strategy in ddp_spawn ddp deepspeed; do
  left=$(( DEADLINE - $(date +%s) ))
  if [ "$left" -lt 40 ]; then echo "skipping $strategy: budget spent"; results+=("\"$strategy\": {\"ok\": false, \"error\": \"budget spent\"}"); continue; fi
  limit=$(( left < RUN_TIMEOUT_S ? left : RUN_TIMEOUT_S ))
  echo "== $strategy (bf16-mixed, batch 12 per GPU, $STEPS steps, limit ${limit}s)"
  started=$(date +%s)
  timeout --kill-after=10 "$limit" "$PY" -m tasks train --params params.yaml \
    --data-dir "$WORK/validated" --out-dir "$WORK/ckpt_$strategy" --strategy "$strategy" --zero-stage 2 \
    --precision bf16-mixed --batch-size 12 --accelerator gpu --devices auto --max-epochs 1 \
    --max-steps "$STEPS" --image-model resnet18 --image-size 64 --threads-per-rank 4 \
    > "$OUT/train_$strategy.log" 2>&1
  rc=$?
  wall=$(( $(date +%s) - started ))
  summary="$WORK/ckpt_$strategy/train_summary.json"
  if [ "$rc" -eq 0 ] && [ -f "$summary" ]; then
    line=$("$PY" - "$summary" "$wall" <<'EOF'
import json, sys
s = json.load(open(sys.argv[1]))
ok = s["accelerator"] == "cuda" and s["steps"] > 0 and s["steps_per_s"]
print(json.dumps({"ok": bool(ok), "it_per_s": s["steps_per_s"], "samples_per_s": s["samples_per_s"],
                  "world_size": s["world_size"], "steps": s["steps"], "accelerator": s["accelerator"],
                  "precision": s["precision"], "best_val_auc": s["best_score"], "wall_s": int(sys.argv[2])}))
EOF
)
    echo "$strategy: $line"
  else
    tail -25 "$OUT/train_$strategy.log"
    line="{\"ok\": false, \"exit_code\": $rc, \"wall_s\": $wall, \"log\": \"train_$strategy.log\"}"
    echo "$strategy: FAILED (exit $rc)"
  fi
  results+=("\"$strategy\": $line")
done

joined=$(IFS=,; echo "${results[*]}")
"$PY" - "$RESULT" "{${joined}}" <<'EOF'
import json, subprocess, sys
runs = json.loads(sys.argv[2])
gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip().splitlines()
report = {"ok": all(r.get("ok") for r in runs.values()), "gpus": gpu, "per_device_batch": 12, "runs": runs}
json.dump(report, open(sys.argv[1], "w"), indent=2)
print("\nit/s per strategy:")
for name, r in runs.items():
    print(f"  {name:>10}: {r.get('it_per_s') or 'failed'}")
print("ok" if report["ok"] else "NOT ok", "->", sys.argv[1])
sys.exit(0 if report["ok"] else 1)
EOF
