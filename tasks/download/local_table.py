"""One user table (CSV or Parquet) for the `local` source: bytes -> a frame of text cells, each real-file
quirk decided.

Every cell is read as text ("" when empty, so an empty text cell stays ""), so what is written back is the
file's own characters. Each decision taken (a fallback encoding, a dropped column, dropped rows) is
recorded in a `Decisions` list that ends up in manifest.json. Row numbers in messages are spreadsheet rows:
the header is row 1, the first data row is row 2.
"""

from __future__ import annotations

import codecs
import io
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fusion_model.dataset import DatasetSchema, canonical
from tasks.errors import StageError
from tasks.params import LocalParams

log = logging.getLogger(__name__)

SHOWN = 10  # rows named in a message; the count gives the rest
_BOM = b"\xef\xbb\xbf"
_MISSING_TEXT = frozenset({"NaN", "nan"})  # how pandas / numpy print a missing value into a CSV
# Bytes the primary encoding cannot decode become one private-use character each (U+10FF80..U+10FFFF),
# so the CSV parser sees text and each damaged cell can be found and decoded again with the fallback.
_MARK_BASE = 0x10FF00
_MARK_HANDLER = "tasks.download.local-mark"
_MARKS = re.compile("[\U0010ff80-\U0010ffff]+")
_MARK_BYTES = (b"\xf4\x8f\xbe", b"\xf4\x8f\xbf")  # UTF-8 of that range: already in the file -> ambiguous


def _mark(e: UnicodeError) -> tuple[str, int]:
    assert isinstance(e, UnicodeDecodeError)
    return "".join(chr(_MARK_BASE + b) for b in e.object[e.start : e.end]), e.end


codecs.register_error(_MARK_HANDLER, _mark)


@dataclass
class Decisions:
    """What the source did about each quirk, in order; logged as it is taken, written to manifest.json."""

    items: list[dict[str, Any]] = field(default_factory=list)

    def add(self, file: str, quirk: str, action: str, **detail: Any) -> None:
        self.items.append({"file": file, "quirk": quirk, "action": action, **detail})
        log.warning("download.local: %s: %s: %s", file, quirk, action)


@dataclass
class Table:
    """One CSV: `cells` all str, indexed by 0-based data row position; `row_ids` aligned with it."""

    name: str  # as named in messages and the manifest
    path: Path
    cells: pd.DataFrame
    row_ids: pd.Series


def spreadsheet_rows(positions: Any) -> str:
    """'rows 2, 5, 9 (3 rows; header = row 1)' for 0-based data positions, the first SHOWN of them."""
    rows = [int(p) + 2 for p in positions]
    shown = ", ".join(str(r) for r in rows[:SHOWN]) + (", ..." if len(rows) > SHOWN else "")
    return f"rows {shown} ({len(rows)} row{'s' if len(rows) != 1 else ''}; header = row 1)"


PARQUET_SUFFIXES = (".parquet", ".pq")


def read_table(name: str, path: Path, p: LocalParams, decisions: Decisions, schema: DatasetSchema) -> Table:
    """Decode and parse `path` (CSV, or Parquet by its suffix); the leading index column becomes `row_ids`,
    columns the dataset schema does not declare are dropped (named in `decisions`)."""
    if path.suffix.lower() in PARQUET_SUFFIXES:
        cells = read_parquet_cells(path)
    else:
        raw = path.read_bytes()
        if not raw.strip():
            raise StageError(f"{path}: the file is empty; point download.local.path at your table")
        text = _decode(name, path, raw, p, decisions)
        try:
            cells = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, na_filter=False)
        except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StageError(f"{path}: not a readable CSV ({reason}); fix the file at the place named") from None
        if _MARKS.search(text):
            cells = _apply_fallback(name, path, cells, p, decisions)
    cells, row_ids = _index_column(name, cells, decisions)
    declared = set(schema.table_columns)
    extra = [c for c in cells.columns if c not in declared]
    if extra:
        cells = cells.drop(columns=extra)
        decisions.add(name, "extra_columns", f"dropped {extra}: columns params.yaml dataset: does not declare",
                      columns=extra)
    for col in (c for c in schema.columns.text if c in cells.columns):
        missing = cells[col].isin(_MISSING_TEXT)
        cells.loc[missing, col] = ""
        empty = int(cells[col].str.strip().eq("").sum())
        if empty:
            decisions.add(name, "empty_text", f"{empty} empty {col} cell(s) kept as \"\""
                          + (f" ({int(missing.sum())} of them written as NaN or nan)" if missing.any() else ""),
                          column=col, rows=empty)
    return Table(name, path, cells.reset_index(drop=True), row_ids.reset_index(drop=True))


