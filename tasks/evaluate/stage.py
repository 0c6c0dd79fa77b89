"""Evaluate stage: score the validated test table with the converted model in `data/model/` only.

Writes into `out_dir` (swapped in whole, so a failed run leaves the previous evaluation intact):
`metrics.json` (the problem type's metrics, its primary one, the classical baseline's beside them),
`predictions.csv`, `ablation.json`, and `plots/` (offline PNGs and the CSVs dvc.yaml's `plots:` reads;
tasks/evaluate/plots.py). Loading the converted file, never the training checkpoint, is what proves the
conversion.
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
from fusion_model.metrics import METRICS, greater_is_better, primary_metric_name
from fusion_model.predict import Predictions
from tasks._io.files import write_json
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks._io.hashing import sha256_file
from tasks.errors import StageError
from tasks.evaluate.baseline import NAME as BASELINE_NAME
from tasks.evaluate.baseline import BaselineResult, fit_and_score
from tasks.evaluate.inputs import TestSet, check_model_dir, load_predictor, load_test_set
from tasks.evaluate.metrics import fingerprint_test_set, label_counts, metrics_of, primary_score
from tasks.evaluate.plots import PLOTS_DIR, write_plots
from tasks.params import EvaluateParams

OUTPUT_FILES: tuple[str, ...] = ("metrics.json", "predictions.csv", "ablation.json", PLOTS_DIR)


class EvaluationSummary(BaseModel):
    out_dir: Path
    rows: int
    problem_type: str
    primary_metric: str
    primary_value: float
    metrics: dict[str, float | None]
    ablation_drop: dict[str, float | None]
    baseline_value: float | None = None
    baseline_seconds: float | None = None
    plots: list[Path]


def predictions_frame(test: TestSet, out: Predictions, baseline: Predictions | None = None) -> pd.DataFrame:
    """row_id, the id column, the label, `prediction` (a class or a value), the ordinal `score`, one
    `proba_<class>` per class, and the same for the baseline (`baseline_...`) when it ran."""
    frame = pd.DataFrame({"row_id": test.table["row_id"].to_numpy(dtype=np.int64)})
    if test.schema.id and test.schema.id in test.table.columns:
        frame[test.schema.id] = test.table[test.schema.id].to_numpy()
    frame["label"] = test.table[test.label].to_numpy()
    for prefix, o in (("", out), ("baseline_", baseline)):
        if o is None:
            continue
        frame[f"{prefix}prediction"] = test.values(o.prediction)
        if test.problem_type == "ordinal" and o.score is not None:
            frame[f"{prefix}score"] = o.score
        if o.proba is not None:
            for i, c in enumerate(test.classes):
                frame[f"{prefix}proba_{c}"] = o.proba[:, i]
    return frame


def ablation_report(test: TestSet, full: Mapping[str, float | None], masked: Mapping[str, Predictions],
                    name: str) -> dict[str, Any]:
    """Score with each modality masked out; `drop` = how much worse (bigger = the modality matters more)."""
    report: dict[str, Any] = {"metric": name, "greater_is_better": greater_is_better(name), "full": full[name],
                              "modalities": {}}
    for modality, out in masked.items():
        scores = metrics_of(test.y, out, test.problem_type, test.num_classes)
        value = scores[name]
        drop = None
        if value is not None and full[name] is not None:
            drop = full[name] - value if greater_is_better(name) else value - full[name]
        report["modalities"][modality] = {"score": value, "drop": drop, "metrics": scores}
    return report


def write_evaluation(out_dir: Path, test: TestSet, out: Predictions, masked: Mapping[str, Predictions],
                     provenance: Mapping[str, Any], metric: str | None = None,
                     baseline: Predictions | None = None) -> dict[str, Any]:
    """Write every evaluation file into `out_dir` (an existing, empty folder) and return metrics.json's content.

    `baseline`: the classical baseline's predictions on the same rows (tasks/evaluate/baseline.py), reported
    beside the model's as `baseline` and `vs_baseline`."""
    kind, k = test.problem_type, test.num_classes
    metrics = metrics_of(test.y, out, kind, k)
    name = primary_metric_name(kind, metric)
    value = primary_score(test.y, out, kind, k, name)
    content: dict[str, Any] = {
        "primary_metric": {"name": name, "value": value, "greater_is_better": greater_is_better(name)},
        "metrics": metrics,
        "problem_type": kind,
        "rows": int(len(test.y)),
        "label": test.label,
        "classes": test.classes,
        **({"label_counts": label_counts(test.y, test.classes)} if kind != "regression" else
           {"label_summary": {"mean": float(np.mean(test.y)), "std": float(np.std(test.y)),
                              "min": float(np.min(test.y)), "max": float(np.max(test.y))}}),
        **provenance,
    }
    if baseline is not None:
        base_value = primary_score(test.y, baseline, kind, k, name)
        content["baseline"] = {"model": BASELINE_NAME, "primary_metric": {"name": name, "value": base_value},
                               "metrics": metrics_of(test.y, baseline, kind, k)}
        # improvement: how much better the model is (positive: better), whichever way the metric points
        improvement = value - base_value if greater_is_better(name) else base_value - value
        content["vs_baseline"] = {"metric": name, "model": value, "baseline": base_value,
                                  "delta": value - base_value, "improvement": improvement}
    write_json(out_dir / "metrics.json", content)
    predictions_frame(test, out, baseline).to_csv(out_dir / "predictions.csv", index=False)
    write_json(out_dir / "ablation.json", ablation_report(test, metrics, masked, name))
    plots = out_dir / PLOTS_DIR
    plots.mkdir()
    write_plots(plots, kind, test.y, out.prediction, out.proba, test.classes, test.label)
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
    if "label_counts" in metrics:
        counts = ", ".join(f"{c}: {n}" for c, n in metrics["label_counts"].items())
        lines += ["", f"Test rows: {metrics['rows']} ({metrics.get('problem_type', 'binary')} label, counts {counts})."]
    else:
        summary = metrics.get("label_summary") or {}
        lines += ["", f"Test rows: {metrics['rows']} (regression label, mean {_fmt(summary.get('mean'))}, "
                      f"std {_fmt(summary.get('std'))})."]
    if baseline:
        vs = metrics["vs_baseline"]
        better = vs.get("improvement", vs["delta"])
        verdict = "beats" if better > 0 else "ties" if better == 0 else "LOSES TO"
        direction = "" if metrics["primary_metric"].get("greater_is_better", True) else " (lower is better)"
        lines += ["", f"The fusion model {verdict} the baseline on {vs['metric']}{direction}: {_fmt(vs['model'])} "
                      f"vs {_fmt(vs['baseline'])} ({vs['delta']:+.4f}). Baseline: {baseline['model']}."]
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


