"""Decision rules fitted on validation rows: ordinal cut points for quadratic weighted kappa, and per-class
biases for macro F1. Shared by the network (fitted each validation epoch, kept in its buffers) and the
classical baseline, so both are judged with the same kind of rule.

Both are small coordinate searches over candidate values (scikit-learn and scipy have no optimiser for
these piecewise-constant objectives); each step keeps the best candidate, so the result never scores
below the starting rule on the rows it was fitted on.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import cohen_kappa_score, f1_score

_CANDIDATES = 41  # quantiles tried per cut point / bias per pass
_PASSES = 3


def apply_cutpoints(score: np.ndarray, cutpoints: np.ndarray) -> np.ndarray:
    """Class index of each row: how many cut points its score reaches (score >= cut)."""
    return np.searchsorted(np.sort(cutpoints), score, side="right")


def fit_cutpoints(score: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """K-1 increasing cut points on `score` (the expected class index, or any score that grows with the
    class) maximising quadratic weighted kappa against `labels` (class indices)."""
    score, labels = np.asarray(score, dtype=np.float64), np.asarray(labels)
    cuts = np.arange(num_classes - 1, dtype=np.float64) + 0.5
    if len(score) == 0 or num_classes < 2:
        return cuts
    classes = np.arange(num_classes)

    def qwk(c: np.ndarray) -> float:
        value = cohen_kappa_score(labels, apply_cutpoints(score, c), labels=classes, weights="quadratic")
        return -1.0 if np.isnan(value) else float(value)

    best = qwk(cuts)
    for _ in range(_PASSES):
        for j in range(num_classes - 1):
            low = cuts[j - 1] if j > 0 else score.min() - 1e-6
            high = cuts[j + 1] if j < num_classes - 2 else score.max() + 1e-6
            inside = score[(score > low) & (score < high)]
            if inside.size == 0:
                continue
            for value in np.unique(np.quantile(inside, np.linspace(0, 1, _CANDIDATES))):
                trial = cuts.copy()
                trial[j] = value
                got = qwk(trial)
                if got > best + 1e-12:
                    best, cuts = got, trial
    return cuts


def fit_class_bias(log_proba: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """One additive bias per class on the log-probabilities maximising macro F1 of the argmax (a rare
    class's threshold moves down until its F1 stops improving)."""
    log_proba, labels = np.asarray(log_proba, dtype=np.float64), np.asarray(labels)
    k = log_proba.shape[1]
    bias = np.zeros(k)
    if len(labels) == 0:
        return bias

    def macro_f1(b: np.ndarray) -> float:
        return float(f1_score(labels, (log_proba + b).argmax(1), labels=np.arange(k), average="macro",
                              zero_division=0))

    best = macro_f1(bias)
    for _ in range(_PASSES):
        for j in range(k):
            others = np.delete(log_proba + bias, j, axis=1).max(1)
            margins = others - log_proba[:, j]  # the bias that makes class j win each row
            for value in np.unique(np.quantile(margins, np.linspace(0.0, 1.0, _CANDIDATES))):
                trial = bias.copy()
                trial[j] = value + 1e-9
                got = macro_f1(trial)
                if got > best + 1e-12:
                    best, bias = got, trial
    return bias - bias.mean()
