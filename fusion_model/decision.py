"""The decision rule fitted on validation rows: ordinal cut points for quadratic weighted kappa. Shared by
the network (fitted each validation epoch, kept in its buffers) and the classical baseline, so both are
judged with the same kind of rule. Multiclass predictions are the argmax for both.

A small coordinate search over candidate values (scikit-learn and scipy have no optimiser for this
piecewise-constant objective); each step keeps the best candidate, so the result never scores below the
starting rule on the rows it was fitted on.
"""

from __future__ import annotations

import numpy as np
from sklearn.metrics import cohen_kappa_score

_CANDIDATES = 41  # quantiles tried per cut point per pass
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
