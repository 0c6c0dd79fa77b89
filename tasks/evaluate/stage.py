"""Evaluate stage: score the validated test table with the converted model in `data/model/` only.

Writes into `out_dir` (swapped in whole, so a failed run leaves the previous evaluation intact):
`metrics.json`, `predictions.csv`, `ablation.json`, `roc.png`, `confusion_matrix.png`, and the plot data
`roc.csv` / `confusion.csv` that dvc.yaml's `plots:` reads. Loading the converted file, never the
training checkpoint, is what proves the conversion.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from filelock import FileLock
from pydantic import BaseModel

from fusion_model.layout import WEIGHTS
from tasks._io.files import write_json
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks._io.hashing import sha256_file
from tasks.errors import StageError
from tasks.evaluate.baseline import NAME as BASELINE_NAME
from tasks.evaluate.baseline import BaselineResult, fit_and_score
from tasks.evaluate.inputs import check_model_dir, load_predictor, load_test_set
from tasks.evaluate.metrics import (
    LabelKind,
    as_class_probabilities,
    compute_metrics,
    fingerprint_test_set,
    label_counts,
    predicted_labels,
    primary_metric_name,
    primary_score,
)
from tasks.evaluate.plots import write_confusion, write_roc
from tasks.params import EvaluateParams

OUTPUT_FILES: tuple[str, ...] = (
    "metrics.json", "predictions.csv", "ablation.json", "roc.png", "confusion_matrix.png", "roc.csv",
    "confusion.csv",
)


class EvaluationSummary(BaseModel):
    out_dir: Path
    rows: int
    primary_metric: str
    primary_value: float
    metrics: dict[str, float | None]
    ablation_drop: dict[str, float | None]
    baseline_value: float | None = None
    baseline_seconds: float | None = None
    plots: list[Path]


def predictions_frame(
    row_ids: np.ndarray, y_true: np.ndarray, proba: np.ndarray, classes: Sequence[int],
    baseline_proba: np.ndarray | None = None,
) -> pd.DataFrame:
    """Columns as the prediction CLI writes them (`proba_<class>`, `prediction`) plus row_id and label, and
    the baseline's probabilities (`baseline_proba_<class>`) when it ran."""
    frame = pd.DataFrame({"row_id": np.asarray(row_ids, dtype=np.int64)})
    for i, c in enumerate(classes):
        frame[f"proba_{c}"] = proba[:, i]
    frame["prediction"] = predicted_labels(proba, classes).astype(np.int64)
    frame["label"] = np.asarray(y_true, dtype=np.int64)
    if baseline_proba is not None:
        for i, c in enumerate(classes):
            frame[f"baseline_proba_{c}"] = baseline_proba[:, i]
    return frame


def ablation_report(
    y_true: np.ndarray,
    full: Mapping[str, float | None],
    masked: Mapping[str, np.ndarray],
    classes: Sequence[int],
    label_kind: LabelKind,
) -> dict[str, Any]:
    """Score with each modality masked out; `drop` = full score - masked score (bigger = more useful)."""
    name = primary_metric_name(label_kind)
    report: dict[str, Any] = {"metric": name, "full": full[name], "modalities": {}}
    for modality, proba in masked.items():
        scores = compute_metrics(y_true, proba, classes, label_kind)
        value = scores[name]
        report["modalities"][modality] = {
            "score": value,
            "drop": None if value is None or full[name] is None else full[name] - value,
            "metrics": scores,
        }
    return report


