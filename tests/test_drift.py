"""Drift gate (tasks/validate/drift.py) on real generated data, real GX: a batch from the reference's own
distribution passes; each kind of drift fails on exactly its column; the report files are readable."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import BaseModel, ValidationError

from fusion_model.dataset import resolve_schema
from fusion_model.presets.petfinder import CATEGORICAL_COLUMNS, IMAGES, LABEL, NUMERIC_COLUMNS
from tasks.validate.drift import (
    CategoricalDrift,
    DriftReport,
    DriftThresholds,
    drift_gate,
    no_batch_report,
    render_drift_markdown,
    write_drift_report,
)

THRESHOLDS = DriftThresholds()
BATCH_ROWS = 600
# ~300 breed codes, most of them rare: a same-distribution batch carries a few the reference never saw
# (Good-Turing expects ~1% of rows for Breed1, ~3% for Breed2), so these may warn but never fail.
RARE_CODE_COLUMNS = {"Breed1", "Breed2"}


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(reference, pool): the validate stage's typed tables of one generated dataset; reference = its
    3,000 train + val rows, pool = its 1,000 test rows (independent draws of the same distribution)."""
    from tasks.download.synthetic import generate
    from tasks.params import SyntheticParams, ValidateParams
    from tasks.validate import validate

    root = tmp_path_factory.mktemp("drift")
    generate(root / "raw", SyntheticParams(n_train=3000, n_test=1000, image_size=16, seed=3))
    out = root / "validated"
    validate(ValidateParams(dataset_dir=root / "raw" / "dataset", out_dir=out,
                            report_dir=root / "reports"))
    reference = pd.concat([pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "val.parquet")],
                          ignore_index=True)
    return reference, pd.read_parquet(out / "test.parquet")


@pytest.fixture
def reference(tables: tuple[pd.DataFrame, pd.DataFrame]) -> pd.DataFrame:
    return tables[0]


@pytest.fixture
def batch(tables: tuple[pd.DataFrame, pd.DataFrame]) -> pd.DataFrame:
    """A fresh copy of 600 same-distribution rows, to change."""
    return tables[1].iloc[:BATCH_ROWS].reset_index(drop=True).copy()


def shift_age(batch: pd.DataFrame) -> pd.DataFrame:
    batch["Age"] = batch["Age"] * 2.5
    return batch


def unseen_codes(batch: pd.DataFrame) -> pd.DataFrame:
    """30% of rows get FurLength 0 and MaturitySize 0: valid codes ("not specified") never generated."""
    rows = np.random.default_rng(0).permutation(len(batch))[: int(0.3 * len(batch))]
    batch.loc[rows, ["FurLength", "MaturitySize"]] = "0"
    return batch


def assert_fails_on(report: DriftReport, *columns: str) -> None:
    assert not report.passed
    assert set(columns) <= set(report.drifted), report.reason
    assert all(c in report.reason for c in columns)
    assert all(report.columns[c].status == "fail" for c in columns)


def test_same_distribution_batches_pass(reference: pd.DataFrame, tables: tuple[pd.DataFrame, pd.DataFrame]) -> None:
    pool = tables[1]
    for rows in (slice(0, BATCH_ROWS), slice(len(pool) - BATCH_ROWS, len(pool))):
        report = drift_gate(reference, pool.iloc[rows], THRESHOLDS)
        assert report.passed and report.drifted == [], report.reason
        assert set(report.warnings) <= RARE_CODE_COLUMNS, report.reason
        assert report.skipped == {}
        numeric = [*NUMERIC_COLUMNS, "Description_length"]
        assert all(report.columns[c].value < THRESHOLDS.psi_warn for c in numeric)  # PSI noise ~0.02
        for c in CATEGORICAL_COLUMNS:
            col = report.columns[c]
            assert isinstance(col, CategoricalDrift)
            assert col.psi < THRESHOLDS.category_psi_warn
            assert col.unseen_share < THRESHOLDS.unseen_fail and col.gx_success
        assert report.columns["missing_photos"].value == 0
        assert report.columns[LABEL].value < THRESHOLDS.label_rate_fail


