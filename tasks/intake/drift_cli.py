"""`python -m tasks drift --reference TABLE --batch TABLE [--json]`: the drift gate on two CSV tables.

The tables are CSVs in the dataset's columns (a leading unnamed index column, as pandas writes it, is
ignored); the columns are compared by role, as params.yaml's `dataset:` section declares them
(`DriftColumns.from_schema`), with params.yaml's `intake.drift_gate`. The report is printed `passed` first: with --json the report's
JSON, else a `passed: true|false` line, the columns that drifted, then the markdown report.

Exit status: 0 passed (a warning included), 1 drifted, 2 bad input (a message on stderr naming the file,
the column, the row (data rows counted from 1, after the header) and the fix), a declared input column
missing from either table included.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

from fusion_model.dataset import DatasetSchema, LabelSpec, canonical
from tasks.checks.tables import LabelRule
from tasks.intake.drift import drift_gate
from tasks.intake.drift_report import DriftReport, render_drift_markdown
from tasks.intake.drift_stats import DriftColumns
from tasks.params import DriftGateParams, ParamsError, load_params

EXIT_PASSED, EXIT_DRIFTED, EXIT_BAD_INPUT = 0, 1, 2
_INDEX_NAMES = ("", "Unnamed: 0")
MAX_EXAMPLES = 3


class DriftInputError(ValueError):
    """A table the gate cannot compare: the message names the file, the column, the row and the fix."""


def _bad_cells(path: Path, table: pd.DataFrame, column: str, bad: pd.Series, what: str, fix: str) -> DriftInputError:
    rows = [i for i, b in enumerate(bad.to_numpy()) if b]
    examples = ", ".join(f"row {i + 1}: {table[column].iloc[i]!r}" for i in rows[:MAX_EXAMPLES])  # rows from 1
    more = f" and {len(rows) - MAX_EXAMPLES} more" if len(rows) > MAX_EXAMPLES else ""
    return DriftInputError(f"{path}: column '{column}' has {len(rows)} cell(s) that are not {what} ({examples}{more}). "
                           f"{fix}")


def _numbers(path: Path, table: pd.DataFrame, column: str) -> pd.Series:
    text = table[column].str.strip()
    values = pd.to_numeric(text.where(text != ""), errors="coerce")
    bad = values.isna() & (text != "")
    if bad.any():
        raise _bad_cells(path, table, column, bad, "numbers",
                         "Write plain numbers (a dot for decimals, no units), or leave a cell empty: empty cells "
                         "are not compared.")
    return values


def _codes(path: Path, table: pd.DataFrame, column: str) -> pd.Series:
    """Whole-number codes as integers (PetFinder's 1, 2, 307 ...); a column of words stays text."""
    text = table[column].str.strip()
    filled = text[text != ""]
    numbers = pd.to_numeric(filled, errors="coerce")
    if numbers.notna().all():
        if (numbers != numbers.round()).any():
            raise _bad_cells(path, table, column, (text != "") & (pd.to_numeric(text, errors="coerce") % 1 != 0),
                             "whole-number codes", "Codes are whole numbers: fix these cells, or leave them empty.")
        return pd.Series(pd.array(numbers.astype("int64")), index=filled.index).reindex(text.index)
    if numbers.notna().any():  # mostly numbers with a few words: a damaged cell, not a column of words
        raise _bad_cells(path, table, column, (text != "") & pd.to_numeric(text, errors="coerce").isna(),
                         "codes like the others", "The column holds numeric codes: fix these cells, or leave them empty.")
    return filled.reindex(text.index)


def read_table(path: Path, columns: DriftColumns, min_rows: int, option: str) -> pd.DataFrame:
    """The table at `path`, with the role columns it has typed (numbers, codes, labels, text)."""
    path = Path(path)
    if not path.is_file():
        raise DriftInputError(f"{path}: no such file ({option}); pass the path of a CSV table in the dataset's columns.")
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False)
    except pd.errors.EmptyDataError:
        raise DriftInputError(f"{path}: the file is empty ({option}); pass a CSV table with a header line and rows.") from None
    except (pd.errors.ParserError, UnicodeDecodeError) as e:
        raise DriftInputError(f"{path}: not a readable CSV ({option}: {e}); export it as a UTF-8 CSV with one header "
                              "line.") from None
    if len(table.columns) and table.columns[0] in _INDEX_NAMES:
        table = table.drop(columns=table.columns[0])  # the index pandas wrote: never a column of the data
    present = [c for c in columns.names if c in table.columns]
    if not present:
        raise DriftInputError(f"{path}: none of the dataset's columns ({', '.join(columns.names)}) is in its header "
                              f"({', '.join(map(str, table.columns[:10]))}); pass a table of this dataset ({option}).")
    if len(table) < min_rows:
        raise DriftInputError(f"{path}: {len(table)} rows, fewer than intake.drift_gate.min_rows={min_rows}: too few "
                              f"to judge drift ({option}); pass a larger table, or lower min_rows in params.yaml.")
    typed = table.copy()
    numeric = [*columns.numeric, *([columns.label] if columns.label and columns.problem_type == "regression" else [])]
    coded = [*columns.categorical, *([columns.label] if columns.label and columns.problem_type != "regression" else [])]
    for c in numeric:
        if c in table.columns:
            typed[c] = _numbers(path, table, c)
    for c in coded:
        if c in table.columns:
            typed[c] = _codes(path, table, c)
    return typed


