"""Arriving batches of the embedded feed through the real download and intake stages: landed, validated
alone, gated on drift, taken in (other feeds, ids and the review: tests/test_intake.py).

The base dataset and batches come from the embedded generator (small images, enough rows for the drift
gate's statistics to be calm on batches of the same population).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest

from fusion_model.dataset import split_images
from tasks.download import download
from tasks.download.manifest import DATASET_DIRNAME
from tasks.intake import intake
from tasks.intake.ledger import read_ledger
from tasks.intake.stage import DriftGateError, last_batch_seen
from tasks.params import DownloadParams, FeedParams, IntakeParams, SyntheticParams, ValidateParams
from tasks.validate import ValidationError, validate

BATCH_ROWS = 400


def _download(root: Path, batch: int, drift: str | list[str] = "none") -> DownloadParams:
    """The base dataset, and the embedded feed's batch `batch` (the generator is the download's)."""
    return DownloadParams(
        source="synthetic", out_dir=root / "data/raw",
        synthetic=SyntheticParams(n_train=1500, n_test=300, image_size=8, seed=3, batch=batch,
                                  batch_rows=BATCH_ROWS, drift=drift),
    )


def _intake(root: Path) -> IntakeParams:
    return IntakeParams(out_dir=root / "data/accumulated", incoming_dir=root / "data/incoming",
                        quarantine_dir=root / "data/quarantine", report_dir=root / "reports",
                        feed=FeedParams(ledger=root / "data/intake/batches.json"))


def _take(root: Path, batch: int, drift: str | list[str] = "none"):  # noqa: ANN202
    """The download stage (the base), then the intake stage (the batch), as dvc.yaml and the flow run them."""
    base = _download(root, batch, drift)
    download(base)
    return intake(_intake(root), base)


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _drift(root: Path) -> dict:
    return json.loads((root / "reports/drift.json").read_text())


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The base dataset, then batches 1, 2, 3 taken in one after another; each step's tree kept."""
    root = tmp_path_factory.mktemp("arriving")
    trees = {}
    for batch in (0, 1, 2, 3):
        summary = _take(root, batch)
        trees[batch] = _tree(root / "data/accumulated")
        assert summary.batches_taken_in == list(range(1, batch + 1))
    return {"root": root, "trees": trees}


def test_each_batch_joins_the_accumulated_data(accumulated: dict) -> None:
    root = accumulated["root"]
    dataset = root / "data/accumulated" / DATASET_DIRNAME
    train = pd.read_csv(dataset / "train.csv", index_col=0)
    held = int(round(BATCH_ROWS * 0.2))
    assert len(train) == 1500 + 3 * (BATCH_ROWS - held)
    assert sorted(p.name for p in (dataset / "holdout").iterdir()) == [f"batch-000{n}.csv" for n in (1, 2, 3)]
    assert all(len(pd.read_csv(dataset / "holdout" / f"batch-000{n}.csv", index_col=0)) == held for n in (1, 2, 3))
    assert len(pd.read_csv(dataset / "test.csv", index_col=0)) == 300  # the frozen test set never changes
    # fresh row ids after the accumulated data's (the base: 0..1799), never the batch file's own
    assert train.index.is_unique and train.index[-(BATCH_ROWS - held):].min() >= 1800
    manifest = json.loads((root / "data/accumulated/manifest.json").read_text())
    assert [b["batch"] for b in manifest["batches"]] == [1, 2, 3]
    ledger = read_ledger(root / "data/intake/batches.json")
    assert [(b.batch, b.status) for b in ledger.batches] == [(1, "taken"), (2, "taken"), (3, "taken")]
    assert [b.sha256 for b in ledger.batches] == [b["sha256"] for b in manifest["batches"]]
    assert manifest["rows"]["train"] == len(train)
    assert _drift(root)["passed"] is True and _drift(root)["batch"] == 3 and _drift(root)["drifted"] == []
    # every image a row names is in the accumulated dataset
    missing = [p for cell in train["Images"] for p in split_images(cell) if not (dataset / p).is_file()]
    assert missing == []
    trees = accumulated["trees"]
    assert all(set(trees[n]) < set(trees[n + 1]) for n in (0, 1, 2))  # it only grows


