"""Each n-gram's weight in the linear member from how unevenly the label's classes hold it: naive Bayes
log-count ratios, as NBSVM (Wang & Manning, ACL 2012) scales a linear model's text features.

The linear member's penalty is one L2 per block; an n-gram that one class holds far more often than the rest
is then shrunk as hard as one that every class holds alike. Scaled by `1 + |r|` (r: the log ratio of the
gram's share of a class's grams to its share of the other classes' grams, smoothed by one), a telling gram's
weight costs less penalty: the same model with a penalty per gram. Written here: no library computes it
(scikit-learn has no NBSVM), and it must sum over the ranks' rows.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from fusion_model.rank_sums import RankSums

# a regression label's five classes: its standardised value cut where a normal's quintiles are (the mean and
# the spread sum over the ranks' rows; quantiles would need every rank's values)
REGRESSION_CUTS = np.array([-0.8416, -0.2533, 0.2533, 0.8416])


def label_classes(labels: np.ndarray, n_classes: int, sums: RankSums) -> tuple[np.ndarray, int]:
    """Each row's class and how many there are: a class label's own (`n_classes` >= 2), or a regression
    value's fifth."""
    if n_classes >= 2:
        return labels.astype(np.int64), n_classes
    values = labels.astype(np.float64)
    n, total, squares = sums.sum(np.array([len(values), values.sum(), (values**2).sum()]))
    mean = total / max(n, 1)
    std = np.sqrt(max(squares / max(n, 1) - mean**2, 0.0)) or 1.0
    return np.searchsorted(REGRESSION_CUTS, (values - mean) / std).astype(np.int64), len(REGRESSION_CUTS) + 1


def gram_scales(x: sp.csr_matrix, classes: np.ndarray, n_classes: int, sums: RankSums) -> np.ndarray:
    """[columns] `1 + sqrt(sum_k prior_k r_k^2)`, r_k the smoothed log ratio of a column's share of class k's
    present grams to its share of the other rows' (for two classes |r|, NBSVM's); 1 where no row holds it."""
    present = x.copy()
    present.data = (present.data != 0).astype(float)
    onehot = sp.csr_matrix((np.ones(len(classes)), (np.arange(len(classes)), classes)),
                           shape=(len(classes), n_classes))
    counts = (present.T @ onehot).toarray()  # [columns, classes]
    rows = np.bincount(classes, minlength=n_classes).astype(float)
    summed = sums.sum(np.concatenate([counts.ravel(), rows])).reshape(-1, n_classes)
    counts, rows = summed[:-1], summed[-1]
    held = counts.sum(1) > 0
    inside = counts[held] + 1
    outside = counts[held].sum(1, keepdims=True) - counts[held] + 1
    ratio = np.log(inside / inside.sum(0)) - np.log(outside / outside.sum(0))
    prior = rows / rows.sum()
    scales = np.ones(x.shape[1])
    scales[held] = 1 + np.sqrt((ratio**2 * prior).sum(1))
    return scales
