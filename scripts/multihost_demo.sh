#!/usr/bin/env bash
# Training across two machines, on this one (Linux, root): two hosts as network namespaces joined by a veth
# pair, each with its own folder and Prefect worker; the retrain flow trains on both (one rank each,
# DeepSpeed ZeRO-2, or ZeRO-3 with --zero-stage 3), gathers the shards, converts once and evaluates; then
# the same seed and parameters train with two ranks on one host for comparison. Everything it starts is
# torn down at the end, also when interrupted. The last line printed is one JSON object (bench/multihost.py).
#   bash scripts/multihost_demo.sh [--zero-stage 3] [--tiny] [--keep]
source "$(dirname "$0")/env.sh"
if [ "$(id -u)" != 0 ]; then
  echo "error: the demo creates network namespaces and mounts: run it as root" >&2
  exit 2
fi
# bench/multihost.py tears the lab down itself (also on SIGTERM/SIGINT/SIGHUP): pass the signal on, then wait
python bench/multihost.py "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null; wait "$child"; exit 130' INT TERM HUP
wait "$child"
