"""prefect.yaml end to end, over many runs: a real Prefect server, a `process` pool, `prefect deploy --all`,
a worker, and `prefect deployment run` of the deployments, six retrains in a row (tiny parameters).

The project is the session's `pipeline_project` (a git + DVC copy after one `dvc repro`, conftest.py).
The worker runs every flow in its own workspace: a clone of that project under RETRAIN_HOME (the pull
steps of prefect.yaml), never in the project folder itself. The soak, in order:

1. a plain run: the first champion;
2. a worse challenger (an override of one run): not promoted;
3. a refused dataset: the flow stops at validation;
4. a run killed mid-training (SIGKILL of the worker's flow process);
5. a better challenger (another override): promoted;
6. a plain run again: params.yaml as committed, whatever earlier runs overrode.

The tests below read what the soak left; the last ones roll the champion back through the `champion`
deployment and stop the worker, then the server, checking that nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from project_copy import dvc, env, lock_hashes, run, sha256

from tasks._io.ports import free_port

pytestmark = pytest.mark.slow

POOL = "retrain-pool"
ARTIFACT_KEYS = {
    "retrain-validation", "retrain-training", "retrain-conversion", "retrain-metrics", "retrain-metrics-table",
    "retrain-run-manifest", "retrain-promotion",
}
# The challengers of the soak, as one-run overrides of the project's tiny parameters (project_copy.TINY):
# a learning rate too small to learn anything in one epoch, and four epochs instead of one.
WORSE = {"train": {"lr": 1e-7}}
BETTER = {"train": {"max_epochs": 4}}
LONG = {"train": {"max_epochs": 200}}  # the run that is killed once its first epoch is saved


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


@dataclass
class Soak:
    stack: PrefectStack
    first_model_sha: str
    project_before: dict[str, Any]
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # label -> flow run (final state)
    champion_after: dict[str, str | None] = field(default_factory=dict)  # label -> champion sha after it
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def workspace(self) -> Path:
        return self.stack.workspace


def _champion_sha(workspace: Path) -> str | None:
    link = workspace / "models" / "champion"
    return Path(os.readlink(link)).name if link.is_symlink() else None


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def _project_state(project: Path) -> dict[str, Any]:
    return {"status": run(project, "git", "status", "--porcelain", "--untracked-files=no").stdout,
            "params": (project / "params.yaml").read_bytes(), "lock": (project / "dvc.lock").read_bytes(),
            "model": sha256(project / "data/model/model.safetensors"),
            "models": sorted(str(p.relative_to(project)) for p in (project / "models").rglob("*"))
            if (project / "models").exists() else []}


def _kill_when_training(s: PrefectStack, flow_run_id: str) -> None:
    """SIGKILL the flow's process once its first epoch is saved; its launcher and ranks must follow."""
    staging = s.workspace / "data" / ".checkpoints.staging"
    deadline = time.monotonic() + 600
    while not (staging / "last.ckpt").exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"the long run never saved an epoch:\n{s.log('worker')}")
        time.sleep(0.5)
    process = s.flow_run_process(flow_run_id)
    assert process is not None, "the flow run's process was not found"
    process.kill()
    deadline = time.monotonic() + 60
    while _mentioning(str(staging)) and time.monotonic() < deadline:
        time.sleep(0.5)


def _mentioning(text: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in a for a in (p.info["cmdline"] or [])):
            found.append(" ".join(p.info["cmdline"])[:200])
    return found


@pytest.fixture(scope="module")
def soak(tmp_path_factory: pytest.TempPathFactory, pipeline_project: dict):
    project = pipeline_project["root"]
    assert dvc(project, "status").stdout.strip() == "Data and pipelines are up to date."
    home = tmp_path_factory.mktemp("prefect_home_deploy")
    runs_home = tmp_path_factory.mktemp("retrain_home")
    broken = tmp_path_factory.mktemp("broken_dataset")
    (broken / "train.csv").write_text(",Type,Age,AdoptionSpeed\n0,1,3,1\n1,2,5,0\n")
    (broken / "test.csv").write_text(",Type,Age,AdoptionSpeed\n0,1,3,1\n")
    s = PrefectStack(project, home, runs_home)
    result = Soak(s, pipeline_project["first_model_sha"], _project_state(project))
    plan: list[tuple[str, dict[str, Any]]] = [
        ("plain", {}), ("worse", WORSE), ("refused", {"validate": {"dataset_dir": str(broken)}}),
        ("killed", LONG), ("better", BETTER), ("plain_again", {}),
    ]
    try:
        t = time.monotonic()
        s.start("server", "server", "start", "--host", "127.0.0.1", "--port", str(s.port))
        s.wait_healthy()
        s.prefect("work-pool", "create", POOL, "--type", "process", "--overwrite")
        s.prefect("work-pool", "set-concurrency-limit", POOL, "1")
        s.deploy_out = s.prefect("--no-prompt", "deploy", "--all").stdout
        s.start("worker", "worker", "start", "--pool", POOL)
        result.timings["stack"] = time.monotonic() - t
        for label, overrides in plan:
            t = time.monotonic()
            flow_run_id = s.submit("retrain/on-demand", **({"overrides": overrides} if overrides else {}))
            if label == "killed":
                _kill_when_training(s, flow_run_id)
            result.runs[label] = s.wait(flow_run_id)
            result.champion_after[label] = _champion_sha(s.workspace)
            result.timings[label] = time.monotonic() - t
        yield result
    finally:
        s.stop()


