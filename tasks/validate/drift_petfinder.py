"""The PetFinder columns of the drift gate, by role: the one place the gate meets fusion_model/schema.py.

The gate and its statistics take their columns as `DriftColumns` arguments; the callers (the batch
intake in tasks/download/batches.py and `python -m tasks drift`) pass these until a dataset declares its
own roles.
"""

from __future__ import annotations

from fusion_model import schema
from tasks.validate.drift_stats import DriftColumns

# the free text whose length is compared (Name is short and often empty: its length says little)
TEXT_LENGTH_COLUMNS: tuple[str, ...] = ("Description",)


def petfinder_columns(label_kind: str = "binary") -> DriftColumns:
    """PetFinder's numeric and coded columns, the Description's length, AdoptionSpeed (binary 0/1 or the
    multiclass 0-4 speed) and the Images column."""
    return DriftColumns(numeric=schema.NUMERIC_COLUMNS, categorical=schema.CATEGORICAL_COLUMNS,
                        text_length=TEXT_LENGTH_COLUMNS, label=schema.LABEL, problem_type=label_kind,
                        image=schema.IMAGES, image_separator=schema.IMAGE_SEPARATOR)
