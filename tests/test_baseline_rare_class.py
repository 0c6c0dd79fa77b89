"""Evaluate's classical baseline on a table with a class of one training row (a merged `other` class of a
real catalogue): its out-of-fold text scores fit folds without that class, and every class keeps its column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusion_model.dataset import resolve_schema
from tasks.evaluate.baseline import fit_and_score

WORDS = {0: "wool coat warm scarf", 1: "linen shorts light sandals", 2: "rain jacket umbrella boots",
         3: "gift voucher card"}


def _table(labels: list[int], seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    return pd.DataFrame({
        "name": [f"{WORDS[y]} item{rng.integers(0, 50)}" for y in labels],
        "kind": [f"k{(y + rng.integers(0, 2)) % 4}" for y in labels],
        "x": rng.normal(0, 1, len(labels)) + np.asarray(labels),
    })


# training rows per class (the last has one); the classes of the validation and test rows
@pytest.mark.parametrize("problem_type, counts, seen", [("multiclass", (30, 30, 19, 1), 3), ("binary", (79, 1), 2)])
def test_a_class_with_one_training_row_keeps_its_column(problem_type: str, counts: tuple[int, ...], seen: int,
                                                         tmp_path: Path) -> None:
    schema = resolve_schema({"preset": None, "id": None, "label": {"column": "y", "problem_type": problem_type},
                             "columns": {"text": ["name"], "categorical": ["kind"], "numerical": ["x"]}})
    y_train = np.repeat(np.arange(len(counts)), counts)
    y_val, y_test = np.resize(np.arange(seen), 30), np.resize(np.arange(seen), 40)
    got = fit_and_score(_table(list(y_train), 0), _table(list(y_val), 1), _table(list(y_test), 2), y_train, y_val,
                        schema, problem_type, len(counts), seed=0, images_root=tmp_path)
    proba = got.predictions.proba
    assert proba.shape == (len(y_test), len(counts)) and np.allclose(proba.sum(1), 1.0)
    common = y_test < len(counts) - 1  # the words give the common classes away
    assert (got.predictions.prediction[common] == y_test[common]).mean() > 0.9


def test_the_multiclass_baseline_takes_the_macro_f1_rule_only_where_macro_f1_is_the_metric(tmp_path: Path) -> None:
    """As the network: class biases fitted on the validation rows' probabilities for macro F1 (the rarely
    most likely class predicted more often), the argmax where the evaluation's metric is another."""
    schema = resolve_schema({"preset": None, "id": None, "label": {"column": "y", "problem_type": "multiclass"},
                             "columns": {"text": ["name"], "categorical": ["kind"], "numerical": ["x"]}})
    rng = np.random.default_rng(3)
    y_train, y_val, y_test = (rng.choice(3, n, p=[0.6, 0.32, 0.08]) for n in (300, 150, 300))

    def table(labels: np.ndarray, seed: int) -> pd.DataFrame:  # only a noisy number tells the classes apart
        r = np.random.default_rng(seed)
        return pd.DataFrame({"name": ["an item"] * len(labels), "kind": ["k"] * len(labels),
                             "x": r.normal(0, 1.2, len(labels)) + labels})

    tables = (table(y_train, 0), table(y_val, 1), table(y_test, 2))
    argmax, rule = (fit_and_score(*tables, y_train, y_val, schema, "multiclass", 3, seed=0, images_root=tmp_path,
                                  macro_f1_rule=flag).predictions for flag in (False, True))
    assert np.array_equal(argmax.prediction, argmax.proba.argmax(1))
    assert np.allclose(rule.proba, argmax.proba)  # the same trees; only the decision differs
    assert (rule.prediction == 2).sum() > (argmax.prediction == 2).sum()


def test_a_code_of_whole_numbers_also_reaches_the_trees_as_a_number(tmp_path: Path) -> None:
    """An item number declared a code, whose order tells the label (items numbered by kind): the test rows'
    items were never seen in training, so only the number's order can tell them apart."""
    schema = resolve_schema({"preset": None, "id": None, "label": {"column": "y", "problem_type": "binary"},
                             "columns": {"text": ["name"], "categorical": ["item"], "numerical": ["x"]}})
    rng = np.random.default_rng(5)
    items = rng.permutation(1000)
    parts = np.split(items, [400, 600])  # training, validation and test rows each their own items

    def table(numbers: np.ndarray, seed: int) -> tuple[pd.DataFrame, np.ndarray]:
        r = np.random.default_rng(seed)
        return (pd.DataFrame({"name": ["an item"] * len(numbers), "item": [str(n) for n in numbers],
                              "x": r.normal(0, 1, len(numbers))}), (numbers >= 500).astype(int))

    (train, y_train), (val, y_val), (test, y_test) = (table(p, i) for i, p in enumerate(parts))
    got = fit_and_score(train, val, test, y_train, y_val, schema, "binary", 2, seed=0, images_root=tmp_path)
    assert (got.predictions.prediction == y_test).mean() > 0.9
