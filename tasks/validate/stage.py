"""Validate stage: check the raw dataset folder with Great Expectations 1.x, then write typed tables.

Reads `dataset_dir` (train.csv, test.csv, the photos), decides the label's classes from the training
table (`tables.label_rule`), runs the suite the dataset schema gives (`tasks/validate/suite.py`) on both
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
from typing import Any

import pandas as pd
from pydantic import BaseModel

from fusion_model.dataset import DatasetSchema, resolve_schema
from tasks._io.files import write_json, write_text
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks.errors import StageError
from tasks.params import ValidateParams
from tasks.validate.report import (
    Outcome,
    ValidationReport,
    failure_message,
    outcomes_from_gx,
    render_html,
    render_markdown,
    report_json,
    table_summary,
)
from tasks.validate.suite import (
    ROW_ID,
    SEEN_CODES_MOSTLY,
    build_suite,
    seen_checked,
    suite_name,
    suite_parameters,
)
from tasks.validate.tables import (
    LabelRule,
    RawTable,
    TableLoadError,
    fallback_classes,
    label_rule,
    mark_seen,
    read_raw,
    stratified_split,
    training_codes,
    typed_table,
    validation_frame,
)

TABLES: tuple[tuple[str, str], ...] = (("train", "train.csv"), ("test", "test.csv"))
# Tables that must hold every class (a model cannot learn a class it never sees): the training rows, and
# an arriving batch, which joins them.
TRAINING_TABLES = frozenset({"train", "batch"})
HOLDOUT_DIR = "holdout"  # per-batch holdouts of arriving data: holdout/batch-<N>.csv (tasks/intake)
REPORT_FILES = ("validation.json", "validation.md", "validation.html")


class ValidationError(StageError):
    """The dataset failed validation; the message lists each failed expectation and the fix."""


class ValidateSummary(BaseModel):
    out_dir: str
    report_dir: str
    problem_type: str
    classes: list[int | str]
    rows: dict[str, int]
    warnings: list[str]
    seconds: float


def run_suite(frames: dict[str, pd.DataFrame], classes: list[int | str], schema: DatasetSchema,
              seen_codes_mostly: float) -> dict[str, list[dict[str, Any]]]:
    """Run the suite on each table through a GX checkpoint; returns each table's results as dicts."""
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    # A fresh in-memory context per run: ~10 ms, nothing written to disk, names never collide.
    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    suite = context.suites.add(build_suite(schema, seen_codes_mostly))
    source = context.data_sources.add_pandas(suite_name(schema))
    out: dict[str, list[dict[str, Any]]] = {}
    for name, frame in frames.items():
        batch = source.add_dataframe_asset(name).add_batch_definition_whole_dataframe("whole")
        definition = context.validation_definitions.add(gx.ValidationDefinition(name=name, data=batch, suite=suite))
        checkpoint = context.checkpoints.add(gx.Checkpoint(
            name=f"{suite_name(schema)}-{name}",
            validation_definitions=[definition],
            result_format={"result_format": "SUMMARY", "unexpected_index_column_names": [ROW_ID],
                           "partial_unexpected_count": 5},
        ))
        result = checkpoint.run(
            batch_parameters={"dataframe": frame},
            expectation_parameters=suite_parameters(classes, require_all_classes=name in TRAINING_TABLES),
        )
        (validation,) = result.run_results.values()
        out[name] = [r.to_json_dict() for r in validation.results]
    return out


def _gx_version() -> str:
    from importlib.metadata import version

    return version("great-expectations")


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
    train, val = stratified_split(tables["train"], schema.label.column, params.val_fraction, params.seed,
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
            "holdout": holdout_file,  # the newest arriving batch's held-out rows, scored beside the test set
        }
        write_json(staged / "meta.json", meta)
        swap_dir(staged, out_dir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return rows


def check_tables(dataset_dir: Path, tables: list[tuple[str, str]], schema: DatasetSchema, workers: int,
                 rule: LabelRule | None = None, seen: dict[str, set[str]] | None = None,
                 seen_codes_mostly: float = SEEN_CODES_MOSTLY,
                 ) -> tuple[ValidationReport, dict[str, pd.DataFrame], LabelRule]:
    """Run the suite on each `(name, file)` of `dataset_dir`: the report (every problem of every table), the
    checked frames of the tables that loaded, and the label rule (decided on the table named "train" unless
    given; `seen`: the training rows' categorical values, else those of "train")."""
    report = ValidationReport(
        success=False, dataset_dir=str(dataset_dir), problem_type=schema.label.problem_type, classes=[],
        suite=suite_name(schema), gx_version=_gx_version(),
    )
    raw_tables: dict[str, RawTable] = {}
    if not dataset_dir.is_dir():
        report.problems.append(
            f"{dataset_dir}: no such folder; run `python -m tasks download` then `python -m tasks intake` first (the "
            "intake stage writes the accumulated data there: intake.out_dir) or set validate.dataset_dir"
        )
    else:
        for name, file in tables:
            try:
                raw_tables[name] = read_raw(name, dataset_dir / file, schema)
            except TableLoadError as e:
                report.problems.append(str(e))
    if rule is None:
        rule = LabelRule(schema.label.problem_type, [])
        if "train" in raw_tables:
            try:
                rule = label_rule(raw_tables["train"], schema)
            except StageError as e:
                report.problems.append(str(e))
                # the other checks still run: against the values the training rows hold
                rule = LabelRule(schema.label.problem_type, fallback_classes(raw_tables["train"], schema))
    report.classes = rule.classes
    frames: dict[str, pd.DataFrame] = {}
    if raw_tables:  # a table that loaded is still checked when the other did not: one report, all problems
        frames = {name: validation_frame(t, schema, rule, dataset_dir, workers) for name, t in raw_tables.items()}
        if seen is None:
            seen = training_codes(frames["train"], schema) if "train" in frames else {}
        seen = {c: codes for c, codes in seen.items() if c in seen_checked(schema)}
        for frame in frames.values():
            mark_seen(frame, seen)
        results = run_suite(frames, rule.classes, schema, seen_codes_mostly)
        outcomes: list[Outcome] = []
        for name, table in raw_tables.items():
            outcomes += outcomes_from_gx(results[name], table, frames[name], schema)
        report.outcomes = outcomes
        report.tables = [table_summary(t, outcomes) for t in raw_tables.values()]
        report.success = not report.problems and all(t.success for t in report.tables)
    return report, frames, rule


def newest_holdout(dataset_dir: Path) -> tuple[str, str] | None:
    """("holdout", relative file) of the newest batch's holdout in the dataset, if any batch arrived."""
    files = sorted((dataset_dir / HOLDOUT_DIR).glob("batch-*.csv"))
    return ("holdout", f"{HOLDOUT_DIR}/{files[-1].name}") if files else None


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
