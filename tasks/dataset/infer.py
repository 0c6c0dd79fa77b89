"""Draft a `dataset:` section for a table: `python -m tasks dataset infer TABLE [--images-dir DIR] [--label COL]`.

Each column gets a role and a one-line reason, from its cells read as text:
- cells that name image files under the images root -> image;
- unique in every row, short -> the id (the row key);
- numbers -> numerical, unless few distinct whole numbers (codes) or a name saying it is an identifier
  -> categorical; a categorical column with many repeated values is also suggested for `frequency`;
- long free text -> text; short strings -> categorical (near-unique short strings: text);
- a constant or empty column -> left out.
The label's problem type follows its values: two -> binary; a few whole numbers in order -> ordinal,
which is asked in a comment (it could be unordered codes); other strings -> multiclass; many numbers ->
regression. A column that nearly decides the label on its own is flagged: it may only be known after the
label (a rating beside a "recommended" flag) and should then be left out. Nothing is guessed silently:
every decision is printed beside the section to paste into params.yaml.
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pandas as pd

from fusion_model.dataset import split_images
from tasks.errors import StageError

IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff"})
MAX_CODES = 10  # whole-number columns with at most this many distinct values read as codes
LONG_TEXT_CHARS = 40  # mean length from which a string column is free text
NEAR_UNIQUE = 0.7  # distinct share from which short strings are text (names, titles), not codes
MANY_WORDS = 0.2  # ... or this distinct share when most values are words (names), not tokens (hex ids)
FREQUENCY_MIN_DISTINCT = 50  # a categorical column this varied, whose values repeat, is worth counting
ORDINAL_MAX_CLASSES = 10
LEAK_ACCURACY = 0.9  # a column whose values alone predict the label this well is flagged
_IDENTIFIER = re.compile(r"(^|[\s_\-])(id|ids|identifier|code|key)$|ID$|Id$", re.IGNORECASE)
_PLAIN = re.compile(r"^[A-Za-z_][\w .\-/]*$")
_WORDS = re.compile(r"^[^\W\d_]+(?:[\s'.\-][^\W\d_]+)*$")


@dataclass
class Column:
    name: str
    role: str  # id | label | image | text | categorical | numerical | skip
    reason: str
    frequency: bool = False


def read_table(path: Path) -> tuple[pd.DataFrame, bool]:
    """Every cell as text ("" when empty); whether the file has a leading unnamed index column (dropped)."""
    if not path.is_file():
        raise StageError(f"{path}: no such file; pass a CSV or Parquet table")
    if path.suffix.lower() in (".parquet", ".pq"):
        from tasks.download.local_table import read_parquet_cells

        cells = read_parquet_cells(path)
    else:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8-sig")
        except UnicodeDecodeError:
            text = raw.decode("cp1252", errors="replace")
        try:
            cells = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False, na_filter=False)
        except (pd.errors.ParserError, pd.errors.EmptyDataError) as e:
            raise StageError(f"{path}: not a readable CSV ({str(e).strip().splitlines()[0]})") from None
    first = cells.columns[0] if len(cells.columns) else ""
    if first == "" or str(first).startswith("Unnamed: 0"):
        return cells.drop(columns=[first]), True
    return cells, False


def _numbers(cells: pd.Series) -> pd.Series:
    return pd.to_numeric(cells.str.strip(), errors="coerce")


def _is_image_column(cells: pd.Series, root: Path) -> tuple[bool, str]:
    values = [p for cell in cells.head(200) for p in split_images(cell)]
    if not values or not all(PurePosixPath(v).suffix.lower() in IMAGE_SUFFIXES for v in values):
        return False, ""
    found = sum((root / v).is_file() for v in values)
    share = found / len(values)
    return share >= 0.5, f"{share:.0%} of the paths checked are files under {root} (e.g. {values[0]})"


def label_role(cells: pd.Series) -> tuple[str, str]:
    """(problem type, reason, with the question for a few ordered whole numbers)."""
    present = cells[cells.str.strip() != ""]
    distinct = sorted(present.str.strip().unique())
    numbers = _numbers(present)
    whole = numbers.notna().all() and bool((numbers == numbers.round()).all())
    if len(distinct) == 2:
        return "binary", f"two values ({distinct[0]}, {distinct[1]}): the second is the positive class"
    if whole and len(distinct) <= ORDINAL_MAX_CLASSES:
        low, high = int(numbers.min()), int(numbers.max())
        return "ordinal", (f"QUESTION: {len(distinct)} whole numbers {low}..{high}: ordinal (their order counts, "
                           "e.g. ratings, speeds) or multiclass (unordered codes)? ordinal assumed; change it "
                           "if the numbers are only names")
    if numbers.notna().all():
        return "regression", f"{len(distinct)} distinct numbers: a quantity"
    return "multiclass", f"{len(distinct)} distinct values: classes without an order"


def _leak(cells: pd.Series, label: pd.Series) -> float | None:
    """How well the column's values alone predict the label (the majority label per value), on labelled
    rows; None for a column too varied to say (an id-like column)."""
    both = pd.DataFrame({"x": cells, "y": label})
    both = both[(both.y.str.strip() != "") & (both.x.str.strip() != "")]
    if both.empty or both.x.nunique() > max(20, len(both) // 20):
        return None
    return float(both.groupby("x").y.agg(lambda y: y.value_counts().iloc[0]).sum() / len(both))


def infer(table: Path, images_dir: Path | None = None, label: str | None = None) -> tuple[list[Column], str | None, bool]:
    """Roles of every column of `table`; the label's problem type and reason; whether the file has an
    index column."""
    cells, has_index = read_table(table)
    root = images_dir or table.parent
    if label is not None and label not in cells.columns:
        raise StageError(f"--label {label!r} is not a column of {table}; its columns: {list(cells.columns)}")
    n = len(cells)
    columns: list[Column] = []
    id_taken = False
    problem_type = None
    for name in cells.columns:
        col = cells[name]
        present = col[col.str.strip() != ""]
        distinct = present.nunique()
        if name == label:
            problem_type, why = label_role(col)
            columns.append(Column(name, "label", f"--label; {why}"))
            continue
        if present.empty or distinct <= 1:
            columns.append(Column(name, "skip", "empty or one value in every row: nothing to learn; left out"))
            continue
        image, why = _is_image_column(present, root)
        if image:
            columns.append(Column(name, "image", why))
            continue
        numbers = _numbers(present)
        is_number = numbers.notna().mean() >= 0.95
        mean_chars = float(present.str.len().mean())
        one_token = float((~present.str.strip().str.contains(r"\s")).mean()) >= 0.95  # keys have no spaces
        if not id_taken and distinct == n and len(present) == n and mean_chars < LONG_TEXT_CHARS and one_token \
                and (not is_number or _IDENTIFIER.search(name) or bool((numbers == numbers.round()).all())):
            id_taken = True
            columns.append(Column(name, "id", f"{distinct} distinct values in {n} rows: the row key"))
            continue
        if is_number:
            whole = bool((numbers.dropna() == numbers.dropna().round()).all())
            if _IDENTIFIER.search(name):
                columns.append(Column(name, "categorical", f"numbers, but the name says it identifies something "
                                      f"({distinct} distinct values): a code",
                                      frequency=distinct >= FREQUENCY_MIN_DISTINCT and distinct < len(present)))
            elif whole and distinct <= MAX_CODES:
                columns.append(Column(name, "categorical", f"{distinct} distinct whole numbers: codes"))
            else:
                columns.append(Column(name, "numerical", f"numbers ({distinct} distinct, "
                                      f"{numbers.min():g}..{numbers.max():g})"))
            continue
        words = float(present.str.split().str.len().mean())
        wordy = float(present.str.strip().str.match(_WORDS).mean()) >= 0.5
        varied = distinct / len(present)
        if mean_chars >= LONG_TEXT_CHARS or (varied >= NEAR_UNIQUE and words >= 2) or (
                varied >= MANY_WORDS and distinct >= FREQUENCY_MIN_DISTINCT and wordy):
            columns.append(Column(name, "text", f"free text (mean {mean_chars:.0f} characters, {words:.1f} words, "
                                  f"{distinct} distinct)"))
            continue
        columns.append(Column(name, "categorical", f"strings, {distinct} distinct",
                              frequency=distinct >= FREQUENCY_MIN_DISTINCT and distinct < len(present)))
    if label is not None:
        for c in columns:
            if c.role in ("categorical", "numerical"):
                accuracy = _leak(cells[c.name], cells[label])
                majority = float(cells[label][cells[label].str.strip() != ""].value_counts(normalize=True).iloc[0])
                if accuracy is not None and accuracy >= LEAK_ACCURACY and accuracy > majority + 0.05:
                    c.reason += (f"; LEAK? alone it predicts {label} for {accuracy:.0%} of rows (the majority class: "
                                 f"{majority:.0%}): leave it out if it is known only with the label")
    return columns, problem_type, has_index


def _yaml(name: str) -> str:
    return name if _PLAIN.match(name) and not name.endswith(" ") else json.dumps(name)


def render(table: Path, columns: list[Column], problem_type: str | None, has_index: bool,
           images_dir: Path | None) -> str:
    by_role = {role: [c.name for c in columns if c.role == role] for role in ("image", "text", "categorical",
                                                                             "numerical")}
    ids = [c.name for c in columns if c.role == "id"]
    labels = [c for c in columns if c.role == "label"]
    index_note = "the file's unnamed index column" if has_index else "the row number"
    lines = [f"# A draft for {table} ({len(columns)} columns); review every line, then paste it into params.yaml.",
             "dataset:",
             "  preset: null",
             f"  id: {_yaml(ids[0]) if ids else 'null'}" + ("" if ids else f"  # no unique column: {index_note}")]
    if labels:
        lines += ["  label:", f"    column: {_yaml(labels[0].name)}", f"    problem_type: {problem_type}",
                  "    classes: null"]
    else:
        lines += ["  label:", "    column: null          # which column to predict? pass --label COLUMN",
                  "    problem_type: binary  # binary | multiclass | ordinal | regression"]
    lines.append("  columns:")
    for role, names in by_role.items():
        lines.append(f"    {role}: [{', '.join(_yaml(n) for n in names)}]")
    counted = [c.name for c in columns if c.frequency]
    lines.append(f"  frequency: [{', '.join(_yaml(n) for n in counted)}]")
    lines.append("# Why each column got its role:")
    lines += [f"#   {c.name}: {c.role} ({c.reason})" + ("; also counted (frequency): its values repeat"
                                                       if c.frequency else "") for c in columns]
    lines += ["# And for download (params.yaml download:):",
              "#   source: local",
              f"#   local: {{path: {table}" + (f", images_dir: {images_dir}" if images_dir else "") + "}"]
    return "\n".join(lines) + "\n"


def infer_section(table: Path, images_dir: Path | None = None, label: str | None = None) -> str:
    """The draft `dataset:` section for `table`, with a reason per column, as YAML text."""
    columns, problem_type, has_index = infer(table, images_dir, label)
    return render(table, columns, problem_type, has_index, images_dir)

