#!/usr/bin/env bash
# The test command: create/reuse .venv, then run the whole suite (slow tests included) on two pytest-xdist
# workers (TEST_WORKERS=0: one process). Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
source "$(dirname "$0")/env.sh"
ruff check .  # lint first: seconds, and a failure names the line
exec python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
