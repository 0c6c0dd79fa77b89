"""The classical baseline every evaluation reports beside the fusion model: what the network must beat.

scikit-learn only, fitted on the rows the network is fitted on (the validated train split), stopped early
on the rows the network picks its epoch on (the val split), scored on the same test rows:

- a TF-IDF linear text model (word uni+bigrams of Name + Description, logistic regression), whose
  out-of-fold probabilities on the training rows (and the full-fit probabilities on the test rows) become
  features of
- a gradient-boosted tree model (HistGradientBoosting) on the tabular columns, codes as categories, plus
  the lengths of the texts.

Stacking out of fold keeps the text score honest: a score fitted on a row never describes that row. The
network alone is compared with this; the network never sees the baseline's output.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
from sklearn.ensemble import HistGradientBoostingClassifier
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold
from sklearn.multiclass import OneVsRestClassifier

from fusion_model.schema import CATEGORICAL_COLUMNS, LABEL, NUMERIC_COLUMNS, TEXT_COLUMNS

NAME = "HistGradientBoosting(tabular + text lengths) + out-of-fold TF-IDF logistic text score"
FOLDS = 5
# A category seen fewer times than this in training is "other": trees cannot learn from a handful of rows,
# and HistGradientBoosting takes at most 255 categories per column.
MIN_CATEGORY_ROWS = 5
MAX_CATEGORIES = 250


@dataclass(frozen=True)
class BaselineResult:
    proba: np.ndarray  # test rows x classes, columns in `classes` order
    seconds: float
    others: tuple[np.ndarray, ...] = ()  # the same for each extra table scored (e.g. a batch's holdout)


def _texts(df: pd.DataFrame) -> pd.Series:
    return df[list(TEXT_COLUMNS)].fillna("").astype(str).agg(" ".join, axis=1)


def _text_model(seed: int, n_classes: int) -> LogisticRegression | OneVsRestClassifier:
    # liblinear is the fastest solver on this sparse text; for the 0-4 label one-vs-rest liblinear models
    # score as well as the multinomial fit in a fraction of its time (BENCHMARKS.md)
    binary = LogisticRegression(C=2.0, solver="liblinear", max_iter=2000, random_state=seed)
    return binary if n_classes == 2 else OneVsRestClassifier(binary)


def _text_scores(train: pd.DataFrame, tests: list[pd.DataFrame], y: np.ndarray,
                 seed: int) -> tuple[np.ndarray, list[np.ndarray]]:
    """Out-of-fold class probabilities of the text model on `train`; full-fit probabilities on each test.

    The vocabulary and idf are fitted once on all training texts (no labels in them: the folds still
    never see the labels of the rows they score), which is most of the cost."""
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), min_df=2, max_features=200_000, sublinear_tf=True,
                                 strip_accents="unicode")
    x = vectorizer.fit_transform(_texts(train))
    n_classes = len(np.unique(y))
    oof = np.zeros((len(train), n_classes))
    folds = StratifiedKFold(n_splits=min(FOLDS, int(np.bincount(y).min())), shuffle=True, random_state=seed)
    for fit_rows, score_rows in folds.split(x, y):
        oof[score_rows] = _text_model(seed, n_classes).fit(x[fit_rows], y[fit_rows]).predict_proba(x[score_rows])
    model = _text_model(seed, n_classes).fit(x, y)
    return oof, [model.predict_proba(vectorizer.transform(_texts(test))) for test in tests]


def _tabular(df: pd.DataFrame, categories: dict[str, list[int]]) -> pd.DataFrame:
    out = pd.DataFrame(index=df.index)
    for col in CATEGORICAL_COLUMNS:
        out[col] = pd.Categorical(df[col].where(df[col].isin(categories[col])), categories=categories[col])
    for col in NUMERIC_COLUMNS:
        out[col] = df[col].astype("float64")
    for col in TEXT_COLUMNS:
        text = df[col].fillna("").astype(str)
        out[f"{col}_chars"] = text.str.len()
        out[f"{col}_words"] = text.str.split().str.len()
    return out


def _frequent_categories(train: pd.DataFrame) -> dict[str, list[int]]:
    out = {}
    for col in CATEGORICAL_COLUMNS:
        counts = train[col].value_counts()
        out[col] = sorted(int(c) for c in counts[counts >= MIN_CATEGORY_ROWS].index[:MAX_CATEGORIES])
    return out


def fit_and_score(train: pd.DataFrame, val: pd.DataFrame, test: pd.DataFrame, classes: list[int], seed: int,
                  others: tuple[pd.DataFrame, ...] = ()) -> BaselineResult:
    """Fit on `train`, stop the trees early on `val` (validated rows with the label), return class
    probabilities for `test` (and `others`)."""
    started = time.perf_counter()
    index = {c: i for i, c in enumerate(classes)}
    y, y_val = train[LABEL].map(index).to_numpy(), val[LABEL].map(index).to_numpy()
    tests = [val, test, *others]
    oof, text_scores = _text_scores(train, tests, y, seed)
    categories = _frequent_categories(train)
    x_train, x_tests = _tabular(train, categories), [_tabular(t, categories) for t in tests]
    for k in range(1, oof.shape[1]):  # one column is redundant (rows sum to 1)
        x_train[f"text_score_{k}"] = oof[:, k]
        for x, scores in zip(x_tests, text_scores, strict=True):
            x[f"text_score_{k}"] = scores[:, k]
    gbdt = HistGradientBoostingClassifier(
        learning_rate=0.05, max_iter=600, max_leaf_nodes=31, min_samples_leaf=30, l2_regularization=1.0,
        categorical_features="from_dtype", early_stopping=True, n_iter_no_change=30, random_state=seed,
    )
    gbdt.fit(x_train, y, X_val=x_tests[0], y_val=y_val)
    probas = []
    for x in x_tests[1:]:
        proba = np.zeros((len(x), len(classes)))
        proba[:, gbdt.classes_] = gbdt.predict_proba(x)
        probas.append(proba)
    return BaselineResult(proba=probas[0], seconds=round(time.perf_counter() - started, 2), others=tuple(probas[1:]))
