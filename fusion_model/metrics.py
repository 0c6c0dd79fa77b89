"""Metrics per problem type, computed by scikit-learn; the same functions score validation epochs, the
test set, the classical baseline and the champion, so every number is comparable.

- binary: `roc_auc` (primary), `accuracy`, `f1` (of the positive class), `log_loss`;
- multiclass: `macro_f1` (primary), `accuracy`, `log_loss`;
- ordinal: `qwk` (quadratic weighted kappa, primary), `accuracy`, `mae` (in classes);
- regression: `rmse` (primary, lower is better), `mae`, `r2`, in the label's unit.
A metric undefined on the rows at hand (one class only, a constant prediction) is None.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    cohen_kappa_score,
    f1_score,
    log_loss,
    mean_absolute_error,
    r2_score,
    roc_auc_score,
)

METRICS: dict[str, tuple[str, ...]] = {
    "binary": ("roc_auc", "accuracy", "f1", "log_loss"),
    "multiclass": ("macro_f1", "accuracy", "log_loss"),
    "ordinal": ("qwk", "accuracy", "mae"),
    "regression": ("rmse", "mae", "r2"),
}
LOWER_IS_BETTER = frozenset({"log_loss", "mae", "rmse"})


def primary_metric_name(problem_type: str, chosen: str | None = None) -> str:
    """The problem type's primary metric, or `chosen` when it is one of the problem type's metrics."""
    names = METRICS[problem_type]
    if chosen is None:
        return names[0]
    if chosen not in names:
        raise ValueError(f"metric {chosen!r} is not computed for a {problem_type} label; choose one of {list(names)}")
    return chosen


def greater_is_better(name: str) -> bool:
    return name not in LOWER_IS_BETTER


def better(a: float, b: float, name: str, margin: float = 0.0) -> bool:
    """Is `a` better than `b` on metric `name` by more than `margin`?"""
    return a > b + margin if greater_is_better(name) else a < b - margin


def compute_metrics(y: np.ndarray, prediction: np.ndarray, problem_type: str, num_classes: int = 0,
                    proba: np.ndarray | None = None) -> dict[str, float | None]:
    """Every metric of `problem_type`. `y` and `prediction` are class indices (classification) or values in
    the label's unit (regression); `proba` the class probabilities [rows, num_classes] (binary, multiclass)."""
    y, prediction = np.asarray(y), np.asarray(prediction)
    out: dict[str, float | None] = {}
    if problem_type == "regression":
        y, prediction = y.astype(np.float64), prediction.astype(np.float64)
        out["rmse"] = float(np.sqrt(np.mean((y - prediction) ** 2))) if len(y) else None
        out["mae"] = float(mean_absolute_error(y, prediction)) if len(y) else None
        out["r2"] = float(r2_score(y, prediction)) if len(y) > 1 and np.ptp(y) > 0 else None
        return _finite(out)
    labels = np.arange(num_classes)
    present = set(np.unique(y).tolist())
    out["accuracy"] = float(accuracy_score(y, prediction)) if len(y) else None
    if problem_type == "binary":
        assert proba is not None
        out["roc_auc"] = float(roc_auc_score(y, proba[:, 1])) if len(present) == 2 else None
        out["f1"] = float(f1_score(y, prediction, pos_label=1, zero_division=0))
    elif problem_type == "multiclass":
        out["macro_f1"] = float(f1_score(y, prediction, labels=labels, average="macro", zero_division=0))
    else:  # ordinal
        out["qwk"] = (float(cohen_kappa_score(y, prediction, labels=labels, weights="quadratic"))
                      if len(present) > 1 else None)
        out["mae"] = float(np.mean(np.abs(y.astype(np.float64) - prediction))) if len(y) else None
    if problem_type in ("binary", "multiclass"):
        assert proba is not None
        # float32 softmax rows sum to 1 only within ~1e-7, below sklearn's float64 tolerance: renormalise
        p = np.clip(np.asarray(proba, dtype=np.float64), 1e-15, None)
        out["log_loss"] = float(log_loss(y, p / p.sum(1, keepdims=True), labels=labels)) if len(y) else None
    order = METRICS[problem_type]
    return _finite({name: out.get(name) for name in order})


def _finite(values: dict[str, float | None]) -> dict[str, float | None]:
    # a kappa of a constant prediction is NaN in scikit-learn: undefined, not a number
    return {k: (None if v is not None and (math.isnan(v) or math.isinf(v)) else v) for k, v in values.items()}


def class_indices(values: Sequence[object], classes: Sequence[object]) -> np.ndarray:
    """Labels as class indices (`classes` order); a value outside the classes raises ValueError naming it."""
    index = {str(c): i for i, c in enumerate(classes)}
    out = np.empty(len(values), dtype=np.int64)
    for i, v in enumerate(values):
        key = str(v)
        if key not in index:
            raise ValueError(f"label {v!r} is not one of the classes {list(classes)}")
        out[i] = index[key]
    return out
