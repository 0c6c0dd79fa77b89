#!/usr/bin/env bash
# The test command: create/reuse .venv, then run the whole suite (slow tests included). Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -m "not slow"`.
source "$(dirname "$0")/env.sh"
ruff check .  # lint first: seconds, and a failure names the line
exec python -m pytest "$@"