def write_evaluation(
    out_dir: Path,
    row_ids: np.ndarray,
    y_true: np.ndarray,
    proba: np.ndarray,
    masked: Mapping[str, np.ndarray],
    classes: Sequence[int],
    label_kind: LabelKind,
    provenance: Mapping[str, Any],
    baseline_proba: np.ndarray | None = None,
) -> dict[str, Any]:
    """Write every evaluation file into `out_dir` (an existing, empty folder) and return metrics.json's content.

    `baseline_proba`: the classical baseline's probabilities on the same rows (tasks/evaluate/baseline.py),
    reported beside the model's as `baseline` and `vs_baseline`."""
    classes = [int(c) for c in classes]
    proba = as_class_probabilities(proba, classes)
    y_true = np.asarray(y_true, dtype=np.int64)
    metrics = compute_metrics(y_true, proba, classes, label_kind)
    name = primary_metric_name(label_kind)
    content: dict[str, Any] = {
        "primary_metric": {"name": name, "value": primary_score(y_true, proba, classes, label_kind),
                           "greater_is_better": True},
        "metrics": metrics,
        "rows": int(len(y_true)),
        "label_counts": label_counts(y_true, classes),
        "label_kind": label_kind,
        "classes": classes,
        **provenance,
    }
    if baseline_proba is not None:
        baseline_proba = as_class_probabilities(baseline_proba, classes)
        value = primary_score(y_true, baseline_proba, classes, label_kind)
        content["baseline"] = {"model": BASELINE_NAME, "primary_metric": {"name": name, "value": value},
                               "metrics": compute_metrics(y_true, baseline_proba, classes, label_kind)}
        content["vs_baseline"] = {"metric": name, "model": content["primary_metric"]["value"], "baseline": value,
                                  "delta": content["primary_metric"]["value"] - value}
    write_json(out_dir / "metrics.json", content)
    predictions_frame(row_ids, y_true, proba, classes, baseline_proba).to_csv(out_dir / "predictions.csv", index=False)
    ablation = ablation_report(
        y_true, metrics, {m: as_class_probabilities(p, classes) for m, p in masked.items()}, classes, label_kind
    )
    write_json(out_dir / "ablation.json", ablation)
    write_roc(out_dir, y_true, proba, classes)
    write_confusion(out_dir, y_true, predicted_labels(proba, classes), classes)
    return content


def _fmt(value: float | None) -> str:
    return "undefined" if value is None else f"{value:.4f}"


def render_markdown(
    metrics: Mapping[str, Any], ablation: Mapping[str, Any] | None = None, plots: Sequence[Path] = ()
) -> str:
    """A markdown summary of metrics.json (and ablation.json, plot paths): for a Prefect artifact and the terminal."""
    primary = metrics["primary_metric"]["name"]
    baseline = metrics.get("baseline")
    if baseline:
        lines = ["| metric | fusion model | classical baseline |", "|---|---|---|"]
    else:
        lines = ["| metric | value |", "|---|---|"]
    for key, value in metrics["metrics"].items():
        label = f"**{key}** (primary)" if key == primary else key
        lines.append(f"| {label} | {_fmt(value)} |" + (f" {_fmt(baseline['metrics'].get(key))} |" if baseline else ""))
    counts = ", ".join(f"{c}: {n}" for c, n in metrics["label_counts"].items())
    lines += ["", f"Test rows: {metrics['rows']} (label counts {counts})."]
    if baseline:
        vs = metrics["vs_baseline"]
        verdict = "beats" if vs["delta"] > 0 else "ties" if vs["delta"] == 0 else "LOSES TO"
        lines += ["", f"The fusion model {verdict} the baseline on {vs['metric']}: {_fmt(vs['model'])} vs "
                      f"{_fmt(vs['baseline'])} ({vs['delta']:+.4f}). Baseline: {baseline['model']}."]
    holdout = metrics.get("holdout")
    if holdout:
        value = holdout["metrics"].get(primary)
        versus = (holdout.get("baseline") or {}).get(primary)
        lines += ["", f"Newest batch's holdout ({holdout['file']}, {holdout['rows']} rows): {primary} {_fmt(value)}"
                      + (f", baseline {_fmt(versus)}." if holdout.get("baseline") else ".")]
    if ablation:
        lines += ["", f"| modality masked | {ablation['metric']} | drop vs full |", "|---|---|---|"]
        for modality, entry in ablation["modalities"].items():
            lines.append(f"| {modality} | {_fmt(entry['score'])} | {_fmt(entry['drop'])} |")
    if plots:
        lines += ["", "Plots (open offline): " + ", ".join(f"`{p}`" for p in plots)]
    return "\n".join(lines) + "\n"