def _manifest(soak: Soak, label: str) -> dict[str, Any]:
    """The run manifest the version step wrote for one of the soak's runs."""
    flow_run_id = soak.runs[label]["id"]
    events = _jsonl(soak.workspace / "models/runs/flow_runs.jsonl")
    run_id = next(e["run_id"] for e in events if e.get("flow_run_id") == flow_run_id)
    return json.loads((soak.workspace / "models/runs" / f"{run_id}.json").read_text())


def test_every_run_ends_as_planned(soak: Soak) -> None:
    states = {label: r["state"]["type"] for label, r in soak.runs.items()}
    assert states == {"plain": "COMPLETED", "worse": "COMPLETED", "refused": "FAILED", "killed": "CRASHED",
                      "better": "COMPLETED", "plain_again": "COMPLETED"}, (states, soak.stack.log("worker"))
    print(f"timings (s): {json.dumps({k: round(v, 1) for k, v in soak.timings.items()})}")


def test_a_run_publishes_every_artifact_and_its_body_runs_once_with_two_ranks(soak: Soak) -> None:
    run_id = soak.runs["plain"]["id"]
    artifacts = soak.stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}})
    by_key = {a["key"]: a for a in artifacts}
    assert ARTIFACT_KEYS <= set(by_key), sorted(by_key)
    training = by_key["retrain-training"]["data"]
    assert "| strategy | deepspeed |" in training and "| world_size | 2 |" in training
    assert "roc_auc" in by_key["retrain-metrics"]["data"] and "classical baseline" in by_key["retrain-metrics"]["data"]
    assert "models/runs/" in by_key["retrain-promotion"]["data"]
    assert set(soak.stack.task_states(run_id)) == {"download", "validate", "train", "convert", "evaluate",
                                                    "version", "promote"}
    events = [e for e in _jsonl(soak.workspace / "models/runs/flow_runs.jsonl") if e.get("flow_run_id") == run_id
              or e.get("run_id") == _manifest(soak, "plain")["run_id"]]
    assert [e["event"] for e in events] == ["started", "finished"] and len({e["pid"] for e in events}) == 1


def test_runs_happen_in_their_own_workspace_and_change_nothing_git_tracks(soak: Soak) -> None:
    assert _project_state(soak.stack.project) == soak.project_before  # the checkout prefect deploy ran in
    workspace = soak.workspace
    assert run(workspace, "git", "status", "--porcelain", "--untracked-files=no").stdout == ""
    assert run(workspace, "git", "rev-parse", "HEAD").stdout == run(soak.stack.project, "git", "rev-parse",
                                                                     "HEAD").stdout


def test_the_same_params_in_another_clone_give_the_same_model_bytes(soak: Soak) -> None:
    """`dvc repro` in the project and the flow in the workspace clone (another path) trained the same
    weights: identical model.safetensors sha256, nothing absolute inside it."""
    decisions = _jsonl(soak.workspace / "models/history.jsonl")
    assert decisions[0]["challenger_sha256"] == soak.first_model_sha