def fit_baseline(data_dir: Path, test: TestSet, image_index: int, seed: int,
                 others: tuple[pd.DataFrame, ...] = (), metric: str | None = None) -> BaselineResult:
    """The classical baseline on the network's rows (selected on train + val, refitted on both, as the
    network), scored on the test rows (and `others`); its multiclass rule aims at `metric` (the
    evaluation's primary metric: macro F1's class biases, else the argmax)."""
    train, val = (pd.read_parquet(data_dir / f"{split}.parquet") for split in ("train", "val"))
    return fit_and_score(train, val, test.table, test.labels_of(train), test.labels_of(val), test.schema,
                         test.problem_type, test.num_classes, seed, test.images_root, image_index, others,
                         macro_f1_rule=primary_metric_name(test.problem_type, metric) == "macro_f1")


def holdout_metrics(predictor: Any, holdout: pd.DataFrame, test: TestSet, batch_size: int,
                    baseline: Predictions | None, file: str | None) -> dict[str, Any]:
    """The model (and the baseline) on the newest arriving batch's held-out rows: how it does on the data
    that just arrived, beside the frozen test set that keeps runs comparable."""
    y = test.labels_of(holdout)
    out = predictor.predict_outputs(holdout.drop(columns=[test.label]), test.images_root, batch_size=batch_size)
    result: dict[str, Any] = {"file": file, "rows": int(len(holdout)),
                              "fingerprint": fingerprint_test_set(holdout, test.label),
                              "metrics": metrics_of(y, out, test.problem_type, test.num_classes)}
    if baseline is not None:
        result["baseline"] = metrics_of(y, baseline, test.problem_type, test.num_classes)
    return result


