"""The expectation suite (GX 1.x) of a dataset schema, defined in code; the PetFinder preset's is saved as
reviewable JSON.

`build_suite(schema)` derives every expectation from the declared columns (fusion_model/dataset.py):
required columns present, the id filled and unique, numbers that parse, codes of `checks.codes`, values in
`checks.bounds`, texts of at most `checks.max_chars`, the label's set and the classes the training rows
must hold, categorical values the training rows hold (on the test table, with a tolerance), image files
safe, present and decodable, and the preset's named row rules. Run ``python -m tasks.checks.write_suite``
after changing this file or the PetFinder preset to regenerate ``tasks/checks/suites/petfinder.json``;
a test fails while the two disagree. The label set and the classes a table must contain are suite
parameters (``$PARAMETER``) filled in at run time from the training table.

Each expectation's ``meta`` carries what it checks and how to fix a failure, in words; the report and
the error message quote them. A row may name no photo at all: the model masks its image input; every photo
a row does name must be safe, present and decodable. Per-row verdicts GX cannot compute itself (files,
numbers among text, a preset's rules) are derived columns (`tasks/checks/tables.py`, `fusion_model.checks`)
expected to be true.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fusion_model import checks
from fusion_model.dataset import ROW_ID, CodeRange, DatasetSchema
from fusion_model.presets import RULES
from tasks.checks.tables import IS_NUMBER, SEEN_CODE, VALID_CODE

__all__ = ["ROW_ID", "build_suite", "expectation_specs", "suite_json", "suite_name", "suite_parameters"]

SUITES_DIR = Path(__file__).parent / "suites"

# Suite parameters, supplied per run (see `suite_parameters`).
LABEL_SET_PARAM = "label_set"
REQUIRED_CLASSES_PARAM = "required_classes"
# Test table: the share of a categorical column's values the training rows must hold (params.yaml
# validate.seen_codes_mostly); below it the file does not match the training data.
SEEN_CODES_MOSTLY = 0.5

_REGENERATE = "re-export the table or correct the cells"


def suite_name(schema: DatasetSchema) -> str:
    return schema.preset or "dataset"


def suite_path(schema: DatasetSchema) -> Path:
    return SUITES_DIR / f"{suite_name(schema)}.json"


def derived_columns(schema: DatasetSchema) -> dict[str, list[str]]:
    """Derived verdict column -> the file columns it is computed from (what the report shows)."""
    out: dict[str, list[str]] = {c: list(schema.columns.image) for c in checks.IMAGE_CHECK_COLUMNS}
    for name in schema.checks.rules:
        out[RULES[name].name] = list(RULES[name].columns)
    for col in schema.columns.numerical + ([schema.label.column] if schema.label.problem_type == "regression" else []):
        out[IS_NUMBER + col] = [col]
    for col in schema.columns.categorical:
        out[SEEN_CODE + col] = [col]
        if col in schema.checks.codes:
            out[VALID_CODE + col] = [col]
    return out


def seen_checked(schema: DatasetSchema) -> list[str]:
    """Categorical columns whose test values are checked against the training rows': those without declared
    codes (declared codes are checked as such; a valid rare code absent from training is no mismatch)."""
    return [c for c in schema.columns.categorical if c not in schema.checks.codes]


def expectation_specs(schema: DatasetSchema, seen_codes_mostly: float = SEEN_CODES_MOSTLY
                      ) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(GX expectation class name, kwargs, meta) in suite order: the single definition of the suite."""
    from fusion_model.checks import code_meaning

    specs: list[tuple[str, dict[str, Any], dict[str, str]]] = []

    def add(kind: str, check: str, fix: str, **kwargs: Any) -> None:
        specs.append((kind, kwargs, {"check": check, "fix": fix}))

    label = schema.label
    required = set(schema.checks.required)
    add("ExpectTableRowCountToBeBetween", "at least one data row", f"the table has no rows: {_REGENERATE}",
        min_value=1)
    add("ExpectColumnValuesToBeUnique", "the file's leading index column is unique",
        "re-export the CSV with a fresh 0..n-1 index column", column=ROW_ID)
    for col in schema.table_columns:
        if col not in schema.checks.optional:
            add("ExpectColumnToExist", "required column present",
                f"add the column '{col}' (declared in params.yaml dataset:) or correct the dataset declaration",
                column=col)
    if schema.id:
        add("ExpectColumnValuesToNotBeNull", "a row key in every row", f"fill every '{schema.id}' cell", column=schema.id)
        add("ExpectColumnValuesToBeUnique", f"{schema.id} unique (the row key)",
            f"remove duplicate rows or give each a distinct '{schema.id}' (dataset.id)", column=schema.id)
        if schema.checks.id_pattern:
            add("ExpectColumnValuesToMatchRegex", f"{schema.id} of the form {schema.checks.id_pattern}",
                f"restore the damaged ids (a spreadsheet turns some into numbers such as 7.76E+08): re-export "
                f"'{schema.id}' formatted as text", column=schema.id, regex=f"^(?:{schema.checks.id_pattern})$")
    for col in schema.columns.categorical:
        if col in required:
            add("ExpectColumnValuesToNotBeNull", "a value in every row", f"fill every '{col}' cell", column=col)
        if col in schema.checks.codes:
            meaning = code_meaning(schema, col)
            fix = f"replace the value with a code in {meaning}, or drop the row"
            kind = "range" if isinstance(schema.checks.codes[col], CodeRange) else "set"
            add("ExpectColumnValuesToBeInSet", f"valid code ({meaning})", fix + f" (a {kind} of dataset.checks.codes)",
                column=VALID_CODE + col, value_set=[True])
        elif col in seen_checked(schema):
            add("ExpectColumnValuesToBeInSet",
                f"values the training rows hold (at least {seen_codes_mostly:.0%} of rows)",
                "check that the column holds the same kind of codes as the training table (not shifted, not "
                "another coding); a few new values are normal", column=SEEN_CODE + col, value_set=[True],
                mostly=seen_codes_mostly)
    for col in schema.columns.numerical:
        if col in required:  # text in the cell reads as missing: this names the row and its cell
            add("ExpectColumnValuesToNotBeNull", "a number in every row", f"fill every '{col}' cell with a number",
                column=col)
        else:
            add("ExpectColumnValuesToBeInSet", "a number (or an empty cell)",
                f"write a number in '{col}' (no units or words), or declare the column as text or categorical",
                column=IS_NUMBER + col, value_set=[True])
        if col in schema.checks.bounds:
            low, high = schema.checks.bounds[col]
            add("ExpectColumnValuesToBeBetween", f"plausible value {low:g}..{high:g}",
                f"correct '{col}' (outside the bounds of dataset.checks.bounds)", column=col, min_value=low,
                max_value=high)
    if label.problem_type == "regression":  # one check: a word is not a missing label, and says so
        add("ExpectColumnValuesToBeInSet", "the label is a number", f"write a number in every '{label.column}' cell",
            column=IS_NUMBER + label.column, value_set=[True])
    else:
        add("ExpectColumnValuesToNotBeNull", "a label in every row", f"fill every '{label.column}' cell",
            column=label.column)
        add("ExpectColumnValuesToBeInSet", "label among the classes of the training rows",
            "use labels of the training table's classes, or list them in dataset.label.classes",
            column=label.column, value_set={"$PARAMETER": LABEL_SET_PARAM})
        add("ExpectColumnDistinctValuesToContainSet", "every class present",
            "add rows of the missing class(es): a model cannot learn a class it never sees",
            column=label.column, value_set={"$PARAMETER": REQUIRED_CLASSES_PARAM})
    for col in schema.columns.text:
        limit = schema.checks.max_chars.get(col)
        if limit is not None:
            add("ExpectColumnValueLengthsToBeBetween", f"text of at most {limit} characters (may be empty)",
                f"shorten '{col}' or check the CSV quoting (a stray quote swallows following rows)",
                column=col, min_value=0, max_value=limit)
    if schema.columns.image:
        add("ExpectColumnValuesToBeInSet", "image paths relative and inside the dataset folder",
            "use relative paths under the images root (no leading '/', no '..', no symlink leaving it)",
            column=checks.PATHS_SAFE, value_set=[True])
        add("ExpectColumnValuesToBeInSet", "image files exist",
            "add the missing file under the images root or fix the path in the image column",
            column=checks.IMAGES_EXIST, value_set=[True])
        add("ExpectColumnValuesToBeInSet", "image files decode",
            "replace the damaged file or remove it from the image column",
            column=checks.IMAGES_DECODE, value_set=[True])
    for name in schema.checks.rules:
        rule = RULES[name]
        add("ExpectColumnValuesToBeInSet", rule.check, rule.fix, column=rule.name, value_set=[True],
            mostly=rule.mostly)
    return specs


