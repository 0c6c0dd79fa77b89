"""Two-number bins: the leaves of a decision tree fitted to the training labels over a pair of numbers.

A number's own bins (rtdl_num_embeddings' tree bins) can only bend the model along that number. Some
tables hold their signal in where two numbers meet: a catalogue number read within a year (each year's
products were listed in runs of one season), which an additive model over the two numbers' bins cannot
express and trees find at once. A tree over the pair gives each such region a code; the linear member
learns a penalised logit per code, as it does for any categorical column. rtdl_num_embeddings bins one
number at a time, so the pair's tree is scikit-learn's, kept as plain lists (JSON, no pickle).
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import numpy as np

SEPARATOR = " × "  # a pair code's column name: "<first> × <second>"
# a wide table pairs only this many of its numbers (66 pairs): those whose own label-fitted bins are the most
# numerous, i.e. where the one-number trees found the most to split on (pairs grow with the square)
MAX_PAIRED = 12


def paired_numbers(bin_counts: list[int], limit: int = MAX_PAIRED) -> list[int]:
    """Which numbers (indices, in column order) are paired: every one, or the `limit` with the most bins."""
    ranked = sorted(range(len(bin_counts)), key=lambda j: -bin_counts[j])[:limit]
    return sorted(ranked)


def fit_pair_tree(x: np.ndarray, labels: np.ndarray, ordered: bool, max_leaves: int, min_rows: int) -> dict[str, Any]:
    """A tree over the two columns of `x` [rows, 2] (standardised numbers), fitted as the one-number bins are:
    at most `max_leaves` leaves of >= `min_rows` training rows; a regression tree for ordered labels."""
    from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

    kind = DecisionTreeRegressor if ordered else DecisionTreeClassifier
    tree = kind(max_leaf_nodes=max(max_leaves, 2), min_samples_leaf=min_rows, min_impurity_decrease=1e-4,
                random_state=0).fit(x, labels).tree_
    return {"feature": tree.feature.tolist(), "threshold": tree.threshold.tolist(),
            "left": tree.children_left.tolist(), "right": tree.children_right.tolist()}


def leaves(tree: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """Each row's leaf (its node number) [rows]: every row walks down a level per step, all rows at once."""
    feature, threshold = np.asarray(tree["feature"]), np.asarray(tree["threshold"])
    left, right = np.asarray(tree["left"]), np.asarray(tree["right"])
    node = np.zeros(len(x), dtype=np.int64)
    rows = np.arange(len(x))
    while (inner := left[node] >= 0).any():
        at = node[inner]
        go_left = x[rows[inner], feature[at]] <= threshold[at]
        node[inner] = np.where(go_left, left[at], right[at])
    return node


def fit_pair_trees(z: np.ndarray, names: list[str], labels: np.ndarray, ordered: bool, max_leaves: int,
                   min_rows: int) -> list[dict[str, Any]]:
    """A tree for each pair of the numbers `names` (columns of `z`) that varies in training; only trees
    that split (more than one leaf) are kept."""
    out = []
    for i, j in combinations(range(len(names)), 2):
        if min(len(np.unique(z[:, i])), len(np.unique(z[:, j]))) < 2:
            continue
        tree = fit_pair_tree(z[:, [i, j]], labels, ordered, max_leaves, min_rows)
        if len(tree["left"]) > 1:
            out.append({"columns": [names[i], names[j]], "tree": tree})
    return out


def pair_name(pair: dict[str, Any]) -> str:
    return SEPARATOR.join(pair["columns"])