def _binary_label(reference: pd.DataFrame, batch: pd.DataFrame, paths: tuple[Path, Path], columns: DriftColumns,
                  label_spec: LabelSpec) -> None:
    """A binary label with more than two values becomes 0/1 by the schema's `label.positive` (as validation
    reads it), or the tables are refused naming the values."""
    label = columns.label
    if label is None or columns.problem_type != "binary":
        return
    classes = {v for t in (reference, batch) if label in t.columns for v in t[label].dropna().unique()}
    if len(classes) <= 2:
        return
    if label_spec.positive is None:
        raise DriftInputError(
            f"{paths[0]} and {paths[1]}: column '{label}' has {len(classes)} classes "
            f"({', '.join(map(str, sorted(classes, key=str)))}), but the label is binary. Pass --problem-type "
            f"multiclass, set dataset.label.positive in params.yaml, or make the label 0/1 first.")
    rule = LabelRule("binary", [0, 1], positive=sorted(canonical(v) for v in label_spec.positive),
                     negative=None if label_spec.negative is None else sorted(canonical(v) for v in label_spec.negative))
    for table in (reference, batch):
        if label in table.columns:
            mapped = rule.map(table[label].dropna())
            table[label] = pd.to_numeric(mapped, errors="coerce").reindex(table.index)


def run(reference: Path, batch: Path, schema: DatasetSchema, thresholds: DriftGateParams) -> DriftReport:
    """Read both tables and gate the batch; DriftInputError for a table it cannot compare."""
    columns = DriftColumns.from_schema(schema)
    ref = read_table(reference, columns, thresholds.min_rows, "--reference")
    new = read_table(batch, columns, thresholds.min_rows, "--batch")
    _binary_label(ref, new, (reference, batch), columns, schema.label)
    compared = [c for c in columns.names if c in ref.columns and c in new.columns]
    if not compared:
        raise DriftInputError(f"{reference} and {batch} share none of the dataset's columns "
                              f"({', '.join(columns.names)}); pass two tables of the same dataset.")
    inputs = [*columns.numeric, *columns.categorical, *columns.text_length]  # the label may be absent (unlabelled)
    for path, table, option in ((reference, ref, "--reference"), (batch, new, "--batch")):
        if absent := [c for c in inputs if c not in table.columns]:
            raise DriftInputError(f"{path}: column(s) {', '.join(map(repr, absent))} that params.yaml dataset: declares "
                                  f"are not in its header ({option}); nothing was compared. Export the table with "
                                  "every declared column, or remove the column from dataset.columns.")
    return drift_gate(ref, new, columns, thresholds)


def main(args: argparse.Namespace) -> int:
    try:
        params = load_params(args.params)
        schema = params.schema
        if args.problem_type:
            label = schema.label.model_copy(update={"problem_type": args.problem_type, "classes": None})
            schema = schema.model_copy(update={"label": label})
        report = run(args.reference, args.batch, schema, params.intake.drift_gate)
    except (DriftInputError, ParamsError) as e:
        print(f"error: drift: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report.model_dump(mode="json"), indent=2))
    else:
        print(f"passed: {str(report.passed).lower()}")
        print(f"drifted: {', '.join(report.drifted) or 'none'}")
        print(f"warnings: {', '.join(report.warnings) or 'none'}\n")
        print(render_drift_markdown(report))
    return EXIT_PASSED if report.passed else EXIT_DRIFTED