def expectation_key(kind: str, kwargs: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(snake_case type, columns): unique within the suite, so results can be put back in suite order."""
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()
    return snake, tuple(kwargs[k] for k in ("column", "column_A", "column_B") if k in kwargs)


def suite_order(schema: DatasetSchema) -> dict[tuple[str, tuple[str, ...]], int]:
    keys = [expectation_key(kind, kwargs) for kind, kwargs, _meta in expectation_specs(schema)]
    assert len(set(keys)) == len(keys), "two expectations of one kind on one column: merge them"
    return {k: i for i, k in enumerate(keys)}


def build_suite(schema: DatasetSchema, seen_codes_mostly: float = SEEN_CODES_MOSTLY) -> Any:
    """The suite as a GX `ExpectationSuite` (imports GX, ~4 s the first time)."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    expectations = [getattr(gxe, kind)(**kwargs, meta=meta)
                    for kind, kwargs, meta in expectation_specs(schema, seen_codes_mostly)]
    return gx.ExpectationSuite(name=suite_name(schema), expectations=expectations)


def suite_parameters(classes: list[int | str], require_all_classes: bool) -> dict[str, list[int | str]]:
    """Run-time values of the suite parameters: the label set (the label column holds canonical text), and
    the classes the table must contain (all of them for train; none for test, where a small split may lack
    a rare class)."""
    texts = [str(c) for c in classes]
    return {LABEL_SET_PARAM: texts, REQUIRED_CLASSES_PARAM: texts if require_all_classes else []}


def suite_dict(schema: DatasetSchema) -> dict[str, Any]:
    """The suite as GX serialises it, without the random ids GX adds (so the file is reproducible)."""
    raw = build_suite(schema).to_json_dict()
    expectations = [{k: v for k, v in e.items() if k not in ("id", "rendered_content")} for e in raw["expectations"]]
    for e in expectations:
        e["kwargs"].pop("batch_id", None)
    return {"name": raw["name"], "meta": {k: v for k, v in raw.get("meta", {}).items() if k != "great_expectations_version"},
            "expectations": expectations}


def _compact_json(obj: Any, indent: int = 0) -> str:
    """JSON with one expectation per block but value lists on one line (308 breed ids stay readable)."""
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {_compact_json(v, indent + 2)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(obj, list) and obj and any(isinstance(v, dict) for v in obj):
        return "[\n" + ",\n".join(f"{inner}{_compact_json(v, indent + 2)}" for v in obj) + f"\n{pad}]"
    return json.dumps(obj, separators=(", ", ": "))


def suite_json(schema: DatasetSchema) -> str:
    return _compact_json(suite_dict(schema)) + "\n"