def evaluate(p: EvaluateParams) -> EvaluationSummary:
    check_model_dir(p.model_dir)
    test = load_test_set(p.data_dir)
    if p.primary_metric is not None and p.primary_metric not in METRICS[test.problem_type]:
        raise StageError(f"evaluate.primary_metric {p.primary_metric!r} is not a {test.problem_type} metric; use one "
                         f"of {list(METRICS[test.problem_type])} or null")
    predictor = load_predictor(p.model_dir)
    if predictor.problem_type != test.problem_type or [str(c) for c in predictor.classes] != [str(c) for c in test.classes]:
        raise StageError(
            f"{p.model_dir} predicts a {predictor.problem_type} label with classes {list(predictor.classes)}, but "
            f"{p.data_dir / 'meta.json'} has a {test.problem_type} label with classes {test.classes}: the model was "
            "trained on another label. Retrain on this data (python -m tasks train), then convert."
        )
    features = test.table.drop(columns=[test.label])
    out = predictor.predict_outputs(features, test.images_root, batch_size=p.batch_size)
    masked = {
        m: predictor.predict_outputs(features, test.images_root, drop_modalities=(m,), batch_size=p.batch_size)
        for m in predictor.model.modalities  # a model without photos to learn from has no image input
    }
    holdout_path = p.data_dir / "holdout.parquet"
    holdout = pd.read_parquet(holdout_path) if holdout_path.is_file() else None
    extra = (holdout,) if holdout is not None else ()
    baseline = (fit_baseline(p.data_dir, test, predictor.pre.image_index, p.seed, extra, p.primary_metric)
                if p.baseline else None)
    provenance: dict[str, Any] = {
        "test_set": {"path": str(p.data_dir / "test.parquet"), "fingerprint": fingerprint_test_set(test.table, test.label)},
        "model": {"path": str(p.model_dir), "sha256": sha256_file(p.model_dir / WEIGHTS)},
    }
    if holdout is not None:
        provenance["holdout"] = holdout_metrics(predictor, holdout, test, p.batch_size,
                                                baseline.others[0] if baseline is not None else None,
                                                test.meta.get("holdout"))

    p.out_dir.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(p.out_dir.parent / f".{p.out_dir.name}.lock"):
        recover_dir(p.out_dir)
        tmp = temp_dir_beside(p.out_dir)
        try:
            content = write_evaluation(tmp, test, out, masked, provenance, p.primary_metric,
                                       baseline.predictions if baseline is not None else None)
            ablation = json.loads((tmp / "ablation.json").read_text())
            swap_dir(tmp, p.out_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    plots = sorted((p.out_dir / PLOTS_DIR).glob("*.png"))
    return EvaluationSummary(
        out_dir=p.out_dir,
        rows=content["rows"],
        problem_type=test.problem_type,
        primary_metric=content["primary_metric"]["name"],
        primary_value=content["primary_metric"]["value"],
        metrics=content["metrics"],
        ablation_drop={m: e["drop"] for m, e in ablation["modalities"].items()},
        baseline_value=(content.get("baseline") or {}).get("primary_metric", {}).get("value"),
        baseline_seconds=baseline.seconds if baseline is not None else None,
        plots=plots,
    )
