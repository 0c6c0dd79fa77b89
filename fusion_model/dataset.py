"""The dataset schema: which column of a table plays which role, what the label is and how to learn it.

A table of photos, descriptions and attributes is declared the way AutoGluon's ``column_types`` or
Ludwig's ``input_features`` declare one: columns by role (``image``, ``text``, ``categorical``,
``numerical``), a unique row key (``id``) and a label with its problem type. Every stage reads the
resolved ``DatasetSchema``: the validation suite, the drift gate, preprocessing, the model's inputs and
head, the classical baseline, the metrics and the predictor. A preset (``fusion_model/presets/``) fills
every key of a known table; keys given beside it override the preset's.

Plausibility rules beyond the roles (``checks``) are optional: the columns every row must fill, the codes a
categorical column may hold, bounds of a numerical column, the longest text, and named row rules that a
preset implements in code.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

if TYPE_CHECKING:
    import pandas as pd

ProblemType = Literal["binary", "multiclass", "ordinal", "regression"]
PROBLEM_TYPES: tuple[str, ...] = ("binary", "multiclass", "ordinal", "regression")
ROLES: tuple[str, ...] = ("image", "text", "categorical", "numerical")
# The model's inputs; evaluation masks each in turn (the ablation).
MODALITIES: tuple[str, ...] = ("image", "tabular", "text")
IMAGE_SEPARATOR = ";"
# the column of every validated table that keeps the input file's own row number (its index column)
ROW_ID = "row_id"

Value = int | str


class SchemaError(ValueError):
    """The dataset declaration (params.yaml `dataset:`) is inconsistent; the message names the key and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LabelSpec(_Strict):
    """The column to predict and how."""

    column: str = Field(description="the label column")
    problem_type: ProblemType = Field("binary", description="binary | multiclass | ordinal | regression")
    classes: list[Value] | None = Field(
        None, description="the classes in order (ordinal: low to high; binary: the positive class last); "
                          "null: the values of the training rows, sorted")
    positive: list[Value] | None = Field(
        None, description="binary from a label with more than two values: these values become the positive "
                          "class 1")
    negative: list[Value] | None = Field(
        None, description="with positive: the values that become class 0 (a value in neither list is refused); "
                          "null: every value not positive")
    transform: Literal["none", "log1p"] = Field(
        "none", description="regression: learn log1p(label) (a skewed amount), predict in the label's unit")
    min_class_rows: int = Field(
        10, ge=2, description="multiclass / ordinal: a class with fewer labelled rows is too rare to split")
    rare_classes: Literal["merge", "refuse", "drop"] = Field(
        "merge", description="multiclass: a too-rare class is merged into `other_class`, refused, or its rows "
                             "dropped (counted in the validation report)")
    other_class: str = Field("other", description="the class the too-rare classes of a multiclass label become")

    @property
    def is_classification(self) -> bool:
        return self.problem_type != "regression"


class ColumnRoles(_Strict):
    """Column names by role (any names, spaces included)."""

    image: list[str] = Field(default_factory=list, description="';'-separated paths relative to the images root")
    text: list[str] = Field(default_factory=list, description="free text, joined in this order")
    categorical: list[str] = Field(default_factory=list, description="codes or strings, one embedding each")
    numerical: list[str] = Field(default_factory=list, description="numbers; an empty cell is missing")

    def items(self) -> Iterable[tuple[str, list[str]]]:
        return ((role, getattr(self, role)) for role in ROLES)


class CodeRange(_Strict):
    min: float
    max: float
    meaning: str = ""


class Checks(_Strict):
    """Plausibility rules of the validation suite beyond the roles (all optional)."""

    required: list[str] = Field(default_factory=list, description="columns every row must fill (label and id always)")
    optional: list[str] = Field(default_factory=list, description="columns a file may lack")
    codes: dict[str, list[Value] | CodeRange] = Field(
        default_factory=dict, description="categorical column -> the values it may hold (a list, or a min/max range)")
    bounds: dict[str, tuple[float, float]] = Field(
        default_factory=dict, description="numerical column -> [low, high] plausible values")
    max_chars: dict[str, int] = Field(default_factory=dict, description="text column -> longest plausible text")
    id_pattern: str | None = Field(None, description="a regular expression every id matches (whole cell)")
    rules: list[str] = Field(default_factory=list, description="row rules the preset implements (by name)")