def test_numeric_shift_fails_on_that_column(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference, shift_age(batch), THRESHOLDS)
    assert_fails_on(report, "Age")
    assert [c for c in report.drifted if c in NUMERIC_COLUMNS] == ["Age"]
    age = report.model_dump(mode="json")["columns"]["Age"]
    assert age["kind"] == "numeric" and age["statistic"] == "psi"
    assert age["psi"] == age["value"] > THRESHOLDS.psi_fail
    assert age["ks_pvalue"] < 1e-6 and age["batch_mean"] > 2 * age["reference_mean"]


def test_unseen_codes_fail_and_are_listed(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference, unseen_codes(batch), THRESHOLDS)
    assert_fails_on(report, "FurLength", "MaturitySize")
    assert [c for c in report.drifted if c in CATEGORICAL_COLUMNS] == ["MaturitySize", "FurLength"]
    assert not set(report.drifted) & set(NUMERIC_COLUMNS)
    for c in ("FurLength", "MaturitySize"):
        col = report.columns[c]
        assert isinstance(col, CategoricalDrift)
        assert col.unseen_share == pytest.approx(0.3) and col.unseen_status == "fail" and not col.gx_success
        assert [(u.code, u.rows) for u in col.unseen_codes] == [("0", int(0.3 * BATCH_ROWS))]
        assert col.psi > THRESHOLDS.category_psi_fail  # the "other" bucket holds the new code
    assert f"0 ({int(0.3 * BATCH_ROWS)})" in report.reason


def test_numeric_and_categorical_drift_together(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference, unseen_codes(shift_age(batch)), THRESHOLDS)
    assert_fails_on(report, "Age", "FurLength", "MaturitySize")
    assert sorted(report.drifted) == ["Age", "FurLength", "MaturitySize"]


