"""One user CSV for the `local` source: bytes -> a frame of text cells, each real-file quirk decided.

Every cell is read as text ("" when empty, so an empty Name or Description stays ""), so what is written
back is the file's own characters; only the label is rewritten. Each decision taken (a fallback encoding,
a dropped column, dropped rows) is recorded in a `Decisions` list that ends up in manifest.json.
Row numbers in messages are spreadsheet rows: the header is row 1, the first data row is row 2.
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

from fusion_model import schema
from tasks.errors import StageError
from tasks.params import LocalParams

log = logging.getLogger(__name__)

PET_ID = re.compile(r"[0-9a-f]{9}")
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


def read_table(name: str, path: Path, p: LocalParams, decisions: Decisions) -> Table:
    """Decode and parse `path`; the leading index column becomes `row_ids`, columns outside the schema
    are dropped (named in `decisions`)."""
    raw = path.read_bytes()
    if not raw.strip():
        raise StageError(f"{path}: the file is empty; point download.local.path at the PetFinder CSV")
    text = _decode(name, path, raw, p, decisions)
    try:
        cells = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, na_filter=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StageError(f"{path}: not a readable CSV ({reason}); fix the file at the place named") from None
    if _MARKS.search(text):
        cells = _apply_fallback(name, path, cells, p, decisions)
    cells, row_ids = _index_column(name, cells, decisions)
    extra = [c for c in cells.columns if c not in schema.ALL_COLUMNS]
    if extra:
        cells = cells.drop(columns=extra)
        decisions.add(name, "extra_columns", f"dropped {extra}: not PetFinder columns (fusion_model/schema.py)",
                      columns=extra)
    for col in (c for c in schema.TEXT_COLUMNS if c in cells.columns):
        missing = cells[col].isin(_MISSING_TEXT)
        cells.loc[missing, col] = ""
        empty = int(cells[col].str.strip().eq("").sum())
        if empty:
            decisions.add(name, "empty_text", f"{empty} empty {col} cell(s) kept as \"\""
                          + (f" ({int(missing.sum())} of them written as NaN or nan)" if missing.any() else ""),
                          column=col, rows=empty)
    return Table(name, path, cells.reset_index(drop=True), row_ids.reset_index(drop=True))


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


def check_columns(table: Table, required: tuple[str, ...]) -> None:
    missing = [c for c in required if c not in table.cells.columns]
    if missing:
        raise StageError(
            f"{table.path}: missing column(s) {missing}; columns found: {list(table.cells.columns)}. Fix: "
            "export every PetFinder column (fusion_model/schema.py), or check download.local.layout"
        )


def check_pet_ids(table: Table, p: LocalParams, decisions: Decisions) -> Table:
    """Refuse (or, with drop_bad_pet_ids, drop) rows whose PetID is not 9 lower-case hex digits."""
    if "PetID" not in table.cells.columns:
        return table
    ids = table.cells["PetID"]
    bad = ~ids.str.fullmatch(PET_ID.pattern)
    if not bad.any():
        return table
    positions = np.flatnonzero(bad.to_numpy())
    examples = list(dict.fromkeys(ids[bad].tolist()))[:3]
    reason = (f"{len(positions)} PetID(s) are not 9 lower-case hex digits ({spreadsheet_rows(positions)}, "
              f"e.g. {examples}): a spreadsheet turned them into numbers (7.76E+08) or cut their leading zeros")
    if not p.drop_bad_pet_ids:
        raise StageError(
            f"{table.path}: column PetID: {reason}. Such rows cannot be matched to their photos. Fix: re-export "
            "the file with PetID formatted as text, or set download.local.drop_bad_pet_ids: true to drop them"
        )
    decisions.add(table.name, "bad_pet_ids", f"dropped {len(positions)} row(s): {reason}",
                  dropped=len(positions), first_rows=[int(r) + 2 for r in positions[:SHOWN]])
    keep = ~bad.to_numpy()
    return Table(table.name, table.path, table.cells[keep].reset_index(drop=True),
                 table.row_ids[keep].reset_index(drop=True))


def label_codes(table: Table) -> np.ndarray:
    """The label column as integers; an empty or non-integer cell is refused with its rows."""
    text = table.cells[schema.LABEL].str.strip()
    values = pd.to_numeric(text, errors="coerce")
    bad = values.isna() | (values != values.round())
    if bad.any():
        positions = np.flatnonzero(bad.to_numpy())
        raise StageError(
            f"{table.path}: column {schema.LABEL}: empty or not an integer in {spreadsheet_rows(positions)} "
            f"(e.g. {text[bad].head(3).tolist()}). Fix: remove the unlabelled rows or fill in their label"
        )
    return values.astype("int64").to_numpy()
