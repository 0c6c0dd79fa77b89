"""The PetFinder expectation suite (GX 1.x), defined in code and saved as reviewable JSON.

Run ``python -m tasks.validate.write_suite`` after changing this file or `fusion_model/schema.py` to
regenerate ``tasks/validate/suites/petfinder.json``; a test fails while the two disagree. The suite is static:
the label set and the classes every table must contain are suite parameters (``$PARAMETER``) filled in
at run time from params.yaml, so one reviewed file serves binary and 0-4 labels.

Each expectation's ``meta`` carries what it checks and how to fix a failure, in words; the report and
the error message quote them. A row may list no photo at all (real rows with PhotoAmt 0): the model masks
its image input; every photo a row does name must be safe, present and decodable. Image rules run on columns derived by `fusion_model.checks` (GX cannot
look at files): ``image_paths_safe``, ``images_exist``, ``images_decode``, each expected to be true;
so does the Breed1/Type rule (``breed1_matches_type``), because a value-pair set of the whole breed
table made every GX run about twice as slow.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fusion_model import checks
from fusion_model.schema import (
    CATEGORICAL_COLUMNS,
    IMAGES,
    LABEL,
    NUMERIC_BOUNDS,
    NUMERIC_COLUMNS,
    REQUIRED_COLUMNS,
)

SUITE_NAME = "petfinder"
SUITE_PATH = Path(__file__).parent / "suites" / "petfinder.json"
ROW_ID = "row_id"

# Suite parameters, supplied per run (see `suite_parameters`).
LABEL_SET_PARAM = "label_set"
REQUIRED_CLASSES_PARAM = "required_classes"

# Real rows: ~1 in 800 has a Breed1 of the other animal type; swapped or shifted columns give far more.
BREED_TYPE_MOSTLY = 0.98
# Longest plausible text; real Descriptions reach ~6,700 characters, Names ~60.
TEXT_MAX_CHARS: dict[str, int] = {"Name": 255, "Description": 20_000}

# Derived image columns -> the column they are computed from (not evaluated when that one is missing).
DERIVED_FROM: dict[str, str] = {c: IMAGES for c in checks.IMAGE_CHECK_COLUMNS} | {checks.BREED_MATCHES_TYPE: "Breed1"}

_REGENERATE = "regenerate the dataset (python -m tasks download) or correct the CSV"


def expectation_specs() -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(GX expectation class name, kwargs, meta) in suite order: the single definition of the suite."""
    specs: list[tuple[str, dict[str, Any], dict[str, str]]] = []

    def add(kind: str, check: str, fix: str, **kwargs: Any) -> None:
        specs.append((kind, kwargs, {"check": check, "fix": fix}))

    add("ExpectTableRowCountToBeBetween", "at least one data row", f"the CSV has no rows: {_REGENERATE}",
        min_value=1)
    add("ExpectColumnValuesToBeUnique", "the CSV's leading index column is unique",
        "re-export the CSV with a fresh 0..n-1 index column", column=ROW_ID)
    for col in REQUIRED_COLUMNS:
        add("ExpectColumnToExist", "required column present",
            f"add the column '{col}' (PetFinder schema, fusion_model/schema.py) or {_REGENERATE}", column=col)
    for col in CATEGORICAL_COLUMNS:
        meaning = checks.code_meaning(col)
        add("ExpectColumnValuesToNotBeNull", "a whole number in every row",
            f"fill every '{col}' cell with a code ({meaning})", column=col)
        codes = checks.allowed_codes(col)
        fix = f"replace the value with a code in {meaning}, or drop the row"
        if codes == list(range(codes[0], codes[-1] + 1)):
            # A range, not a 308-value set: GX copies every kwarg of every expectation many times per
            # run, and the breed sets alone doubled the run time. Codes are whole numbers already
            # (a fraction reads as missing), so the range is exact.
            add("ExpectColumnValuesToBeBetween", f"valid code ({meaning})", fix, column=col,
                min_value=codes[0], max_value=codes[-1])
        else:
            add("ExpectColumnValuesToBeInSet", f"valid code ({meaning})", fix, column=col, value_set=codes)
    for col in NUMERIC_COLUMNS:
        low, high = NUMERIC_BOUNDS[col]
        add("ExpectColumnValuesToNotBeNull", "a number in every row", f"fill every '{col}' cell with a number",
            column=col)
        add("ExpectColumnValuesToBeBetween", f"plausible value {low:g}..{high:g}",
            f"correct '{col}' (negative or implausibly large; bounds in fusion_model/schema.py NUMERIC_BOUNDS)",
            column=col, min_value=low, max_value=high)
    add("ExpectColumnValuesToNotBeNull", "a label in every row", f"fill every '{LABEL}' cell", column=LABEL)
    add("ExpectColumnValuesToBeInSet", "label in the label set of params.yaml validate.label_kind",
        "use labels of the configured set, or set validate.label_kind (binary 0/1, multiclass 0-4)",
        column=LABEL, value_set={"$PARAMETER": LABEL_SET_PARAM})
    add("ExpectColumnDistinctValuesToContainSet", "every class present",
        "add rows of the missing class(es): a model cannot learn a class it never sees",
        column=LABEL, value_set={"$PARAMETER": REQUIRED_CLASSES_PARAM})
    for col, limit in TEXT_MAX_CHARS.items():
        add("ExpectColumnValueLengthsToBeBetween", f"text of at most {limit} characters (may be empty)",
            f"shorten '{col}' or check the CSV quoting (a stray quote swallows following rows)",
            column=col, min_value=0, max_value=limit)
    add("ExpectColumnValuesToBeInSet", "image paths relative and inside the dataset folder",
        "use relative paths under the dataset folder (no leading '/', no '..', no symlink leaving it)",
        column=checks.PATHS_SAFE, value_set=[True])
    add("ExpectColumnValuesToBeInSet", "image files exist",
        "add the missing file under the dataset folder or fix the path in 'Images'",
        column=checks.IMAGES_EXIST, value_set=[True])
    add("ExpectColumnValuesToBeInSet", "image files decode",
        "replace the damaged file (re-download the dataset) or remove it from 'Images'",
        column=checks.IMAGES_DECODE, value_set=[True])
    add("ExpectColumnValuesToBeUnique", "PetID unique (when the column is present)",
        "remove duplicate pets or give each a distinct PetID", column="PetID")
    add("ExpectColumnValuesToBeInSet",
        f"Breed1 belongs to the animal Type (breed_labels.csv) in at least {BREED_TYPE_MOSTLY:.0%} of rows",
        "check that Type and Breed1 are not swapped or shifted; a few mismatches are normal",
        column=checks.BREED_MATCHES_TYPE, value_set=[True], mostly=BREED_TYPE_MOSTLY)
    return specs