def read_parquet_cells(path: Path) -> pd.DataFrame:
    """A Parquet file's cells as text: "" for a missing value, whole numbers written as integers."""
    try:
        frame = pd.read_parquet(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise StageError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); re-export it") from None
    if frame.index.name is not None or not isinstance(frame.index, pd.RangeIndex):
        frame = frame.reset_index().rename(columns={frame.index.name or "index": ""})
    out = pd.DataFrame(index=range(len(frame)))
    for col in frame.columns:
        values = frame[col].reset_index(drop=True)
        if pd.api.types.is_numeric_dtype(values) and not pd.api.types.is_bool_dtype(values):
            out[str(col)] = values.map(canonical)
        else:
            out[str(col)] = values.map(lambda v: "" if v is None or (isinstance(v, float) and v != v) else str(v))
    return out


def _decode(name: str, path: Path, raw: bytes, p: LocalParams, decisions: Decisions) -> str:
    for enc, key in ((p.encoding, "encoding"), (p.fallback_encoding, "fallback_encoding")):
        try:
            if enc is not None:
                codecs.lookup(enc)
        except LookupError:
            raise StageError(f"download.local.{key}: unknown encoding {enc!r}; use a Python codec name "
                             "such as utf-8, cp1252 or latin-1") from None
    if any(m in raw for m in _MARK_BYTES):
        raise StageError(f"{path}: holds private-use characters U+10FF80..U+10FFFF, which this reader reserves; "
                         "remove them or re-save the file")
    if codecs.lookup(p.encoding).name == "utf-8" and raw.startswith(_BOM):
        raw = raw[len(_BOM):]
        decisions.add(name, "byte_order_mark", "removed the UTF-8 byte-order mark (a spreadsheet's 'CSV UTF-8')")
    return raw.decode(p.encoding, errors=_MARK_HANDLER)


def _apply_fallback(name: str, path: Path, cells: pd.DataFrame, p: LocalParams, decisions: Decisions) -> pd.DataFrame:
    """Decode the cells holding bytes `p.encoding` rejected with `p.fallback_encoding`, or refuse them."""
    hit = pd.DataFrame({c: cells[c].str.contains(_MARKS) for c in cells.columns})
    rows = np.flatnonzero(hit.any(axis=1).to_numpy())
    columns = [c for c in cells.columns if hit[c].any()]
    bad_header = [c for c in cells.columns if _MARKS.search(c)]
    where = f"{spreadsheet_rows(rows)}, columns {columns}" + (f", header {bad_header}" if bad_header else "")
    if p.fallback_encoding is None:
        raise StageError(
            f"{path}: bytes that are not {p.encoding} in {where}. Fix: re-save the file as UTF-8, or set "
            "download.local.fallback_encoding (e.g. cp1252, what Excel writes on Windows) to decode those cells"
        )

    def redecode(text: str) -> str:
        def one(m: re.Match[str]) -> str:
            data = bytes(ord(ch) - _MARK_BASE for ch in m.group())
            try:
                return data.decode(p.fallback_encoding)  # type: ignore[arg-type]
            except UnicodeDecodeError:
                raise StageError(
                    f"{path}: bytes {data!r} in {where} are neither {p.encoding} nor {p.fallback_encoding}. Fix: "
                    "re-save the file as UTF-8, or set download.local.fallback_encoding to its real encoding "
                    "(latin-1 decodes any byte)"
                ) from None
        return _MARKS.sub(one, text)

    fixed = cells.rename(columns=redecode)
    for c in columns:
        fixed[redecode(c)] = cells[c].map(redecode)
    n_cells = int(hit.to_numpy().sum())
    decisions.add(
        name, "encoding",
        f"{n_cells} cell(s) in {len(rows)} row(s) were not {p.encoding}: decoded with the fallback "
        f"{p.fallback_encoding} ({where})",
        fallback_encoding=p.fallback_encoding, cells=n_cells, rows=len(rows),
        first_rows=[int(r) + 2 for r in rows[:SHOWN]], columns=[redecode(c) for c in columns],
    )
    return fixed


