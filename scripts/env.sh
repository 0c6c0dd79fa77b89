# Sourced by scripts/pipeline.sh and scripts/test.sh: create (or reuse) .venv and set the environment.
# Idempotent: packages are (re)installed only when requirements.lock or pyproject.toml changed since the
# last install. The lock (refresh: `bash scripts/lock.sh`) pins every package of .venv with its hashes.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
VENV="$ROOT/.venv"
LOCK="$ROOT/requirements.lock"
STAMP="$VENV/.installed-$(cat pyproject.toml "$LOCK" | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  # The locked set (torch with its CUDA libraries) takes ~7 GiB: refuse before a half-written venv does.
  NEED_GIB="${FUSION_INSTALL_MIN_FREE_GIB:-8}"
  read -r FREE_KB MOUNT < <(df -Pk "$ROOT" | awk 'NR == 2 {print $4, $6}')
  FREE_GIB=$(( FREE_KB / 1048576 ))
  if [ "$FREE_GIB" -lt "$NEED_GIB" ] && [ ! -x "$VENV/bin/python" ]; then
    echo "[env] $VENV needs ~$NEED_GIB GiB to install requirements.lock, but $MOUNT has only $FREE_GIB GiB" \
         "free (df -h $ROOT): free some space (old clones, /tmp) and run again" >&2
    exit 1
  fi
  echo "[env] installing requirements.lock into $VENV (first time ~4 min on 2 cores; later runs reuse it)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # The locked pip first (the venv's bundled pip 23 takes ~1.7x the CPU for the same install), then exactly
  # the locked set, every file checked against its hashes. pip takes torch and the nvidia-* wheels from this
  # machine's local sources where they are (see `pip config list`), the rest from PyPI.
  "$VENV/bin/python" -m pip install -q --require-hashes --no-deps \
    -r <(awk '/^pip==/{p=1; print; next} p && /^ /{print; next} {p=0}' "$LOCK")
  "$VENV/bin/python" -m pip install -q --require-hashes --no-deps -r "$LOCK"
  # A venv reused across a lock change: drop what the lock no longer has (the project itself stays).
  "$VENV/bin/python" - "$LOCK" <<'EOF'
import importlib.metadata as md, re, subprocess, sys, tomllib
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
locked = {norm(m[1]) for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", open(sys.argv[1]).read(), re.M)}
have = {norm(d.metadata["Name"]) for d in md.distributions() if d.metadata["Name"]}
project = norm(tomllib.load(open("pyproject.toml", "rb"))["project"]["name"])
extra = sorted(have - locked - {project})
if extra:
    print("[env] removing packages the lock does not have:", " ".join(extra), file=sys.stderr)
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *extra], check=True)
EOF
  # The project itself: editable, not hash-checked, built with the locked setuptools (no isolated build).
  "$VENV/bin/python" -m pip install -q --no-deps --no-build-isolation -e .
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
