"""The frequency keys' target encodings (fusion_model/preprocess.py): scikit-learn's TargetEncoder, its table
saved with the model for new rows, the training rows' own values cross-fitted, numbers of the deep half alone."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold
from sklearn.preprocessing import TargetEncoder

from fusion_model.build import build_module
from fusion_model.data import ValidatedData
from fusion_model.preprocess import Preprocessor
from fusion_model.target_encoding import keyed_columns
from tests.linear_member_worker import config as _config
from tests.validated_tables import make_validated

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def validated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rescuers that carry the label (r1 places the fast adoptions), as on real PetFinder rows."""
    validated = make_validated(tmp_path_factory.mktemp("targets"), n_train=96, n_val=48, n_test=16)
    for split in ("train", "val", "test"):
        table = pd.read_parquet(validated / f"{split}.parquet")
        table["RescuerID"] = np.where(table["AdoptionSpeed"] == 1, "r1", "r" + (table["row_id"] % 5).astype(str))
        table.to_parquet(validated / f"{split}.parquet")
    return validated


def _fit(data: ValidatedData, train: pd.DataFrame | None = None, labels: np.ndarray | None = None,
         n_classes: int = 2, **keys: object) -> Preprocessor:
    train = data.train if train is None else train
    return Preprocessor.fit(train, data.schema, text_buckets=256, image_size=32, image_index=0,
                            labels=data.labels(train) if labels is None else labels, n_classes=n_classes,
                            frequency_targets=True, **keys)


def _column(pre: Preprocessor, df: pd.DataFrame, name: str, in_train: bool = False) -> np.ndarray:
    """A numeric input as the training process reads it, before standardising (log1p undone)."""
    j = pre.numeric_columns.index(name)
    return np.expm1(pre.numeric(df, in_train=in_train)[:, j].numpy() * pre.numeric_std[j] + pre.numeric_mean[j])


def test_new_rows_read_the_saved_table_and_training_rows_their_cross_fitted_values(validated: Path) -> None:
    data = ValidatedData.read(validated)
    pre = _fit(data)
    assert pre.numeric_columns[-2:] == ["RescuerID target", "Breed1 target"] and pre.target_inputs == 2
    keys = data.train[["RescuerID"]].astype(str).to_numpy(dtype=object)
    labels = data.labels(data.train)
    reference = TargetEncoder(target_type="binary", cv=StratifiedKFold(5, shuffle=True, random_state=0))
    own = reference.fit_transform(keys, labels)[:, 0]
    table = dict(zip(reference.categories_[0], reference.encodings_[0], strict=True))
    new = data.val.assign(RescuerID=np.where(np.arange(len(data.val)) == 0, "never-seen", data.val["RescuerID"]))
    expected = [reference.target_mean_] + [table[k] for k in new["RescuerID"].iloc[1:]]
    np.testing.assert_allclose(_column(pre, new, "RescuerID target"), expected, rtol=1e-5)
    np.testing.assert_allclose(_column(pre, data.train, "RescuerID target", in_train=True), own, rtol=1e-5)
    # the training rows read as new rows would get the full table instead (their own labels in it)
    assert not np.allclose(_column(pre, data.train, "RescuerID target"), own, rtol=1e-3)
    # saved as JSON without the training rows' values; a loaded preprocessor encodes new rows the same
    saved = json.loads(json.dumps(pre.to_dict()))
    assert "target_folds" not in saved and pre.target_folds is not None
    again = Preprocessor.from_dict(saved)
    assert torch.equal(again.numeric(new), pre.numeric(new))


def test_a_training_rows_encoding_never_reads_its_own_label(validated: Path) -> None:
    """A key of one row each (an id): its table entry follows that row's label, its cross-fitted value cannot."""
    data = ValidatedData.read(validated)
    train = data.train.assign(RescuerID=[f"once-{i}" for i in range(len(data.train))])
    pre = _fit(data, train)
    labels = data.labels(train)
    table = np.array([pre.target_tables["RescuerID"][k][0] for k in train["RescuerID"]])
    assert roc_auc_score(labels, table) == 1.0
    own = _column(pre, train, "RescuerID target", in_train=True)
    assert len(np.unique(np.round(own, 6))) <= 5  # one value per fold: the other folds' label mean
    assert roc_auc_score(labels, own) < 0.75


def test_one_encoding_per_class_for_classes_one_for_a_regression_and_none_when_off(validated: Path) -> None:
    data = ValidatedData.read(validated)
    rng = np.random.default_rng(0)
    classes = _fit(data, labels=rng.integers(0, 4, len(data.train)), n_classes=4)
    assert classes.numeric_columns[-8:] == [f"{key} target {k}" for key in ("RescuerID", "Breed1") for k in range(4)]
    rows = np.array([classes.target_tables["RescuerID"][k] for k in ("r1", "r2")])
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=0.05)  # shares of the classes, shrunk
    amounts = _fit(data, labels=rng.normal(size=len(data.train)), n_classes=0, ordered_labels=True)
    assert amounts.numeric_columns[-2:] == ["RescuerID target", "Breed1 target"]
    off = Preprocessor.fit(data.train, data.schema, text_buckets=256, image_size=32, image_index=0,
                           labels=data.labels(data.train), n_classes=2, frequency_targets=False)
    assert off.target_inputs == 0 and not any(c.endswith(" target") for c in off.numeric_columns)


