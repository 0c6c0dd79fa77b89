"""Training across two machines, on one: the flow's training on two network-namespace hosts, checked.

    python bench/multihost.py [--zero-stage 2|3] [--tiny] [--keep]       (Linux, root; scripts/multihost_demo.sh)

Builds the lab of tests/netns_hosts.py (two hosts joined by a veth pair, each with its own folder and
Prefect worker; the Prefect server, the DVC remote and the git repository on the control side of the
bridge), runs `retrain/on-demand` with `train.hosts` set to the two hosts (one rank each, DeepSpeed
ZeRO-2 or 3: download, validate, train on both hosts, gather + convert once, evaluate, version,
promote), then trains the same seed and parameters with two ranks on one host (the control side, the
train and convert stages' CLI) and compares the two converted models. Tears everything down, even when
interrupted, and prints as its last line one JSON object:

    {"hosts": 2, "world_size": 2, "strategy": "deepspeed", "zero_stage": 2, "shards_per_host": [..],
     "model_sha256": "..", "single_host_sha256": "..", "bit_equal": true|false, "max_abs_diff": ..,
     "samples_per_s": .., "single_host_samples_per_s": .., "throughput_ratio": .., "demo_s": ..}

`--tiny` uses the test suite's tiny parameters (120 rows, one epoch) instead of params.yaml's defaults.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from netns_hosts import HostLab, can_run, compare, shards_per_host, single_host_reference  # noqa: E402
from project_copy import sha256  # noqa: E402


def run(zero_stage: int, tiny: bool, work: Path) -> dict[str, Any]:
    started = time.monotonic()
    params: dict[str, Any] = {"train": {"strategy": "deepspeed", "zero_stage": zero_stage, "devices": 1,
                                        "accelerator": "cpu"}}
    lab = HostLab(work / "lab", hosts=2, params=params, tiny=tiny)
    # the workers poll at Prefect's default interval, as the README's set-up runs them (the tests' lab polls
    # every second to save time, which on two cores takes CPU from the ranks while they train)
    for key in ("PREFECT_WORKER_QUERY_SECONDS", "PREFECT_WORKER_PREFETCH_SECONDS"):
        lab.env.pop(key, None)
    try:
        lab.up()
        print(f"[demo] lab up in {time.monotonic() - started:.0f} s: hosts "
              + ", ".join(f"{h.name} {h.train_address}" for h in lab.hosts) + f", API {lab.api}", flush=True)
        flow_run = lab.retrain(timeout_s=1800)
        state = flow_run["state"]
        if state["type"] != "COMPLETED":
            raise SystemExit(f"the retrain run ended {state['name']}: {state.get('message')}\n"
                             f"{lab.log('worker')}")
        workspace = lab.workspace
        summary = json.loads((workspace / "data/checkpoints/train_summary.json").read_text())
        shards = shards_per_host(lab, lab.run_id_of(flow_run))
        print(f"[demo] trained on both hosts and converted in {time.monotonic() - started:.0f} s; single-host "
              "reference next", flush=True)
    finally:
        left = lab.down()  # before the reference: its workers and servers must not share the CPU with it
        if left:
            print(f"[demo] ended {len(left)} process(es) still running in the hosts", flush=True)
    model = workspace / "data/model/model.safetensors"
    ref_model, ref_summary = single_host_reference(workspace, work / "single_host")
    bit_equal, diff = compare(model, ref_model)
    rate, ref_rate = summary["samples_per_s"], ref_summary["samples_per_s"]
    return {
        "hosts": len(lab.hosts), "world_size": summary["world_size"], "strategy": summary["strategy"],
        "zero_stage": summary["zero_stage"], "shards_per_host": shards,
        "model_sha256": sha256(model), "single_host_sha256": sha256(ref_model), "bit_equal": bit_equal,
        "max_abs_diff": diff, "samples_per_s": round(rate, 2), "single_host_samples_per_s": round(ref_rate, 2),
        "throughput_ratio": round(rate / ref_rate, 3), "demo_s": round(time.monotonic() - started, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zero-stage", type=int, choices=[2, 3], default=2)
    parser.add_argument("--tiny", action="store_true", help="the test suite's tiny parameters (a quick check)")
    parser.add_argument("--keep", action="store_true", help="keep the lab's folder (logs, workspaces) afterwards")
    args = parser.parse_args()
    why = can_run()
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2

    def interrupted(signum: int, frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # the teardown that follows runs to its end
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(sig, interrupted)
    work = Path(tempfile.mkdtemp(prefix="multihost-demo-"))
    ok = False
    try:
        result = run(args.zero_stage, args.tiny, work)
        ok = True
    finally:
        if args.keep or not ok:
            print(f"[demo] logs and workspaces kept in {work}", flush=True)
        else:
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