def _index_column(name: str, cells: pd.DataFrame, decisions: Decisions) -> tuple[pd.DataFrame, pd.Series]:
    """Row ids: the leading unnamed index column when it holds unique integers, else the 0-based row number."""
    positions = pd.Series(np.arange(len(cells), dtype="int64"))
    first = cells.columns[0] if len(cells.columns) else ""
    if not (first == "" or first.startswith("Unnamed: 0")):
        decisions.add(name, "index_column", "none in the file: row ids are the 0-based row numbers")
        return cells, positions
    ids = pd.to_numeric(cells[first], errors="coerce")
    cells = cells.drop(columns=[first])
    if ids.isna().any() or (ids != ids.round()).any() or ids.duplicated().any():
        decisions.add(name, "index_column", "leading index column is not unique integers: dropped, row ids are "
                      "the 0-based row numbers")
        return cells, positions
    return cells, ids.astype("int64")


def check_columns(table: Table, required: list[str], schema: DatasetSchema) -> None:
    missing = [c for c in required if c not in table.cells.columns]
    if missing:
        raise StageError(
            f"{table.path}: missing column(s) {missing} that params.yaml dataset: declares; columns found: "
            f"{list(table.cells.columns)}. Fix: correct the column names in the dataset section (spaces and case "
            "count), or export the missing columns"
        )


def check_ids(table: Table, p: LocalParams, decisions: Decisions, schema: DatasetSchema) -> Table:
    """Refuse (or, with drop_bad_ids, drop) rows whose id is empty, repeated, or not of `checks.id_pattern`."""
    if schema.id is None or schema.id not in table.cells.columns:
        return table
    ids = table.cells[schema.id].str.strip()
    reasons = pd.Series("", index=ids.index, dtype="str")
    if schema.checks.id_pattern:
        reasons[~ids.str.fullmatch(schema.checks.id_pattern)] = (
            f"not of the form {schema.checks.id_pattern} (a spreadsheet turned them into numbers such as "
            "7.76E+08 or cut their leading zeros)")
    reasons[ids.duplicated(keep=False) & (reasons == "")] = "repeated"
    reasons[ids == ""] = "empty"
    bad = reasons != ""
    if not bad.any():
        return table
    positions = np.flatnonzero(bad.to_numpy())
    parts = []
    for why, group in reasons[bad].groupby(reasons[bad], sort=False):
        examples = list(dict.fromkeys(ids[group.index].tolist()))[:3]
        parts.append(f"{len(group)} {why} ({spreadsheet_rows(group.index)}, e.g. {examples})")
    reason = f"{len(positions)} bad id(s) in column {schema.id}: " + "; ".join(parts)
    if not p.drop_bad_ids:
        raise StageError(
            f"{table.path}: {reason}. The id is the row key (dataset.id): every row needs its own. Fix: re-export "
            f"the file with '{schema.id}' formatted as text and unique, or set download.local.drop_bad_ids: true "
            "to drop these rows (every copy of a repeated id)"
        )
    decisions.add(table.name, "bad_ids", f"dropped {len(positions)} row(s): {reason}",
                  dropped=len(positions), first_rows=[int(r) + 2 for r in positions[:SHOWN]])
    keep = ~bad.to_numpy()
    return Table(table.name, table.path, table.cells[keep].reset_index(drop=True),
                 table.row_ids[keep].reset_index(drop=True))


def check_labels(table: Table, schema: DatasetSchema) -> None:
    """Every row labelled: an empty label cell is refused with its rows."""
    label = schema.label.column
    empty = table.cells[label].str.strip() == ""
    if empty.any():
        positions = np.flatnonzero(empty.to_numpy())
        raise StageError(
            f"{table.path}: column {label}: empty in {spreadsheet_rows(positions)}. Fix: remove the unlabelled "
            "rows or fill in their label"
        )
