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
from fusion_model.dataset import ROW_ID, DatasetSchema, canonical, class_value, sort_classes
from fusion_model.presets import RULES
from tasks.errors import StageError

# Derived columns: "<prefix><column>" holds a per-row verdict about <column> (the report shows <column>).
IS_NUMBER = "is_a_number: "  # a non-empty cell parses as a number
VALID_CODE = "valid_code: "  # a categorical cell is one of `checks.codes`
SEEN_CODE = "seen_in_training: "  # a categorical cell is a value the training rows hold
DERIVED_PREFIXES: tuple[str, ...] = (IS_NUMBER, VALID_CODE, SEEN_CODE)


def derived_source(column: str) -> str | None:
    """The file column a derived verdict column is about, or None for a file column."""
    for prefix in DERIVED_PREFIXES:
        if column.startswith(prefix):
            return column[len(prefix):]
    return None


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


def read_raw(name: str, path: Path, schema: DatasetSchema) -> RawTable:
    """Read `path` (train.csv / test.csv): leading unnamed index column -> row_id, all cells as text."""
    if not path.is_file():
        raise TableLoadError(
            f"{path}: file not found. The dataset folder must hold train.csv, test.csv and images/; "
            "run `python -m tasks download` then `python -m tasks intake` (it writes the accumulated data, "
            "intake.out_dir) or point validate.dataset_dir at the right folder"
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
    known = set(schema.table_columns)
    return RawTable(
        name=name,
        path=path,
        raw=raw.reset_index(drop=True),
        extra_columns=[c for c in raw.columns if c not in known and c != ROW_ID],
        missing_optional=sorted(c for c in schema.checks.optional if c not in raw.columns),
        notes=notes,
    )


@dataclass(frozen=True)
class LabelRule:
    """How the label column's cells become classes, decided once on the training table (meta.json)."""

    problem_type: str
    classes: list[int | str]  # [] for regression
    positive: list[str] | None = None  # binary from a many-valued label: these canonical values -> class 1
    negative: list[str] | None = None  # ... these -> class 0 (None: every other value); others stay, refused
    merged: list[str] = field(default_factory=list)  # multiclass: too-rare classes merged into other_class
    other_class: str | None = None
    dropped: list[str] = field(default_factory=list)  # multiclass, rare_classes: drop

    def to_dict(self) -> dict[str, object]:
        return {"problem_type": self.problem_type, "classes": self.classes, "positive": self.positive,
                "negative": self.negative, "merged": self.merged, "other_class": self.other_class,
                "dropped": self.dropped}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> LabelRule:
        return cls(**data)  # type: ignore[arg-type]

    def map(self, cells: pd.Series) -> pd.Series:
        """Canonical label texts -> class texts ("" for an empty cell or a dropped class)."""
        text = cells.map(canonical)
        if self.positive is not None:
            positive = text.isin(self.positive)
            negative = text.isin(self.negative) if self.negative is not None else ~positive & (text != "")
            # a value in neither list keeps its own text: the suite's label check names its row
            return text.mask(positive, "1").mask(negative, "0")
        if self.merged:  # a class no training row holds (a split's lone row) is rarer still: merged as well
            known = {canonical(c) for c in self.classes} | {""}
            text = text.where(text.isin(known), self.other_class or "")
        if self.dropped:
            text = text.where(~text.isin(self.dropped), "")
        return text


def _refuse_words_as_numbers(cells: pd.Series, where: str) -> None:
    """A regression label whose filled cells are mostly words is another problem type, not missing values:
    say which type fits (a few bad cells are left to the suite, which names their rows)."""
    filled = cells[cells.str.strip() != ""]
    words = filled[checks.not_a_number(filled)]
    if len(filled) == 0 or len(words) * 2 <= len(filled):
        return
    distinct = filled.map(canonical).nunique()
    fits = "binary" if distinct == 2 else "multiclass (or ordinal, listing the order in dataset.label.classes)"
    examples = ", ".join(repr(v) for v in words.unique()[:3])
    raise StageError(f"{where}: declared a regression label, but {len(words)} of {len(filled)} filled cell(s) are "
                     f"not numbers ({examples}); the column holds {distinct} distinct values. Fix: set "
                     f"dataset.label.problem_type to {fits}, or pick a numeric column as the label")


def label_rule(train: RawTable, schema: DatasetSchema) -> LabelRule:
    """Decide, from the training table's labels, the classes and how cells map onto them; refuse a label
    that cannot be learned (one class, too many values for binary, an ordinal without an order)."""
    label = schema.label
    where = f"{train.path}, column '{label.column}'"
    if label.column not in train.raw.columns:
        raise StageError(f"{where}: missing; the label column dataset.label.column must be in the table. Fix the "
                         "column name in params.yaml or the file's header")
    if label.problem_type == "regression":
        _refuse_words_as_numbers(train.raw[label.column], where)
        return LabelRule("regression", [])
    text = train.raw[label.column].map(canonical)
    values = [v for v in text.unique() if v != ""]
    given = [canonical(c) for c in label.classes] if label.classes is not None else None
    if label.problem_type == "binary":
        if len(values) > 2 and (given is None or not set(values) <= set(given)):
            if label.positive is None:
                raise StageError(
                    f"{where}: a binary label, but the training rows hold {len(values)} values "
                    f"({', '.join(sorted(values)[:8])}). Fix: set dataset.label.positive to the values that mean the "
                    "positive class, or dataset.label.problem_type: multiclass / ordinal")
            positive = sorted({canonical(v) for v in label.positive})
            negative = sorted({canonical(v) for v in label.negative}) if label.negative is not None else None
            mapped = set(LabelRule("binary", [0, 1], positive=positive, negative=negative).map(text[text != ""]))
            # a value in neither list is left for the suite's label check, which names its rows
            if mapped <= {"0", "1"} and mapped != {"0", "1"}:
                raise StageError(
                    f"{where}: dataset.label.positive {label.positive} makes every training row the same class; "
                    "a model needs two classes. Fix: choose the values that mean the positive class")
            return LabelRule("binary", [0, 1], positive=positive, negative=negative)
        classes = given if given is not None else [canonical(c) for c in sort_classes(values)]
        if len(set(values)) < 2:
            raise StageError(f"{where}: every training row holds the same label {values[0] if values else '(empty)'}"
                             "; a model needs at least two classes. Fix: add rows of the other class")
        return LabelRule("binary", [class_value(c) for c in classes])
    if given is None and label.problem_type == "ordinal":
        try:
            [float(v) for v in values]
        except ValueError:
            raise StageError(
                f"{where}: an ordinal label must be numeric or have its order given: the values "
                f"{sorted(values)[:8]} are not numbers. Fix: list them low to high in dataset.label.classes") from None
    if len(values) < 2:
        raise StageError(f"{where}: every training row holds the same label {values[0] if values else '(empty)'}; "
                         "a model needs at least two classes. Fix: add rows of other classes")
    if label.problem_type == "ordinal":
        classes = given if given is not None else [canonical(c) for c in sort_classes(values)]
        return LabelRule("ordinal", [class_value(c) for c in classes])
    counts = text[text != ""].value_counts()
    rare = sorted(c for c, n in counts.items() if n < label.min_class_rows and (given is None or c not in given))
    if rare and label.rare_classes == "refuse":
        raise StageError(
            f"{where}: class(es) {rare} have fewer than dataset.label.min_class_rows ({label.min_class_rows}) "
            "training rows: too rare to learn and to split. Fix: add rows, lower min_class_rows, or set "
            "dataset.label.rare_classes: merge (into other_class) or drop")
    kept = [c for c in counts.index if c not in rare]
    merged, dropped, other = ([], rare, None) if label.rare_classes == "drop" else (rare, [], label.other_class)
    if merged and len(merged) == len(counts):
        raise StageError(f"{where}: every class has fewer than {label.min_class_rows} training rows; lower "
                         "dataset.label.min_class_rows")
    if merged:
        if int(counts[merged].sum()) < 2:
            raise StageError(
                f"{where}: the rare class(es) {merged} hold {int(counts[merged].sum())} training row, too few even "
                f"merged into {other!r}. Fix: drop those rows, or set dataset.label.rare_classes: drop")
        if other in kept:
            raise StageError(f"{where}: dataset.label.other_class {other!r} is already a class; choose another name")
        kept.append(other)
    classes = given if given is not None else [canonical(c) for c in sort_classes(kept)]
    return LabelRule("multiclass", [class_value(c) for c in classes], merged=merged, other_class=other if merged else None,
                     dropped=dropped)


def fallback_classes(train: RawTable, schema: DatasetSchema) -> list[int | str]:
    """The training rows' label values as classes: what the other checks run against when the label
    itself was refused."""
    column = schema.label.column
    if schema.label.problem_type == "regression" or column not in train.raw.columns:
        return []
    return sort_classes(train.raw[column].map(canonical))


def validation_frame(table: RawTable, schema: DatasetSchema, rule: LabelRule, dataset_root: Path, workers: int,
                     image_checks: bool = True) -> pd.DataFrame:
    """What GX sees: row_id, each declared column typed by its role (numbers parsed, NaN when empty or not a
    number; codes and labels as canonical text, None when empty), and the derived verdict columns (but
    SEEN_CODE: `mark_seen`). Extra columns are left out (reported instead). `image_checks=False` leaves
    out the file checks (the benchmark times them)."""
    raw = table.raw
    frame = pd.DataFrame({ROW_ID: raw[ROW_ID].astype("int64")})
    roles = schema.role_of
    label = schema.label.column

    def text_or_none(col: str) -> pd.Series:
        return raw[col].astype("str").where(raw[col].str.strip() != "", None)

    for col in (c for c in schema.table_columns if c in raw.columns):
        role = roles.get(col)
        if col == label:
            if rule.problem_type == "regression":
                frame[col] = checks.to_numbers(raw[col])
                frame[IS_NUMBER + col] = frame[col].notna()  # an empty label is not a number either
            else:
                mapped = rule.map(raw[col])
                frame[col] = mapped.where(mapped != "", None)
        elif role == "numerical":
            frame[col] = checks.to_numbers(raw[col])
            if col not in schema.checks.required:  # a required one: text reads as missing, named by not-null
                frame[IS_NUMBER + col] = ~checks.not_a_number(raw[col])
        elif role == "categorical":
            frame[col] = raw[col].map(canonical).where(raw[col].str.strip() != "", None)
            if col in schema.checks.codes:
                frame[VALID_CODE + col] = checks.code_allowed(schema, col, raw[col])
        elif role == "text":
            frame[col] = raw[col].astype("str")
        else:  # image cells, the id and frequency keys: an empty cell is a missing value
            frame[col] = text_or_none(col)
    for name in schema.checks.rules:
        rule_ = RULES[name]
        if all(c in raw.columns for c in rule_.columns):
            frame[rule_.name] = rule_.evaluate(raw)
    if image_checks and any(c in raw.columns for c in schema.columns.image):
        derived = checks.check_images(checks.image_cells(raw, schema.columns.image), dataset_root, workers=workers)
        for col in derived.columns:
            frame[col] = derived[col]
    return frame


def typed_table(frame: pd.DataFrame, schema: DatasetSchema, rule: LabelRule) -> pd.DataFrame:
    """The stage's output table from a frame that passed validation: row_id, the id, every input by role
    (categorical as canonical text, "" when empty; numerical float64, NaN when empty; text and image cells as
    text), the frequency keys, and the label (a class value: int64 when the classes are whole numbers;
    float64 for regression). Rows whose label a `drop` rule removed are left out."""
    out = pd.DataFrame({ROW_ID: frame[ROW_ID].astype("int64")})
    roles = schema.role_of
    label = schema.label.column
    for col in schema.table_columns:
        if col not in frame.columns:
            continue  # only optional columns can be absent after a successful validation
        if col == label:
            if rule.problem_type == "regression":
                out[col] = frame[col].astype("float64")
            else:
                out[col] = frame[col]
        elif roles.get(col) == "numerical":
            out[col] = frame[col].astype("float64")
        else:
            out[col] = frame[col].fillna("").astype("str")
    if label in out.columns and rule.problem_type != "regression":
        out = out[out[label].notna() & (out[label] != "")]
        values = out[label].map(class_value)
        out[label] = values.astype("int64") if all(isinstance(c, int) for c in rule.classes) else values.astype("str")
    return out.reset_index(drop=True)


def training_codes(frame: pd.DataFrame, schema: DatasetSchema) -> dict[str, set[str]]:
    """Categorical column -> the values the training rows hold (checked on test and batch tables)."""
    return {c: set(frame[c].dropna()) for c in schema.columns.categorical if c in frame.columns}


def mark_seen(frame: pd.DataFrame, seen: dict[str, set[str]]) -> None:
    """Add the SEEN_CODE verdict of each categorical column: is the value one the training rows hold
    (<NA> for an empty cell)."""
    for col, codes in seen.items():
        if col in frame.columns:
            frame[SEEN_CODE + col] = frame[col].isin(codes).astype("boolean").where(frame[col].notna(), pd.NA)


def auto_val_fraction(labelled_rows: int, problem_type: str) -> float:
    """The share of the labelled rows held out to validate on. Where those rows only choose (the epoch, the
    members' mix, the linear member's penalties: a binary or regression label), AutoGluon's rule (its default
    holdout_frac): a fifth of a small table, but at least 500 rows up to 5,000, then a tenth, shrinking to keep
    ~2,500 rows above 25,000; the deep members learn from the rows it frees. Where a decision rule is also
    fitted on them (ordinal cut points, multiclass class biases), a fifth: with fewer rows those rules moved
    more than the deep members gained (BENCHMARKS.md measures both)."""
    if problem_type in ("ordinal", "multiclass"):
        return 0.2
    if labelled_rows < 5000:
        return max(0.1, min(0.2, 500.0 / max(labelled_rows, 1)))
    return max(0.01, min(0.1, 2500.0 / labelled_rows))


def stratified_split(table: pd.DataFrame, label: str, fraction: float, seed: int,
                     stratify: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Deterministic train/val split: `fraction` of each class (at least one row of every class with two
    or more rows, never all of them) goes to val, or of all rows when `stratify` is off (regression);
    both keep the table's row order."""
    rng = np.random.default_rng(seed)
    labels = table[label].to_numpy() if stratify else np.zeros(len(table))
    in_val = np.zeros(len(table), dtype=bool)
    for cls in np.unique(labels):
        positions = np.flatnonzero(labels == cls)
        n_val = int(round(len(positions) * fraction))
        n_val = min(max(n_val, 1), len(positions) - 1) if len(positions) >= 2 else 0
        in_val[rng.permutation(positions)[:n_val]] = True
    return table[~in_val].reset_index(drop=True), table[in_val].reset_index(drop=True)
