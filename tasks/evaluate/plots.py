"""Evaluation plots a person can open offline (matplotlib PNG) and the same data as CSV for `dvc plots`.

The PNGs need nothing to open; the CSVs are what dvc.yaml's top-level `plots:` section draws (`dvc plots
show` / `diff`, whose page loads its Vega scripts from vendor/vega/: docs/dvc.md). What is drawn follows
the problem type:
- classification (binary, multiclass, ordinal): `roc.csv` (fpr,tpr: the positive class for binary, the
  micro-average one-vs-rest otherwise) + `roc.png`, `confusion.csv` (actual,predicted per row, DVC's
  confusion template) + `confusion_matrix.png`;
- regression: `residuals.csv` (actual,predicted per row, DVC's scatter template) + `predicted_vs_actual.png`
  and `residuals.png`.
Every evaluation writes every CSV dvc.yaml draws (PLOT_CSVS): those of the other problem types hold their
header and no row, which DVC loads as a plot with no data and draws nothing. A missing file would be a
load error ("DVC failed to load some plots") for the whole revision, in `dvc plots show` and in every
`dvc plots diff` that compares it.
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

PLOTS_DIR = "plots"
# Every CSV dvc.yaml's top-level `plots:` draws, with its columns, in the order written.
PLOT_CSVS: dict[str, tuple[str, ...]] = {
    "roc.csv": ("fpr", "tpr", "threshold"),
    "confusion.csv": ("actual", "predicted"),
    "residuals.csv": ("actual", "predicted"),
}


def write_plots(out_dir: Path, kind: str, y: np.ndarray, prediction: np.ndarray, proba: np.ndarray | None,
                classes: Sequence[object], label: str) -> list[Path]:
    """The plots of problem type `kind` into `out_dir`, and the other types' CSVs with their header only."""
    if kind == "regression":
        written = write_regression(out_dir, y, prediction, label)
    else:
        if proba is None:
            raise ValueError(f"{kind} plots need the class probabilities")
        written = [*write_roc(out_dir, y, proba, classes), *write_confusion(out_dir, y, prediction, classes)]
    for name, columns in PLOT_CSVS.items():
        if not (out_dir / name).exists():
            pd.DataFrame(columns=list(columns)).to_csv(out_dir / name, index=False)
            written.append(out_dir / name)
    return written


def roc_points(y: np.ndarray, proba: np.ndarray) -> pd.DataFrame:
    """The ROC curve DVC plots (`y`: class indices): class 1 vs 0 for two classes, micro-averaged
    one-vs-rest for more."""
    y = np.asarray(y)
    if proba.shape[1] == 2:
        fpr, tpr, thr = roc_curve(y, proba[:, 1], pos_label=1)
    else:
        onehot = (y[:, None] == np.arange(proba.shape[1])[None, :]).astype(int)
        fpr, tpr, thr = roc_curve(onehot.ravel(), proba.ravel())
    # roc_curve's first threshold is +inf (the (0, 0) point); CSV and JSON readers choke on inf.
    thr = np.where(np.isfinite(thr), thr, 1.0)
    return pd.DataFrame({"fpr": fpr, "tpr": tpr, "threshold": thr})


def write_roc(out_dir: Path, y: np.ndarray, proba: np.ndarray, classes: Sequence[object]) -> list[Path]:
    """roc.csv (fpr,tpr,threshold) and roc.png; for more than two classes the PNG also draws each class."""
    points = roc_points(y, proba)
    csv_path, png_path = out_dir / "roc.csv", out_dir / "roc.png"
    points.to_csv(csv_path, index=False, float_format="%.6g")

    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    label = f"class {classes[1]} vs {classes[0]}" if len(classes) == 2 else "micro-average"
    ax.plot(points.fpr, points.tpr, lw=2, label=f"{label} (AUC {auc(points.fpr, points.tpr):.3f})")
    if len(classes) > 2:
        y = np.asarray(y)
        for i, c in enumerate(classes):
            if 0 < (y == i).sum() < len(y):  # a class absent from the labels has no curve
                fpr, tpr, _ = roc_curve(y == i, proba[:, i])
                ax.plot(fpr, tpr, lw=1, alpha=0.7, label=f"class {c} (AUC {auc(fpr, tpr):.3f})")
    ax.plot([0, 1], [0, 1], ls="--", color="grey", lw=1, label="chance")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC curve (test set)")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return [csv_path, png_path]


def write_confusion(out_dir: Path, y: np.ndarray, prediction: np.ndarray, classes: Sequence[object]) -> list[Path]:
    """confusion.csv (one actual,predicted pair of class names per row, DVC's confusion template) and
    confusion_matrix.png (`y`, `prediction`: class indices)."""
    csv_path, png_path = out_dir / "confusion.csv", out_dir / "confusion_matrix.png"
    names = np.asarray([str(c) for c in classes], dtype=object)
    pd.DataFrame({"actual": names[np.asarray(y, dtype=int)],
                  "predicted": names[np.asarray(prediction, dtype=int)]}).to_csv(csv_path, index=False)
    matrix = confusion_matrix(y, prediction, labels=list(range(len(classes))))
    size = max(4.5, 0.5 * len(classes) + 2.5)
    fig, ax = plt.subplots(figsize=(size + 0.5, size), dpi=100)
    ConfusionMatrixDisplay(matrix, display_labels=list(names)).plot(ax=ax, cmap="Blues", colorbar=False,
                                                                    xticks_rotation=45 if len(classes) > 4 else 0)
    ax.set_title("Confusion matrix (test set, rows = actual)")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return [csv_path, png_path]


def write_regression(out_dir: Path, y: np.ndarray, prediction: np.ndarray, label: str) -> list[Path]:
    """residuals.csv (actual,predicted per row), predicted_vs_actual.png and residuals.png."""
    y, prediction = np.asarray(y, dtype=float), np.asarray(prediction, dtype=float)
    csv_path = out_dir / "residuals.csv"
    pd.DataFrame({"actual": y, "predicted": prediction}).to_csv(csv_path, index=False, float_format="%.6g")
    scatter, hist = out_dir / "predicted_vs_actual.png", out_dir / "residuals.png"
    fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
    ax.scatter(y, prediction, s=6, alpha=0.5)
    low, high = float(min(y.min(), prediction.min())), float(max(y.max(), prediction.max()))
    ax.plot([low, high], [low, high], ls="--", color="grey", lw=1, label="perfect")
    ax.set(xlabel=f"actual {label}", ylabel=f"predicted {label}", title="Predicted vs actual (test set)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(scatter)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(5, 4), dpi=100)
    ax.hist(prediction - y, bins=40)
    ax.set(xlabel=f"predicted - actual {label}", ylabel="rows", title="Residuals (test set)")
    fig.tight_layout()
    fig.savefig(hist)
    plt.close(fig)
    return [csv_path, scatter, hist]
