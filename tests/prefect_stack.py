"""A real Prefect server and a `process` worker for the deployment tests, each in its own process group,
with their logs in files; `prefect deployment run` through the CLI, states read over the REST API."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from project_copy import env

from tasks._io.ports import free_port

POOL = "retrain-pool"
PORT = "<port>"  # the free port of this stack (docs/deployments.md: 4200)
# The worker set-up of docs/deployments.md ("Deployments: nightly, on demand, champion"), command for command
# and in its order (test_worker_env.py reads that page and checks it): the documented set-up is what the tests
# run.
SETUP: list[tuple[str, ...]] = [
    ("server", "start", "--host", "127.0.0.1", "--port", PORT),
    ("work-pool", "create", POOL, "--type", "process", "--overwrite"),
    ("work-pool", "set-concurrency-limit", POOL, "1"),
    ("--no-prompt", "deploy", "--all"),
    ("worker", "start", "--pool", POOL),
]
# What the worker's environment names (prefect.yaml's pull steps read them when a run starts).
WORKER_VARIABLES = ("RETRAIN_REPOSITORY", "RETRAIN_HOME")


class PrefectStack:
    """A server and a worker, each in its own process group, with their logs in files."""

    def __init__(self, project: Path, home: Path, runs_home: Path) -> None:
        self.project, self.port = project, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = env() | {
            "PREFECT_HOME": str(home), "PREFECT_API_URL": self.api, "PREFECT_UI_ENABLED": "false",
            "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1",
            "PREFECT_LOGGING_LEVEL": "INFO",
            # where the pull steps put the run workspace, and what they clone into it
            "RETRAIN_HOME": str(runs_home), "RETRAIN_REPOSITORY": str(project),
        }
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = home
        self.workspace = runs_home / "workspace"

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

    def prefect(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "prefect", *args], cwd=self.project, env=self.env, capture_output=True,
            text=True, timeout=timeout,
        )
        assert not check or done.returncode == 0, (
            f"prefect {' '.join(args)}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = httpx.post(f"{self.api}{path}", json=body, timeout=30)
        response.raise_for_status()
        return response.json()

    def get(self, path: str) -> Any:
        response = httpx.get(f"{self.api}{path}", timeout=30)
        response.raise_for_status()
        return response.json()

    def submit(self, deployment: str, **parameters: Any) -> str:
        """Start a run of `deployment` (flow/name) with these parameters; returns the flow run's id."""
        args = ["deployment", "run", deployment]
        for key, value in parameters.items():
            args += ["--param", f"{key}={json.dumps(value) if not isinstance(value, str) else value}"]
        out = self.prefect(*args).stdout
        return next(line.split()[-1] for line in out.splitlines() if "UUID:" in line)

    def wait(self, flow_run_id: str, timeout_s: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            flow_run = self.get(f"/flow_runs/{flow_run_id}")
            if flow_run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return flow_run
            time.sleep(1)
        raise AssertionError(f"flow run {flow_run_id} not finished after {timeout_s} s:\n{self.log('worker')}")

    def task_states(self, flow_run_id: str) -> dict[str, str]:
        runs = self.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})
        return {t["name"].rsplit("-", 1)[0]: t["state"]["type"] for t in runs}

    def flow_run_process(self, flow_run_id: str) -> psutil.Process | None:
        for p in psutil.process_iter():
            try:
                if p.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id and "prefect" in " ".join(p.cmdline()):
                    return p
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return None

    def stop(self) -> None:
        """Worker first: a worker whose server went away first hangs."""
        for name in ("worker", "server"):
            self.stop_one(name)

    def stop_one(self, name: str, grace_s: float = 30) -> None:
        """SIGTERM the process's group, SIGKILL it after `grace_s`: a Prefect worker told to stop can keep
        polling with its client already closed (its log then repeats "All connection attempts failed"), and a
        test must not wait on it."""
        proc = self.procs.pop(name, None)
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        try:  # anything the group started and left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def leftovers(self) -> list[str]:
        """Processes still running that belong to this stack: its port, its project or its workspace."""
        found = []
        for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
            try:
                cmd = " ".join(p.info["cmdline"] or [])
                cwd = p.info["cwd"] or ""
                mine = str(self.port) in cmd or any(str(f) in cwd or str(f) in cmd
                                                    for f in (self.project, self.workspace))
                if mine and p.pid != os.getpid():
                    found.append(f"{p.pid}: {cmd[:200]}")
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return found

    def deploy(self) -> None:
        """SETUP, in order: a server, a one-at-a-time process pool, `prefect deploy --all` of prefect.yaml,
        then a worker."""
        for command in SETUP:
            args = [str(self.port) if a == PORT else a for a in command]
            if command[0] in ("server", "worker"):
                self.start(command[0], *args)
                if command[0] == "server":
                    self.wait_healthy()
            elif command[1:] == ("deploy", "--all"):
                self.deploy_out = self.prefect(*args).stdout
            else:
                self.prefect(*args)
