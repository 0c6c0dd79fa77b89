"""The retrain flow's wiring: typed overrides, retries only where transient, artifacts, and a refused
dataset stopping the flow before training (a real flow run on Prefect's temporary local server).

The whole flow with 2 training ranks, through a deployment and a worker, is in test_deployment.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from filelock import FileLock
from prefect.exceptions import ParameterTypeError
from prefect.states import Failed
from pydantic import ValidationError

from flows.artifacts import key_value_table, training_markdown
from flows.overrides import ParamOverrides, overrides_dict, parse_set, resolve_params
from flows.retrain import RUN_LOG_NAME, main, retrain
from flows.stage_tasks import (
    _transient,
    convert_task,
    download_task,
    evaluate_task,
    promote_task,
    train_task,
    validate_task,
    version_task,
)
from tasks.errors import StageError, TransientError
from tasks.params import ParamsError

ROOT = Path(__file__).resolve().parents[1]


# --- parameters ----------------------------------------------------------------------------------------


def test_overrides_replace_only_the_given_keys_nested_sections_included() -> None:
    overrides = ParamOverrides.model_validate(
        {"train": {"max_epochs": 1}, "download": {"synthetic": {"n_train": 120}, "sha256": None}}
    )
    params = resolve_params(ROOT / "params.yaml", overrides_dict(overrides))
    file = yaml.safe_load((ROOT / "params.yaml").read_text())
    assert params.train.max_epochs == 1
    assert params.train.lr == file["train"]["lr"]
    assert params.download.synthetic.n_train == 120
    assert params.download.synthetic.n_test == file["download"]["synthetic"]["n_test"]
    assert overrides_dict(overrides)["download"]["sha256"] is None  # an explicit null is an override too


def test_overrides_refuse_an_unknown_key_or_a_wrong_type_naming_it() -> None:
    with pytest.raises(ValidationError, match=r"train\.max_epoch\b"):
        ParamOverrides.model_validate({"train": {"max_epoch": 1}})
    with pytest.raises(ValidationError, match=r"train\.strategy"):
        ParamOverrides.model_validate({"train": {"strategy": "horovod"}})
    with pytest.raises(ParamsError, match="train.max_epochs: Input should be greater than or equal to 1"):
        resolve_params(ROOT / "params.yaml", {"train": {"max_epochs": 0}})


def test_prefect_validates_run_parameters_against_the_typed_overrides() -> None:
    schema = json.dumps(retrain.parameters.model_dump())
    assert "max_epochs" in schema and "ParamOverrides" in schema
    with pytest.raises(ParameterTypeError, match="max_epochs"):
        retrain.validate_parameters({"overrides": {"train": {"max_epochs": "many"}}})
    with pytest.raises(ParameterTypeError, match="source"):
        retrain.validate_parameters({"source": "ftp"})


def test_set_flag_parses_values_as_yaml_and_explains_its_format() -> None:
    assert parse_set(["train.hidden_sizes=[8, 4]", "download.synthetic.n_train=120"]) == {
        "train": {"hidden_sizes": [8, 4]}, "download": {"synthetic": {"n_train": 120}}
    }
    with pytest.raises(ParamsError, match=r"expected SECTION.KEY=VALUE, e.g. --set train.max_epochs=1"):
        parse_set(["max_epochs=1"])


def test_main_refuses_bad_overrides_before_starting_prefect(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", str(ROOT / "params.yaml"), "--set", "train.max_epochs=0"]) == 2
    assert "train.max_epochs: Input should be greater than or equal to 1" in capsys.readouterr().err
    assert main(["--params", str(ROOT / "params.yaml"), "--set", "train.max_epoch=1"]) == 2
    assert "train.max_epoch" in capsys.readouterr().err


# --- retries and artifacts -----------------------------------------------------------------------------


def test_only_the_download_retries_and_only_for_transient_failures() -> None:
    assert download_task.retries == 3 and sum(download_task.retry_delay_seconds) >= 120
    for step in (validate_task, train_task, convert_task, evaluate_task, version_task, promote_task):
        assert step.retries == 0, step.name
    assert _transient(download_task, None, Failed(data=TransientError("HTTP 503 on all 5 attempts"))) is True
    assert _transient(download_task, None, Failed(data=StageError("sha256 mismatch"))) is False
    assert _transient(download_task, None, Failed(data=OSError("No space left on device"))) is False


def test_training_artifact_puts_strategy_world_size_and_throughput_first() -> None:
    summary = {"fit_wall_s": 2.5, "samples_per_s": 207.05, "world_size": 2, "strategy": "deepspeed"}
    lines = training_markdown(summary, Path("data/checkpoints/train_summary.json")).splitlines()
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert rows == ["| strategy | deepspeed |", "| world_size | 2 |", "| samples_per_s | 207.1 |", "| fit_wall_s | 2.5 |"]
    assert "`{\"a\": 1}`" in key_value_table({"nested": {"a": 1}})
    assert "was not written" in training_markdown(None, Path("x.json"))


# --- real flow runs (Prefect's temporary server) -------------------------------------------------------


@pytest.fixture(scope="module")
def temporary_prefect_server():
    """Prefect's temporary server for this module, stopped here rather than at interpreter exit (where its
    shutdown log line hits closed streams). Its first start takes ~20 s idle, minutes on a busy machine."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=300):
        yield


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, temporary_prefect_server: None):
    """A project folder whose dataset fails validation: train.csv lacks most required columns."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["download"]["synthetic"] |= {"n_train": 20, "n_test": 10, "image_size": 16}
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "train.csv").write_text(",Type,Age,AdoptionSpeed\n0,1,3,1\n1,2,5,0\n")
    (broken / "test.csv").write_text(",Type,Age,AdoptionSpeed\n0,1,3,1\n")
    params["validate"]["dataset_dir"] = str(broken)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _task_states(flow_state) -> dict[str, list[str]]:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_state.state_details.flow_run_id]))
        )
    states: dict[str, list[str]] = {}
    for run in runs:
        states.setdefault(run.name.rsplit("-", 1)[0], []).append(f"{run.state.type.value}:{run.run_count}")
    return states


def _artifacts(flow_state) -> dict[str, object]:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    flow_run_id = flow_state.state_details.flow_run_id
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found}


@pytest.mark.slow
def test_the_download_task_retries_an_outage_and_never_a_refusal(
        temporary_prefect_server: None, tiny_raw_dataset: Path, tmp_path: Path) -> None:
    """Through the real download against a real server: 503s outlasting the download's own attempts are
    a TransientError, which the Prefect task retries (here without its minutes of delay); a 404 is not."""
    from prefect import flow
    from zip_server import ZipServer, zip_of

    from tasks.params import DatasetParams, DownloadParams

    server = ZipServer().start()
    try:
        server.routes["/petfinder.zip"] = zip_of(tiny_raw_dataset)
        server.faults["/petfinder.zip"] = [503, 503, 503, 503]  # two task runs of two attempts each
        quick = download_task.with_options(retry_delay_seconds=[0.2, 0.2, 0.2])

        @flow(name="download-retries")
        def fetch(path: str) -> object:
            return quick(DownloadParams(source="url", url=server.url(path), out_dir=tmp_path / path.strip("/"),
                                        max_attempts=2, backoff_s=0.01, timeout_s=10), DatasetParams().schema)

        state = fetch("/petfinder.zip", return_state=True)
        assert state.is_completed(), state.message
        assert _task_states(state) == {"download": ["COMPLETED:3"]}  # failed twice, retried by Prefect
        assert server.hits["/petfinder.zip"] == 5
        refused = fetch("/missing.zip", return_state=True)
        assert refused.is_failed() and _task_states(refused) == {"download": ["FAILED:1"]}
        assert server.hits["/missing.zip"] == 1
    finally:
        server.stop()


@pytest.mark.slow
def test_a_refused_dataset_stops_the_flow_before_training(workspace: Path) -> None:
    state = retrain(params_path=Path("params.yaml"), version_outputs=False, return_state=True)
    assert state.is_failed()
    with pytest.raises(StageError, match="train.csv"):
        state.result()
    # validate ran once (no retry) and nothing after it ran
    assert _task_states(state) == {"download": ["COMPLETED:1"], "intake": ["COMPLETED:1"], "validate": ["FAILED:1"]}
    assert not (workspace / "data/checkpoints").exists() and not (workspace / "models/champion").exists()
    events = [json.loads(line) for line in (workspace / "models/runs" / RUN_LOG_NAME).read_text().splitlines()]
    assert [e["event"] for e in events] == ["started", "failed"]
    assert "validation of" in events[1]["error"] and "train.csv" in events[1]["error"]
    report = _artifacts(state)["retrain-validation"]  # the failed report is in the UI too
    assert report.description == "Validation FAILED" and "Breed1" in report.data


@pytest.mark.slow
def test_a_quarantined_batch_fails_the_run_naming_it_with_the_ledger_in_the_ui(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, temporary_prefect_server: None) -> None:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["download"]["synthetic"] |= {"n_train": 300, "n_test": 60, "image_size": 8, "batch_rows": 120,
                                        "drift": ["numeric", "codes"]}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(tmp_path)
    state = retrain(params_path=Path("params.yaml"), version_outputs=False, next_batch=True, return_state=True)
    assert state.is_failed() and "batch 1 (batch-0001) is refused and quarantined" in state.message
    assert "drift gate" in state.message
    assert _task_states(state) == {"download": ["COMPLETED:1"], "intake": ["FAILED:1"]}
    artifacts = _artifacts(state)
    assert "quarantined" in str(artifacts["retrain-batches"].data) and "Age" in artifacts["retrain-drift"].data
    assert (tmp_path / "data/quarantine/batch-0001/reason.txt").read_text().startswith("drift: ")


@pytest.mark.slow
def test_a_second_retrain_in_the_same_workspace_is_refused(workspace: Path) -> None:
    (workspace / "models/runs").mkdir(parents=True)
    with FileLock(str(workspace / "models/runs/.retrain.lock")):
        state = retrain(params_path=Path("params.yaml"), version_outputs=False, return_state=True)
    assert state.is_failed()
    with pytest.raises(StageError, match="another retrain is running in .* wait for it to finish"):
        state.result()
    assert _task_states(state) == {}


@pytest.mark.slow
def test_a_killed_flow_leaves_no_temporary_prefect_server_behind(tmp_path: Path) -> None:
    """SIGKILL of `python -m flows.retrain` runs nothing of it: a watcher it left ends the temporary server."""
    import subprocess
    import sys
    import time

    import psutil

    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["download"]["synthetic"] |= {"n_train": 40, "n_test": 20, "image_size": 16}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    home = tmp_path / "prefect_home"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"} | {"PREFECT_HOME": str(home)}
    flow_proc = subprocess.Popen([sys.executable, "-m", "flows.retrain", "--no-version", "--no-promote"],
                                 cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def servers() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline", "environ"]):
            try:
                if ("prefect.server.api.server:create_app" in " ".join(p.info["cmdline"] or [])
                        and (p.info["environ"] or {}).get("PREFECT_HOME") == str(home)):
                    found.append(p)
            except psutil.Error:
                continue
        return found

    try:
        deadline = time.monotonic() + 180
        while not servers():
            assert flow_proc.poll() is None, "the flow ended before its temporary server was seen"
            assert time.monotonic() < deadline, "no temporary server started"
            time.sleep(0.2)
        flow_proc.kill()
        flow_proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while servers() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert servers() == []
    finally:
        if flow_proc.poll() is None:
            flow_proc.kill()
        for p in servers():
            p.kill()


def test_the_watcher_ends_a_descendant_that_is_no_longer_a_child(tmp_path: Path) -> None:
    """What polling the children misses: a process the flow started through another that has exited (so
    it is re-parented away), or one started between the watcher's last look and the SIGKILL. It carries
    the watcher's token in its environment and is ended all the same."""
    import subprocess
    import sys
    import time

    import psutil

    pid_file = tmp_path / "orphan.pid"
    orphan = f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); open({str(pid_file)!r}, 'w').write(str(p.pid))"
    parent_code = (
        "import os, subprocess, sys, time\n"
        "from tasks._io.processes import start_reaper\n"
        "start_reaper()\n"
        f"subprocess.run([sys.executable, '-c', {orphan!r}], check=True)\n"  # exits, its child lives on
        "time.sleep(1)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    parent = subprocess.run([sys.executable, "-c", parent_code], cwd=ROOT, timeout=60)
    assert parent.returncode == -9
    left = psutil.Process(int(pid_file.read_text()))
    try:
        deadline = time.monotonic() + 20
        while left.is_running() and left.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left.is_running() or left.status() == psutil.STATUS_ZOMBIE
    finally:
        if left.is_running():
            left.kill()


def test_prefect_yaml_deployments_are_valid_for_this_flow() -> None:
    from prefect.client.schemas.schedules import CronSchedule

    from flows.champion import champion
    from flows.score import score
    from flows.train_nodes import train_node

    config = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    flows = {f.name: f for f in (retrain, champion, score, train_node)}
    # Prefect names a deployment '<flow>/<deployment>', so two flows may each have an 'on-demand'
    deployments = {}
    for d in config["deployments"]:
        path, _, name = d["entrypoint"].partition(":")
        [flow_] = [f for f in flows.values() if f.fn.__name__ == name]
        assert (ROOT / path).is_file(), d["entrypoint"]
        key = f"{flow_.name}/{d['name']}"
        assert key not in deployments, f"{key} is declared twice"
        deployments[key] = (d, flow_)
    assert set(deployments) == {
        "retrain/nightly", "retrain/on-demand", "champion/champion", "train-node/node", "score/on-demand",
        "score/nightly",
    }
    for d, flow_ in deployments.values():
        assert d["work_pool"]["name"] == "retrain-pool"
        if d["name"] == "node":  # started by the retrain flow with its parameters, one per host at once
            assert d["tags"] == ["retrain", "node"] and "parameters" not in d
            continue
        assert d["concurrency_limit"] == {"limit": 1, "collision_strategy": "ENQUEUE"}
        flow_.validate_parameters(d["parameters"])  # raises on a parameter the flow does not take
    for key in ("retrain/nightly", "score/nightly"):
        [schedule] = deployments[key][0]["schedules"]
        CronSchedule(cron=schedule["cron"], timezone=schedule["timezone"])
    assert deployments["retrain/nightly"][0]["parameters"]["source"] == "synthetic"
    # runs happen in a clone the worker keeps, never in the folder `prefect deploy` ran in
    steps = [next(iter(step)) for step in config["pull"]]
    assert steps[-2:] == ["prefect.deployments.steps.git_clone", "prefect.deployments.steps.set_working_directory"]