def test_the_encodings_are_numbers_of_the_deep_half_alone(validated: Path) -> None:
    """The linear member reads the same keys one-hot (a penalised effect per value, the GLM's own encoding)."""
    data = ValidatedData.read(validated)
    pre, kwargs, module = build_module(_config(validated), data)
    model = module.model
    crossed = [c for c in data.schema.columns.categorical if c not in data.schema.frequency]
    n = 2 + len(crossed)  # each key, and the key of most values (Breed1 here) crossed with each other code
    assert pre.target_inputs == n and kwargs["deep_only_numbers"] == n
    assert kwargs["n_numeric"] == len(pre.numeric_columns)  # the deep half embeds every number
    linear_bins = sum(len(e) - 1 for e in pre.numeric_bins[:-n])
    assert model.linear.numeric_inputs == len(pre.numeric_columns) - n
    assert model.linear.numerical_weight.shape[0] == linear_bins
    _, off_kwargs, off = build_module(_config(validated, frequency_targets=False), data)
    assert off_kwargs["deep_only_numbers"] == 0 and off_kwargs["n_numeric"] == kwargs["n_numeric"] - n
    # the linear member's fit does not depend on them: the same penalties and weights either way
    for block, weight in off.linear_glm["linear"].weights.items():
        np.testing.assert_allclose(module.linear_glm["linear"].weights[block], weight, rtol=1e-4, atol=1e-6)


def test_an_empty_key_reads_the_labels_mean_in_training_as_for_a_new_row(validated: Path) -> None:
    data = ValidatedData.read(validated)
    train = data.train.assign(RescuerID=np.where(np.arange(len(data.train)) % 3 == 0, "", data.train["RescuerID"]))
    pre = _fit(data, train)
    empty = (train["RescuerID"] == "").to_numpy()
    mean = pre.target_tables["RescuerID"][""][0]
    np.testing.assert_allclose(_column(pre, train, "RescuerID target", in_train=True)[empty], mean, rtol=1e-5)
    np.testing.assert_allclose(_column(pre, train, "RescuerID target")[empty], mean, rtol=1e-5)


def test_training_rows_with_a_repeated_index_are_refused(validated: Path) -> None:
    data = ValidatedData.read(validated)
    twice = pd.concat([data.train.iloc[:20], data.train.iloc[:20]])
    with pytest.raises(ValueError, match="unique row ids"):
        _fit(data, twice)


def test_the_key_of_most_values_is_crossed_with_each_code() -> None:
    counts = {"RescuerID": {"a": 3, "b": 1, "c": 2}, "Breed1": {"1": 5, "2": 1}}
    assert keyed_columns(["RescuerID", "Breed1"], ["Type", "Breed1", "State"], counts, crosses=True) == {
        "RescuerID": ["RescuerID"], "Breed1": ["Breed1"],
        "RescuerID & Type": ["RescuerID", "Type"], "RescuerID & State": ["RescuerID", "State"]}
    assert keyed_columns(["RescuerID", "Breed1"], ["Type"], counts, crosses=False) == {
        "RescuerID": ["RescuerID"], "Breed1": ["Breed1"]}
    assert keyed_columns([], ["Type"], {}, crosses=True) == {}


def test_a_crossed_key_reads_what_neither_column_says_alone(validated: Path) -> None:
    """Each rescuer places its dogs fast and its cats slowly, or the other way round: the rescuer's mean and the
    type's say nothing, the crossed key's mean says it all, for new rows from the saved table too."""
    data = ValidatedData.read(validated)
    n = len(data.train)
    train = data.train.assign(RescuerID=[f"r{i % 12}" for i in range(n)], Breed1="1",
                              Type=[str(1 + (i // 12) % 2) for i in range(n)])
    labels = np.array([(i % 12 % 2) ^ ((i // 12) % 2) for i in range(n)])
    pre = _fit(data, train, labels=labels, frequency_crosses=True)
    assert pre.target_keys["RescuerID & Type"] == ["RescuerID", "Type"]
    assert "Breed1 & Type" not in pre.target_keys  # one value: not the key of most values
    new = train.assign(row_id=train["row_id"] + 10_000)  # read as new rows: the saved tables
    assert roc_auc_score(labels, _column(pre, new, "RescuerID & Type target")) == 1.0
    assert roc_auc_score(labels, _column(pre, new, "RescuerID target")) < 0.7
    assert roc_auc_score(labels, _column(pre, train, "RescuerID & Type target", in_train=True)) > 0.9
    # an empty rescuer reads the label's mean in its crosses too; the saved keys rebuild the same inputs
    empty = new.assign(RescuerID="")
    np.testing.assert_allclose(_column(pre, empty, "RescuerID & Type target"),
                               pre.target_tables["RescuerID & Type"][""][0], rtol=1e-5)
    again = Preprocessor.from_dict(json.loads(json.dumps(pre.to_dict())))
    assert torch.equal(again.numeric(new), pre.numeric(new))


def test_a_model_saved_before_crossed_keys_reads_its_tables_by_their_names(validated: Path) -> None:
    data = ValidatedData.read(validated)
    pre = _fit(data)
    saved = pre.to_dict()
    assert saved["target_keys"] == {"RescuerID": ["RescuerID"], "Breed1": ["Breed1"]}
    saved.pop("target_keys")  # model_config.json of the last format without crossed keys
    assert torch.equal(Preprocessor.from_dict(saved).numeric(data.val), pre.numeric(data.val))
