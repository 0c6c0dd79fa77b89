"""Two-number bins (fusion_model/pair_bins.py): a label-fitted tree over each pair of numbers, its leaf and the
nodes above it codes of the linear member, so a catalogue number read within a year becomes learnable by a
linear model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import sparse
from sklearn.linear_model import LogisticRegression
from sklearn.tree import DecisionTreeClassifier, DecisionTreeRegressor

from fusion_model.build import build_module
from fusion_model.data import FusionDataset, ValidatedData
from fusion_model.dataset import resolve_schema
from fusion_model.pair_bins import (
    MAX_PAIRED,
    PATH_COLUMNS,
    PATH_EXPLAINED,
    fit_pair_tree,
    fit_pair_trees,
    paired_numbers,
    path_names,
    paths,
)
from fusion_model.preprocess import Preprocessor
from fusion_model.wide_fit import L2_GRIDS, design
from tests.linear_member_worker import config
from tests.validated_tables import make_validated

SCHEMA = resolve_schema({"preset": None, "id": None, "label": {"column": "y", "problem_type": "binary"},
                         "columns": {"categorical": ["kind"], "numerical": ["year", "number"]}})


@pytest.mark.parametrize("ordered", [False, True])
def test_the_walk_gives_each_row_the_path_scikit_learn_gives_it(ordered: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400, 2))
    y = (x[:, 0] * x[:, 1] > 0).astype(float) if ordered else (x[:, 0] * x[:, 1] > 0).astype(int)
    tree = fit_pair_tree(x, y, ordered, max_leaves=32, min_rows=4)
    kind = DecisionTreeRegressor if ordered else DecisionTreeClassifier
    reference = kind(max_leaf_nodes=32, min_samples_leaf=4, min_impurity_decrease=1e-4, random_state=0).fit(x, y)
    fresh = rng.normal(size=(300, 2))
    nodes = paths(tree, fresh)
    assert nodes.shape == (300, reference.get_depth()) == (300, tree["depth"])
    assert np.array_equal(nodes[:, -1], reference.apply(fresh))
    for row, way in zip(nodes, reference.decision_path(fresh).tolil().rows, strict=True):
        below_root = sorted(way)[1:]  # a child's node number is above its parent's
        assert list(row) == below_root + [below_root[-1]] * (len(row) - len(below_root))  # the leaf repeated
    assert len(np.unique(paths(tree, x)[:, -1])) > 4  # the crossing needs several leaves
    # a tree saved before the paths (no depth) still gives each row its leaf, alone
    old = {k: v for k, v in tree.items() if k not in ("depth", "explained", "levels")}
    assert np.array_equal(paths(old, fresh), nodes[:, -1:])
    assert path_names({"columns": ["a", "b"], "tree": old}) == ["a × b"]


def test_the_paths_of_the_trees_that_explain_the_labels_are_coded_within_a_budget() -> None:
    """The nodes above the leaves are codes where a pair's tree explains most of the labels, PATH_COLUMNS
    columns at most over the pairs, the best trees first; the trees of noise keep their leaves alone."""
    rng = np.random.default_rng(3)
    z = rng.normal(size=(2000, 10))  # 45 pairs
    crossing = (z[:, 0] * z[:, 1] > 0) ^ (rng.random(2000) < 0.02)  # the first two numbers' crossing
    pairs = fit_pair_trees(z, [f"n{j}" for j in range(10)], crossing.astype(int), False, max_leaves=64, min_rows=4)
    coded = [p for p in pairs if p["tree"]["levels"] > 1]
    assert [p["columns"] for p in coded] == [["n0", "n1"]]  # the one tree of signal, whole
    assert coded[0]["tree"]["levels"] == coded[0]["tree"]["depth"] > 2
    assert coded[0]["tree"]["explained"] >= PATH_EXPLAINED > max(p["tree"]["explained"] for p in pairs[1:])
    assert all(len(path_names(p)) == p["tree"]["levels"] for p in pairs)
    # stripes along the first number: each of its 19 pairs' trees explains the label, deep; paths of the best
    # ones until the budget is spent
    wide = rng.normal(size=(2000, 20))
    stripes = (np.floor(wide[:, 0] * 6) % 2).astype(int)
    pairs = fit_pair_trees(wide, [f"n{j}" for j in range(20)], stripes, False, max_leaves=256, min_rows=2)
    strong = [p for p in pairs if p["tree"]["explained"] >= PATH_EXPLAINED]
    coded = [p for p in pairs if p["tree"]["levels"] > 1]
    assert sum(p["tree"]["depth"] - 1 for p in strong) > PATH_COLUMNS  # more than the budget holds
    assert 0 < sum(p["tree"]["levels"] - 1 for p in coded) <= PATH_COLUMNS and len(coded) < len(strong)
    assert all(p in strong for p in coded) and max(strong, key=lambda p: p["tree"]["explained"]) in coded


def _table(rows: int, seed: int) -> pd.DataFrame:
    """The label lives where two numbers meet: in 2011 low numbers are positive, in 2016 high ones are, so
    neither number alone (nor their sum: an additive model) says much."""
    rng = np.random.default_rng(seed)
    year = rng.choice([2011, 2016], rows)
    number = rng.integers(10_000, 20_000, rows)
    y = ((number < 15_000) == (year == 2011)).astype(int)
    return pd.DataFrame({"kind": rng.choice(["a", "b"], rows), "year": year, "number": number, "y": y})


def test_a_pair_of_numbers_gets_a_code_that_makes_their_crossing_linear() -> None:
    train, test = _table(600, 1), _table(400, 2)
    fit = dict(text_buckets=64, image_size=32, image_index=0, numeric_bins=64, bin_min_rows=4,
               labels=train["y"].to_numpy())
    pre = Preprocessor.fit(train, SCHEMA, pair_bins=True, **fit)
    depth = pre.pair_trees[0]["tree"]["depth"]
    # the pair's codes come last: the nodes at each depth, then the leaf
    assert pre.categorical_columns == ["kind", *[f"year × number @{d}" for d in range(1, depth)], "year × number"]
    assert pre.pair_columns == depth > 1 and len(pre.vocabularies["year × number"]) >= 4
    codes = pre.categorical(test).numpy()
    assert (codes[:, 1:] > 0).all()  # every fresh row lands in nodes the training rows fill

    # saved as JSON and read back, the preprocessor gives every row the same codes
    again = Preprocessor.from_dict(json.loads(json.dumps(pre.to_dict())))
    assert np.array_equal(again.categorical(test).numpy(), codes)

    def accuracy(p: Preprocessor, pair_codes: bool) -> float:
        """A logistic regression on the one-number bins (and the pair's code): what the linear member reads."""
        def features(df: pd.DataFrame) -> sparse.csr_matrix:
            blocks = [p.numeric(df).numpy()[:, 2:]]  # the bins' encodings (after the two standardised values)
            if pair_codes:
                blocks.append(np.eye(p.cardinalities[-1])[p.categorical(df).numpy()[:, -1]])
            return sparse.csr_matrix(np.hstack(blocks))
        model = LogisticRegression(C=10, max_iter=5000).fit(features(train), train["y"])
        return float((model.predict(features(test)) == test["y"]).mean())

    without = Preprocessor.fit(train, SCHEMA, **fit)
    assert without.categorical_columns == ["kind"] and without.pair_trees == []
    assert accuracy(without, False) < 0.75 < 0.95 < accuracy(pre, True)


def test_pairs_are_not_fitted_without_labels_and_skip_a_constant_number() -> None:
    train = _table(200, 3).assign(year=2011)  # one year: nothing to pair
    assert Preprocessor.fit(train, SCHEMA, text_buckets=64, image_size=32, image_index=0, pair_bins=True,
                            labels=train["y"].to_numpy()).pair_trees == []
    assert Preprocessor.fit(_table(200, 3), SCHEMA, text_buckets=64, image_size=32, image_index=0,
                            pair_bins=True).pair_trees == []  # quantile bins: no labels to fit a tree to


def test_the_pairs_are_a_block_of_the_linear_member_with_its_own_penalty_chosen_on_validation(tmp_path: Path) -> None:
    """The pairs' codes share the codes' table but not their penalty: a table without a crossing can leave
    them out in effect (the grid's top) without weakening its plain codes."""
    torch.set_num_threads(1)
    validated = make_validated(tmp_path, n_train=96, n_val=48, n_test=16)
    data = ValidatedData.read(validated)
    pre, kwargs, module = build_module(config(validated, pair_bins=True), data)
    pairs = pre.pair_columns
    assert pairs >= len(pre.pair_trees) > 0 and kwargs["linear_only_codes"] == len(pre.frequency_codes) + pairs
    report = module.linear_report
    scores = {float(k): v for k, v in report["tried"]["pairs"].items()}
    assert report["l2"]["pairs"] in L2_GRIDS["pairs"] and min(scores, key=scores.get) == report["l2"]["pairs"]

    ds = FusionDataset(data.train, pre, data.dataset_root, labels=data.labels(data.train))
    batch = {k: torch.stack([ds[i][k] for i in range(len(ds))]) for k in ds[0]}
    model = module.model.eval()
    x = design(model, batch, pair_codes=pairs)
    assert list(x) == ["text", "chars", "categorical", "pairs", "numerical"]
    codes = (batch["categorical"] + model.linear.code_offsets).numpy()
    assert set(x["pairs"].indices) == set(codes[:, -pairs:].ravel())  # each block reads its own columns
    assert set(x["categorical"].indices) == set(codes[:, :-pairs].ravel())
    # both blocks' weights live in the one table the forward reads: its logits are the blocks' sum
    with torch.no_grad():
        ours = model.linear(getattr(model, "text", None), batch, set()).double().numpy()
        theirs = sum(m @ model.linear.weight(b).double().numpy() for b, m in x.items())
        theirs = theirs + model.linear.intercept.double().numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4)
    rows = np.unique(codes[:, -pairs:])
    assert model.linear.categorical_weight[rows].abs().sum() > 0  # fitted, at the penalty chosen


def test_a_wide_table_pairs_only_the_numbers_whose_own_bins_found_the_most() -> None:
    counts = [3, 9, 1, 9, 5, 2, 8, 7, 4, 6, 2, 10, 11, 2]  # 14 numbers: 91 pairs, too many
    chosen = paired_numbers(counts)
    assert len(chosen) == MAX_PAIRED == 12 and chosen == sorted(chosen)
    assert set(range(14)) - set(chosen) == {2, 13}  # the fewest bins left out, a tie by column order
    assert paired_numbers([4, 2, 3]) == [0, 1, 2]  # a narrow table: every number