class DatasetSchema(_Strict):
    """A resolved dataset declaration: every key set (a preset's values merged with the given ones)."""

    preset: str | None = None
    id: str | None = Field(None, description="unique row key; null: the file's index column, else the row number")
    label: LabelSpec
    columns: ColumnRoles
    frequency: list[str] = Field(
        default_factory=list, description="columns whose value's count among the training rows is a numeric input "
                                          "(e.g. listings per rescuer); the column itself need not be an input")
    checks: Checks = Checks()

    @model_validator(mode="after")
    def _consistent(self) -> DatasetSchema:
        problems = schema_problems(self)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    # ---- column lists --------------------------------------------------------------------------------
    @property
    def inputs(self) -> list[str]:
        """Every input column, by role order."""
        return [c for _role, cols in self.columns.items() for c in cols]

    @property
    def role_of(self) -> dict[str, str]:
        return {c: role for role, cols in self.columns.items() for c in cols}

    @property
    def feature_columns(self) -> list[str]:
        """What a prediction request carries: the id (when declared), every input and every frequency key."""
        out = [self.id] if self.id else []
        out += self.inputs
        out += [c for c in self.frequency if c not in out]
        return out

    @property
    def table_columns(self) -> list[str]:
        """Every column a validated table keeps, in this order: id, inputs, frequency keys, label."""
        return [*self.feature_columns, self.label.column]

    @property
    def required_features(self) -> list[str]:
        """Feature columns a file must have (the rest are `checks.optional`)."""
        return [c for c in self.feature_columns if c not in self.checks.optional]

    @property
    def modalities(self) -> list[str]:
        """The model inputs this table feeds."""
        out = []
        if self.columns.image:
            out.append("image")
        if self.columns.categorical or self.columns.numerical or self.frequency:
            out.append("tabular")
        if self.columns.text:
            out.append("text")
        return out

    def non_null(self) -> list[str]:
        """Columns every row must fill: the id, the label and `checks.required`."""
        out = [self.id] if self.id else []
        out.append(self.label.column)
        out += [c for c in self.checks.required if c not in out]
        return out


def schema_problems(s: DatasetSchema) -> list[str]:
    """Why the declaration cannot be used (each with the key and the fix), or []."""
    problems = []
    seen: dict[str, str] = {}
    for role, cols in s.columns.items():
        for c in cols:
            if c in seen and seen[c] != role:
                problems.append(f"column {c!r} is given two roles ({seen[c]} and {role}); keep it in one of "
                                f"dataset.columns.{seen[c]} / dataset.columns.{role}")
            elif c in seen:
                problems.append(f"column {c!r} is listed twice in dataset.columns.{role}; list it once")
            seen[c] = role
    label = s.label.column
    if label in seen:
        problems.append(f"the label {label!r} is also an input (dataset.columns.{seen[label]}): it would give the "
                        "answer away; remove it from the inputs")
    if s.id is not None and s.id in seen:
        problems.append(f"the id {s.id!r} is also an input (dataset.columns.{seen[s.id]}); a unique key carries "
                        "nothing to learn: remove it from the inputs, or set dataset.id to another column or null")
    if s.id is not None and s.id == label:
        problems.append(f"dataset.id and dataset.label.column are both {label!r}; the label cannot be the row key")
    if s.checks.id_pattern is not None:
        import re

        try:
            re.compile(s.checks.id_pattern)
        except re.error as e:
            problems.append(f"dataset.checks.id_pattern {s.checks.id_pattern!r} is not a regular expression ({e})")
    if label in s.frequency:
        problems.append(f"the label {label!r} is in dataset.frequency; counting the label's values leaks it")
    if not seen and not s.frequency:
        problems.append("dataset.columns names no input column; give at least one of image, text, categorical, "
                        "numerical")
    lab = s.label
    if lab.problem_type == "regression" and (lab.classes or lab.positive or lab.negative):
        problems.append("dataset.label: classes and positive are for classification; a regression label has "
                        "neither (set them to null)")
    if lab.problem_type != "regression" and lab.transform != "none":
        problems.append("dataset.label.transform is for regression labels only; set it to none")
    if lab.problem_type == "binary" and lab.classes is not None and len(lab.classes) != 2:
        problems.append(f"dataset.label.classes {lab.classes} must hold exactly two classes for a binary label "
                        "(the positive one last)")
    if lab.problem_type != "binary" and (lab.positive is not None or lab.negative is not None):
        problems.append("dataset.label.positive / negative turn a label into a binary one; set problem_type: "
                        "binary or set them to null")
    if lab.negative is not None and lab.positive is None:
        problems.append("dataset.label.negative needs dataset.label.positive (the values of class 1)")
    if lab.positive is not None and lab.negative is not None and \
            {canonical(v) for v in lab.positive} & {canonical(v) for v in lab.negative}:
        problems.append("dataset.label.positive and negative share a value; each value belongs to one class")
    if lab.classes is not None and len(set(map(str, lab.classes))) != len(lab.classes):
        problems.append(f"dataset.label.classes {lab.classes} repeats a class; list each once")
    declared = set(s.table_columns)
    for key, cols in (("checks.required", s.checks.required), ("checks.codes", list(s.checks.codes)),
                      ("checks.bounds", list(s.checks.bounds)), ("checks.max_chars", list(s.checks.max_chars))):
        stray = [c for c in cols if c not in declared]
        if stray:
            problems.append(f"dataset.{key} names {stray}, which the schema does not declare; declare them or "
                            "remove them")
    return problems