def test_an_override_stays_in_its_run_and_the_next_plain_run_uses_params_yaml(soak: Soak) -> None:
    from tasks.params import load_params

    committed = load_params(soak.workspace / "params.yaml").model_dump(mode="json", by_alias=True)
    better = _manifest(soak, "better")
    assert better["overridden"] == ["train.max_epochs"] and better["params"]["train"]["max_epochs"] == 4
    assert better["dvc"]["uncommitted_stages"] == ["train", "convert", "evaluate"]
    plain = _manifest(soak, "plain_again")
    assert plain["overridden"] == [] and plain["params"]["train"] == committed["train"]
    assert plain["dvc"]["uncommitted_stages"] == [] and "train" not in plain["dvc"]["pushed_stages"]
    # dvc.lock describes what the workspace holds: the last run used params.yaml, so nothing is stale
    assert dvc(soak.workspace, "status").stdout.strip() == "Data and pipelines are up to date."


def test_a_refused_dataset_and_a_killed_run_leave_the_champion_and_the_checkpoints(soak: Soak) -> None:
    assert soak.stack.task_states(soak.runs["refused"]["id"]) == {"download": "COMPLETED", "validate": "FAILED"}
    after = soak.champion_after
    assert after["refused"] == after["killed"] == after["worse"] == after["plain"]
    assert not _mentioning(str(soak.workspace / "data" / ".checkpoints.staging"))  # no orphaned rank
    assert not (soak.workspace / "data" / ".checkpoints.staging").exists()  # the next run restarted cleanly


def test_the_champion_is_the_better_model_and_the_registry_lists_exactly_the_promotions(soak: Soak) -> None:
    decisions = {d["run_id"]: d for d in _jsonl(soak.workspace / "models/history.jsonl")}
    plain, worse, better = (decisions[_manifest(soak, k)["run_id"]] for k in ("plain", "worse", "better"))
    assert plain["promoted"] and not worse["promoted"] and better["promoted"]
    assert worse["challenger_score"] < plain["challenger_score"] < better["challenger_score"]
    assert not decisions[_manifest(soak, "plain_again")["run_id"]]["promoted"]
    assert _champion_sha(soak.workspace) == better["challenger_sha256"]
    rows = json.loads(run(soak.workspace, sys.executable, "-m", "tasks", "champion", "list", "--json").stdout)
    assert [(r["version"], r["sha256"], r["current"]) for r in rows] == [
        (1, plain["challenger_sha256"], False), (2, better["challenger_sha256"], True)]
    assert rows[1]["run_id"] == _manifest(soak, "better")["run_id"] and rows[1]["code_rev"]
    leftovers = [p for p in (soak.workspace / "data").iterdir() if p.name.startswith(".") and p.is_dir()]
    leftovers += [p for p in (soak.workspace / "models").rglob(".*") if p.is_dir()]
    assert leftovers == []


def test_rollback_through_prefect_restores_the_previous_champion_byte_for_byte(soak: Soak) -> None:
    s = soak.stack
    flow_run = s.wait(s.submit("champion/champion", action="rollback"))
    assert flow_run["state"]["type"] == "COMPLETED", s.log("worker")
    champion = soak.workspace / "models" / "champion"
    first = _jsonl(soak.workspace / "models/history.jsonl")[0]
    assert sha256(champion / "model.safetensors") == first["challenger_sha256"]
    # the last run trained with the first one's parameters on the same data: the same bytes again
    assert (champion / "model.safetensors").read_bytes() == (soak.workspace / "data/model/model.safetensors").read_bytes()
    artifacts = s.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    assert any(a["key"] == "champion-registry" and "| * | 1 |" in a["data"] for a in artifacts)


def test_deployments_have_a_nightly_cron_and_run_one_at_a_time(soak: Soak) -> None:
    s = soak.stack
    nightly = s.get("/deployments/name/retrain/nightly")
    assert [x["schedule"].get("cron") for x in nightly["schedules"]] == ["0 2 * * *"]
    for name in ("retrain/nightly", "retrain/on-demand", "champion/champion"):
        deployment = s.get(f"/deployments/name/{name}")
        assert deployment["global_concurrency_limit"]["limit"] == 1
        assert deployment["concurrency_options"]["collision_strategy"] == "ENQUEUE"
        steps = [next(iter(step)) for step in deployment["pull_steps"]]
        assert "prefect.deployments.steps.git_clone" in steps  # every run in its own workspace
    assert nightly["parameters"]["source"] == "synthetic"
    assert s.get(f"/work_pools/{POOL}")["concurrency_limit"] == 1


def test_stopping_leaves_no_process_behind(soak: Soak) -> None:
    soak.stack.stop()
    deadline = time.monotonic() + 10
    while soak.stack.leftovers() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert soak.stack.leftovers() == []
    assert lock_hashes(soak.workspace)  # the workspace's dvc.lock is readable after it all
