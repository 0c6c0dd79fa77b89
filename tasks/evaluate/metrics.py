"""Classification metrics for the evaluate and promote stages, computed by scikit-learn.

Binary (the tutorial's 0 slow / 1 fast): ROC AUC (primary), accuracy, log loss, F1 of class 1.
Multiclass (Kaggle's 0-4): quadratic weighted kappa (primary), accuracy, macro one-vs-rest ROC AUC.
Every primary metric is "higher is better", which promotion relies on.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Literal

import numpy as np
import pandas as pd
from sklearn.metrics import (
    accuracy_score,
    cohen_kappa_score,
    f1_score,
    log_loss,
    roc_auc_score,
)

from fusion_model.schema import LABEL
from tasks.errors import StageError

LabelKind = Literal["binary", "multiclass"]

PRIMARY_METRIC: dict[str, str] = {"binary": "roc_auc", "multiclass": "quadratic_weighted_kappa"}


def primary_metric_name(label_kind: LabelKind) -> str:
    return PRIMARY_METRIC[label_kind]


def as_class_probabilities(proba: np.ndarray, classes: Sequence[int]) -> np.ndarray:
    """Return an (n, len(classes)) probability matrix; a binary model may give only P(class 1) as (n,)."""
    proba = np.asarray(proba, dtype=np.float64)
    if proba.ndim == 1 and len(classes) == 2:
        proba = np.stack([1.0 - proba, proba], axis=1)
    if proba.ndim != 2 or proba.shape[1] != len(classes):
        raise StageError(
            f"the model returned probabilities of shape {proba.shape}, but the test set has classes "
            f"{list(classes)}: the model was trained for a different label set. Retrain (python -m tasks train) "
            "on data validated with the same label_kind."
        )
    if not np.all(np.isfinite(proba)):
        bad = int(np.flatnonzero(~np.isfinite(proba).all(axis=1))[0])
        raise StageError(
            f"the model returned a non-finite probability (row position {bad}); the weights are probably "
            "corrupt or diverged. Retrain, or re-run convert to rewrite data/model/model.safetensors."
        )
    return proba


def predicted_labels(proba: np.ndarray, classes: Sequence[int]) -> np.ndarray:
    """The most probable class of each row (for binary this equals thresholding P(1) at 0.5)."""
    return np.asarray(classes)[np.argmax(proba, axis=1)]


def compute_metrics(
    y_true: Sequence[int] | np.ndarray,
    proba: np.ndarray,
    classes: Sequence[int],
    label_kind: LabelKind,
) -> dict[str, float | None]:
    """Every metric of this label kind; a metric undefined on these labels (one class only) is None."""
    y = np.asarray(y_true)
    classes = [int(c) for c in classes]
    proba = as_class_probabilities(proba, classes)
    y_pred = predicted_labels(proba, classes)
    present = set(np.unique(y).tolist())
    unknown = present - set(classes)
    if unknown:
        raise StageError(
            f"test labels {sorted(unknown)} are not among the model's classes {classes}; validate the data "
            "with the label_kind the model was trained for."
        )
    out: dict[str, float | None] = {"accuracy": float(accuracy_score(y, y_pred))}
    if label_kind == "binary":
        out["roc_auc"] = float(roc_auc_score(y, proba[:, 1])) if len(present) == 2 else None
        # float32 softmax rows sum to 1 only within ~1e-7, below sklearn's float64 tolerance: renormalise.
        out["log_loss"] = float(log_loss(y, proba / proba.sum(axis=1, keepdims=True), labels=classes))
        out["f1"] = float(f1_score(y, y_pred, pos_label=classes[1], zero_division=0))
    else:
        out["quadratic_weighted_kappa"] = (
            float(cohen_kappa_score(y, y_pred, labels=classes, weights="quadratic")) if len(present) > 1 else None
        )
        # One-vs-rest AUC needs every class among the labels; sklearn refuses otherwise.
        out["roc_auc_ovr_macro"] = (
            float(roc_auc_score(y, proba, multi_class="ovr", average="macro", labels=classes))
            if present == set(classes)
            else None
        )
    # A kappa of a constant prediction is NaN in sklearn; report it as undefined, not as a number.
    return {k: (None if v is not None and math.isnan(v) else v) for k, v in out.items()}


def primary_score(
    y_true: Sequence[int] | np.ndarray, proba: np.ndarray, classes: Sequence[int], label_kind: LabelKind
) -> float:
    """The primary metric, or a StageError saying why it is undefined on this test set."""
    name = primary_metric_name(label_kind)
    value = compute_metrics(y_true, proba, classes, label_kind)[name]
    if value is None:
        counts = pd.Series(np.asarray(y_true)).value_counts().sort_index().to_dict()
        raise StageError(
            f"{name} is undefined on this test set (label counts {counts}): it needs at least two classes "
            "(and, for a constant prediction, some variation). Use a larger or stratified test set."
        )
    return value


def label_counts(y_true: Sequence[int] | np.ndarray, classes: Sequence[int]) -> dict[str, int]:
    """Rows per class, every class listed (0 when absent), keyed by str for JSON."""
    y = np.asarray(y_true)
    return {str(int(c)): int((y == c).sum()) for c in classes}


def fingerprint_test_set(table: pd.DataFrame, label: str = LABEL) -> str:
    """sha256 of the test table (rows in row_id order, columns by name): equal means scores are comparable.

    Features are hashed as well as ids and labels, so a re-generated table with the same ids but other
    content counts as a different test set (the champion is then re-scored rather than trusted).
    """
    if "row_id" not in table.columns or label not in table.columns:
        raise StageError(f"the test table needs `row_id` and `{label}` columns to fingerprint it; re-run validate.")
    canonical = table.sort_values("row_id", kind="stable")[sorted(table.columns)]
    digest = hashlib.sha256(canonical.to_csv(index=False, lineterminator="\n").encode()).hexdigest()
    return f"sha256:{digest}"
