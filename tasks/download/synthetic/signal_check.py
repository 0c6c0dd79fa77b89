"""Simple per-modality baselines that show a (binary) PetFinder-layout dataset carries learnable signal.

Logistic regression on one-hot codes (tabular), on token counts (text), on mean colour and simple image
statistics of each row's first photo (image), and on all three together. Used by the tests and by
``bench/synthetic_signal.py``; sklearn only, a second or two for a few thousand rows.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image
from scipy import sparse
from sklearn.feature_extraction.text import CountVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import OneHotEncoder, StandardScaler

from fusion_model.dataset import split_images
from fusion_model.presets import petfinder as pf


def modality_aucs(dataset_dir: Path) -> dict[str, float]:
    """Test ROC AUC of a model fitted on train.csv, per modality and for all three combined."""
    dataset_dir = Path(dataset_dir)
    train = pd.read_csv(dataset_dir / "train.csv", index_col=0, keep_default_na=False)
    test = pd.read_csv(dataset_dir / "test.csv", index_col=0, keep_default_na=False)
    feats = {
        "tabular": _tabular(train, test),
        "text": _text(train, test),
        "image": _image(dataset_dir, train, test),
    }
    feats["all"] = tuple(sparse.hstack([f[i] for f in feats.values()]).tocsr() for i in (0, 1))
    y_train, y_test = train[pf.LABEL].to_numpy(), test[pf.LABEL].to_numpy()
    aucs = {}
    for name, (x_train, x_test) in feats.items():
        model = LogisticRegression(C=0.3, max_iter=2000).fit(x_train, y_train)
        aucs[name] = float(roc_auc_score(y_test, model.predict_proba(x_test)[:, 1]))
    return aucs


def _tabular(train: pd.DataFrame, test: pd.DataFrame) -> tuple[sparse.csr_matrix, sparse.csr_matrix]:
    onehot = OneHotEncoder(handle_unknown="ignore").fit(train[list(pf.CATEGORICAL_COLUMNS)])
    numeric = StandardScaler().fit(np.log1p(train[list(pf.NUMERIC_COLUMNS)]))

    def f(df: pd.DataFrame) -> sparse.csr_matrix:
        cat = onehot.transform(df[list(pf.CATEGORICAL_COLUMNS)])
        num = numeric.transform(np.log1p(df[list(pf.NUMERIC_COLUMNS)]))
        return sparse.hstack([cat, sparse.csr_matrix(num)]).tocsr()

    return f(train), f(test)


def _text(train: pd.DataFrame, test: pd.DataFrame) -> tuple[sparse.csr_matrix, sparse.csr_matrix]:
    vec = CountVectorizer(token_pattern=r"[\w-]+", binary=True).fit(train["Name"] + " " + train["Description"])
    return vec.transform(train["Name"] + " " + train["Description"]), vec.transform(test["Name"] + " " + test["Description"])


def _image_stats(path: Path) -> np.ndarray:
    px = np.asarray(Image.open(path).convert("RGB"), dtype=np.float32) / 255.0
    grey = px.mean(axis=2)
    edges = np.abs(np.diff(grey, axis=0)).mean() + np.abs(np.diff(grey, axis=1)).mean()
    return np.concatenate([px.mean(axis=(0, 1)), px.std(axis=(0, 1)), [grey.mean(), edges]])


def _image(dataset_dir: Path, train: pd.DataFrame, test: pd.DataFrame) -> tuple[sparse.csr_matrix, sparse.csr_matrix]:
    def stats(df: pd.DataFrame) -> np.ndarray:
        return np.stack([_image_stats(dataset_dir / split_images(c)[0]) for c in df[pf.IMAGES]])

    s_train, s_test = stats(train), stats(test)
    scaler = StandardScaler().fit(s_train)
    return sparse.csr_matrix(scaler.transform(s_train)), sparse.csr_matrix(scaler.transform(s_test))
