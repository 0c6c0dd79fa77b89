"""Two-number bins: the leaves of a decision tree fitted to the training labels over a pair of numbers.

A number's own bins (rtdl_num_embeddings' tree bins) can only bend the model along that number. Some
tables hold their signal in where two numbers meet: a catalogue number read within a year (each year's
products were listed in runs of one season), which an additive model over the two numbers' bins cannot
express and trees find at once. A tree over the pair gives each such region a code; the linear member
learns a penalised logit per code, as it does for any categorical column. Every node on a row's way down
is a code too, one column per depth, where the pair's tree is the table's main signal (`PATH_EXPLAINED`):
the penalty then shrinks a leaf of a few rows towards the region above it rather than towards nothing (a
tree's hierarchical shrinkage, Agarwal et al., ICML 2022), so fine leaves cost little where they do not
hold. rtdl_num_embeddings bins one number at a time, so the pair's tree is scikit-learn's, kept as plain
lists (JSON, no pickle).
"""

from __future__ import annotations

from itertools import combinations
from typing import Any

import numpy as np

SEPARATOR = " × "  # a pair code's column name: "<first> × <second>"
# a wide table pairs only this many of its numbers (66 pairs): those whose own label-fitted bins are the most
# numerous, i.e. where the one-number trees found the most to split on (pairs grow with the square)
MAX_PAIRED = 12
# a tree's path is coded where it explains at least this share of the training labels' impurity (fashion's
# catalogue number within the year: 0.92); trees of a few rows a leaf explain 0.1-0.2 of pure noise, and
# their pairs' block the walk leaves out in effect. At most PATH_COLUMNS such columns over a table's pairs,
# best trees first: the linear member's fits pay for every column (66 pairs' whole paths: ~700; BENCHMARKS.md)
PATH_EXPLAINED = 0.5
PATH_COLUMNS = 64


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
    leaf = tree.children_left < 0
    rows_impurity = tree.impurity * tree.weighted_n_node_samples
    explained = 1.0 - rows_impurity[leaf].sum() / rows_impurity[0] if rows_impurity[0] > 0 else 0.0
    return {"feature": tree.feature.tolist(), "threshold": tree.threshold.tolist(),
            "left": tree.children_left.tolist(), "right": tree.children_right.tolist(),
            "depth": int(tree.max_depth), "explained": float(explained), "levels": int(tree.max_depth)}


def paths(tree: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """Each row's nodes below the root, [rows, levels]: column d the node at depth d + 1, a row whose leaf
    is shallower keeping its leaf; the last column is the leaf. Every row walks down a level per step, all
    rows at once. A tree of one level (its path not coded, or saved before paths were) gives its leaves."""
    feature, threshold = np.asarray(tree["feature"]), np.asarray(tree["threshold"])
    left, right = np.asarray(tree["left"]), np.asarray(tree["right"])
    node = np.zeros(len(x), dtype=np.int64)
    rows = np.arange(len(x))

    def down() -> None:  # every row not at its leaf one level down
        inner = left[node] >= 0
        at = node[inner]
        node[inner] = np.where(x[rows[inner], feature[at]] <= threshold[at], left[at], right[at])

    out = np.zeros((len(x), tree.get("levels", 1)), dtype=np.int64)
    for level in range(out.shape[1] - 1):
        down()
        out[:, level] = node
    while (left[node] >= 0).any():  # the rest of the way down to the leaves
        down()
    out[:, -1] = node
    return out


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
    budget = PATH_COLUMNS
    for pair in sorted(out, key=lambda p: -p["tree"]["explained"]):  # stable: ties in column order
        above = pair["tree"]["depth"] - 1
        coded = pair["tree"]["explained"] >= PATH_EXPLAINED and above <= budget
        pair["tree"]["levels"] = 1 + (above if coded else 0)
        budget -= pair["tree"]["levels"] - 1
    return out


def pair_name(pair: dict[str, Any]) -> str:
    return SEPARATOR.join(pair["columns"])


def path_names(pair: dict[str, Any]) -> list[str]:
    """The code columns of a pair's nodes, as `paths` gives them: "<a> × <b> @d" for the nodes at depth d,
    the leaf's column named "<a> × <b>"."""
    name = pair_name(pair)
    return [f"{name} @{d + 1}" for d in range(pair["tree"].get("levels", 1) - 1)] + [name]


def pair_codes(pairs: list[dict[str, Any]], columns: list[str], z: np.ndarray) -> dict[str, np.ndarray]:
    """Each code column of the pairs' trees (`path_names`) -> its node per row, from the standardised numbers
    `z` of `columns`."""
    index = {c: j for j, c in enumerate(columns)}
    out: dict[str, np.ndarray] = {}
    for p in pairs:
        out.update(zip(path_names(p), paths(p["tree"], z[:, [index[c] for c in p["columns"]]]).T, strict=True))
    return out