def test_label_rate_change_fails_on_label(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    """A fifth of the batch's rows turn from 0 (slow) to 1 (fast): the positive rate rises ~0.2."""
    zeros = np.flatnonzero(batch[LABEL].to_numpy() == 0)
    batch.loc[np.random.default_rng(0).choice(zeros, BATCH_ROWS // 5, replace=False), LABEL] = 1
    report = drift_gate(reference, batch, THRESHOLDS)
    assert_fails_on(report, LABEL)
    assert report.drifted == [LABEL]
    label = report.columns[LABEL]
    assert label.kind == "label" and label.statistic == "positive_rate_difference"
    assert label.value == pytest.approx(label.rates["1"].difference) and label.value > 0.15


def test_multiclass_label_gates_the_largest_class_change(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    reference = reference.assign(**{LABEL: np.arange(len(reference)) % 5})
    speeds = np.arange(len(batch)) % 5
    speeds[speeds == 4] = 0  # class 4 (never adopted) vanishes into class 0
    ordinal = resolve_schema({"preset": "petfinder", "label": {"problem_type": "ordinal"}})
    report = drift_gate(reference, batch.assign(**{LABEL: speeds}), THRESHOLDS, ordinal, [0, 1, 2, 3, 4])
    assert_fails_on(report, LABEL)
    label = report.columns[LABEL]
    assert label.statistic == "max_rate_difference" and label.value == pytest.approx(0.2)
    assert set(label.rates) == {"0", "1", "2", "3", "4"}


def test_missing_photos_fail(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    batch.loc[: BATCH_ROWS // 2 - 1, IMAGES] = ""
    report = drift_gate(reference, batch, THRESHOLDS)
    assert_fails_on(report, "missing_photos")
    assert report.drifted == ["missing_photos"]
    photos = report.columns["missing_photos"]
    assert photos.kind == "photos" and photos.value == pytest.approx(0.5)


def test_tiny_batch_is_refused(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference, batch.iloc[:20], THRESHOLDS)
    assert not report.passed and report.batch_rows == 20 and report.columns == {}
    assert "20 rows" in report.reason and "min_rows=50" in report.reason
    assert render_drift_markdown(report).startswith("# Drift gate: FAILED\n\nthe batch has 20 rows")


def test_absent_columns_are_skipped_not_failed(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference.drop(columns=["Fee"]), batch.drop(columns=[IMAGES, "State"]), THRESHOLDS)
    assert report.passed, report.reason
    assert set(report.skipped) == {"Fee", "State", "missing_photos"}
    assert "absent from the reference" in report.skipped["Fee"] and "absent from the batch" in report.skipped["State"]
    assert not {"Fee", "State", "missing_photos"} & set(report.columns)
    assert "Skipped" in render_drift_markdown(report)


def test_report_files(reference: pd.DataFrame, batch: pd.DataFrame, tmp_path: Path) -> None:
    report = drift_gate(reference, unseen_codes(shift_age(batch)), THRESHOLDS)
    paths = write_drift_report(report, tmp_path / "reports")
    assert [p.name for p in paths] == ["drift.json", "drift.md", "drift.png"]
    data = json.loads(paths[0].read_text())
    assert data["passed"] is False and sorted(data["drifted"]) == ["Age", "FurLength", "MaturitySize"]
    assert {"warned", "warnings", "reason", "reference_rows", "batch_rows", "thresholds", "columns"} <= set(data)
    assert data["thresholds"] == THRESHOLDS.model_dump() and data["batch_rows"] == BATCH_ROWS
    assert data["columns"]["FurLength"]["unseen_codes"] == [{"code": "0", "rows": 180}]
    assert DriftReport.model_validate(data) == report  # round trip, kinds included
    markdown = paths[1].read_text()
    assert markdown == render_drift_markdown(report)
    assert markdown.splitlines()[0] == "# Drift gate: FAILED"
    fail_rows = [line for line in markdown.splitlines() if "**FAIL**" in line]
    assert sorted(line.split("|")[1].strip() for line in fail_rows) == ["Age", "FurLength", "MaturitySize"]
    assert "0 (180)" in markdown
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.joinpath("reports").glob(".*.tmp")) == []


def test_markdown_title_follows_the_verdict(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    strict = DriftThresholds(unseen_warn=0.0, label_rate_warn=0.0)
    assert render_drift_markdown(drift_gate(reference, batch, strict)).startswith("# Drift gate: WARNED")
    relaxed = DriftThresholds(unseen_warn=0.5, unseen_fail=0.5, label_rate_warn=0.5, label_rate_fail=0.5)
    report = drift_gate(reference, batch, relaxed)
    assert report.passed and not report.warned, report.reason
    assert render_drift_markdown(report).startswith("# Drift gate: PASSED")


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValidationError):
        DriftThresholds(psi_wran=0.2)  # extra="forbid": a typo is an error, not a silent default
    with pytest.raises(ValidationError, match="psi_warn must not be above psi_fail"):
        DriftThresholds(psi_warn=0.3, psi_fail=0.2)
    assert DriftThresholds.model_validate(DriftThresholds().model_dump()) == DriftThresholds()


def test_thresholds_from_another_model_or_a_dict(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    """The caller passes its params.yaml section (a model with the same fields) or a plain dict."""

    class Section(BaseModel):
        psi_fail: float = 5.0
        psi_warn: float = 5.0

    report = drift_gate(reference, shift_age(batch), Section())  # type: ignore[arg-type]
    assert "Age" not in report.drifted and report.thresholds.psi_fail == 5.0
    assert report.thresholds.unseen_fail == THRESHOLDS.unseen_fail  # the rest keep their defaults
    with pytest.raises(ValidationError):
        drift_gate(reference, batch, {"psi_fial": 1.0})  # type: ignore[arg-type]


def test_no_batch_report(tmp_path: Path) -> None:
    report = no_batch_report()
    assert report.passed and not report.warned and report.drifted == [] and report.columns == {}
    report.batch = 7  # the caller records which batch a report is about
    paths = write_drift_report(report, tmp_path)
    data = json.loads(paths[0].read_text())
    assert data["passed"] is True and data["drifted"] == [] and data["batch"] == 7
    assert "no arriving batch" in paths[1].read_text()
    assert paths[2].read_bytes()[:4] == b"\x89PNG"
