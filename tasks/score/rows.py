"""A drop's rows: its table read, each row checked with the validation rules, the good rows predicted.

The checks are the validation suite's per-row rules as the library applies them before any prediction
(`fusion_model.checks.row_problems`: required values, numbers, code sets, plausible amounts, safe existing
decodable photos), read from the model's own schema (model_config.json `dataset`). A row that fails one is
a reject naming its row, the column, the value and the reason; the other rows are predicted. A table that
lacks a column the model needs, or cannot be read at all, is refused as a whole (StageError).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fusion_model.checks import RowProblem, missing_columns, row_problems
from fusion_model.dataset import DatasetSchema
from fusion_model.predict import Predictions, Predictor, prediction_frame, read_rows_csv
from tasks.errors import StageError

ROW = "row"  # the 1-based row of the drop's table (counted after the header): the first column of each output


def read_rows(table: Path, text_columns: Iterable[str], shown: str | Path) -> pd.DataFrame:
    """The rows of a drop's table (CSV or Parquet), as `python -m fusion_model.predict` reads a CSV; its own
    index column is dropped (rows are named by their position). `shown`: the table as messages name it."""
    try:
        if table.suffix.lower() == ".parquet":
            frame = pd.read_parquet(table)
            for col in text_columns:
                if col in frame.columns:
                    frame[col] = frame[col].fillna("").astype(str)
        else:
            frame = read_rows_csv(table, text_columns)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StageError(f"{shown}: not a readable table ({reason}); export the rows as a UTF-8 CSV with one header "
                         "line, or as Parquet, and drop them again") from None
    return frame.reset_index(drop=True)


def plain(value: Any) -> Any:
    """A cell as JSON: numpy scalars as Python values, NaN and other missing values as null."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, str | int | float | bool):
        return value
    try:
        missing = bool(pd.isna(value))
    except (TypeError, ValueError):  # a list or an array in a Parquet cell
        missing = False
    return None if missing else str(value)


@dataclass
class CheckedRows:
    good: pd.DataFrame  # the rows every check passed (index: position in the table)
    rejects: list[dict[str, Any]]  # one record per refused row, in the table's order
    ignored_columns: list[str]  # columns of the table the model does not read (a label column, extras)


def _reject(frame: pd.DataFrame, index: int, problems: list[RowProblem], schema: DatasetSchema) -> dict[str, Any]:
    record: dict[str, Any] = {ROW: int(index) + 1}
    if schema.id and schema.id in frame.columns:
        record["id"] = plain(frame.at[index, schema.id])
    record["problems"] = [{"column": p.column, "value": plain(p.value),
                           "reason": f"image {p.file!r}: {p.reason}" if p.file is not None else p.reason}
                          for p in problems]
    record["values"] = {str(col): plain(v) for col, v in frame.loc[index].items()}
    return record


def check_rows(frame: pd.DataFrame, schema: DatasetSchema, images_root: Path, workers: int,
               shown: str | Path) -> CheckedRows:
    """Split the table's rows into the good ones and reject records; refuse a table lacking a needed column."""
    needed = [c for c in schema.required_features if c != schema.id]
    missing = missing_columns(frame, needed)
    if missing:
        raise StageError(
            f"{shown}: lacks the column(s) {missing} the model reads, so no row of it can be scored. Add them (the "
            f"model was trained on the columns {needed}; image cells are ';'-separated paths relative to the drop's "
            "folder) and drop the rows again")
    by_row: dict[int, list[RowProblem]] = {}
    for problem in row_problems(frame, images_root, schema, workers):
        by_row.setdefault(int(problem.index), []).append(problem)
    rejects = [_reject(frame, index, problems, schema) for index, problems in sorted(by_row.items())]
    read = set(schema.feature_columns)
    return CheckedRows(good=frame.drop(index=list(by_row)), rejects=rejects,
                       ignored_columns=[str(c) for c in frame.columns if c not in read])


def predict_rows(predictor: Predictor, good: pd.DataFrame, images_root: Path, batch_size: int,
                 shown: str | Path) -> pd.DataFrame:
    """The predictions of the good rows: row, the id (named as the dataset declares it), prediction, score
    (ordinal), proba_<class> (classification); a table with no good row gives the header alone."""
    id_column = predictor.schema.id
    if len(good):
        out = predictor.predict(good, images_root, batch_size=batch_size, source=shown)
    else:
        classes = predictor.classes
        regression = predictor.problem_type == "regression"
        empty = Predictions(prediction=np.zeros(0, dtype=np.int64),
                            proba=None if regression else np.zeros((0, len(classes)), dtype=np.float32),
                            score=np.zeros(0) if predictor.problem_type == "ordinal" else None)
        ids = good[id_column] if id_column and id_column in good.columns else None
        out = prediction_frame(empty, predictor.problem_type, classes, good.index, ids=ids, id_column=id_column)
    if ROW not in out.columns:  # (an id column named `row` already names the rows)
        out.insert(0, ROW, (good.index + 1).astype(np.int64))
    return out
