"""Validate stage: check the raw dataset folder with Great Expectations 1.x, then write typed tables.

Reads `dataset_dir` (train.csv, test.csv, the photos), decides the label's classes from the training
table (`tables.label_rule`), runs the suite the dataset schema gives (`tasks/checks/suite.py`) on both
tables (image files checked by `fusion_model.checks`, in parallel), always writes the report to
`report_dir`, and only when everything passes replaces `out_dir` (train/val/test parquet + meta.json, which
carries the resolved schema every later stage reads) in one rename. A failure raises `ValidationError`
listing every failed expectation with its column, count and example rows or files, and leaves the
previous `out_dir` untouched.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pandas as pd
from pydantic import BaseModel

from fusion_model.dataset import DatasetSchema, resolve_schema
from tasks._io.files import write_json, write_text
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks.checks.report import (
    ValidationReport,
    failure_message,
    render_html,
    render_markdown,
    report_json,
)
from tasks.checks.run import ValidationError, check_tables, newest_holdout
from tasks.checks.tables import (
    LabelRule,
    auto_val_fraction,
    stratified_split,
    typed_table,
)
from tasks.params import ValidateParams

TABLES: tuple[tuple[str, str], ...] = (("train", "train.csv"), ("test", "test.csv"))
REPORT_FILES = ("validation.json", "validation.md", "validation.html")


class ValidateSummary(BaseModel):
    out_dir: str
    report_dir: str
    problem_type: str
    classes: list[int | str]
    rows: dict[str, int]
    warnings: list[str]
    seconds: float


def write_reports(report: ValidationReport, report_dir: Path) -> None:
    write_text(report_dir / "validation.json", report_json(report))
    write_text(report_dir / "validation.md", render_markdown(report))
    write_text(report_dir / "validation.html", render_html(report))


def _dataset_root_for_meta(dataset_dir: Path, out_dir: Path) -> str:
    """The dataset folder relative to out_dir, so meta.json (a DVC output) is identical in every clone."""
    try:
        return Path(os.path.relpath(os.path.abspath(dataset_dir), os.path.abspath(out_dir))).as_posix()
    except ValueError:  # another drive on Windows: no relative path exists
        return Path(os.path.abspath(dataset_dir)).as_posix()


def write_outputs(
    tables: dict[str, pd.DataFrame], params: ValidateParams, schema: DatasetSchema, rule: LabelRule,
    dataset_dir: Path, holdout_file: str | None = None,
) -> dict[str, int]:
    """Write train/val/test (and the newest batch's holdout) parquet + meta.json into a temporary folder
    beside out_dir, then swap."""
    out_dir = Path(params.out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    fraction = (auto_val_fraction(len(tables["train"]), rule.problem_type) if params.val_fraction == "auto"
                else float(params.val_fraction))
    train, val = stratified_split(tables["train"], schema.label.column, fraction, params.seed,
                                  stratify=rule.problem_type != "regression")
    splits = {"train": train, "val": val, "test": tables["test"]}
    if "holdout" in tables:
        splits["holdout"] = tables["holdout"]
    recover_dir(out_dir)  # a crash in an earlier swap left the last good output under a backup name
    staged = temp_dir_beside(out_dir)
    try:
        for name, df in splits.items():
            df.to_parquet(staged / f"{name}.parquet", index=False)
        rows = {name: len(df) for name, df in splits.items()}
        meta = {
            "dataset_root": _dataset_root_for_meta(dataset_dir, out_dir),
            "label": schema.label.column,
            "problem_type": rule.problem_type,
            "classes": rule.classes,
            "label_rule": rule.to_dict(),
            "id": schema.id,
            "schema": schema.model_dump(mode="json"),  # what every later stage reads the columns from
            "rows": rows,
            "val_fraction": round(fraction, 6),
            "holdout": holdout_file,  # the newest arriving batch's held-out rows, scored beside the test set
        }
        write_json(staged / "meta.json", meta)
        swap_dir(staged, out_dir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return rows


def validate(params: ValidateParams, dataset: DatasetSchema | None = None) -> ValidateSummary:
    """Validate `params.dataset_dir` as `dataset` declares it (default: the PetFinder preset); on success
    write `params.out_dir`, always write the reports."""
    started = time.perf_counter()
    schema = dataset or resolve_schema({"preset": "petfinder"})
    dataset_dir = Path(params.dataset_dir)
    report_dir = Path(params.report_dir)
    holdout = newest_holdout(dataset_dir) if dataset_dir.is_dir() else None
    report, frames, rule = check_tables(dataset_dir, [*TABLES, *([holdout] if holdout else [])], schema,
                                        params.workers, seen_codes_mostly=params.seen_codes_mostly)
    write_reports(report, report_dir)
    if not report.success:
        raise ValidationError(failure_message(report, str(report_dir / "validation.md")))
    rows = write_outputs({n: typed_table(f, schema, rule) for n, f in frames.items()}, params, schema, rule,
                         dataset_dir, holdout_file=holdout[1] if holdout else None)
    return ValidateSummary(
        out_dir=str(params.out_dir), report_dir=str(report_dir), problem_type=rule.problem_type,
        classes=rule.classes, rows=rows, warnings=report.warnings, seconds=round(time.perf_counter() - started, 2),
    )
