"""The classical baseline every evaluation reports beside the fusion model: what the network must beat.

scikit-learn only, fitted on the rows the network is fitted on (the validated train split), stopped early
on the rows the network picks its epoch on (the val split), scored on the same test rows, and given every
signal the network gets (the columns by role of the dataset schema):

- text: a TF-IDF linear model of the text columns (word uni+bigrams; logistic regression for classes, ridge
  regression for ordinal and regression labels);
- images: a linear model of cheap colour features of each row's photo (an 8x8 thumbnail and per-channel
  histograms, the photo the network uses);
- the codes and the `dataset.frequency` keys (a rescuer, an item: thousands of values), target-encoded
  out of fold (scikit-learn's TargetEncoder: each value's shrunk mean label, cross-fitted);
- their out-of-fold scores on the training rows (full-fit scores on the other rows) are features, beside
  the tabular columns (the frequent codes as native categories, numbers, codes of whole numbers also as
  numbers), the lengths of the texts and the same training-row frequencies the network counts, of
- a gradient-boosted tree model (HistGradientBoosting): a classifier for binary and multiclass labels, a
  regressor for ordinal (on the class index) and regression labels (on the transformed target).

As the network is, it is selected on the validation rows (the trees' count by early stopping, the decision
rule: ordinal cut points, multiclass class biases for macro F1) and then refitted on train + val with that many
trees, every stacked score recomputed out of fold over those rows. Stacking out of fold keeps each score
honest: a score fitted on a row never describes that row. The network alone is compared with this; the
network never sees the baseline's output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image
from sklearn.dummy import DummyClassifier
from sklearn.ensemble import HistGradientBoostingClassifier, HistGradientBoostingRegressor
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression, Ridge
from sklearn.model_selection import KFold, StratifiedKFold
from sklearn.multiclass import OneVsRestClassifier
from sklearn.preprocessing import StandardScaler, TargetEncoder

from fusion_model.dataset import DatasetSchema, canonical, integer_codes, row_images
from fusion_model.decision import apply_class_bias, apply_cutpoints, fit_class_bias, fit_cutpoints
from fusion_model.predict import Predictions

NAME = ("HistGradientBoosting(tabular + text lengths + frequencies) + out-of-fold target-encoded codes, TF-IDF "
        "text and colour-feature image scores, refitted on train + val")
FOLDS = 5
# A category seen fewer times than this in training is "other": trees cannot learn from a handful of rows,
# and HistGradientBoosting takes at most 255 categories per column.
MIN_CATEGORY_ROWS = 5
MAX_CATEGORIES = 250
THUMBNAIL = 8  # the photo's colours on an 8x8 grid
HISTOGRAM_BINS = 8  # per RGB channel


@dataclass(frozen=True)
class BaselineResult:
    predictions: Predictions  # the test rows
    seconds: float
    others: tuple[Predictions, ...] = ()  # the same for each extra table scored (e.g. a batch's holdout)


@dataclass(frozen=True)
class Task:
    problem_type: str
    num_classes: int  # 0 for regression
    transform: str = "none"

    @property
    def classifies(self) -> bool:
        """The trees and the text model predict classes (binary, multiclass); else a number."""
        return self.problem_type in ("binary", "multiclass")


def _texts(df: pd.DataFrame, columns: list[str]) -> pd.Series:
    return df[columns].fillna("").astype(str).agg(" ".join, axis=1)


def _linear(task: Task, seed: int) -> LogisticRegression | OneVsRestClassifier | Ridge:
    if not task.classifies:
        return Ridge(alpha=1.0)
    # liblinear is the fastest solver on sparse text; for several classes one-vs-rest liblinear models
    # score as well as the multinomial fit in a fraction of its time (BENCHMARKS.md)
    binary = LogisticRegression(C=2.0, solver="liblinear", max_iter=2000, random_state=seed)
    return binary if task.num_classes == 2 else OneVsRestClassifier(binary)


def _score(model: object, x: object, task: Task) -> np.ndarray:
    """A linear model's output as stacking features: class probabilities (one redundant column dropped), or
    the predicted number as one column."""
    if task.classifies:
        return _class_proba(model, x, task)[:, 1:]
    return model.predict(x)[:, None]  # type: ignore[attr-defined]


def _class_proba(model: object, x: object, task: Task) -> np.ndarray:
    """Probabilities over every class of the task: a class the model's rows lacked (a rare class missing
    from a fold) keeps its column, at 0."""
    proba = np.zeros((x.shape[0], task.num_classes))  # type: ignore[attr-defined]
    proba[:, model.classes_] = model.predict_proba(x)  # type: ignore[attr-defined]
    return proba


def _folds(y: np.ndarray, task: Task, seed: int) -> StratifiedKFold | KFold:
    """The seeded folds every out-of-fold score uses (stratified by class where there are classes)."""
    if task.classifies:
        return StratifiedKFold(n_splits=max(2, min(FOLDS, int(np.bincount(y).min()))), shuffle=True,
                               random_state=seed)
    return KFold(n_splits=FOLDS, shuffle=True, random_state=seed)


def _out_of_fold(x_train: object, tests: list[object], y: np.ndarray, task: Task, seed: int
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
    """Out-of-fold scores of a linear model on the training rows; full-fit scores on each other table."""
    width = task.num_classes - 1 if task.classifies else 1
    oof = np.zeros((len(y), width))
    for fit_rows, score_rows in _folds(y, task, seed).split(np.zeros(len(y)), y):
        model = _fitted_linear(x_train[fit_rows], y[fit_rows], task, seed)  # type: ignore[index]
        oof[score_rows] = _score(model, x_train[score_rows], task)  # type: ignore[index]
    model = _fitted_linear(x_train, y, task, seed)
    return oof, [_score(model, x, task) for x in tests]


def _fitted_linear(x: object, y: np.ndarray, task: Task, seed: int) -> object:
    """The linear model fitted on (x, y); the classes' training shares where the rows hold one class only
    (a logistic regression needs two)."""
    if task.classifies and len(np.unique(y)) < 2:
        return DummyClassifier(strategy="prior").fit(x, y)
    return _linear(task, seed).fit(x, y)


def _text_scores(train: pd.DataFrame, tests: list[pd.DataFrame], y: np.ndarray, task: Task, columns: list[str],
                 seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """The vocabulary and idf are fitted once on all training texts (no labels in them: the folds still
    never see the labels of the rows they score), which is most of the cost."""
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, max_features=200_000, sublinear_tf=True,
                                 strip_accents="unicode")
    try:
        x = vectorizer.fit_transform(_texts(train, columns))
    except ValueError:  # no word occurs in two training rows: nothing to learn from
        return np.zeros((len(train), 0)), [np.zeros((len(t), 0)) for t in tests]
    return _out_of_fold(x, [vectorizer.transform(_texts(t, columns)) for t in tests], y, task, seed)


def image_features(df: pd.DataFrame, images_root: Path, image_columns: list[str], image_index: int) -> np.ndarray:
    """Per row: the chosen photo's colours on a THUMBNAIL x THUMBNAIL grid and a histogram per channel
    (NaN for a row without a photo)."""
    width = 3 * THUMBNAIL * THUMBNAIL + 3 * HISTOGRAM_BINS
    out = np.full((len(df), width), np.nan, dtype=np.float32)
    for i, row in enumerate(df[image_columns].to_dict("records")):
        paths = row_images(row, image_columns)
        if not paths:
            continue
        with Image.open(images_root / paths[min(image_index, len(paths) - 1)]) as im:
            im.draft("RGB", (4 * THUMBNAIL, 4 * THUMBNAIL))  # decode at a fraction of the size
            rgb = np.asarray(im.convert("RGB").resize((32, 32), Image.BILINEAR), dtype=np.float32) / 255.0
        thumb = rgb.reshape(THUMBNAIL, 32 // THUMBNAIL, THUMBNAIL, 32 // THUMBNAIL, 3).mean(axis=(1, 3))
        hist = [np.histogram(rgb[..., c], bins=HISTOGRAM_BINS, range=(0, 1))[0] / rgb[..., c].size for c in range(3)]
        out[i] = np.concatenate([thumb.ravel(), *hist])
    return out


def _image_scores(feats: list[np.ndarray], y: np.ndarray, task: Task, seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Out-of-fold image scores from each table's `image_features` (the training rows' first); NaN for rows
    without a photo (the trees treat NaN as missing)."""
    train = feats[0]
    has = [~np.isnan(f).any(axis=1) for f in feats]
    width = task.num_classes - 1 if task.classifies else 1
    if has[0].sum() < 2 * FOLDS or (task.classifies and len(np.unique(y[has[0]])) < 2):
        return np.full((len(train), 0), np.nan), [np.zeros((len(t), 0)) for t in feats[1:]]
    scaler = StandardScaler().fit(feats[0][has[0]])
    scaled = [scaler.transform(np.nan_to_num(f)) for f in feats]
    oof_rows, test_scores = _out_of_fold(scaled[0][has[0]], [s for s in scaled[1:]], y[has[0]], task, seed)
    oof = np.full((len(train), width), np.nan)
    oof[has[0]] = oof_rows
    return oof, [np.where(h[:, None], s, np.nan) for h, s in zip(has[1:], test_scores, strict=True)]


