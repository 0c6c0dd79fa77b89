"""The `petfinder` preset: the PetFinder.my adoption table (Kaggle columns + the tutorial's `Images`).

The only module that names PetFinder's columns: the embedded generator, the Kaggle photo layout and the
code tables read them from here. Code tables come from the "PetFinder.my Adoption Prediction label files"
(``petfinder_codes/``). The label `AdoptionSpeed` is 0-4 in the Kaggle original (`ordinal`) and 0 slow /
1 fast in the tutorial (`binary`); a 0-4 file read as binary maps 0-2 (adopted within 30 days) to 1.
"""

from __future__ import annotations

import csv
from functools import cache
from importlib import resources
from typing import Any

import pandas as pd

LABEL = "AdoptionSpeed"
IMAGES = "Images"
PET_ID = "PetID"
RESCUER_ID = "RescuerID"
PHOTO_AMOUNT = "PhotoAmt"
TYPE = "Type"
BREED1 = "Breed1"

# Kaggle column order, then the tutorial's image column.
KAGGLE_COLUMNS: tuple[str, ...] = (
    "Type", "Name", "Age", "Breed1", "Breed2", "Gender", "Color1", "Color2", "Color3", "MaturitySize",
    "FurLength", "Vaccinated", "Dewormed", "Sterilized", "Health", "Quantity", "Fee", "State",
    "RescuerID", "VideoAmt", "Description", "PetID", "PhotoAmt", LABEL,
)
ALL_COLUMNS: tuple[str, ...] = (*KAGGLE_COLUMNS, IMAGES)
TEXT_COLUMNS: tuple[str, ...] = ("Name", "Description")
CATEGORICAL_COLUMNS: tuple[str, ...] = (
    "Type", "Breed1", "Breed2", "Gender", "Color1", "Color2", "Color3", "MaturitySize", "FurLength",
    "Vaccinated", "Dewormed", "Sterilized", "Health", "State",
)
NUMERIC_COLUMNS: tuple[str, ...] = ("Age", "Quantity", "Fee", "VideoAmt", "PhotoAmt")
# May be absent in a valid file (the tutorial drops neither, other exports do).
OPTIONAL_COLUMNS: tuple[str, ...] = (RESCUER_ID, PET_ID)

# Inclusive code ranges of the coded columns, with their meaning for error messages.
CODE_RANGES: dict[str, tuple[int, int, str]] = {
    "Type": (1, 2, "1 dog, 2 cat"),
    "Gender": (1, 3, "1 male, 2 female, 3 mixed"),
    "MaturitySize": (0, 4, "0 not specified .. 4 extra large"),
    "FurLength": (0, 3, "0 not specified .. 3 long"),
    "Vaccinated": (1, 3, "1 yes, 2 no, 3 not sure"),
    "Dewormed": (1, 3, "1 yes, 2 no, 3 not sure"),
    "Sterilized": (1, 3, "1 yes, 2 no, 3 not sure"),
    "Health": (0, 3, "0 not specified .. 3 serious injury"),
    "Color1": (1, 7, "colour id 1-7"),
    "Color2": (0, 7, "colour id 1-7, 0 none"),
    "Color3": (0, 7, "colour id 1-7, 0 none"),
    "Breed1": (0, 307, "breed id 0-307 (dogs 1-240, cats 241-306, 307 mixed)"),
    "Breed2": (0, 307, "breed id 0-307, 0 none"),
}
# Plausibility bounds for counts and amounts: wide enough for real rows (Fee up to 2400, Quantity up to
# 20, Age up to 255 months, PhotoAmt up to 30), narrow enough to catch unit or parsing errors.
NUMERIC_BOUNDS: dict[str, tuple[float, float]] = {
    "Age": (0, 300), "Quantity": (1, 30), "Fee": (0, 5000), "VideoAmt": (0, 20), "PhotoAmt": (0, 40),
}
# Longest plausible text; real Descriptions reach ~6,700 characters, Names ~60.
TEXT_MAX_CHARS: dict[str, int] = {"Name": 255, "Description": 20_000}
# Real rows: ~1 in 800 has a Breed1 of the other animal type; swapped or shifted columns give far more.
BREED_TYPE_MOSTLY = 0.98
BREED_MATCHES_TYPE = "breed1_matches_type"
PET_ID_PATTERN = "[0-9a-f]{9}"  # a spreadsheet turns some into numbers (7.76E+08) or cuts leading zeros


def schema_dict() -> dict[str, Any]:
    """The preset's `dataset:` section (every key)."""
    codes: dict[str, Any] = {c: {"min": lo, "max": hi, "meaning": meaning} for c, (lo, hi, meaning) in CODE_RANGES.items()}
    codes["State"] = sorted(states())
    return {
        "preset": "petfinder",
        "id": PET_ID,
        "label": {"column": LABEL, "problem_type": "binary", "classes": None,
                  # a 0-4 AdoptionSpeed file read as binary: adopted within 30 days -> 1 (fast)
                  "positive": [0, 1, 2], "negative": [3, 4]},
        "columns": {"image": [IMAGES], "text": list(TEXT_COLUMNS), "categorical": list(CATEGORICAL_COLUMNS),
                    "numerical": list(NUMERIC_COLUMNS)},
        # listings per rescuer and how common the breed is, counted on the training rows
        "frequency": [RESCUER_ID, BREED1],
        "checks": {
            "required": [*CATEGORICAL_COLUMNS, *NUMERIC_COLUMNS],
            "optional": list(OPTIONAL_COLUMNS),
            "codes": codes,
            "bounds": {c: list(b) for c, b in NUMERIC_BOUNDS.items()},
            "max_chars": dict(TEXT_MAX_CHARS),
            "id_pattern": PET_ID_PATTERN,
            "rules": [BREED_MATCHES_TYPE],
        },
    }


def _read_codes(name: str) -> list[dict[str, str]]:
    with resources.files("fusion_model.presets.petfinder_codes").joinpath(name).open(newline="") as f:
        return list(csv.DictReader(f))


@cache
def breeds() -> dict[int, tuple[int, str]]:
    """BreedID -> (Type, BreedName)."""
    return {int(r["BreedID"]): (int(r["Type"]), r["BreedName"]) for r in _read_codes("breed_labels.csv")}


@cache
def colors() -> dict[int, str]:
    return {int(r["ColorID"]): r["ColorName"] for r in _read_codes("color_labels.csv")}


@cache
def states() -> dict[int, str]:
    return {int(r["StateID"]): r["StateName"] for r in _read_codes("state_labels.csv")}


def breed_matches_type(frame: pd.DataFrame) -> pd.Series:
    """Per row: is Breed1 a breed of the row's Type (breed_labels.csv)? 0 (unknown) and 307 (mixed) fit
    both. <NA> where either code is missing or unknown (other checks report those)."""
    animal_type = pd.to_numeric(frame[TYPE], errors="coerce")
    breed1 = pd.to_numeric(frame[BREED1], errors="coerce")
    of_type = {b: t for b, (t, _name) in breeds().items()}
    breed_type = breed1.map(of_type)
    fits = (breed_type == animal_type) | breed1.isin([0, 307])
    known = animal_type.isin([1, 2]) & (breed1.isin([0]) | breed_type.notna())
    return fits.astype("boolean").where(known, pd.NA)
