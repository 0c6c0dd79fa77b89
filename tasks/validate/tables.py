"""Reading the raw CSVs, the frame GX validates, and the typed tables the validate stage writes.

The CSV is read with every cell as text, so nothing is guessed and error examples quote the file's own
characters; numbers are parsed afterwards (unparseable -> NaN -> the not-null expectation names the row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fusion_model import checks
from fusion_model.schema import (
    ALL_COLUMNS,
    CATEGORICAL_COLUMNS,
    IMAGES,
    LABEL,
    NUMERIC_COLUMNS,
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    TEXT_COLUMNS,
)
from tasks.validate.suite import ROW_ID

NUMBER_COLUMNS: tuple[str, ...] = (*CATEGORICAL_COLUMNS, *NUMERIC_COLUMNS, LABEL)


class TableLoadError(ValueError):
    """A CSV cannot be read as a table at all (missing, empty, malformed); the message names the file."""


@dataclass
class RawTable:
    """One CSV as text: `raw` holds every cell as str ("" when empty) plus a `row_id` column."""

    name: str  # train / test
    path: Path
    raw: pd.DataFrame
    extra_columns: list[str] = field(default_factory=list)
    missing_optional: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def read_raw(name: str, path: Path) -> RawTable:
    """Read `path` (train.csv / test.csv): leading unnamed index column -> row_id, all cells as text."""
    if not path.is_file():
        raise TableLoadError(
            f"{path}: file not found. The dataset folder must hold train.csv, test.csv and images/; "
            "run `python -m tasks download` or point validate.dataset_dir at the right folder"
        )
    if path.stat().st_size == 0:
        raise TableLoadError(f"{path}: the file is empty (0 bytes); re-download the dataset or restore the file")
    try:
        raw = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False, encoding="utf-8")
    except pd.errors.EmptyDataError:
        raise TableLoadError(f"{path}: no header row (the file holds only blank lines); restore the file") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as e:
        reason = str(e).strip().splitlines()[0]
        raise TableLoadError(f"{path}: not a readable CSV ({reason}); fix the file at the place named") from None
    notes: list[str] = []
    first = raw.columns[0] if len(raw.columns) else ""
    if first == "" or first.startswith("Unnamed: 0"):
        ids = pd.to_numeric(raw[first], errors="coerce")
        bad = ids.isna() | (ids != ids.round())
        if bad.any():
            lines = (np.flatnonzero(bad.to_numpy())[:5] + 2).tolist()  # +1 header, +1 one-based
            raise TableLoadError(
                f"{path}: the leading index column has non-integer values on line(s) {lines}; "
                "re-export the CSV with an integer index column (pandas: df.to_csv(path))"
            )
        raw = raw.drop(columns=[first])
        row_id = ids.astype("int64")
    else:
        notes.append("no leading index column: row_id is the 0-based row number")
        row_id = pd.Series(np.arange(len(raw), dtype="int64"))
    raw.insert(0, ROW_ID, row_id.to_numpy())
    known = set(ALL_COLUMNS)
    return RawTable(
        name=name,
        path=path,
        raw=raw.reset_index(drop=True),
        extra_columns=[c for c in raw.columns if c not in known and c != ROW_ID],
        missing_optional=sorted(c for c in OPTIONAL_COLUMNS if c not in raw.columns),
        notes=notes,
    )


def validation_frame(table: RawTable, dataset_root: Path, workers: int, image_checks: bool = True) -> pd.DataFrame:
    """What GX sees: row_id, numbers parsed (NaN when empty or not a number), text as str, empty image
    cells as null, and the derived check columns. Extra columns are left out (reported instead).
    `image_checks=False` leaves out the file checks (the benchmark times them separately)."""
    raw = table.raw
    frame = pd.DataFrame({ROW_ID: raw[ROW_ID].astype("int64")})
    for col in (c for c in ALL_COLUMNS if c in raw.columns):
        if col in NUMBER_COLUMNS:
            frame[col] = checks.to_numbers(raw[col])
            if col in CATEGORICAL_COLUMNS or col == LABEL:  # codes are whole numbers: 1.5 reads as missing
                frame[col] = frame[col].where(frame[col] == frame[col].round())
        elif col in TEXT_COLUMNS:
            frame[col] = raw[col].astype("str")
        else:  # Images, PetID, RescuerID: an empty cell is a missing value
            frame[col] = raw[col].astype("str").where(raw[col].str.strip() != "", None)
    if "Type" in frame.columns and "Breed1" in frame.columns:
        frame[checks.BREED_MATCHES_TYPE] = checks.breed_matches_type(frame["Type"], frame["Breed1"])
    if image_checks and IMAGES in raw.columns:
        derived = checks.check_images(frame[IMAGES], dataset_root, workers=workers)
        for col in derived.columns:
            frame[col] = derived[col]
    return frame


def typed_table(frame: pd.DataFrame) -> pd.DataFrame:
    """The stage's output table from a frame that passed validation (codes int64, amounts float64)."""
    out = pd.DataFrame({ROW_ID: frame[ROW_ID].astype("int64")})
    for col in ALL_COLUMNS:
        if col not in frame.columns:
            continue  # only optional columns can be absent after a successful validation
        if col in CATEGORICAL_COLUMNS or col == LABEL:
            out[col] = frame[col].astype("int64")
        elif col in NUMERIC_COLUMNS:
            out[col] = frame[col].astype("float64")
        else:
            out[col] = frame[col].fillna("").astype("str")
    assert all(c in out.columns for c in REQUIRED_COLUMNS)
    return out.reset_index(drop=True)


def stratified_split(table: pd.DataFrame, fraction: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deterministic stratified train/val split: `fraction` of each class (at least one row of every
    class with two or more rows, never all of them) goes to val; both keep the CSV's row order."""
    rng = np.random.default_rng(seed)
    labels = table[LABEL].to_numpy()
    in_val = np.zeros(len(table), dtype=bool)
    for cls in np.unique(labels):
        positions = np.flatnonzero(labels == cls)
        n_val = int(round(len(positions) * fraction))
        n_val = min(max(n_val, 1), len(positions) - 1) if len(positions) >= 2 else 0
        in_val[rng.permutation(positions)[:n_val]] = True
    return table[~in_val].reset_index(drop=True), table[in_val].reset_index(drop=True)
