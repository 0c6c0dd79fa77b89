"""The presets by name: a known table's whole `dataset:` declaration, and the row rules it implements.

`PRESETS` maps a preset name to a function returning its declaration (params.yaml `dataset.preset`);
`RULES` maps a rule name (a preset's `checks.rules`) to the per-row check the validation suite runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pandas as pd

from fusion_model.presets import petfinder


@dataclass(frozen=True)
class RowRule:
    """A check across columns of one row, run as a derived boolean column expected to be true."""

    name: str  # the derived column's name
    column: str  # the column a failure is reported on
    columns: tuple[str, ...]  # the file's columns it reads (the report shows their cells)
    check: str
    fix: str
    mostly: float  # the share of rows that must pass
    evaluate: Callable[[pd.DataFrame], pd.Series]  # nullable booleans: <NA> where it cannot be judged


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {"petfinder": petfinder.schema_dict}

RULES: dict[str, RowRule] = {
    petfinder.BREED_MATCHES_TYPE: RowRule(
        name=petfinder.BREED_MATCHES_TYPE,
        column=petfinder.BREED1,
        columns=(petfinder.TYPE, petfinder.BREED1),
        check=f"Breed1 belongs to the animal Type (breed_labels.csv) in at least {petfinder.BREED_TYPE_MOSTLY:.0%} "
              "of rows",
        fix="check that Type and Breed1 are not swapped or shifted; a few mismatches are normal",
        mostly=petfinder.BREED_TYPE_MOSTLY,
        evaluate=petfinder.breed_matches_type,
    ),
}
