"""Each problem type end to end on small subsets of real tables beside the project (../shared; never in it),
through the stage CLIs with only params.yaml changed, and one dataset through the Prefect flow: binary
(reviews, `Recommended IND`), multiclass (fashion products with their photos, `season`), ordinal (reviews,
`Rating`) and regression (PetFinder's `Fee`, log1p). Skipped with a reason where the tables are absent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from shared_data import shared_dir

ROOT = Path(__file__).resolve().parents[1]
SHARED = shared_dir()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(SHARED is None, reason="the real tables (../shared) are not beside the project")]
STAGES = ("download", "validate", "train", "convert", "evaluate")
# A few hundred rows, one epoch of the tiny timm model on one process: every stage in seconds.
TINY_TRAIN = {"image_model": "test_resnet", "image_size": 32, "text_buckets": 4096, "adapter_dim": 16,
              "hidden_sizes": [32], "max_epochs": 3, "batch_size": 32, "strategy": "ddp", "devices": 1,
              "accelerator": "cpu", "lr": 0.005, "candidates": [{}]}
REVIEWS = {"text": ["Title", "Review Text"],
           "categorical": ["Clothing ID", "Division Name", "Department Name", "Class Name"],
           "numerical": ["Age", "Positive Feedback Count"]}


def _cases() -> dict[str, dict[str, Any]]:
    return {
        "binary": {"file": "womens_clothing/reviews.csv", "rows": 500,
                   "dataset": {"preset": None, "id": None, "columns": REVIEWS, "frequency": ["Clothing ID"],
                               "label": {"column": "Recommended IND", "problem_type": "binary"}},
                   "metric": "roc_auc"},
        "multiclass": {"file": "fashion/styles.csv", "rows": 400, "images": "fashion",
                       "dataset": {"preset": None, "id": "id",
                                   "label": {"column": "season", "problem_type": "multiclass"},
                                   "columns": {"image": ["image"], "text": ["productDisplayName"],
                                               "categorical": ["gender", "masterCategory", "subCategory",
                                                               "articleType", "baseColour", "usage"],
                                               "numerical": ["year"]}},
                       "metric": "macro_f1"},
        "ordinal": {"file": "womens_clothing/reviews.csv", "rows": 500,
                    "dataset": {"preset": None, "id": None, "columns": REVIEWS, "frequency": ["Clothing ID"],
                                "label": {"column": "Rating", "problem_type": "ordinal"}},
                    "metric": "qwk"},
        "regression": {"file": "petfinder/real/dogs_train.csv", "rows": 500, "drop_bad_ids": True,
                       "dataset": {"preset": "petfinder",
                                   "label": {"column": "Fee", "problem_type": "regression", "transform": "log1p"},
                                   "columns": {"numerical": ["Age", "Quantity", "VideoAmt", "PhotoAmt"]}},
                       "metric": "rmse"},
    }


def _project(tmp: Path, case: dict[str, Any]) -> Path:
    """A subset of the real table and a params.yaml (the project's, the dataset declared, paths in `tmp`)."""
    assert SHARED is not None
    source = SHARED / case["file"]
    if not source.is_file():
        pytest.skip(f"{source} is absent")
    first = pd.read_csv(source, nrows=0).columns[0]
    frame = pd.read_csv(source, dtype=str, keep_default_na=False, index_col=0 if first.startswith("Unnamed") or
                        first == "" else None).head(case["rows"])
    table = tmp / "input" / Path(case["file"]).name
    table.parent.mkdir(parents=True)
    frame.to_csv(table, index=frame.index.name is not None or first.startswith("Unnamed") or first == "")
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["dataset"] = case["dataset"]
    local = {"path": str(table), "drop_bad_ids": case.get("drop_bad_ids", False)}
    if "images" in case:
        local["images_dir"] = str(SHARED / case["images"])
    params["download"].update(source="local", out_dir=str(tmp / "raw"), local=local)
    params["intake"]["report_dir"] = str(tmp / "reports")
    params["intake"]["feed"]["ledger"] = str(tmp / "intake/batches.json")  # never the project's own
    params["validate"].update(dataset_dir=str(tmp / "raw/dataset"), out_dir=str(tmp / "validated"),
                              report_dir=str(tmp / "reports"))
    params["train"].update(data_dir=str(tmp / "validated"), out_dir=str(tmp / "checkpoints"),
                           live_dir=str(tmp / "training"), **TINY_TRAIN)
    params["convert"].update(checkpoint_dir=str(tmp / "checkpoints"), out_dir=str(tmp / "model"))
    params["evaluate"].update(model_dir=str(tmp / "model"), data_dir=str(tmp / "validated"), out_dir=str(tmp / "eval"))
    params["promote"].update(model_dir=str(tmp / "model"), eval_dir=str(tmp / "eval"),
                             champion_dir=str(tmp / "models/champion"), data_dir=str(tmp / "validated"),
                             validation_report=str(tmp / "reports/validation.json"),
                             drift_report=str(tmp / "reports/drift.json"), require_beat_baseline=False)
    params["version"].update(manifest_dir=str(tmp / "models/runs"))
    path = tmp / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def _run(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def _check_evaluation(tmp: Path, kind: str, metric: str) -> dict[str, Any]:
    metrics = json.loads((tmp / "eval/metrics.json").read_text())
    assert metrics["problem_type"] == kind and metrics["primary_metric"]["name"] == metric
    assert metrics["baseline"]["primary_metric"]["name"] == metric and "improvement" in metrics["vs_baseline"]
    preds = pd.read_csv(tmp / "eval/predictions.csv", keep_default_na=False)
    assert len(preds) == metrics["rows"] and {"row_id", "label", "prediction", "baseline_prediction"} <= set(preds)
    plots = {p.name for p in (tmp / "eval/plots").iterdir()}
    if kind == "regression":
        assert {"residuals.csv", "predicted_vs_actual.png", "residuals.png"} <= plots
        assert metrics["metrics"]["rmse"] < metrics["label_summary"]["std"] * 1.5  # in the label's unit, not log
    else:
        assert {"roc.csv", "confusion.csv", "roc.png", "confusion_matrix.png"} <= plots
        assert {f"proba_{c}" for c in metrics["classes"]} <= set(preds.columns)
    return metrics


@pytest.mark.parametrize("kind", ["binary", "ordinal", "regression"])
def test_stage_clis_on_a_real_subset(kind: str, tmp_path: Path) -> None:
    case = _cases()[kind]
    params = _project(tmp_path, case)
    for stage in STAGES:
        _run("-m", "tasks", stage, "--params", str(params))
    metrics = _check_evaluation(tmp_path, kind, case["metric"])
    meta = json.loads((tmp_path / "validated/meta.json").read_text())
    if kind == "binary":
        assert meta["classes"] == [0, 1] and "Rating" not in meta["schema"]["columns"]["categorical"]
        assert metrics["metrics"]["roc_auc"] > 0.6  # the review text alone says much of it
    if kind == "ordinal":
        assert meta["classes"] == [1, 2, 3, 4, 5]
        preds = pd.read_csv(tmp_path / "eval/predictions.csv")
        assert preds["score"].between(0, 4).all() and set(preds["prediction"]) <= {1, 2, 3, 4, 5}
    if kind == "regression":
        assert meta["classes"] == [] and meta["schema"]["label"]["transform"] == "log1p"
    # a prediction request through the CLI, with the table's columns and without the label
    rows = pd.read_parquet(tmp_path / "validated/test.parquet").drop(columns=[meta["label"], "row_id"]).head(5)
    rows.to_csv(tmp_path / "new.csv")
    _run("-m", "fusion_model.predict", "--model", str(tmp_path / "model"), "--csv", str(tmp_path / "new.csv"),
         "--images-root", str(tmp_path / "raw/dataset"), "--out", str(tmp_path / "preds.csv"))
    assert len(pd.read_csv(tmp_path / "preds.csv")) == 5


def test_fashion_with_real_photos_through_the_flow(tmp_path: Path) -> None:
    case = _cases()["multiclass"]
    params = _project(tmp_path, case)
    _run("-m", "flows.retrain", "--params", str(params), "--no-version", timeout=1200)
    metrics = _check_evaluation(tmp_path, "multiclass", "macro_f1")
    meta = json.loads((tmp_path / "validated/meta.json").read_text())
    assert meta["problem_type"] == "multiclass" and "Fall" in meta["classes"]
    ablation = json.loads((tmp_path / "eval/ablation.json").read_text())
    assert set(ablation["modalities"]) == {"image", "tabular", "text"}  # the photos are an input
    assert (tmp_path / "models/champion/model.safetensors").is_file()  # promoted: the first model
    assert metrics["metrics"]["accuracy"] > 0.5
