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
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from prefect_stack import POOL, PrefectStack
from project_copy import dvc, lock_hashes, run, sha256

pytestmark = pytest.mark.slow

ARTIFACT_KEYS = {
    "retrain-validation", "retrain-training", "retrain-conversion", "retrain-metrics", "retrain-metrics-table",
    "retrain-run-manifest", "retrain-promotion",
}
# The challengers of the soak, as one-run overrides of the project's tiny parameters (project_copy.TINY):
# a learning rate too small to learn anything in one epoch, and four epochs instead of one.
WORSE = {"train": {"lr": 1e-7}}
BETTER = {"train": {"max_epochs": 4}}
LONG = {"train": {"max_epochs": 200, "early_stopping_patience": None}}  # killed once its first epoch is saved


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
        s.deploy()
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
    assert set(soak.stack.task_states(run_id)) == {"download", "intake", "validate", "train", "convert", "evaluate",
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
    assert soak.stack.task_states(soak.runs["refused"]["id"]) == {"download": "COMPLETED", "intake": "COMPLETED",
                                                                       "validate": "FAILED"}
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
