"""The decision rules: multiclass class biases fitted, without labels, to the macro F1 the probabilities
expect; ordinal cut points searched with scikit-learn's quadratic kappa, computed without its checks."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.exceptions import UndefinedMetricWarning
from sklearn.metrics import cohen_kappa_score, f1_score

from fusion_model.decision import (
    _BIASES,
    apply_class_bias,
    apply_cutpoints,
    expected_macro_f1,
    fit_class_bias,
    fit_cutpoints,
    quadratic_kappa,
)


def _calibrated(rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Probabilities of three classes, one rare and never the most likely, and labels drawn from them (so the
    probabilities are calibrated by construction)."""
    rng = np.random.default_rng(seed)
    rare = rng.uniform(0.0, 0.4, rows) * (rng.random(rows) < 0.2)
    common = rng.uniform(0.7, 1.0, rows) * (1 - rare)  # >= 0.42: always above the rare class
    proba = np.stack([common, 1 - rare - common, rare], 1)
    labels = (rng.random(rows)[:, None] > proba.cumsum(1)).sum(1)
    return proba, labels


def test_the_rule_predicts_a_rare_class_the_argmax_never_does_and_raises_macro_f1_on_labels_it_never_saw() -> None:
    proba, _ = _calibrated(2000, seed=0)
    bias = fit_class_bias(proba)
    assert (proba.argmax(1) != 2).all() and bias[2] > bias[0]
    assert (apply_class_bias(proba, bias) == 2).sum() > 0
    assert expected_macro_f1(proba, apply_class_bias(proba, bias)) > expected_macro_f1(proba, proba.argmax(1)) + 0.05
    # fresh rows of the same population, their labels drawn from their probabilities: the fitted biases carry over
    fresh, labels = _calibrated(20000, seed=1)
    argmax = f1_score(labels, fresh.argmax(1), average="macro")
    rule = f1_score(labels, apply_class_bias(fresh, bias), average="macro")
    assert rule > argmax + 0.05


def test_the_biases_are_the_best_of_their_candidates_one_class_at_a_time() -> None:
    """No single class's candidate beats the fitted biases on the expected macro F1 (the grid search,
    vectorised over the candidates, agrees with a direct evaluation of each)."""
    proba, _ = _calibrated(500, seed=2)
    bias = fit_class_bias(proba)
    best = expected_macro_f1(proba, apply_class_bias(proba, bias))
    for j in range(3):
        for value in _BIASES:
            trial = bias.copy()
            trial[j] = value
            assert expected_macro_f1(proba, apply_class_bias(proba, trial)) <= best + 1e-12


def test_confident_probabilities_keep_the_argmax() -> None:
    """Where every row is all but certain there is nothing to gain: the biases stay zero (the argmax)."""
    proba = np.full((300, 4), 0.001)
    proba[np.arange(300), np.arange(300) % 4] = 0.997
    assert np.array_equal(fit_class_bias(proba), np.zeros(4))
    assert np.array_equal(fit_class_bias(np.zeros((0, 4))), np.zeros(4))


def test_expected_macro_f1_is_macro_f1_when_the_probabilities_are_the_labels() -> None:
    labels = np.array([0, 0, 1, 2, 2, 2, 1, 0])
    prediction = np.array([0, 1, 1, 2, 0, 2, 1, 0])
    assert np.isclose(expected_macro_f1(np.eye(3)[labels], prediction), f1_score(labels, prediction, average="macro"))


@pytest.mark.parametrize(("rows", "k", "seed"), [(1295, 5, 0), (40, 3, 1), (7, 5, 2), (3000, 4, 3)])
def test_the_search_s_kappa_is_scikit_learn_s_to_the_bit(rows: int, k: int, seed: int) -> None:
    """The cut points' search compares candidates by this value: any other float order could turn a tie."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, rows)
    for predicted in (rng.integers(0, k, rows), np.clip(labels + rng.integers(-1, 2, rows), 0, k - 1)):
        assert quadratic_kappa(labels, predicted, k) == cohen_kappa_score(
            labels, predicted, labels=np.arange(k), weights="quadratic")


def test_an_undefined_kappa_is_the_worst_candidate() -> None:
    """One class in both the labels and the predictions: scikit-learn's kappa is undefined (nan), the search's
    -1, so any cut point that separates something wins over it."""
    ones = np.ones(20, dtype=np.int64)
    with pytest.warns(UndefinedMetricWarning):
        assert np.isnan(cohen_kappa_score(ones, ones, labels=np.arange(3), weights="quadratic"))
    assert quadratic_kappa(ones, ones, 3) == -1.0


def test_fitted_cut_points_beat_rounding_on_a_shifted_score() -> None:
    """A score that sits 0.7 above each row's class: rounding it puts most rows one class too high; the cut
    points found put nearly all of them back."""
    rng = np.random.default_rng(4)
    labels = rng.integers(0, 5, 600)
    score = labels + 0.7 + rng.normal(0, 0.15, 600)
    cuts = fit_cutpoints(score, labels, 5)
    rounded = quadratic_kappa(labels, apply_cutpoints(score, np.arange(4) + 0.5), 5)
    assert quadratic_kappa(labels, apply_cutpoints(score, cuts), 5) > max(0.99, rounded + 0.05)
    assert np.all(np.diff(cuts) > 0)
