"""The checks of tables that the validate stage and the intake stage both run: the dataset schema's GX suite
on each table (`tasks.checks.suite`), image files and row rules (`tasks.checks.tables`), one report
(`tasks.checks.report`) listing every problem of every table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from fusion_model.dataset import DatasetSchema
from tasks.checks.report import Outcome, ValidationReport, outcomes_from_gx, table_summary
from tasks.checks.suite import (
    ROW_ID,
    SEEN_CODES_MOSTLY,
    build_suite,
    seen_checked,
    suite_name,
    suite_parameters,
)
from tasks.checks.tables import (
    LabelRule,
    RawTable,
    TableLoadError,
    fallback_classes,
    label_rule,
    mark_seen,
    read_raw,
    training_codes,
    validation_frame,
)
from tasks.errors import StageError

# Tables that must hold every class (a model cannot learn a class it never sees): the training rows, and
# an arriving batch, which joins them.
TRAINING_TABLES = frozenset({"train", "batch"})
HOLDOUT_DIR = "holdout"  # per-batch holdouts of arriving data: holdout/batch-<N>.csv (tasks/intake)

class ValidationError(StageError):
    """The dataset failed validation; the message lists each failed expectation and the fix."""


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


