"""Evaluation plots a person can open offline (matplotlib PNG) and the same data as CSV for `dvc plots`.

DVC's HTML loads Vega from a CDN and is blank offline, so the PNGs are the human view; the CSVs are what
dvc.yaml's `plots:` section points at (`roc.csv`: fpr,tpr; `confusion.csv`: actual,predicted per row).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI; must precede pyplot

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from sklearn.metrics import ConfusionMatrixDisplay, auc, confusion_matrix, roc_curve  # noqa: E402


def roc_points(y_true: np.ndarray, proba: np.ndarray, classes: Sequence[int]) -> pd.DataFrame:
    """The ROC curve DVC plots: class 1 vs 0 for binary, micro-averaged one-vs-rest for multiclass."""
    y = np.asarray(y_true)
    if len(classes) == 2:
        fpr, tpr, thr = roc_curve(y, proba[:, 1], pos_label=classes[1])
    else:
        onehot = (y[:, None] == np.asarray(classes)[None, :]).astype(int)
        fpr, tpr, thr = roc_curve(onehot.ravel(), proba.ravel())
    # roc_curve's first threshold is +inf (the (0, 0) point); CSV and JSON readers choke on inf.
    thr = np.where(np.isfinite(thr), thr, 1.0)
    return pd.DataFrame({"fpr": fpr, "tpr": tpr, "threshold": thr})


def write_roc(out_dir: Path, y_true: np.ndarray, proba: np.ndarray, classes: Sequence[int]) -> tuple[Path, Path]:
    """roc.csv (fpr,tpr,threshold) and roc.png; multiclass PNGs also draw each class one-vs-rest."""
    points = roc_points(y_true, proba, classes)
    csv_path, png_path = out_dir / "roc.csv", out_dir / "roc.png"
    points.to_csv(csv_path, index=False, float_format="%.6g")

    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    label = "class 1 vs 0" if len(classes) == 2 else "micro-average"
    ax.plot(points.fpr, points.tpr, lw=2, label=f"{label} (AUC {auc(points.fpr, points.tpr):.3f})")
    if len(classes) > 2:
        y = np.asarray(y_true)
        for i, c in enumerate(classes):
            if 0 < (y == c).sum() < len(y):  # a class absent from the labels has no curve
                fpr, tpr, _ = roc_curve(y == c, proba[:, i])
                ax.plot(fpr, tpr, lw=1, alpha=0.7, label=f"class {c} (AUC {auc(fpr, tpr):.3f})")
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC curve (test set)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return csv_path, png_path


def write_confusion(
    out_dir: Path, y_true: np.ndarray, y_pred: np.ndarray, classes: Sequence[int]
) -> tuple[Path, Path]:
    """confusion.csv (one actual,predicted pair per row, DVC's confusion template) and confusion_matrix.png."""
    csv_path, png_path = out_dir / "confusion.csv", out_dir / "confusion_matrix.png"
    pd.DataFrame({"actual": np.asarray(y_true, dtype=int), "predicted": np.asarray(y_pred, dtype=int)}).to_csv(
        csv_path, index=False
    )
    matrix = confusion_matrix(y_true, y_pred, labels=list(classes))
    fig, ax = plt.subplots(figsize=(5, 4.5), dpi=100)
    ConfusionMatrixDisplay(matrix, display_labels=list(classes)).plot(ax=ax, cmap="Blues", colorbar=False)
    ax.set_title("Confusion matrix (test set, rows = actual)")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return csv_path, png_path
