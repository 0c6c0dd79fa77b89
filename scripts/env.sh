# Sourced by scripts/pipeline.sh and scripts/test.sh: create (or reuse) .venv and set the environment.
# Idempotent: the venv is rebuilt only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV="$ROOT/.venv"
STAMP="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  echo "[env] installing into $VENV (first time ~5 min on 2 cores; later runs reuse it)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # torch first: the CUDA build (runs on CPU too) that the pins name.
  "$VENV/bin/pip" install -q torch==2.14.1 torchvision==0.29.1
  "$VENV/bin/pip" install -q -e ".[dev]"
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=60
export DVC_NO_ANALYTICS=1
export HF_HUB_OFFLINE=1
# DeepSpeed JIT-builds small ops once per machine: keep them out of ~/.cache and reuse them.
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.torch_ext}"
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"; fi
