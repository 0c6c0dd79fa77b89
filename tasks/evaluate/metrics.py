"""Test-set helpers of the evaluate and promote stages: the metrics themselves are fusion_model/metrics.py
(the same functions score validation epochs), here their refusals as StageErrors and the test set's
fingerprint."""

from __future__ import annotations

import hashlib

import numpy as np
import pandas as pd

from fusion_model.metrics import compute_metrics, primary_metric_name
from fusion_model.predict import Predictions
from tasks.errors import StageError


def metrics_of(y: np.ndarray, out: Predictions, problem_type: str, num_classes: int) -> dict[str, float | None]:
    """Every metric of the problem type; a non-finite prediction is refused (corrupt or diverged weights)."""
    for name, values in (("prediction", out.prediction), ("probability", out.proba)):
        if values is not None and not np.all(np.isfinite(np.asarray(values, dtype=np.float64))):
            bad = int(np.flatnonzero(~np.isfinite(np.asarray(values, dtype=np.float64)).reshape(len(values), -1)
                                     .all(axis=1))[0])
            raise StageError(
                f"the model returned a non-finite {name} (row position {bad}); the weights are probably corrupt "
                "or diverged. Retrain, or re-run convert to rewrite data/model/model.safetensors."
            )
    return compute_metrics(y, out.prediction, problem_type, num_classes, out.proba)


def primary_score(y: np.ndarray, out: Predictions, problem_type: str, num_classes: int,
                  name: str | None = None) -> float:
    """The primary metric (or `name`), or a StageError saying why it is undefined on this test set."""
    name = primary_metric_name(problem_type, name)
    value = metrics_of(y, out, problem_type, num_classes)[name]
    if value is None:
        counts = pd.Series(np.asarray(y)).value_counts().sort_index().to_dict()
        raise StageError(
            f"{name} is undefined on this test set (label counts {counts}): it needs at least two classes "
            "(and, for a constant prediction, some variation). Use a larger or stratified test set."
        )
    return value


def label_counts(y: np.ndarray, classes: list[int | str]) -> dict[str, int]:
    """Rows per class (y holds class indices), every class listed (0 when absent), keyed by str for JSON."""
    y = np.asarray(y)
    return {str(c): int((y == i).sum()) for i, c in enumerate(classes)}


def fingerprint_test_set(table: pd.DataFrame, label: str) -> str:
    """sha256 of the test table (rows in row_id order, columns by name): equal means scores are comparable.

    Features are hashed as well as ids and labels, so a re-generated table with the same ids but other
    content counts as a different test set (the champion is then re-scored rather than trusted).
    """
    if "row_id" not in table.columns or label not in table.columns:
        raise StageError(f"the test table needs `row_id` and `{label}` columns to fingerprint it; re-run validate.")
    canonical = table.sort_values("row_id", kind="stable")[sorted(table.columns)]
    digest = hashlib.sha256(canonical.to_csv(index=False, lineterminator="\n").encode()).hexdigest()
    return f"sha256:{digest}"