def _frequent_categories(train: pd.DataFrame, columns: list[str]) -> dict[str, list[str]]:
    out = {}
    for col in columns:
        counts = train[col].map(canonical).value_counts()
        out[col] = sorted(str(c) for c in counts[counts >= MIN_CATEGORY_ROWS].index[:MAX_CATEGORIES])
    return out


def _tabular(df: pd.DataFrame, schema: DatasetSchema, categories: dict[str, list[str]],
             counts: dict[str, pd.Series], in_train: bool, numbered: list[str]) -> pd.DataFrame:
    out = pd.DataFrame(index=df.index)
    for col in schema.columns.categorical:
        values = df[col].map(canonical)
        out[col] = pd.Categorical(values.where(values.isin(categories[col])), categories=categories[col])
    for col in numbered:  # a code of whole numbers (an item number) also as a number, as the network reads it
        out[f"{col}_number"] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    for col in schema.columns.numerical:
        out[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    for col in schema.columns.text:
        text = df[col].fillna("").astype(str)
        out[f"{col}_chars"] = text.str.len()
        out[f"{col}_words"] = text.str.split().str.len()
    for col, table in counts.items():  # the network's frequencies: a training row leaves itself out
        keys = df[col].map(canonical) if col in df.columns else pd.Series("", index=df.index)
        n = keys.map(table).fillna(0).to_numpy(dtype=float, copy=True)
        n[keys.to_numpy() == ""] = 0
        out[f"{col}_frequency"] = np.clip(n - 1, 0, None) if in_train else n
    return out


def _target(y: np.ndarray, task: Task) -> np.ndarray:
    if task.problem_type == "regression" and task.transform == "log1p":
        return np.log1p(np.clip(y, 0, None))
    return y.astype(np.float64) if not task.classifies else y


def _encoded_codes(train: pd.DataFrame, tests: list[pd.DataFrame], y: np.ndarray, task: Task, columns: list[str],
                   seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Each code's shrunk mean label (per class for several classes), cross-fitted on the training rows."""
    kind = {"binary": "binary", "multiclass": "multiclass"}.get(task.problem_type, "continuous")

    def codes(df: pd.DataFrame) -> pd.DataFrame:
        return pd.DataFrame({c: df[c].map(canonical) if c in df.columns else "" for c in columns}, index=df.index)

    encoder = TargetEncoder(target_type=kind, cv=_folds(y, task, seed))
    return encoder.fit_transform(codes(train), y), [encoder.transform(codes(t)) for t in tests]


def _features(train: pd.DataFrame, tests: list[pd.DataFrame], target: np.ndarray, task: Task, schema: DatasetSchema,
              seed: int, image_feats: list[np.ndarray] | None) -> tuple[pd.DataFrame, list[pd.DataFrame]]:
    """The trees' inputs for the training rows (every score out of fold) and for each other table."""
    categories = _frequent_categories(train, schema.columns.categorical)
    counts = {c: train[c].map(canonical).value_counts() for c in schema.frequency if c in train.columns}
    numbered = integer_codes(train, list(schema.columns.categorical))
    x_train = _tabular(train, schema, categories, counts, in_train=True, numbered=numbered)
    x_tests = [_tabular(t, schema, categories, counts, in_train=False, numbered=numbered) for t in tests]
    stacked: list[tuple[str, tuple[np.ndarray, list[np.ndarray]]]] = []
    coded = list(dict.fromkeys([*schema.columns.categorical, *schema.frequency]))
    if coded:
        stacked.append(("code", _encoded_codes(train, tests, target, task, coded, seed)))
    if schema.columns.text:
        stacked.append(("text", _text_scores(train, tests, target, task, schema.columns.text, seed)))
    if image_feats is not None:
        stacked.append(("image", _image_scores(image_feats, target, task, seed)))
    for name, (oof, scores) in stacked:
        for k in range(oof.shape[1]):
            x_train[f"{name}_score_{k}"] = oof[:, k]
            for x, s in zip(x_tests, scores, strict=True):
                x[f"{name}_score_{k}"] = s[:, k]
    return x_train, x_tests


def fit_and_score(train: pd.DataFrame, val: pd.DataFrame, test: pd.DataFrame, y_train: np.ndarray,
                  y_val: np.ndarray, schema: DatasetSchema, problem_type: str, num_classes: int, seed: int,
                  images_root: Path, image_index: int = 0, others: tuple[pd.DataFrame, ...] = (),
                  macro_f1_rule: bool = True) -> BaselineResult:
    """Select on `train` (labels `y_train`: class indices, or values for regression) with `val` (the trees
    stopped early, the decision rule fitted), refit on both with that many trees, and return the
    predictions for `test` (and `others`). `macro_f1_rule`: a multiclass label's class biases for macro F1
    (false: the argmax, where the evaluation's metric is another)."""
    started = time.perf_counter()
    task = Task(problem_type, num_classes if problem_type != "regression" else 0, schema.label.transform)
    tables = [train, val, test, *others]
    images = ([image_features(t, images_root, schema.columns.image, image_index) for t in tables]
              if schema.columns.image else None)
    trees = dict(learning_rate=0.05, max_iter=600, max_leaf_nodes=31, min_samples_leaf=30, l2_regularization=1.0,
                 categorical_features="from_dtype", random_state=seed)
    model = HistGradientBoostingClassifier if task.classifies else HistGradientBoostingRegressor
    # selection: the trees' count and the decision rule, on the validation rows
    target = _target(y_train, task)
    x_train, x_tests = _features(train, tables[1:], target, task, schema, seed, images)
    gbdt = model(**trees, early_stopping=True, n_iter_no_change=30).fit(
        x_train, target, X_val=x_tests[0], y_val=_target(y_val, task))
    rule = _decide([_predict(gbdt, x_tests[0], task)], y_val, task, macro_f1_rule)
    # refit on every labelled row with that many trees
    every, y_every = pd.concat([train, val]), np.concatenate([y_train, y_val])
    target = _target(y_every, task)
    every_images = None if images is None else [np.concatenate(images[:2]), *images[2:]]
    x_every, x_rest = _features(every, tables[2:], target, task, schema, seed, every_images)
    refit = model(**{**trees, "max_iter": max(1, gbdt.n_iter_)}, early_stopping=False).fit(x_every, target)
    results = [rule([_predict(refit, x, task)])[0] for x in x_rest]
    return BaselineResult(predictions=results[0], seconds=round(time.perf_counter() - started, 2),
                          others=tuple(results[1:]))


def _predict(gbdt: object, x: pd.DataFrame, task: Task) -> Predictions:
    if task.classifies:
        proba = _class_proba(gbdt, x, task)
        return Predictions(prediction=proba.argmax(1), proba=proba,
                           score=proba[:, 1] if task.problem_type == "binary" else None)
    value = gbdt.predict(x)  # type: ignore[attr-defined]
    if task.problem_type == "regression":
        value = np.expm1(value) if task.transform == "log1p" else value
        return Predictions(prediction=value, proba=None, score=value)
    return Predictions(prediction=np.clip(np.rint(value), 0, task.num_classes - 1).astype(np.int64), proba=None,
                       score=value)


def _decide(on_val: list[Predictions], y_val: np.ndarray, task: Task,
            macro_f1_rule: bool) -> Callable[[list[Predictions]], list[Predictions]]:
    """The decision rule fitted on the validation rows' predictions, as a function applied to any table."""
    if task.problem_type == "ordinal":
        cuts = fit_cutpoints(on_val[0].score, y_val, task.num_classes)  # type: ignore[arg-type]
        return lambda results: [Predictions(prediction=apply_cutpoints(r.score, cuts), proba=None, score=r.score)  # type: ignore[arg-type]
                                for r in results]
    if task.problem_type == "multiclass" and macro_f1_rule:
        bias = fit_class_bias(on_val[0].proba)  # type: ignore[arg-type]
        return lambda results: [Predictions(prediction=apply_class_bias(r.proba, bias), proba=r.proba, score=r.score)  # type: ignore[arg-type]
                                for r in results]
    return lambda results: results
