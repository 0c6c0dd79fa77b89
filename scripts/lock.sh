#!/usr/bin/env bash
# Regenerate requirements.lock from pyproject.toml: run `bash scripts/lock.sh` after editing the
# [project] dependencies or optional-dependencies, then commit both files. Current pins are kept where
# they still fit; `bash scripts/lock.sh --upgrade` (or `--upgrade-package NAME`) moves them. Needs PyPI.
# `bash scripts/lock.sh --check` (offline, run by .ci/run) fails when the lock is stale.
# The lock covers every package (direct, transitive, dev extras, pip) for CPython 3.11 on Linux x86_64.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
LOCK=requirements.lock
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
UV_VERSION=0.13.9

# sha256 of what the lock is made from (requires-python and both dependency lists, order-insensitive):
# the lock's header records it, and --check compares it with pyproject.toml's.
deps_digest() {
  "$PY" - <<'EOF'
import hashlib, json, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
src = {"requires-python": p.get("requires-python", ""),
       "dependencies": sorted(p.get("dependencies", [])),
       "optional-dependencies": {k: sorted(v) for k, v in p.get("optional-dependencies", {}).items()}}
print(hashlib.sha256(json.dumps(src, sort_keys=True).encode()).hexdigest())
EOF
}

if [ "${1:-}" = "--check" ]; then
  # Offline: the lock must have been made from the current dependency lists, and pin every `==` of them.
  LOCK_DIGEST="$(deps_digest)" "$PY" - "$LOCK" <<'EOF'
import os, re, sys, tomllib
lock_path = sys.argv[1]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
try:
    text = open(lock_path).read()
except FileNotFoundError:
    sys.exit(f"[lock] {lock_path} is missing: run `bash scripts/lock.sh`")
pins = {norm(m[1]): m[2] for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", text, re.M)}
problems = []
m = re.search(r"^# pyproject-deps-sha256: ([0-9a-f]{64})$", text, re.M)
if not m or m[1] != os.environ["LOCK_DIGEST"]:
    problems.append("pyproject.toml's dependency lists changed since the lock was made")
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = p.get("dependencies", []) + [r for v in p.get("optional-dependencies", {}).values() for r in v]
for r in reqs:
    name = norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r)[1])
    exact = re.search(r"===?\s*([^\s,;]+)", r)
    if name not in pins:
        problems.append(f"{r!r} is not in the lock")
    elif exact and pins[name] != exact[1]:
        problems.append(f"{r!r} but the lock has {name}=={pins[name]}")
if problems:
    sys.exit(f"[lock] {lock_path} is stale; run `bash scripts/lock.sh` and commit it:\n  " + "\n  ".join(problems))
print(f"[lock] {lock_path} is up to date with pyproject.toml ({len(pins)} packages)")
EOF
  exit 0
fi

# uv in a tool venv of its own, outside .venv (so the locked environment holds nothing extra).
TOOLS="${XDG_CACHE_HOME:-$HOME/.cache}/fusion-retrain/lock-tools"
if ! "$TOOLS/bin/uv" --version 2>/dev/null | grep -q " $UV_VERSION"; then
  "$PY" -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q "uv==$UV_VERSION"
fi

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
# uv keeps the pins of the file it writes to (unless --upgrade): start it from the current lock.
[ -f "$LOCK" ] && cp "$LOCK" "$TMP/out.txt"
# Resolved against PyPI alone, so any machine makes the same lock; pip (read from stdin) is locked too.
echo pip | "$TOOLS/bin/uv" pip compile --no-config --quiet pyproject.toml - --all-extras \
  --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
  --default-index https://pypi.org/simple --generate-hashes \
  --custom-compile-command "bash scripts/lock.sh" -o "$TMP/out.txt" "$@"

# pip takes a wheel from this machine's local sources (pip config: find-links, file:// indexes) when its
# hash is allowed: add the hash of every local file of a locked version that PyPI's list lacks.
"$PY" -m pip config list 2>/dev/null >"$TMP/pipconf" || true
"$PY" - "$TMP/out.txt" "$TMP/pipconf" <<'EOF'
import glob, hashlib, html, os, re, sys, urllib.parse, urllib.request
out, conf = sys.argv[1], open(sys.argv[2]).read()
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
text = open(out).read()
pins = {norm(m[1]): m[2] for m in re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", text, re.M)}
locs = [l for v in re.findall(r"(?:find-links|extra-index-url|index-url)='([^']*)'", conf) for l in v.split()]
files = set()
for loc in locs:
    path = urllib.parse.urlparse(loc).path if loc.startswith("file:") else loc
    if not os.path.isdir(path):
        continue
    if os.path.isfile(os.path.join(path, "index.html")) or loc.startswith("file:"):  # a PEP 503 index
        for name in pins:
            page = os.path.join(path, name, "index.html")
            if os.path.isfile(page):
                for href in re.findall(r'href="([^"#]+)', open(page).read()):
                    files.add(os.path.normpath(os.path.join(path, name, html.unescape(href))))
    else:  # a find-links folder
        files.update(glob.glob(os.path.join(path, "*")))
added = {}
for f in sorted(files):
    b = os.path.basename(f)
    m = re.match(r"^([A-Za-z0-9_.]+?)-([^-]+?)(?:-[^-]+-[^-]+-[^-]+\.whl|\.tar\.gz|\.zip)$", b)
    if not m or pins.get(norm(m[1])) != m[2] or not os.path.isfile(f):
        continue
    h = hashlib.sha256(open(f, "rb").read()).hexdigest()
    if h not in text:
        added.setdefault(norm(m[1]), []).append(h)
def add(mo):
    hs = added.get(norm(mo[1]))
    return mo[0] if not hs else mo[0] + "".join(f"    --hash=sha256:{h} \\\n" for h in hs)
text = re.sub(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==[^\n]*\\\n", add, text, flags=re.M)
open(out, "w").write(text)
for n, hs in added.items():
    print(f"[lock] {n}: added {len(hs)} local file hash(es) that PyPI does not list", file=sys.stderr)
EOF

{
  echo "# Lock of the whole environment for CPython 3.11 on Linux x86_64: every package (direct, transitive,"
  echo "# dev extras, pip) with its hashes. scripts/env.sh installs it with pip --require-hashes --no-deps."
  echo "# Refresh after editing pyproject.toml's dependencies: \`bash scripts/lock.sh\` (keeps pins that still"
  echo "# fit; add --upgrade to move them), then commit both. CI runs \`bash scripts/lock.sh --check\`."
  echo "# pyproject-deps-sha256: $(deps_digest)"
  cat "$TMP/out.txt"
} >"$TMP/lock"
mv "$TMP/lock" "$LOCK"
echo "[lock] wrote $LOCK ($(grep -cE '^[A-Za-z0-9]' "$LOCK") packages)" >&2
