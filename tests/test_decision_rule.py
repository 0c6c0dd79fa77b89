"""The multiclass decision rule: class biases fitted, without labels, to the macro F1 the probabilities expect."""

from __future__ import annotations

import numpy as np
from sklearn.metrics import f1_score

from fusion_model.decision import _BIASES, apply_class_bias, expected_macro_f1, fit_class_bias


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