def expectation_key(kind: str, kwargs: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    """(snake_case type, columns): unique within the suite, so results can be put back in suite order."""
    snake = re.sub(r"(?<!^)(?=[A-Z])", "_", kind).lower()
    return snake, tuple(kwargs[k] for k in ("column", "column_A", "column_B") if k in kwargs)


def suite_order() -> dict[tuple[str, tuple[str, ...]], int]:
    keys = [expectation_key(kind, kwargs) for kind, kwargs, _meta in expectation_specs()]
    assert len(set(keys)) == len(keys), "two expectations of one kind on one column: merge them"
    return {k: i for i, k in enumerate(keys)}


def build_suite() -> Any:
    """The suite as a GX `ExpectationSuite` (imports GX, ~4 s the first time)."""
    import great_expectations as gx
    import great_expectations.expectations as gxe

    expectations = [getattr(gxe, kind)(**kwargs, meta=meta) for kind, kwargs, meta in expectation_specs()]
    return gx.ExpectationSuite(name=SUITE_NAME, expectations=expectations)


def suite_parameters(classes: list[int], require_all_classes: bool) -> dict[str, list[int]]:
    """Run-time values of the suite parameters: the label set, and the classes the table must contain
    (all of them for train; none for test, where a small split may lack a rare class)."""
    return {LABEL_SET_PARAM: list(classes), REQUIRED_CLASSES_PARAM: list(classes) if require_all_classes else []}


def suite_dict() -> dict[str, Any]:
    """The suite as GX serialises it, without the random ids GX adds (so the file is reproducible)."""
    raw = build_suite().to_json_dict()
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


def suite_json() -> str:
    return _compact_json(suite_dict()) + "\n"