def test_a_batch_taken_in_twice_and_a_plain_run_change_nothing(accumulated: dict, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(accumulated["root"], root)
    before = _tree(root / "data/accumulated")
    assert _take(root, 2).already == ["batch-0002: batch 2, taken"]
    _take(root, 0)  # the base of the same params: the accumulated data is kept, not rebuilt
    assert _tree(root / "data/accumulated") == before
    assert last_batch_seen(_intake(root)) == 3


def test_a_drifted_batch_stops_before_training_and_is_quarantined(accumulated: dict, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(accumulated["root"], root)
    before = _tree(root / "data/accumulated")
    with pytest.raises(DriftGateError) as err:
        _take(root, 4, drift=["numeric", "codes"])
    report = _drift(root)
    assert report["passed"] is False and report["batch"] == 4
    assert "Age" in report["drifted"] and {"FurLength", "MaturitySize"} <= set(report["drifted"])
    assert "Age" in str(err.value) and "quarantined" in str(err.value)
    assert _tree(root / "data/accumulated") == before  # the accumulated data is untouched
    quarantined = root / "data/quarantine/batch-0004"
    assert (quarantined / "train.csv").is_file() and json.loads((quarantined / "drift.json").read_text())["drifted"]
    assert not (root / "data/incoming/batch-0004").exists()
    assert (root / "reports/drift.md").read_text().startswith("# Drift gate: FAILED")
    assert (root / "reports/drift.png").read_bytes()[:4] == b"\x89PNG"
    assert last_batch_seen(_intake(root)) == 4  # the nightly run moves on to batch 5
    # a person reviews it and takes it in: the drift verdict is overridden, and the override recorded
    from fusion_model.dataset import resolve_schema
    from tasks.intake.review import readmit

    record = readmit(_intake(root), _download(root, 0), resolve_schema({"preset": "petfinder"}), 4)
    assert record.status == "readmitted" and any(o.startswith("drift") and "Age" in o for o in record.overrides)
    manifest = json.loads((root / "data/accumulated/manifest.json").read_text())
    assert manifest["batches"][-1]["batch"] == 4 and manifest["batches"][-1]["overrides"] == record.overrides
    assert not quarantined.exists() and (root / "data/accumulated/dataset/holdout/batch-0004.csv").is_file()


def test_a_batch_with_broken_photos_is_refused_by_validation(accumulated: dict, tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(accumulated["root"], root)
    before = _tree(root / "data/accumulated")
    with pytest.raises(ValidationError, match=r"batch 5 \(batch-0005\) is refused and quarantined") as err:
        _take(root, 5, drift="photos")
    assert "image files decode" in str(err.value)
    assert _tree(root / "data/accumulated") == before
    quarantined = root / "data/quarantine/batch-0005"
    assert "FAILED" in (quarantined / "validation.md").read_text()


def test_validate_writes_the_newest_holdout_beside_the_frozen_test_set(accumulated: dict, tmp_path: Path) -> None:
    root = accumulated["root"]
    out = tmp_path / "validated"
    summary = validate(ValidateParams(dataset_dir=root / "data/accumulated" / DATASET_DIRNAME, out_dir=out,
                                      report_dir=tmp_path / "reports", workers=1))
    held = int(round(BATCH_ROWS * 0.2))
    assert summary.rows["holdout"] == held and summary.rows["test"] == 300
    meta = json.loads((out / "meta.json").read_text())
    assert meta["holdout"] == "holdout/batch-0003.csv"
    holdout = pd.read_parquet(out / "holdout.parquet")
    assert (holdout["row_id"] >= 1800 + 2 * BATCH_ROWS).all()  # batch 3's rows: after the base's and 1's and 2's
