"""Validate stage: the generated dataset passes and writes the contract's files; each kind of bad
dataset fails with a message naming the column or file, the report is still written, and the last good
output survives."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusion_model import checks
from fusion_model.dataset import resolve_schema
from fusion_model.presets.petfinder import CATEGORICAL_COLUMNS, LABEL, NUMERIC_COLUMNS
from tasks.checks.report import ValidationReport, render_html, render_markdown
from tasks.checks.suite import suite_json, suite_path
from tasks.checks.tables import auto_val_fraction, stratified_split
from tasks.params import ValidateParams
from tasks.validate import ValidationError, validate

PETFINDER = resolve_schema({"preset": "petfinder"})
REQUIRED_COLUMNS = [c for c in PETFINDER.table_columns if c not in PETFINDER.checks.optional]

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ helpers
@pytest.fixture
def dataset(tiny_raw_dataset: Path, tmp_path: Path) -> Path:
    """A private copy of the good dataset, to corrupt."""
    return Path(shutil.copytree(tiny_raw_dataset, tmp_path / "raw" / "dataset"))


def params_for(dataset: Path, tmp_path: Path, **overrides: object) -> ValidateParams:
    return ValidateParams(
        dataset_dir=dataset, out_dir=tmp_path / "data" / "validated", report_dir=tmp_path / "reports", **overrides
    )


def edit_csv(path: Path, change: Callable[[pd.DataFrame], pd.DataFrame | None]) -> None:
    """Rewrite a CSV through pandas as text, keeping its leading index column."""
    df = pd.read_csv(path, index_col=0, dtype=str, keep_default_na=False)
    changed = change(df)
    df = df if changed is None else changed
    df.to_csv(path, lineterminator="\n")


def first_image(dataset: Path, row: int = 0) -> str:
    df = pd.read_csv(dataset / "train.csv", index_col=0, dtype=str, keep_default_na=False)
    return df["Images"].iloc[row].split(";")[0]


def set_cell(column: str, value: str, row: int = 0, file: str = "train.csv") -> Callable[[Path], None]:
    def corrupt(dataset: Path) -> None:
        def change(df: pd.DataFrame) -> None:
            df.iloc[row, df.columns.get_loc(column)] = value

        edit_csv(dataset / file, change)

    return corrupt


def row_id_of(dataset: Path, row: int = 0, file: str = "train.csv") -> int:
    return int(pd.read_csv(dataset / file, index_col=0).index[row])


# ------------------------------------------------------------------------------------- the good case
def test_good_dataset_passes_with_the_contract_layout(tiny_validated: Path, tiny_raw_dataset: Path) -> None:
    meta = json.loads((tiny_validated / "meta.json").read_text())
    assert meta["label"] == LABEL and meta["problem_type"] == "binary" and meta["classes"] == [0, 1]
    assert meta["schema"] == PETFINDER.model_dump(mode="json") and meta["id"] == "PetID"
    # Stored relative to out_dir (the same in every clone), resolving to the raw folder.
    assert not Path(meta["dataset_root"]).is_absolute()
    assert (tiny_validated / meta["dataset_root"]).resolve() == tiny_raw_dataset.resolve()
    assert meta["rows"] == {"train": 192, "val": 48, "test": 80} and meta["val_fraction"] == 0.2

    raw_train = pd.read_csv(tiny_raw_dataset / "train.csv", index_col=0)
    tables = {n: pd.read_parquet(tiny_validated / f"{n}.parquet") for n in ("train", "val", "test")}
    for name, df in tables.items():
        assert len(df) == meta["rows"][name]
        assert list(df.columns[:1]) == ["row_id"] and set(REQUIRED_COLUMNS) <= set(df.columns)
        assert not any(c in df.columns for c in ("image_paths_safe", "images_exist", "images_decode"))
        assert all(df[c].dtype == "int64" for c in (LABEL, "row_id"))
        assert all(pd.api.types.is_string_dtype(df[c]) for c in CATEGORICAL_COLUMNS)  # codes as canonical text
        assert all(df[c].dtype == "float64" for c in NUMERIC_COLUMNS)
        assert df["Name"].isna().sum() == 0 and df["Description"].isna().sum() == 0
        assert df["Images"].str.startswith("images/").all()
    # val is a stratified part of train: disjoint, together exactly the CSV's rows, both classes in each.
    train, val = tables["train"], tables["val"]
    assert set(train.row_id).isdisjoint(val.row_id)
    assert sorted([*train.row_id, *val.row_id]) == sorted(raw_train.index)
    assert set(val[LABEL]) == {0, 1}
    assert abs(val[LABEL].mean() - raw_train[LABEL].mean()) < 0.05
    row = raw_train.loc[train.row_id[0]]
    assert train.loc[0, "Age"] == row["Age"] and train.loc[0, "Images"] == row["Images"]

    reports = tiny_validated.parent / "reports"
    report = json.loads((reports / "validation.json").read_text())
    assert report["success"] is True and report["failed"] == 0
    assert {o["status"] for o in report["outcomes"]} == {"passed"}
    assert (reports / "validation.md").read_text().startswith("# Data validation: PASSED")
    assert "PASSED" in (reports / "validation.html").read_text()


def test_stratified_split_is_deterministic_and_keeps_rare_classes() -> None:
    table = pd.DataFrame({"row_id": np.arange(103), LABEL: [0] * 80 + [1] * 20 + [2] * 2 + [3]})
    train, val = stratified_split(table, LABEL, 0.2, seed=7)
    again_train, again_val = stratified_split(table, LABEL, 0.2, seed=7)
    pd.testing.assert_frame_equal(val, again_val)
    assert val[LABEL].value_counts().to_dict() == {0: 16, 1: 4, 2: 1}
    assert set(train[LABEL]) == {0, 1, 2, 3}  # a class with one row stays in train
    assert not val.row_id.equals(stratified_split(table, LABEL, 0.2, seed=8)[1].row_id)


@pytest.mark.parametrize("problem_type", ["binary", "regression"])
def test_auto_val_fraction_follows_the_autogluon_holdout_rule_where_the_rows_only_choose(problem_type: str) -> None:
    assert auto_val_fraction(240, problem_type) == 0.2  # a small table: a fifth
    assert auto_val_fraction(3000, problem_type) == pytest.approx(500 / 3000)  # then 500 rows ...
    assert auto_val_fraction(6473, problem_type) == 0.1  # ... a tenth from 5,000 labelled rows
    assert auto_val_fraction(100_000, problem_type) == pytest.approx(0.025)  # ~2,500 rows on a large table
    assert auto_val_fraction(10_000_000, problem_type) == 0.01


@pytest.mark.parametrize("problem_type", ["ordinal", "multiclass"])
def test_auto_val_fraction_keeps_a_fifth_where_a_decision_rule_is_fitted_on_the_rows(problem_type: str) -> None:
    assert {auto_val_fraction(n, problem_type) for n in (240, 3000, 6473, 100_000)} == {0.2}


@pytest.mark.parametrize(("given", "val_rows", "recorded"), [(0.25, 60, 0.25), ("auto", 48, 0.2)])
def test_the_val_fraction_is_used_and_recorded(dataset: Path, tmp_path: Path, given: float | str, val_rows: int,
                                               recorded: float) -> None:
    validate(params_for(dataset, tmp_path, val_fraction=given))
    meta = json.loads((tmp_path / "data" / "validated" / "meta.json").read_text())
    assert meta["rows"]["val"] == val_rows and meta["val_fraction"] == recorded


def test_a_val_fraction_out_of_range_is_refused_naming_the_key() -> None:
    for bad in (0, 1.0, "half"):
        with pytest.raises(ValueError, match="val_fraction"):
            ValidateParams(val_fraction=bad)


def test_extra_columns_and_absent_optional_columns_are_tolerated(dataset: Path, tmp_path: Path, tiny_validated: Path) -> None:
    for file in ("train.csv", "test.csv"):
        edit_csv(dataset / file, lambda df: df.drop(columns=["PetID", "RescuerID"]).assign(Notes="x"))
    summary = validate(params_for(dataset, tmp_path))
    assert any("extra column(s) ['Notes']" in w for w in summary.warnings)
    report = json.loads((tmp_path / "reports" / "validation.json").read_text())
    petid = [o for o in report["outcomes"] if o["column"] == "PetID"]
    assert petid and {o["status"] for o in petid} == {"skipped"}
    assert report["tables"][0]["missing_optional_columns"] == ["PetID", "RescuerID"]
    # Same rows, same split, same values as the unmodified dataset: extras are dropped, nothing else moves.
    out = pd.read_parquet(tmp_path / "data" / "validated" / "val.parquet")
    ref = pd.read_parquet(tiny_validated / "val.parquet").drop(columns=["PetID", "RescuerID"])
    pd.testing.assert_frame_equal(out, ref)


def test_rows_without_photos_pass_and_a_named_photo_is_still_checked(dataset: Path, tmp_path: Path) -> None:
    """Real rows with PhotoAmt 0 list no photo: they are valid (the model masks their image); a photo a row
    does name must still exist."""
    edit_csv(dataset / "train.csv", lambda df: df.assign(Images=["" if i % 3 == 0 else v
                                                                 for i, v in enumerate(df["Images"])]))
    edit_csv(dataset / "test.csv", lambda df: df.assign(Images=""))
    validate(params_for(dataset, tmp_path))
    train = pd.read_parquet(tmp_path / "data" / "validated" / "train.parquet")
    test = pd.read_parquet(tmp_path / "data" / "validated" / "test.parquet")
    assert (test["Images"] == "").all() and 0 < (train["Images"] == "").mean() < 1
    (dataset / first_image(dataset, 1)).unlink()
    with pytest.raises(ValidationError, match="expected image files exist"):
        validate(params_for(dataset, tmp_path))


# -------------------------------------------------------------------------------------- bad datasets
def _missing_column(dataset: Path) -> list[str]:
    edit_csv(dataset / "train.csv", lambda df: df.drop(columns=["Fee"]))
    return ["train.csv, column 'Fee': missing"]


def _label_out_of_set(dataset: Path) -> list[str]:
    set_cell(LABEL, "7", row=3)(dataset)
    return [f"train.csv, column '{LABEL}'", f"row_id {row_id_of(dataset, 3)} ({LABEL}='7')"]


def _one_class(dataset: Path) -> list[str]:
    edit_csv(dataset / "train.csv", lambda df: df.assign(**{LABEL: "0"}))
    return [f"train.csv, column '{LABEL}': every training row holds the same label 0; a model needs at least two "
            "classes"]


def _code_out_of_range(dataset: Path) -> list[str]:
    set_cell("Gender", "4", row=5, file="test.csv")(dataset)
    return ["test.csv, column 'Gender': expected valid code (1-3", f"row_id {row_id_of(dataset, 5, 'test.csv')}"]


def _nan_in_required(dataset: Path) -> list[str]:
    set_cell("Quantity", "", row=2)(dataset)
    return ["train.csv, column 'Quantity': expected a number in every row", "1 of 240 row(s)"]


def _not_a_number(dataset: Path) -> list[str]:
    set_cell("Fee", "free", row=2)(dataset)
    return ["train.csv, column 'Fee': expected a number in every row", "Fee='free'"]


def _negative_age(dataset: Path) -> list[str]:
    set_cell("Age", "-2", row=4)(dataset)
    return ["train.csv, column 'Age': expected plausible value 0..300", "Age='-2'"]


def _duplicate_petid(dataset: Path) -> list[str]:
    df = pd.read_csv(dataset / "train.csv", index_col=0, dtype=str, keep_default_na=False)
    set_cell("PetID", df["PetID"].iloc[0], row=1)(dataset)
    return ["train.csv, column 'PetID': expected PetID unique", "2 of 240 row(s)"]


def _absolute_image_path(dataset: Path) -> list[str]:
    target = str((dataset / first_image(dataset, 6)).resolve())  # exists, but absolute
    set_cell("Images", target, row=6)(dataset)
    return ["train.csv, column 'Images': expected image paths relative", "absolute path", target]


def _dotdot_image_path(dataset: Path) -> list[str]:
    shutil.copy(dataset / first_image(dataset, 0), dataset.parent / "outside.jpg")
    set_cell("Images", "images/../../outside.jpg", row=0)(dataset)
    return ["column 'Images': expected image paths relative", "images/../../outside.jpg: path contains '..'"]


def _symlink_escape(dataset: Path) -> list[str]:
    outside = dataset.parent / "elsewhere.jpg"
    shutil.copy(dataset / first_image(dataset, 1), outside)
    os.symlink(outside, dataset / "images" / "escape.jpg")
    set_cell("Images", "images/escape.jpg", row=1)(dataset)
    return ["images/escape.jpg: resolves outside the dataset folder"]


def _missing_image(dataset: Path) -> list[str]:
    name = first_image(dataset, 8)
    (dataset / name).unlink()
    return ["train.csv, column 'Images': expected image files exist", f"{name}: file not found"]


def _corrupt_jpeg(dataset: Path) -> list[str]:
    name = first_image(dataset, 9)
    data = (dataset / name).read_bytes()
    (dataset / name).write_bytes(data[: len(data) // 2])
    return ["column 'Images': expected image files decode", f"{name}: does not decode (OSError"]


def _empty_csv(dataset: Path) -> list[str]:
    (dataset / "test.csv").write_bytes(b"")
    return ["test.csv: the file is empty (0 bytes)"]


def _header_only_csv(dataset: Path) -> list[str]:
    edit_csv(dataset / "test.csv", lambda df: df.iloc[:0])
    return ["test.csv: expected at least one data row", "observed: 0"]


def _breed_type_mismatch(dataset: Path) -> list[str]:
    def swap(df: pd.DataFrame) -> None:  # dogs given a cat breed in 10% of rows: beyond the tolerance
        dogs = df.index[df["Type"] == "1"][:24]
        df.loc[dogs, "Breed1"] = "266"

    edit_csv(dataset / "train.csv", swap)
    return ["train.csv, column 'Breed1': expected Breed1 belongs to the animal Type", "Breed1='266'"]


BAD_DATASETS: dict[str, Callable[[Path], list[str]]] = {
    "missing_column": _missing_column,
    "label_out_of_set": _label_out_of_set,
    "label_with_one_class": _one_class,
    "code_out_of_range": _code_out_of_range,
    "nan_in_required_field": _nan_in_required,
    "not_a_number": _not_a_number,
    "negative_age": _negative_age,
    "duplicate_petid": _duplicate_petid,
    "absolute_image_path": _absolute_image_path,
    "dotdot_image_path": _dotdot_image_path,
    "symlink_escaping_root": _symlink_escape,
    "missing_image": _missing_image,
    "corrupt_jpeg": _corrupt_jpeg,
    "empty_csv": _empty_csv,
    "header_only_csv": _header_only_csv,
    "breed_type_mismatch": _breed_type_mismatch,
}


@pytest.mark.parametrize("case", list(BAD_DATASETS))
def test_bad_dataset_fails_naming_column_or_file(case: str, dataset: Path, tmp_path: Path) -> None:
    expected = BAD_DATASETS[case](dataset)
    params = params_for(dataset, tmp_path)
    with pytest.raises(ValidationError) as info:
        validate(params)
    message = str(info.value)
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"
    assert "Fix:" in message or "re-download" in message or "restore" in message
    assert not params.out_dir.exists()  # nothing written for a failed validation
    report = json.loads((params.report_dir / "validation.json").read_text())
    assert report["success"] is False and report["failed"] >= 1
    assert "FAILED" in (params.report_dir / "validation.md").read_text()


def test_failed_validation_keeps_previous_output_byte_identical(
    dataset: Path, tmp_path: Path, tiny_validated: Path
) -> None:
    params = params_for(dataset, tmp_path)
    shutil.copytree(tiny_validated, params.out_dir)
    before = {p.name: p.read_bytes() for p in params.out_dir.iterdir()}
    _corrupt_jpeg(dataset)
    with pytest.raises(ValidationError, match="does not decode"):
        validate(params)
    assert {p.name: p.read_bytes() for p in params.out_dir.iterdir()} == before
    assert [p.name for p in params.out_dir.parent.iterdir()] == ["validated"]  # no temp folder left


def test_cli_exits_nonzero_with_the_reason(dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tasks.__main__ import main

    (dataset / "train.csv").unlink()
    code = main(["validate", "--params", str(ROOT / "params.yaml"), "--dataset-dir", str(dataset),
                 "--out-dir", str(tmp_path / "validated"), "--report-dir", str(tmp_path / "reports")])
    assert code == 1
    err = capsys.readouterr().err
    assert "train.csv: file not found" in err and "python -m tasks download" in err
    assert json.loads((tmp_path / "reports" / "validation.json").read_text())["problems"]


def test_given_classes_require_every_class_in_training(dataset: Path, tmp_path: Path) -> None:
    schema = resolve_schema({"preset": "petfinder", "label": {"problem_type": "ordinal", "classes": [0, 1, 2, 3, 4]}})
    with pytest.raises(ValidationError) as info:
        validate(params_for(dataset, tmp_path), schema)
    assert f"column '{LABEL}': expected every class present" in str(info.value)
    assert "missing: ['2', '3', '4']" in str(info.value)
    assert str(info.value).count("Fix:") == 1  # 0/1 labels are inside 0-4: only class presence fails


# -------------------------------------------------------------------------------- suite and reports
def test_suite_json_is_regenerated_from_code() -> None:
    path = suite_path(PETFINDER)
    assert path.read_text() == suite_json(PETFINDER), "run `python -m tasks.checks.write_suite` and review the diff"
    suite = json.loads(path.read_text())
    kinds = {e["type"] for e in suite["expectations"]}
    assert {"expect_column_to_exist", "expect_column_values_to_be_in_set", "expect_column_values_to_be_between",
            "expect_column_distinct_values_to_contain_set", "expect_column_values_to_be_unique"} <= kinds
    assert all(e["meta"]["fix"] for e in suite["expectations"])


def test_reports_render_offline(tiny_validated: Path) -> None:
    report = ValidationReport.model_validate_json((tiny_validated.parent / "reports" / "validation.json").read_text())
    page = render_html(report)
    assert not re.search(r"<script|<link|https?://|src=", page), "the HTML must not load anything"
    md = render_markdown(report)
    assert md.startswith("# Data validation: PASSED") and "| train | Age |" in md


# ------------------------------------------------------------------------------ row checks (no GX)
def test_image_path_problems(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "images").mkdir(parents=True)
    (root / "images" / "inside.jpg").write_bytes(b"x")
    os.symlink(root / "images" / "inside.jpg", root / "images" / "alias.jpg")  # symlink inside: fine
    os.symlink(tmp_path, root / "images" / "up")
    resolved = root.resolve()
    assert checks.image_path_problem("images/inside.jpg", resolved) is None
    assert checks.image_path_problem("images/alias.jpg", resolved) is None
    cases = {"/etc/passwd": "absolute", "C:/x.jpg": "absolute", "images/../../x.jpg": "'..'",
             "images\\x.jpg": "backslash", "images/up/elsewhere.jpg": "outside", "": "empty"}
    for path, reason in cases.items():
        assert reason in (checks.image_path_problem(path, resolved) or ""), path


def test_decode_check_agrees_serial_and_parallel(tiny_raw_dataset: Path, tmp_path: Path) -> None:
    files = sorted((tiny_raw_dataset / "images").glob("*.jpg"))
    broken = tmp_path / "broken.jpg"
    broken.write_bytes(files[0].read_bytes()[:200])
    (tmp_path / "text.jpg").write_text("not an image")
    # past the fork threshold the check runs in worker processes: distinct copies make the batch that big
    copies = [tmp_path / f"copy{i}.jpg" for i in range(checks._FORK_MIN_IMAGES)]
    for i, copy in enumerate(copies):
        copy.write_bytes(files[i % len(files)].read_bytes())
    for good in (files[:40], copies):  # threads, then processes
        paths = [*good, broken, tmp_path / "text.jpg"]
        serial = checks.decode_problems(paths, workers=1)
        assert checks.decode_problems(paths, workers=2) == serial
        assert [p for p, why in serial.items() if why] == [broken, tmp_path / "text.jpg"]


def test_check_prediction_rows(tiny_raw_dataset: Path) -> None:
    rows = pd.read_csv(tiny_raw_dataset / "test.csv", index_col=0).drop(columns=[LABEL]).head(12)
    checks.check_prediction_rows(rows, tiny_raw_dataset, PETFINDER, workers=2)  # good rows pass without the label

    bad = rows.copy()
    bad.loc[bad.index[1], "Type"] = 5
    bad.loc[bad.index[2], "Age"] = np.nan
    bad.loc[bad.index[3], "Images"] = "images/none.jpg"
    bad.loc[bad.index[4], "Images"] = "../x.jpg"
    with pytest.raises(ValueError) as info:
        checks.check_prediction_rows(bad, tiny_raw_dataset, PETFINDER)
    message = str(info.value)
    assert f"row {bad.index[1]}, column 'Type': value 5 is not a valid code (1-2: 1 dog, 2 cat)" in message
    assert f"row {bad.index[2]}, column 'Age': value nan is empty" in message
    assert f"row {bad.index[3]}, file images/none.jpg: file not found" in message
    assert f"row {bad.index[4]}, file ../x.jpg: path contains '..'" in message
    assert message.startswith("4 problem(s)") and "Fix:" in message
    with pytest.raises(ValueError, match=r"lack required column\(s\) \['Fee'\]"):
        checks.check_prediction_rows(rows.drop(columns=["Fee"]), tiny_raw_dataset, PETFINDER)
