"""prefect.yaml end to end: a real Prefect server, a `process` pool, `prefect deploy --all`, a worker, and
`prefect deployment run ... --watch` in a throwaway git + DVC copy of the project (tiny parameters).

The project is the session's `pipeline_project` (after one `dvc repro`, conftest.py), so the flow's
outputs are compared byte for byte with DVC's. One module-scoped deployment run is shared by the tests
below; the last one stops the worker, then the server, and checks that nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml
from project_copy import dvc, env, lock_hashes, run, sha256

pytestmark = pytest.mark.slow

POOL = "retrain-pool"
ARTIFACT_KEYS = {
    "retrain-validation", "retrain-training", "retrain-conversion", "retrain-metrics", "retrain-metrics-table",
    "retrain-run-manifest", "retrain-promotion",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrefectStack:
    """A server and a worker, each in its own process group, with their logs in files."""

    def __init__(self, project: Path, home: Path) -> None:
        self.project, self.port = project, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = env() | {
            "PREFECT_HOME": str(home), "PREFECT_API_URL": self.api, "PREFECT_UI_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = home

    def start(self, name: str, *args: str) -> None:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        env = self.env if name != "server" else {k: v for k, v in self.env.items() if k != "PREFECT_API_URL"}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "prefect", *args], cwd=self.project, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text()[-4000:]

    def wait_healthy(self, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.procs["server"].poll() is not None:
                raise AssertionError(f"prefect server exited:\n{self.log('server')}")
            try:
                if httpx.get(f"{self.api}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"prefect server not healthy after {timeout_s} s:\n{self.log('server')}")

    def prefect(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "prefect", *args], cwd=self.project, env=self.env, capture_output=True,
            text=True, timeout=timeout,
        )
        assert done.returncode == 0, f"prefect {' '.join(args)}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
        return done

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = httpx.post(f"{self.api}{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.api}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def stop(self) -> None:
        """Worker first: a worker whose server went away first hangs."""
        for name in ("worker", "server"):
            proc = self.procs.pop(name, None)
            if proc is None or proc.poll() is not None:
                continue
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            try:  # anything the group started and left behind
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def leftovers(self) -> list[str]:
        """Processes still running that belong to this stack: its port or its project folder."""
        found = []
        for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                mine = str(self.port) in cmd or str(self.project) in (p.info["cwd"] or "")
                if mine and p.pid != os.getpid():
                    found.append(f"{p.pid}: {cmd[:200]}")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, pipeline_project: dict):
    project = pipeline_project["root"]
    assert dvc(project, "status").stdout.strip() == "Data and pipelines are up to date."
    home = tmp_path_factory.mktemp("prefect_home_deploy")
    s = PrefectStack(project, home)
    s.before = {"lock": lock_hashes(project), "model_sha": sha256(project / "data/model/model.safetensors"),
                "params": (project / "params.yaml").read_text()}
    max_epochs = yaml.safe_load(s.before["params"])["train"]["max_epochs"]
    timings: dict[str, float] = {}
    try:
        t = time.monotonic()
        s.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(s.port))
        s.wait_healthy()
        timings["server"] = time.monotonic() - t
        s.prefect("work-pool", "create", POOL, "--type", "process", "--overwrite")
        s.prefect("work-pool", "set-concurrency-limit", POOL, "1")
        timings["pool"] = time.monotonic() - t - timings["server"]
        t = time.monotonic()
        s.deploy_out = s.prefect("--no-prompt", "deploy", "--all").stdout
        timings["deploy"] = time.monotonic() - t
        s.start("worker", "worker", "start", "--pool", POOL)
        t = time.monotonic()
        s.run_out = subprocess.run(
            [sys.executable, "-m", "prefect", "deployment", "run", "retrain/on-demand",
             "--param", "overrides=" + json.dumps({"train": {"max_epochs": max_epochs}}),
             "--watch", "--watch-timeout", "600"],
            cwd=project, env=s.env, capture_output=True, text=True, timeout=660,
        )
        timings["run"] = time.monotonic() - t
        s.timings = timings
        yield s
    finally:
        s.stop()


def _flow_run(s: PrefectStack) -> dict:
    runs = s.post("/flow_runs/filter", {"deployments": {"name": {"any_": ["on-demand"]}}})
    assert len(runs) == 1, runs
    return runs[0]


def test_deployment_run_completes(stack: PrefectStack) -> None:
    out = stack.run_out.stdout + stack.run_out.stderr
    assert stack.run_out.returncode == 0, f"{out[-3000:]}\nworker log:\n{stack.log('worker')}"
    assert "Flow run finished successfully in 'Completed'" in out
    assert _flow_run(stack)["state"]["type"] == "COMPLETED"
    print(f"timings (s): {json.dumps({k: round(v, 1) for k, v in stack.timings.items()})}")


def test_run_publishes_every_artifact(stack: PrefectStack) -> None:
    run_id = _flow_run(stack)["id"]
    artifacts = stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
    by_key = {a["key"]: a for a in artifacts}
    assert ARTIFACT_KEYS <= set(by_key), sorted(by_key)
    training = by_key["retrain-training"]["data"]
    assert "| strategy | deepspeed |" in training and "| world_size | 2 |" in training
    assert "samples_per_s" in training
    assert "roc_auc" in by_key["retrain-metrics"]["data"]
    assert "models/runs/" in by_key["retrain-promotion"]["data"]


def _run_log(project: Path) -> list[dict]:
    return [json.loads(line) for line in (project / "models/runs/flow_runs.jsonl").read_text().splitlines()]


def test_run_leaves_the_model_and_a_champion(stack: PrefectStack) -> None:
    project = stack.project
    assert (project / "data/model/model.safetensors").is_file()
    assert (project / "models/champion/model.safetensors").is_file()
    decisions = [json.loads(line) for line in (project / "models/history.jsonl").read_text().splitlines()]
    assert decisions[-1]["promoted"] is True  # the first model becomes champion


def test_flow_body_runs_once_with_two_training_ranks(stack: PrefectStack) -> None:
    project = stack.project
    events = _run_log(project)
    assert [e["event"] for e in events] == ["started", "finished"]
    assert len({e["pid"] for e in events}) == 1
    summary = json.loads((project / "data/checkpoints/train_summary.json").read_text())
    assert summary["world_size"] == 2
    task_runs = stack.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [_flow_run(stack)["id"]]}}})
    names = sorted(t["name"].rsplit("-", 1)[0] for t in task_runs)
    assert names == sorted(["download", "validate", "train", "convert", "evaluate", "version", "promote"])
    assert (project / "models/runs" / f"{events[0]['run_id']}.json").is_file()


def test_deployments_have_a_nightly_cron_and_run_one_at_a_time(stack: PrefectStack) -> None:
    nightly = stack.get("/deployments/name/retrain/nightly")
    crons = [s["schedule"].get("cron") for s in nightly["schedules"]]
    assert crons == ["0 2 * * *"]
    on_demand = stack.get("/deployments/name/retrain/on-demand")
    assert on_demand["schedules"] == []
    for deployment in (nightly, on_demand):
        assert deployment["global_concurrency_limit"]["limit"] == 1
        assert deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE"
        assert deployment["parameters"]["params_path"] == "params.yaml"
    assert nightly["parameters"]["source"] == "synthetic"
    assert stack.get(f"/work_pools/{POOL}")["concurrency_limit"] == 1


def test_dvc_records_exactly_what_the_flow_produced(stack: PrefectStack) -> None:
    project = stack.project
    assert (project / "params.yaml").read_text() == stack.before["params"]  # overrides equal to the file
    assert dvc(project, "status").stdout.strip() == "Data and pipelines are up to date."
    out = dvc(project, "repro").stdout
    assert "Running stage" not in out and "Data and pipelines are up to date." in out
    manifest = json.loads((project / "models/runs" / f"{_run_log(project)[0]['run_id']}.json").read_text())
    assert manifest["recorded_params"] == []
    assert manifest["promotion"]["promoted"] is True
    assert manifest["dvc"]["pushed"] is True
    assert manifest["git"]["rev"] == run(project, "git", "rev-parse", "HEAD").stdout.strip()


def test_the_flow_rebuilds_the_dvc_outputs_byte_for_byte(stack: PrefectStack) -> None:
    """Same seed and params: the flow's data and model hashes equal those of the earlier `dvc repro`."""
    after = lock_hashes(stack.project)
    for out in ("data/raw", "data/validated", "data/model", "data/eval/predictions.csv"):
        assert after[out] == stack.before["lock"][out], out
    assert sha256(stack.project / "data/model/model.safetensors") == stack.before["model_sha"]


def test_stopping_leaves_no_process_behind(stack: PrefectStack) -> None:
    stack.stop()
    deadline = time.monotonic() + 10
    while stack.leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert stack.leftovers() == []
