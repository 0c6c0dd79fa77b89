"""Five nights of the `nightly` deployment on arriving data, through a real Prefect server and worker.

Each night is `prefect deployment run retrain/nightly`, triggered by hand: it takes in the batch after the
last one seen (prefect.yaml: next_batch) and retrains on the accumulated data with params.yaml as
committed. Nights 1-3 bring batches 1, 2, 3 of the same population; night 4 a drifted batch (older
animals: Age; "not specified" codes: FurLength, MaturitySize); night 5 a batch with photos cut short. The
drift and the broken photos are one-night overrides of what the embedded feed emits; the project's base
dataset is large enough for the drift gate's statistics to be calm on batches of its own population.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from prefect_stack import PrefectStack
from project_copy import dvc, make_project, write_params

pytestmark = pytest.mark.slow

FEED = {"n_train": 1500, "n_test": 300, "image_size": 8, "seed": 3, "batch_rows": 400}
NIGHTS: list[tuple[str, dict[str, Any]]] = [
    ("batch 1", {}), ("batch 2", {}), ("batch 3", {}),
    ("drifted", {"download": {"synthetic": {"drift": ["numeric", "codes"]}}}),
    ("broken photos", {"download": {"synthetic": {"drift": "photos"}}}),
]


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


@dataclass
class Night:
    flow_run: dict[str, Any]
    tasks: dict[str, str]
    accumulated: dict[str, bytes]  # data/accumulated (the intake's folder) of the workspace after the night
    champion: dict[str, bytes]
    validated: dict[str, Any] | None
    drift: dict[str, Any] | None


@dataclass
class Nights:
    stack: PrefectStack
    project: Path
    nights: dict[str, Night] = field(default_factory=dict)

    @property
    def workspace(self) -> Path:
        return self.stack.workspace


@pytest.fixture(scope="module")
def nights(tmp_path_factory: pytest.TempPathFactory):
    project = make_project(tmp_path_factory.mktemp("nightly") / "project", {"download": {"synthetic": FEED}})
    stack = PrefectStack(project, tmp_path_factory.mktemp("prefect_home_nightly"),
                         tmp_path_factory.mktemp("retrain_home_nightly"))
    result = Nights(stack, project)
    try:
        stack.deploy()
        for label, overrides in NIGHTS:
            flow_run = stack.wait(stack.submit("retrain/nightly", **({"overrides": overrides} if overrides else {})))
            ws = stack.workspace
            champion = ws / "models" / "champion"
            result.nights[label] = Night(
                flow_run=flow_run, tasks=stack.task_states(flow_run["id"]),
                accumulated=_tree(ws / "data/accumulated"),
                champion=_tree(champion.resolve()) if champion.is_symlink() else {},
                validated=_read_json(ws / "data/validated/meta.json"), drift=_read_json(ws / "reports/drift.json"),
            )
        yield result
    finally:
        stack.stop()


def _artifact(nights: Nights, flow_run_id: str, key: str) -> str:
    artifacts = nights.stack.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    return next(a["data"] for a in artifacts if a["key"] == key)


def test_each_night_ends_as_planned(nights: Nights) -> None:
    states = {label: n.flow_run["state"]["type"] for label, n in nights.nights.items()}
    assert states == {"batch 1": "COMPLETED", "batch 2": "COMPLETED", "batch 3": "COMPLETED",
                      "drifted": "FAILED", "broken photos": "FAILED"}, (states, nights.stack.log("worker"))
    stages = ["download", "intake", "validate", "train", "convert", "evaluate", "version", "promote"]
    for label in ("batch 1", "batch 2", "batch 3"):
        assert nights.nights[label].tasks == dict.fromkeys(stages, "COMPLETED")
    # both refusals stop in the intake stage, which lands, checks and gates the batch: nothing trains
    assert nights.nights["drifted"].tasks == {"download": "COMPLETED", "intake": "FAILED"}
    assert nights.nights["broken photos"].tasks == {"download": "COMPLETED", "intake": "FAILED"}
    for label in ("batch 1", "batch 2", "batch 3"):  # the final state says which batch the night took in
        assert f"batch(es) {label.split()[1]} taken in" in nights.nights[label].flow_run["state"]["message"]


def test_the_accumulated_data_grows_by_each_batch_and_each_run_trains_on_it(nights: Nights) -> None:
    manifests = [json.loads(nights.nights[f"batch {n}"].accumulated["manifest.json"]) for n in (1, 2, 3)]
    assert [[b["batch"] for b in m["batches"]] for m in manifests] == [[1], [1, 2], [1, 2, 3]]
    joined = FEED["batch_rows"] - round(FEED["batch_rows"] * 0.2)  # each batch's training share
    assert [m["rows"]["train"] for m in manifests] == [FEED["n_train"] + n * joined for n in (1, 2, 3)]
    # what the night trained on: the validated splits of that night's accumulated training rows
    trained = [nights.nights[f"batch {n}"].validated["rows"] for n in (1, 2, 3)]
    assert [r["train"] + r["val"] for r in trained] == [m["rows"]["train"] for m in manifests]
    assert all(r["test"] == FEED["n_test"] for r in trained)  # the frozen test set
    assert [nights.nights[f"batch {n}"].validated["holdout"] for n in (1, 2, 3)] == [
        f"holdout/batch-000{n}.csv" for n in (1, 2, 3)]  # each night also scores its batch's held-out rows


def test_the_metrics_of_the_runs_are_on_one_plot(nights: Nights) -> None:
    models = nights.workspace / "models"
    decisions = [json.loads(line) for line in (models / "history.jsonl").read_text().splitlines()]
    assert len(decisions) == 3 and all(d["challenger_score"] > 0.5 for d in decisions)
    assert [Path(d["holdout"]["file"]).name for d in decisions] == [f"batch-000{n}.csv" for n in (1, 2, 3)]
    assert (models / "score_history.png").read_bytes()[:4] == b"\x89PNG"
    third = nights.nights["batch 3"].flow_run["id"]
    promotion = _artifact(nights, third, "retrain-promotion")
    assert "score_history.png" in promotion and "newest batch's holdout" in promotion


def test_a_drifted_batch_stops_before_training_and_its_report_names_both_columns(nights: Nights) -> None:
    night = nights.nights["drifted"]
    assert "drift gate" in night.flow_run["state"]["message"]
    drifted = set(night.drift["drifted"])
    assert "Age" in drifted and drifted & {"FurLength", "MaturitySize"}, night.drift
    quarantined = nights.workspace / "data/quarantine/batch-0004"
    assert set(json.loads((quarantined / "drift.json").read_text())["drifted"]) == drifted
    assert not (nights.workspace / "data/incoming/batch-0004").exists()
    drift = _artifact(nights, night.flow_run["id"], "retrain-drift")  # the figures in the UI, the PNG linked
    assert "Age" in drift and "drift.png" in drift and (nights.workspace / "reports/drift.png").is_file()


def test_a_batch_with_broken_photos_is_quarantined_by_validation(nights: Nights) -> None:
    night = nights.nights["broken photos"]
    quarantined = nights.workspace / "data/quarantine/batch-0005"
    assert "quarantined" in night.flow_run["state"]["message"]
    report = json.loads((quarantined / "validation.json").read_text())
    assert report["success"] is False and "images/" in (quarantined / "validation.md").read_text()


def test_after_five_nights_the_champion_and_the_data_are_those_of_night_three(nights: Nights) -> None:
    third, last = nights.nights["batch 3"], nights.nights["broken photos"]
    assert last.accumulated == third.accumulated and last.champion == third.champion and third.champion


def test_dvc_repro_reproduces_the_accumulated_data(nights: Nights) -> None:
    """The project the workspace is cloned from, batch by batch through params.yaml and `dvc repro`:
    the same files as the nights took in, byte for byte."""
    project = nights.project
    for batch in (1, 2, 3):
        write_params(project, {"download": {"synthetic": {"batch": batch}}})
        dvc(project, "repro", "--force", "intake")  # what arrives is outside DVC's view: forced
    assert _tree(project / "data/accumulated") == nights.nights["batch 3"].accumulated
    train = pd.read_csv(project / "data/accumulated/dataset/train.csv", index_col=0)
    assert len(train) == json.loads(nights.nights["batch 3"].accumulated["manifest.json"])["rows"]["train"]
    assert "batches" not in json.loads((project / "data/raw/manifest.json").read_text())  # download's own


def test_stopping_leaves_no_process_behind(nights: Nights) -> None:
    nights.stack.stop()
    assert nights.stack.leftovers() == []
    assert os.path.isdir(nights.workspace / "data/quarantine")