def fit_baseline(data_dir: Path, test: pd.DataFrame, classes: list[int], seed: int,
                 others: tuple[pd.DataFrame, ...] = ()) -> BaselineResult:
    """The classical baseline on the network's rows (fitted on train, stopped on val), scored on `test`
    (and `others`)."""
    train, val = (pd.read_parquet(data_dir / f"{split}.parquet") for split in ("train", "val"))
    return fit_and_score(train, val, test, classes, seed, others)


def holdout_metrics(predictor: Any, holdout: pd.DataFrame, meta: dict[str, Any], images_root: Path, batch_size: int,
                    baseline_proba: np.ndarray | None) -> dict[str, Any]:
    """The model (and the baseline) on the newest arriving batch's held-out rows: how it does on the data
    that just arrived, beside the frozen test set that keeps runs comparable."""
    label, classes, kind = meta["label"], [int(c) for c in meta["classes"]], meta["label_kind"]
    y = holdout[label].to_numpy()
    proba = as_class_probabilities(predictor.predict_proba(holdout.drop(columns=[label]), images_root,
                                                          batch_size=batch_size), classes)
    out: dict[str, Any] = {"file": meta.get("holdout"), "rows": int(len(holdout)),
                           "fingerprint": fingerprint_test_set(holdout, label),
                           "metrics": compute_metrics(y, proba, classes, kind)}
    if baseline_proba is not None:
        out["baseline"] = compute_metrics(y, as_class_probabilities(baseline_proba, classes), classes, kind)
    return out


def evaluate(p: EvaluateParams) -> EvaluationSummary:
    check_model_dir(p.model_dir)
    table, meta, images_root = load_test_set(p.data_dir)
    label, label_kind, classes = meta["label"], meta["label_kind"], [int(c) for c in meta["classes"]]
    predictor = load_predictor(p.model_dir)
    if [int(c) for c in predictor.classes] != classes:
        raise StageError(
            f"{p.model_dir} predicts classes {list(predictor.classes)}, but {p.data_dir / 'meta.json'} has {classes}: "
            "the model was trained on another label set. Retrain on this data (python -m tasks train), then convert."
        )
    features = table.drop(columns=[label])
    proba = predictor.predict_proba(features, images_root, batch_size=p.batch_size)
    masked = {
        m: predictor.predict_proba(features, images_root, drop_modalities=(m,), batch_size=p.batch_size)
        for m in predictor.model.modalities  # a model without photos to learn from has no image input
    }
    holdout_path = p.data_dir / "holdout.parquet"
    holdout = pd.read_parquet(holdout_path) if holdout_path.is_file() else None
    extra = (holdout,) if holdout is not None else ()
    baseline = fit_baseline(p.data_dir, table, classes, p.seed, extra) if p.baseline else None
    provenance: dict[str, Any] = {
        "test_set": {"path": str(p.data_dir / "test.parquet"), "fingerprint": fingerprint_test_set(table, label)},
        "model": {"path": str(p.model_dir), "sha256": sha256_file(p.model_dir / WEIGHTS)},
    }
    if holdout is not None:
        provenance["holdout"] = holdout_metrics(predictor, holdout, meta, images_root, p.batch_size,
                                                baseline.others[0] if baseline is not None else None)

    p.out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(p.out_dir.parent / f".{p.out_dir.name}.lock"):
        recover_dir(p.out_dir)
        tmp = temp_dir_beside(p.out_dir)
        try:
            content = write_evaluation(
                tmp, table["row_id"].to_numpy(), table[label].to_numpy(), np.asarray(proba),
                {m: np.asarray(v) for m, v in masked.items()}, classes, label_kind, provenance,
                baseline.proba if baseline is not None else None,
            )
            ablation = json.loads((tmp / "ablation.json").read_text())
            swap_dir(tmp, p.out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return EvaluationSummary(
        out_dir=p.out_dir,
        rows=content["rows"],
        primary_metric=content["primary_metric"]["name"],
        primary_value=content["primary_metric"]["value"],
        metrics=content["metrics"],
        ablation_drop={m: e["drop"] for m, e in ablation["modalities"].items()},
        baseline_value=(content.get("baseline") or {}).get("primary_metric", {}).get("value"),
        baseline_seconds=baseline.seconds if baseline is not None else None,
        plots=[p.out_dir / "roc.png", p.out_dir / "confusion_matrix.png"],
    )
