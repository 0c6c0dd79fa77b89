"""Drift gate (tasks/intake/drift.py, drift_report.py, drift_stats.py) and `python -m tasks drift` on
real generated data: a batch from the reference's own distribution passes; each kind of drift fails on
exactly its column; the columns come by role; the report files are readable; the CLI's exit codes and
messages.
(On real PetFinder rows: tests/test_drift_real.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import BaseModel, ValidationError

from fusion_model.dataset import resolve_schema
from fusion_model.presets.petfinder import CATEGORICAL_COLUMNS, IMAGES, LABEL, NUMERIC_COLUMNS, TEXT_COLUMNS
from tasks.intake.drift import MISSING_IMAGES, DriftThresholds, drift_gate, no_batch_report
from tasks.intake.drift_report import (
    CategoricalDrift,
    DriftReport,
    render_drift_markdown,
    write_drift_report,
)
from tasks.intake.drift_stats import DriftColumns, holm

ROOT = Path(__file__).resolve().parents[1]
THRESHOLDS = DriftThresholds()
COLUMNS = DriftColumns.from_schema(resolve_schema({"preset": "petfinder"}))
BATCH_ROWS = 600


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """One generated dataset: its raw CSVs (the CLI's input) and the validate stage's typed tables;
    reference = its 3,000 train + val rows, pool = its 1,000 test rows (independent draws of the same
    distribution)."""
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
    return {"reference": reference, "pool": pd.read_parquet(out / "test.parquet"),
            "raw": root / "raw" / "dataset"}


@pytest.fixture
def reference(generated: dict) -> pd.DataFrame:
    return generated["reference"]


@pytest.fixture
def batch(generated: dict) -> pd.DataFrame:
    """A fresh copy of 600 same-distribution rows, to change."""
    return generated["pool"].iloc[:BATCH_ROWS].reset_index(drop=True).copy()


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


def test_holm_adjusts_like_the_step_down_procedure() -> None:
    # sorted: 0.005 * 4 = 0.02, 0.01 * 3 = 0.03, 0.03 * 2 = 0.06, 0.04 * 1 = 0.04 -> kept monotone: 0.06
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and holm([]) == []


def test_same_distribution_batches_pass(reference: pd.DataFrame, generated: dict) -> None:
    pool = generated["pool"]
    for rows in (slice(0, BATCH_ROWS), slice(len(pool) - BATCH_ROWS, len(pool))):
        report = drift_gate(reference, pool.iloc[rows], COLUMNS, THRESHOLDS)
        assert report.passed and report.drifted == [] and report.warnings == [], report.reason
        assert report.skipped == {}
        assert set(report.columns) == {*NUMERIC_COLUMNS, *(f"{c}_length" for c in TEXT_COLUMNS), *CATEGORICAL_COLUMNS, LABEL,
                                       MISSING_IMAGES}
        tests = [t for c in report.columns.values() for t in c.tests]
        assert report.tests == len(tests) and all(t.p_adjusted > THRESHOLDS.alpha_warn for t in tests)
        assert all(t.p_adjusted >= t.p_value for t in tests)
        assert report.columns[MISSING_IMAGES].tests[0].effect_size == 0


def test_numeric_shift_fails_on_that_column(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference, shift_age(batch), COLUMNS, THRESHOLDS)
    assert_fails_on(report, "Age")
    assert report.drifted == ["Age"]
    age = report.model_dump(mode="json")["columns"]["Age"]
    assert age["kind"] == "numeric" and [t["test"] for t in age["tests"]] == ["ks"]
    test = age["tests"][0]
    assert test["p_adjusted"] < THRESHOLDS.alpha_fail and test["effect"] == "psi"
    assert test["effect_size"] == age["psi"] > THRESHOLDS.min_psi
    assert age["ks_pvalue"] < 1e-6 and age["batch_mean"] > 2 * age["reference_mean"]


def test_unseen_codes_fail_and_are_listed(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference, unseen_codes(batch), COLUMNS, THRESHOLDS)
    assert_fails_on(report, "FurLength", "MaturitySize")
    assert sorted(report.drifted) == ["FurLength", "MaturitySize"]
    for c in ("FurLength", "MaturitySize"):
        col = report.columns[c]
        assert isinstance(col, CategoricalDrift)
        assert col.unseen_share == pytest.approx(0.3) and col.decisive.test == "unseen_binomial"
        assert col.expected_unseen_share < 0.01  # no rare codes in the reference: new ones are not chance
        assert [(u.code, u.rows) for u in col.unseen_codes] == [("0", int(0.3 * BATCH_ROWS))]
        shares = next(t for t in col.tests if t.test == "chi2")
        assert shares.status == "ok"  # the rows with known codes keep their shares
    assert f"0 ({int(0.3 * BATCH_ROWS)})" in report.reason


def test_numeric_and_categorical_drift_together(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference, unseen_codes(shift_age(batch)), COLUMNS, THRESHOLDS)
    assert sorted(report.drifted) == ["Age", "FurLength", "MaturitySize"]


def test_shifted_code_shares_fail_on_that_column(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    """Codes the reference has, in other shares: the chi-square over the known codes decides."""
    batch["Gender"] = np.where(np.arange(len(batch)) % 4 == 0, "3", "1")  # 25 % mixed, 75 % male
    report = drift_gate(reference, batch, COLUMNS, THRESHOLDS)
    assert report.drifted == ["Gender"], report.reason
    gender = report.columns["Gender"]
    assert gender.decisive.test == "chi2" and gender.decisive.effect_size >= THRESHOLDS.min_psi


def test_label_rate_change_fails_on_label(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    """A fifth of the batch's rows turn from 0 (slow) to 1 (fast): the positive rate rises ~0.2."""
    zeros = np.flatnonzero(batch[LABEL].to_numpy() == 0)
    batch.loc[np.random.default_rng(0).choice(zeros, BATCH_ROWS // 5, replace=False), LABEL] = 1
    report = drift_gate(reference, batch, COLUMNS, THRESHOLDS)
    assert report.drifted == [LABEL], report.reason
    label = report.columns[LABEL]
    assert label.kind == "label" and label.decisive.test == "fisher" and label.decisive.effect == "rate_difference"
    assert label.decisive.effect_size == pytest.approx(label.rates["1"].difference)
    assert label.decisive.effect_size > 0.15


def test_multiclass_label_gates_the_class_shares(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    reference = reference.assign(**{LABEL: np.arange(len(reference)) % 5})
    speeds = np.arange(len(batch)) % 5
    speeds[speeds == 4] = 0  # class 4 (never adopted) vanishes into class 0
    report = drift_gate(reference, batch.assign(**{LABEL: speeds}), DriftColumns.from_schema(resolve_schema({"preset": "petfinder", "label": {"problem_type": "multiclass"}})), THRESHOLDS)
    assert_fails_on(report, LABEL)
    label = report.columns[LABEL]
    assert label.decisive.test == "chi2" and label.decisive.effect_size == pytest.approx(0.2)
    assert set(label.rates) == {"0", "1", "2", "3", "4"} and label.problem_type == "multiclass"


def test_missing_images_fail(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    batch.loc[: BATCH_ROWS // 2 - 1, IMAGES] = ""
    report = drift_gate(reference, batch, COLUMNS, THRESHOLDS)
    assert report.drifted == [MISSING_IMAGES], report.reason
    images = report.columns[MISSING_IMAGES]
    assert images.kind == "images" and images.batch_share == pytest.approx(0.5)
    assert images.batch_rows_without_image == BATCH_ROWS // 2


def test_columns_come_by_role_not_from_the_petfinder_schema(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    """Another dataset's names and roles: a regression label, an ordinal one, words as categories."""
    names = {"Age": "age_months", "Color1": "colour", "Description": "review", LABEL: "price"}
    roles = DriftColumns(numeric=("age_months",), categorical=("colour",), text_length=("review",), label="price",
                         problem_type="regression")
    words = {str(c): f"colour-{c}" for c in range(8)}
    ref = reference.rename(columns=names).assign(colour=lambda t: t["colour"].map(words),
                                                 price=lambda t: t["age_months"] * 3.0)
    new = shift_age(batch).rename(columns=names).assign(colour=lambda t: t["colour"].map(words),
                                                        price=lambda t: t["age_months"] * 3.0)
    report = drift_gate(ref, new, roles, THRESHOLDS)
    assert sorted(report.drifted) == ["age_months", "price"], report.reason
    assert set(report.columns) == {"age_months", "colour", "review_length", "price"}  # nothing else compared
    assert report.columns["price"].decisive.test == "ks" and report.columns_by_role == roles
    ordinal = DriftColumns(label=LABEL, problem_type="ordinal")
    assert drift_gate(reference, batch, ordinal, THRESHOLDS).columns[LABEL].decisive.test == "chi2"
    with pytest.raises(ValidationError, match="columns named in more than one role: Age"):
        DriftColumns(numeric=("Age",), categorical=("Age",))


def test_tiny_batch_is_refused(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference, batch.iloc[:20], COLUMNS, THRESHOLDS)
    assert not report.passed and report.batch_rows == 20 and report.columns == {}
    assert "20 rows" in report.reason and "min_rows=50" in report.reason
    assert render_drift_markdown(report).startswith("# Drift gate: FAILED\n\nthe batch has 20 rows")


def test_absent_columns_are_skipped_not_failed(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    report = drift_gate(reference.drop(columns=["Fee"]), batch.drop(columns=[IMAGES, "State"]), COLUMNS, THRESHOLDS)
    assert report.passed, report.reason
    assert set(report.skipped) == {"Fee", "State", MISSING_IMAGES}
    assert "absent from the reference" in report.skipped["Fee"] and "absent from the batch" in report.skipped["State"]
    assert not {"Fee", "State", MISSING_IMAGES} & set(report.columns)
    assert "Skipped" in render_drift_markdown(report)


def test_report_files(reference: pd.DataFrame, batch: pd.DataFrame, tmp_path: Path) -> None:
    report = drift_gate(reference, unseen_codes(shift_age(batch)), COLUMNS, THRESHOLDS)
    paths = write_drift_report(report, tmp_path / "reports")
    assert [p.name for p in paths] == ["drift.json", "drift.md", "drift.png"]
    data = json.loads(paths[0].read_text())
    assert next(iter(data)) == "passed" and data["passed"] is False
    assert sorted(data["drifted"]) == ["Age", "FurLength", "MaturitySize"]
    assert {"warned", "warnings", "reason", "reference_rows", "batch_rows", "thresholds", "columns", "tests"} <= set(data)
    assert data["thresholds"] == THRESHOLDS.model_dump() and data["batch_rows"] == BATCH_ROWS
    assert data["columns"]["FurLength"]["unseen_codes"] == [{"code": "0", "rows": 180}]
    assert DriftReport.model_validate(data) == report  # round trip, kinds included
    markdown = paths[1].read_text()
    assert markdown == render_drift_markdown(report)
    assert markdown.splitlines()[0] == "# Drift gate: FAILED"
    fail_rows = [line for line in markdown.splitlines() if "**FAIL**" in line]
    assert sorted(line.split("|")[1].strip() for line in fail_rows) == ["Age", "FurLength", "MaturitySize"]
    assert "0 (180)" in markdown and f"Holm's correction over all {report.tests} tests" in markdown
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(tmp_path.joinpath("reports").glob(".*.tmp")) == []


def test_markdown_title_follows_the_verdict(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    zeros = np.flatnonzero(batch[LABEL].to_numpy() == 0)
    batch.loc[np.random.default_rng(1).choice(zeros, BATCH_ROWS // 10, replace=False), LABEL] = 1
    p = drift_gate(reference, batch, COLUMNS, THRESHOLDS).columns[LABEL].decisive.p_adjusted
    between = DriftThresholds(alpha_fail=p / 10, alpha_warn=min(0.9, p * 10))  # the label warns, nothing fails
    report = drift_gate(reference, batch, COLUMNS, between)
    assert report.passed and report.warnings == [LABEL], report.reason
    assert render_drift_markdown(report).startswith("# Drift gate: WARNED")
    quiet = drift_gate(reference, batch, COLUMNS, DriftThresholds(min_share_change=0.5))  # below the floor
    assert quiet.passed and not quiet.warned, quiet.reason
    assert render_drift_markdown(quiet).startswith("# Drift gate: PASSED")


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValidationError):
        DriftThresholds(alpha_fial=0.2)  # extra="forbid": a typo is an error, not a silent default
    with pytest.raises(ValidationError, match="alpha_warn must not be below alpha_fail"):
        DriftThresholds(alpha_warn=0.01, alpha_fail=0.05)
    with pytest.raises(ValidationError):
        DriftThresholds(alpha_fail=1.0)
    assert DriftThresholds.model_validate(DriftThresholds().model_dump()) == DriftThresholds()


def test_params_yaml_holds_the_calibrated_gate() -> None:
    from tasks.params import load_params

    gate = load_params(ROOT / "params.yaml").intake.drift_gate
    assert gate == DriftThresholds()  # params.yaml and the typed defaults say the same
    assert set(gate.model_dump()) == {"alpha_fail", "alpha_warn", "min_psi", "min_share_change", "min_rows"}


def test_thresholds_from_another_model_or_a_dict(reference: pd.DataFrame, batch: pd.DataFrame) -> None:
    """The caller passes its params.yaml section (a model with the same fields) or a plain dict."""

    class Section(BaseModel):
        min_psi: float = 50.0

    report = drift_gate(reference, shift_age(batch), COLUMNS, Section())
    assert "Age" not in report.drifted and report.thresholds.min_psi == 50.0
    assert report.thresholds.alpha_fail == THRESHOLDS.alpha_fail  # the rest keep their defaults
    with pytest.raises(ValidationError):
        drift_gate(reference, batch, COLUMNS, {"alpha_fial": 0.1})


def test_no_batch_report(tmp_path: Path) -> None:
    report = no_batch_report()
    assert report.passed and not report.warned and report.drifted == [] and report.columns == {}
    report.batch = 7  # the caller records which batch a report is about
    paths = write_drift_report(report, tmp_path)
    data = json.loads(paths[0].read_text())
    assert data["passed"] is True and data["drifted"] == [] and data["batch"] == 7
    assert "no arriving batch" in paths[1].read_text()
    assert paths[2].read_bytes()[:4] == b"\x89PNG"


# ---------------------------------------------------------------- python -m tasks drift (exit 0 / 1 / 2)
@pytest.fixture(scope="module")
def tables(generated: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CSVs in the dataset's columns: the generated train.csv (reference) and test.csv (same population),
    and variants of the test rows."""
    folder = tmp_path_factory.mktemp("drift_cli")
    raw = generated["raw"]
    test = pd.read_csv(raw / "test.csv", index_col=0, dtype=str, keep_default_na=False)
    older = test.assign(Age=(test["Age"].astype(int) * 3).astype(str))
    damaged = test.copy()
    damaged.iloc[[4, 9], damaged.columns.get_loc("Age")] = ["three", "7 months"]
    speeds = test.assign(**{LABEL: [str(i % 5) for i in range(len(test))]})
    codes = test.copy()
    codes.iloc[[2], codes.columns.get_loc("Breed1")] = ["307.5"]
    words = test.copy()
    words.iloc[[0, 1], words.columns.get_loc("Gender")] = ["male", "female"]
    out = {"reference": raw / "train.csv", "same": raw / "test.csv", "older": folder / "older.csv",
           "damaged": folder / "damaged.csv", "speeds": folder / "speeds.csv", "few": folder / "few.csv",
           "empty": folder / "empty.csv", "other": folder / "other.csv", "codes": folder / "codes.csv",
           "words": folder / "words.csv", "ages": folder / "ages.csv", "fees": folder / "fees.csv",
           "no_fee": folder / "no_fee.csv"}
    test.drop(columns=["Fee"]).to_csv(out["no_fee"])
    codes.to_csv(out["codes"])
    words.to_csv(out["words"])
    test[["Age"]].to_csv(out["ages"])
    test[["Fee"]].to_csv(out["fees"])
    older.to_csv(out["older"])
    damaged.to_csv(out["damaged"])
    speeds.to_csv(out["speeds"])
    test.iloc[:20].to_csv(out["few"])
    out["empty"].write_text("")
    pd.DataFrame({"sku": range(100), "price": range(100)}).to_csv(out["other"])
    return out


def _drift(tables: dict[str, Path], reference: str, batch: str, *extra: str) -> int:
    from tasks.__main__ import main

    return main(["drift", "--params", str(ROOT / "params.yaml"), "--reference", str(tables[reference]),
                 "--batch", str(tables[batch]), *extra])


def test_cli_exit_0_for_a_same_population_batch(tables: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert _drift(tables, "reference", "same") == 0
    out = capsys.readouterr().out
    assert out.splitlines()[:2] == ["passed: true", "drifted: none"] and "# Drift gate: PASSED" in out


def test_cli_exit_1_for_a_drifted_batch_with_passed_first(tables: dict[str, Path]) -> None:
    done = subprocess.run([sys.executable, "-m", "tasks", "drift", "--reference", str(tables["reference"]),
                           "--batch", str(tables["older"]), "--json"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert next(iter(report)) == "passed" and report["passed"] is False and report["drifted"] == ["Age"]
    assert report["batch_rows"] == 1000 and report["reference_rows"] == 3000  # the index column is not data


@pytest.mark.parametrize(("reference", "batch", "extra", "message"), [
    ("reference", "missing", (), r"missing\.csv: no such file \(--batch\); pass the path of a CSV table"),
    ("empty", "same", (), r"empty\.csv: the file is empty \(--reference\)"),
    ("reference", "damaged", (), r"damaged\.csv: column 'Age' has 2 cell\(s\) that are not numbers \(row 5: "
                                 r"'three', row 10: '7 months'\)\. Write plain numbers"),
    ("reference", "few", (), r"few\.csv: 20 rows, fewer than intake\.drift_gate\.min_rows=50: too few to judge "
                             r"drift \(--batch\); pass a larger table"),
    ("reference", "other", (), r"other\.csv: none of the dataset's columns \(Age, .*\) is in its header "
                               r"\(sku, price\)"),
    ("reference", "codes", (), r"codes\.csv: column 'Breed1' has 1 cell\(s\) that are not whole-number codes "
                               r"\(row 3: '307\.5'\)"),
    ("reference", "words", (), r"words\.csv: column 'Gender' has 2 cell\(s\) that are not codes like the others "
                               r"\(row 1: 'male', row 2: 'female'\)"),
    ("ages", "fees", (), r"ages\.csv and .*fees\.csv share none of the dataset's columns"),
    ("reference", "no_fee", (), r"no_fee\.csv: column\(s\) 'Fee' that params\.yaml dataset: declares are not in its "
                                r"header \(--batch\); nothing was compared"),
    ("no_fee", "same", (), r"no_fee\.csv: column\(s\) 'Fee' .* \(--reference\)"),
    ("reference", "same", ("--params", "/nonexistent/params.yaml"), r"no such params file"),
])
def test_cli_exit_2_for_bad_input_naming_the_file_and_the_fix(
        tables: dict[str, Path], capsys: pytest.CaptureFixture[str], reference: str, batch: str,
        extra: tuple[str, ...], message: str) -> None:
    tables = {**tables, "missing": tables["few"].parent / "missing.csv"}
    assert _drift(tables, reference, batch, *extra) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: drift: ")
    assert re.search(message, captured.err), captured.err


def test_cli_multiclass_label_kind(tables: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The 0-4 speeds against a 0/1 reference, as multiclass: a drift of the label, not a bad input."""
    assert _drift(tables, "reference", "speeds", "--problem-type", "multiclass", "--json") == 1
    assert LABEL in json.loads(capsys.readouterr().out)["drifted"]
    # as binary, the 0-4 speeds become 0/1 by the schema's label.positive, as validation reads them
    assert _drift(tables, "reference", "speeds", "--json") in (0, 1)
    assert LABEL in json.loads(capsys.readouterr().out)["columns"]
