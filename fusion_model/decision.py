"""The decision rule fitted on validation rows: ordinal cut points for quadratic weighted kappa, and class
biases for macro F1. Shared by the network (fitted each validation epoch, kept in its buffers) and the
classical baseline, so both are judged with the same kind of rule.

The class biases are fitted without the labels: they maximise the macro F1 that the validation rows' own
probabilities expect (each row a fractional true positive of every class), the plug-in rule for F-measures
(the argmax of re-weighted probabilities). A rare class's few validation labels would make a fitted rule
chase noise (BENCHMARKS.md); every row's probability mass does not.

Both are small coordinate searches over candidate values (scikit-learn and scipy have no optimiser for these
piecewise-constant objectives, and scikit-learn's threshold tuning is binary only); each step keeps the best
candidate, so the result never scores below the starting rule on the rows it was fitted on.
"""

from __future__ import annotations

import numpy as np

_CANDIDATES = 41  # quantiles tried per cut point per pass
_PASSES = 3


def apply_cutpoints(score: np.ndarray, cutpoints: np.ndarray) -> np.ndarray:
    """Class index of each row: how many cut points its score reaches (score >= cut)."""
    return np.searchsorted(np.sort(cutpoints), score, side="right")


def fit_cutpoints(score: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """K-1 increasing cut points on `score` (the expected class index, or any score that grows with the
    class) maximising quadratic weighted kappa against `labels` (class indices)."""
    score, labels = np.asarray(score, dtype=np.float64), np.asarray(labels, dtype=np.int64)
    cuts = np.arange(num_classes - 1, dtype=np.float64) + 0.5
    if len(score) == 0 or num_classes < 2:
        return cuts

    def qwk(c: np.ndarray) -> float:
        return quadratic_kappa(labels, apply_cutpoints(score, c), num_classes)

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


def quadratic_kappa(labels: np.ndarray, predicted: np.ndarray, k: int) -> float:
    """scikit-learn's `cohen_kappa_score(labels, predicted, labels=range(k), weights="quadratic")` (class
    indices), -1 where it is undefined: the same float operations in the same order, so the same value to the
    bit, without the input checks that were most of each of the search's hundreds of calls (BENCHMARKS.md)."""
    weights = np.zeros((k, k)) + np.arange(k)
    weights = (weights - weights.T) ** 2
    confusion = np.bincount(labels * k + predicted, minlength=k * k).reshape(k, k).astype(np.float64)
    sum0, sum1 = confusion.sum(axis=0), confusion.sum(axis=1)
    total = sum0.sum()
    if total == 0:
        return -1.0
    denominator = np.sum(weights * (np.outer(sum0, sum1) / total))
    if denominator == 0:
        return -1.0
    return float(1 - np.sum(weights * confusion) / denominator)


_BIASES = np.round(np.linspace(-3.0, 3.0, 61), 2)  # candidate log weights per class (probability x 0.05 .. 20)


def expected_macro_f1(proba: np.ndarray, prediction: np.ndarray) -> float:
    """Macro F1 of `prediction` (class indices) expected under `proba` [rows, classes] itself: class k's true
    positives sum P(k) over the rows predicted k, its positives sum P(k) over every row."""
    proba = np.asarray(proba, dtype=np.float64)
    k = proba.shape[1]
    predicted = np.bincount(prediction, minlength=k)
    true_positive = np.bincount(prediction, weights=proba[np.arange(len(proba)), prediction], minlength=k)
    denominator = predicted + proba.sum(0)
    return float(np.mean(np.divide(2 * true_positive, denominator, out=np.zeros(k), where=denominator > 0)))


def apply_class_bias(proba: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Class index of each row: the argmax of its log probabilities plus `bias`."""
    return np.argmax(np.log(np.clip(np.asarray(proba, dtype=np.float64), 1e-12, None)) + bias, 1)


def _macro_f1_over_biases(proba: np.ndarray, log_p: np.ndarray, bias: np.ndarray, j: int) -> np.ndarray:
    """`expected_macro_f1` of the argmax of log_p + bias with class j's bias set to each of `_BIASES`, all at
    once: a row goes to j exactly when j's bias exceeds its margin to the best other class."""
    others = log_p + bias
    others[:, j] = -np.inf
    other = others.argmax(1)
    to_j = (_BIASES[None, :] > (others[np.arange(len(log_p)), other] - log_p[:, j])[:, None])  # [rows, biases]
    stays = (~to_j).astype(np.float64)
    one_hot = np.eye(log_p.shape[1])[other]  # [rows, classes]
    predicted = one_hot.T @ stays  # [classes, biases]
    true_positive = (one_hot * proba[np.arange(len(proba)), other][:, None]).T @ stays
    predicted[j], true_positive[j] = to_j.sum(0), proba[:, j] @ to_j
    denominator = predicted + proba.sum(0)[:, None]
    f1 = np.divide(2 * true_positive, denominator, out=np.zeros_like(predicted), where=denominator > 0)
    return f1.mean(0)


def fit_class_bias(proba: np.ndarray) -> np.ndarray:
    """Per-class biases added to the log probabilities before the argmax, maximising `expected_macro_f1` on
    these rows (zeros, the argmax, unless a bias beats it); label-free."""
    proba = np.asarray(proba, dtype=np.float64)
    bias = np.zeros(proba.shape[1])
    if len(proba) == 0:
        return bias
    log_p = np.log(np.clip(proba, 1e-12, None))
    best = expected_macro_f1(proba, apply_class_bias(proba, bias))
    for _ in range(_PASSES):
        before = best
        for j in range(len(bias)):
            scores = _macro_f1_over_biases(proba, log_p, bias, j)
            if scores.max() > best + 1e-12:
                best, bias[j] = float(scores.max()), _BIASES[int(scores.argmax())]
        if best <= before:
            break
    return bias
