"""The PetFinder tutorial schema: one source of truth for columns, code ranges and column roles.

Used by the synthetic generator, the validation suite, the model's preprocessing and the predictor, so a
column added or a range changed here changes all of them together. Code tables come from the
"PetFinder.my Adoption Prediction label files" (see ``codes/``).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import cache
from importlib import resources

LABEL = "AdoptionSpeed"
IMAGES = "Images"
IMAGE_SEPARATOR = ";"
# Dataset folder inside the tutorial zip (and inside data/raw for the embedded dataset).
DATASET_DIRNAME = "petfinder_for_tutorial"

# Kaggle column order, then the tutorial's image column.
KAGGLE_COLUMNS: tuple[str, ...] = (
    "Type", "Name", "Age", "Breed1", "Breed2", "Gender", "Color1", "Color2", "Color3", "MaturitySize",
    "FurLength", "Vaccinated", "Dewormed", "Sterilized", "Health", "Quantity", "Fee", "State",
    "RescuerID", "VideoAmt", "Description", "PetID", "PhotoAmt", LABEL,
)
ALL_COLUMNS: tuple[str, ...] = (*KAGGLE_COLUMNS, IMAGES)
# May be absent in a valid file (the tutorial drops neither, other exports do).
OPTIONAL_COLUMNS: frozenset[str] = frozenset({"RescuerID", "PetID"})
REQUIRED_COLUMNS: tuple[str, ...] = tuple(c for c in ALL_COLUMNS if c not in OPTIONAL_COLUMNS)
# Everything a prediction request needs (the label is what we predict).
FEATURE_COLUMNS: tuple[str, ...] = tuple(c for c in REQUIRED_COLUMNS if c != LABEL)

TEXT_COLUMNS: tuple[str, ...] = ("Name", "Description")
# The model's inputs; evaluation masks each in turn (the ablation).
MODALITIES: tuple[str, ...] = ("image", "tabular", "text")
CATEGORICAL_COLUMNS: tuple[str, ...] = (
    "Type", "Breed1", "Breed2", "Gender", "Color1", "Color2", "Color3", "MaturitySize", "FurLength",
    "Vaccinated", "Dewormed", "Sterilized", "Health", "State",
)
NUMERIC_COLUMNS: tuple[str, ...] = ("Age", "Quantity", "Fee", "VideoAmt", "PhotoAmt")


@dataclass(frozen=True)
class CodeRange:
    """Inclusive integer range of a coded column, with the meaning for error messages."""

    low: int
    high: int
    meaning: str


CODE_RANGES: dict[str, CodeRange] = {
    "Type": CodeRange(1, 2, "1 dog, 2 cat"),
    "Gender": CodeRange(1, 3, "1 male, 2 female, 3 mixed"),
    "MaturitySize": CodeRange(0, 4, "0 not specified .. 4 extra large"),
    "FurLength": CodeRange(0, 3, "0 not specified .. 3 long"),
    "Vaccinated": CodeRange(1, 3, "1 yes, 2 no, 3 not sure"),
    "Dewormed": CodeRange(1, 3, "1 yes, 2 no, 3 not sure"),
    "Sterilized": CodeRange(1, 3, "1 yes, 2 no, 3 not sure"),
    "Health": CodeRange(0, 3, "0 not specified .. 3 serious injury"),
    "Color1": CodeRange(1, 7, "colour id 1-7"),
    "Color2": CodeRange(0, 7, "colour id 1-7, 0 none"),
    "Color3": CodeRange(0, 7, "colour id 1-7, 0 none"),
    "Breed1": CodeRange(0, 307, "breed id 0-307 (dogs 1-240, cats 241-306, 307 mixed)"),
    "Breed2": CodeRange(0, 307, "breed id 0-307, 0 none"),
}

# Plausibility bounds for counts and amounts: wide enough for real rows (Fee up to 2400, Quantity up to
# 20, Age up to 255 months, PhotoAmt up to 30), narrow enough to catch unit or parsing errors.
NUMERIC_BOUNDS: dict[str, tuple[float, float]] = {
    "Age": (0, 300),
    "Quantity": (1, 30),
    "Fee": (0, 5000),
    "VideoAmt": (0, 20),
    "PhotoAmt": (0, 40),
}

LABEL_SETS: dict[str, tuple[int, ...]] = {
    "binary": (0, 1),  # the tutorial: 0 slow, 1 fast
    "multiclass": (0, 1, 2, 3, 4),  # the Kaggle original
}


def _read_codes(name: str) -> list[dict[str, str]]:
    with resources.files("fusion_model.codes").joinpath(name).open(newline="") as f:
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


def split_images(cell: object) -> list[str]:
    """The ';'-separated relative image paths of one row (empty list for an empty cell)."""
    if not isinstance(cell, str):
        return []
    return [p.strip() for p in cell.split(IMAGE_SEPARATOR) if p.strip()]
