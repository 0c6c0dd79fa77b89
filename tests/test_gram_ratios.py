"""The linear member's per-gram scales (fusion_model/gram_ratios.py): naive Bayes log-count ratios."""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from fusion_model.gram_ratios import gram_scales, label_classes
from fusion_model.rank_sums import RankSums


def _grams(rows: list[list[int]], columns: int) -> sp.csr_matrix:
    return sp.csr_matrix([[1.0 if j in row else 0.0 for j in range(columns)] for row in rows])


def test_a_gram_one_class_holds_weighs_more_than_one_every_class_holds() -> None:
    # three classes, two rows each; gram 0 in every row, gram 1 only in class 2's, gram 3 in none
    x = _grams([[0], [0], [0], [0], [0, 1], [0, 1, 2]], 4)
    classes = np.array([0, 0, 1, 1, 2, 2])
    scales = gram_scales(x, classes, 3, RankSums())
    assert scales[3] == 1.0  # no row holds it: left as it is
    assert scales[1] > scales[2] > 1.0 and scales[1] > scales[0]


def test_two_classes_give_nbsvms_ratio() -> None:
    x = _grams([[0, 1], [0], [1], [1, 2]], 3)
    classes = np.array([1, 1, 0, 0])
    p, q = 1 + np.array([2, 1, 0]), 1 + np.array([0, 2, 1])
    expected = 1 + np.abs(np.log(p / p.sum()) - np.log(q / q.sum()))
    np.testing.assert_allclose(gram_scales(x, classes, 2, RankSums()), expected)


def test_the_scales_do_not_depend_on_how_the_grams_are_weighed() -> None:
    """Presence counts, as NBSVM's: a tf-idf weight or a repeated gram changes nothing."""
    x = _grams([[0, 1], [0], [1], [1, 2]], 3)
    classes = np.array([1, 1, 0, 0])
    weighed = x.multiply(np.array([[0.3, 2.0, 0.7]])).tocsr()
    np.testing.assert_allclose(gram_scales(weighed, classes, 2, RankSums()), gram_scales(x, classes, 2, RankSums()))


def test_a_regression_label_stands_in_fifths_of_its_spread() -> None:
    values = np.random.default_rng(0).normal(50.0, 10.0, 10_000)
    classes, n = label_classes(values, 0, RankSums())
    assert n == 5
    shares = np.bincount(classes, minlength=5) / len(values)
    np.testing.assert_allclose(shares, 0.2, atol=0.02)
    assert (np.diff([values[classes == k].mean() for k in range(5)]) > 0).all()
    labels = np.array([0, 2, 1])
    assert label_classes(labels, 3, RankSums())[0].tolist() == [0, 2, 1]  # a class label is its own class