# ------------------------------------------------------------------------------------ values and labels
def canonical(value: Any) -> str:
    """The text of a categorical or label cell as the pipeline compares it: stripped, and a whole number
    written as an integer ("3", "3.0" and 3 are the same code). Empty or missing -> ""."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    text = str(value).strip()
    if not text:
        return ""
    try:
        number = float(text)
    except ValueError:
        return text
    if math.isfinite(number) and number == int(number) and abs(number) < 2**53:
        return str(int(number))
    return text


def class_value(text: str) -> Value:
    """A class as JSON keeps it: an int when the text is a whole number, else the text."""
    try:
        return int(text)
    except ValueError:
        return text


def sort_classes(texts: Iterable[str]) -> list[Value]:
    """Distinct canonical class texts in order: numerically when all are numbers, else alphabetically."""
    unique = sorted(set(texts) - {""})
    try:
        return [class_value(t) for t in sorted(unique, key=float)]
    except ValueError:
        return [class_value(t) for t in unique]


def split_images(cell: object) -> list[str]:
    """The ';'-separated relative image paths of one cell (empty list for an empty cell)."""
    if not isinstance(cell, str):
        return []
    return [p.strip() for p in cell.split(IMAGE_SEPARATOR) if p.strip()]


def row_images(row: Mapping[str, Any], image_columns: Iterable[str]) -> list[str]:
    """Every photo a row names, image column by image column."""
    return [p for col in image_columns for p in split_images(row.get(col))]


# ----------------------------------------------------------------------------------------- resolution
def _merge(base: dict[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """`given` over `base`, recursively for mappings; lists and scalars are replaced whole."""
    out = dict(base)
    for key, value in given.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _given(tree: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of a declaration that are set: a null means "not given" (the preset's value stays)."""
    return {k: (_given(v) if isinstance(v, Mapping) else v) for k, v in tree.items() if v is not None}


def _prune_preset_checks(merged: dict[str, Any], given_checks: Mapping[str, Any]) -> None:
    """Drop the preset's checks of columns the declaration no longer has (columns given here replace the
    preset's); checks given here are kept, and refused if they name an undeclared column."""
    columns = merged.get("columns", {})
    label = merged.get("label", {})
    declared = {c for cols in columns.values() for c in cols} | set(merged.get("frequency", []))
    declared |= {merged.get("id"), label.get("column")}
    checks = merged.get("checks", {})
    for key in ("required", "optional"):
        if key in checks and key not in given_checks:
            checks[key] = [c for c in checks[key] if c in declared]
    for key in ("codes", "bounds", "max_chars"):
        if key in checks:
            mine = given_checks.get(key, {})
            checks[key] = {c: v for c, v in checks[key].items() if c in declared or c in mine}
    if "rules" in checks and "rules" not in given_checks:  # a preset's row rule reads the columns it names
        from fusion_model.presets import RULES

        checks["rules"] = [r for r in checks["rules"] if set(RULES[r].columns) <= declared]


def resolve_schema(declared: Mapping[str, Any]) -> DatasetSchema:
    """The `dataset:` section as written (a preset and/or explicit keys) -> a complete DatasetSchema.

    A key given as null is not given (the preset's value stays), except `id`, whose null means what the
    key documents (the file's index column, else the row number). Raises SchemaError naming the key and
    the fix."""
    from fusion_model.presets import PRESETS

    preset = declared.get("preset")
    given = _given({k: v for k, v in declared.items() if k != "preset"})
    if "id" in declared:
        given["id"] = declared["id"]
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            raise SchemaError(f"dataset.preset {preset!r} is not one of {sorted(PRESETS)}; use one of them, or null "
                              "and declare every key")
        base = PRESETS[preset]()
        given_type = given.get("label", {}).get("problem_type")
        if given_type is not None and given_type != base["label"]["problem_type"]:
            # the preset's classes and binary rule belong to its own problem type
            base["label"] = {k: v for k, v in base["label"].items() if k not in ("classes", "positive", "negative")}
    elif "label" not in given or "columns" not in given:
        raise SchemaError("dataset: with preset null, declare at least label (column, problem_type) and columns "
                          "(image, text, categorical, numerical); `python -m tasks dataset infer TABLE` drafts them")
    merged = _merge(base, given) | {"preset": preset}
    if base:
        _prune_preset_checks(merged, given.get("checks", {}))
    try:
        return DatasetSchema.model_validate(merged)
    except ValidationError as e:
        problems = "; ".join(
            (f"dataset.{'.'.join(str(p) for p in err['loc'])}: " if err["loc"] else "dataset: ")
            + str(err["msg"]).removeprefix("Value error, ") for err in e.errors())
        raise SchemaError(f"invalid dataset declaration: {problems}") from None


def integer_valued(values: pd.Series) -> bool:
    """Every cell a whole number (an integer column, or text of digits such as "15970")."""
    import pandas as pd

    numbers = pd.to_numeric(values, errors="coerce")
    return bool(len(values)) and bool(numbers.notna().all()) and bool((numbers == numbers.round()).all())


def integer_codes(train: pd.DataFrame, columns: list[str]) -> list[str]:
    """The codes whose filled training cells are whole numbers of more than two values (an item number):
    their order may mean what a tree learner finds in it (AutoGluon reads such a column as a number)."""
    filled = {c: train[c].map(canonical).replace("", None).dropna() for c in columns if c in train.columns}
    return [c for c, v in filled.items() if v.nunique() > 2 and integer_valued(v)]
