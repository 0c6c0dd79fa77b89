#!/usr/bin/env bash
# The main command: create/reuse .venv, then retrain on the embedded dataset with params.yaml
# (every stage, in the order of ARCHITECTURE.md) and print the metrics.
# Extra arguments go to the flow, e.g. `bash scripts/pipeline.sh --source url`.
source "$(dirname "$0")/env.sh"
exec python -m flows.retrain "$@"
