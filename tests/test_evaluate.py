"""Evaluation: metrics equal scikit-learn's, every output file is written and readable, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from sklearn.metrics import accuracy_score, cohen_kappa_score, f1_score, log_loss, roc_auc_score

from tasks.errors import StageError
from tasks.evaluate import OUTPUT_FILES, evaluate, render_markdown
from tasks.evaluate.inputs import check_model_dir, load_test_set
from tasks.evaluate.metrics import compute_metrics, fingerprint_test_set, primary_score
from tasks.evaluate.stage import write_evaluation
from tasks.params import EvaluateParams


def _binary_case(n: int = 200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    p1 = np.clip(0.5 + 0.3 * (y - 0.5) + rng.normal(0, 0.25, n), 0.01, 0.99)
    return y, np.stack([1 - p1, p1], axis=1)


def _multiclass_case(n: int = 300, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 5, n)
    logits = rng.normal(0, 1, (n, 5))
    logits[np.arange(n), y] += 1.5
    proba = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    return y, proba


def test_binary_metrics_equal_sklearn() -> None:
    y, proba = _binary_case()
    got = compute_metrics(y, proba, [0, 1], "binary")
    pred = proba.argmax(axis=1)
    assert got == {
        "accuracy": accuracy_score(y, pred),
        "roc_auc": roc_auc_score(y, proba[:, 1]),
        "log_loss": pytest.approx(log_loss(y, proba), rel=1e-12),
        "f1": f1_score(y, pred),
    }
    # A model that returns only P(class 1) scores the same.
    assert compute_metrics(y, proba[:, 1], [0, 1], "binary") == got
    assert primary_score(y, proba, [0, 1], "binary") == roc_auc_score(y, proba[:, 1])


def test_multiclass_metrics_equal_sklearn() -> None:
    y, proba = _multiclass_case()
    got = compute_metrics(y, proba, [0, 1, 2, 3, 4], "multiclass")
    pred = proba.argmax(axis=1)
    assert got == {
        "accuracy": accuracy_score(y, pred),
        "quadratic_weighted_kappa": cohen_kappa_score(y, pred, weights="quadratic"),
        "roc_auc_ovr_macro": roc_auc_score(y, proba, multi_class="ovr", average="macro"),
    }
    assert 0.2 < got["quadratic_weighted_kappa"] < 1


def test_undefined_primary_metric_and_wrong_shape_are_explained() -> None:
    y = np.zeros(10, dtype=int)
    proba = np.full((10, 2), 0.5)
    assert compute_metrics(y, proba, [0, 1], "binary")["roc_auc"] is None
    with pytest.raises(StageError, match=r"roc_auc is undefined on this test set \(label counts \{0: 10\}\)"):
        primary_score(y, proba, [0, 1], "binary")
    with pytest.raises(StageError, match=r"shape \(10, 2\).*classes \[0, 1, 2, 3, 4\].*Retrain"):
        compute_metrics(y, proba, [0, 1, 2, 3, 4], "multiclass")
    with pytest.raises(StageError, match=r"test labels \[7\] are not among the model's classes"):
        compute_metrics(np.full(10, 7), proba, [0, 1], "binary")


def test_fingerprint_ignores_row_order_but_not_content() -> None:
    table = pd.DataFrame({"row_id": [3, 1, 2], "Age": [4, 5, 6], "AdoptionSpeed": [0, 1, 1]})
    same = table.iloc[[2, 0, 1]][["AdoptionSpeed", "row_id", "Age"]]
    assert fingerprint_test_set(table) == fingerprint_test_set(same)
    relabelled = table.assign(AdoptionSpeed=[1, 1, 1])
    changed = table.assign(Age=[4, 5, 7])
    assert len({fingerprint_test_set(t) for t in (table, relabelled, changed)}) == 3


def _write_fixed(out_dir: Path, kind: str) -> dict:
    y, proba = _binary_case() if kind == "binary" else _multiclass_case()
    classes = [0, 1] if kind == "binary" else [0, 1, 2, 3, 4]
    rng = np.random.default_rng(2)
    # Masking a modality blurs the probabilities towards uniform: the score drops.
    masked = {m: 0.5 * proba + 0.5 * rng.dirichlet(np.ones(len(classes)), len(y)) for m in ("image", "text")}
    masked["tabular"] = proba
    out_dir.mkdir()
    provenance = {"test_set": {"fingerprint": "sha256:x"}, "model": {"sha256": "y"}}
    content = write_evaluation(out_dir, np.arange(100, 100 + len(y)), y, proba, masked, classes, kind, provenance)
    return {"y": y, "proba": proba, "classes": classes, "content": content}


@pytest.mark.parametrize("kind", ["binary", "multiclass"])
def test_write_evaluation_writes_every_file(tmp_path: Path, kind: str) -> None:
    case = _write_fixed(tmp_path / "eval", kind)
    out = tmp_path / "eval"
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUT_FILES)

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics == case["content"]
    assert metrics["metrics"] == compute_metrics(case["y"], case["proba"], case["classes"], kind)
    name = "roc_auc" if kind == "binary" else "quadratic_weighted_kappa"
    assert metrics["primary_metric"] == {"name": name, "value": metrics["metrics"][name], "greater_is_better": True}
    assert metrics["rows"] == len(case["y"])
    assert sum(metrics["label_counts"].values()) == len(case["y"])
    assert metrics["label_counts"]["1"] == int((case["y"] == 1).sum())
    assert metrics["test_set"]["fingerprint"] == "sha256:x"

    preds = pd.read_csv(out / "predictions.csv")
    prob_cols = [f"proba_{c}" for c in case["classes"]]
    assert list(preds.columns) == ["row_id", *prob_cols, "prediction", "label"]
    np.testing.assert_array_equal(preds[prob_cols].to_numpy(), case["proba"])  # full precision round trip
    np.testing.assert_array_equal(preds["label"], case["y"])
    assert preds["row_id"].tolist() == list(range(100, 100 + len(case["y"])))

    ablation = json.loads((out / "ablation.json").read_text())
    assert ablation["metric"] == name and ablation["full"] == metrics["primary_metric"]["value"]
    assert set(ablation["modalities"]) == {"image", "tabular", "text"}
    assert ablation["modalities"]["tabular"]["drop"] == 0.0
    assert ablation["modalities"]["image"]["drop"] > 0
    entry = ablation["modalities"]["text"]
    assert entry["drop"] == pytest.approx(ablation["full"] - entry["score"])

    roc = pd.read_csv(out / "roc.csv")
    assert list(roc.columns) == ["fpr", "tpr", "threshold"]
    assert roc.fpr.is_monotonic_increasing and roc.tpr.is_monotonic_increasing
    assert (roc.fpr.iloc[0], roc.tpr.iloc[-1]) == (0, 1)
    confusion = pd.read_csv(out / "confusion.csv")
    assert list(confusion.columns) == ["actual", "predicted"] and len(confusion) == len(case["y"])
    assert (confusion.predicted == preds.prediction).all()
    for png in ("roc.png", "confusion_matrix.png"):
        with Image.open(out / png) as im:
            assert im.format == "PNG" and im.size[0] >= 400


def test_render_markdown_lists_metrics_counts_and_ablation(tmp_path: Path) -> None:
    case = _write_fixed(tmp_path / "eval", "binary")
    ablation = json.loads((tmp_path / "eval" / "ablation.json").read_text())
    text = render_markdown(case["content"], ablation, plots=[tmp_path / "eval" / "roc.png"])
    m = case["content"]["metrics"]
    assert f"| **roc_auc** (primary) | {m['roc_auc']:.4f} |" in text
    assert f"| log_loss | {m['log_loss']:.4f} |" in text
    counts = case["content"]["label_counts"]
    assert f"Test rows: 200 (label counts 0: {counts['0']}, 1: {counts['1']})" in text
    assert f"| image | {ablation['modalities']['image']['score']:.4f} |" in text
    assert f"Plots (open offline): `{tmp_path / 'eval' / 'roc.png'}`" in text


@pytest.mark.parametrize("missing", ["model.safetensors", "model_config.json", "manifest.json"])
def test_incomplete_model_folder_is_refused(tmp_path: Path, missing: str) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("model.safetensors", "model_config.json", "manifest.json"):
        if name != missing:
            (model_dir / name).write_text("{}")
    with pytest.raises(StageError) as err:
        evaluate(EvaluateParams(model_dir=model_dir, data_dir=tmp_path / "validated", out_dir=tmp_path / "eval"))
    assert f"missing {missing}" in str(err.value)
    assert "python -m tasks convert" in str(err.value)
    assert not (tmp_path / "eval").exists()


def test_missing_model_folder_and_test_set_are_explained(tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"model: no model folder\. Run `python -m tasks convert`"):
        check_model_dir(tmp_path / "model")
    with pytest.raises(StageError, match=r"meta\.json: missing\. Run `python -m tasks validate`"):
        load_test_set(tmp_path)
    (tmp_path / "meta.json").write_text(
        json.dumps({"dataset_root": "../raw", "label": "AdoptionSpeed", "label_kind": "binary", "classes": [0, 1]})
    )
    with pytest.raises(StageError, match=r"test\.parquet: missing\. Run `python -m tasks validate`"):
        load_test_set(tmp_path)


# ------------------------------------------------------------------ a real converted model (slow chain)
@pytest.mark.slow
def test_evaluation_of_a_converted_model(tiny_model_chain) -> None:
    chain = tiny_model_chain
    out = chain.trained_eval
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUT_FILES)
    test = pd.read_parquet(chain.data_dir / "test.parquet")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["rows"] == len(test) and metrics["classes"] == [0, 1]
    assert metrics["label_counts"] == {str(c): int((test.AdoptionSpeed == c).sum()) for c in (0, 1)}
    assert metrics["test_set"]["fingerprint"] == fingerprint_test_set(test)
    assert metrics["model"]["sha256"] == json.loads((chain.trained / "manifest.json").read_text())["output"]["sha256"]

    preds = pd.read_csv(out / "predictions.csv")
    assert preds.row_id.tolist() == test.row_id.tolist()
    assert (preds.label == test.AdoptionSpeed).all()
    proba = preds[["proba_0", "proba_1"]].to_numpy()
    np.testing.assert_allclose(proba.sum(axis=1), 1, atol=1e-6)
    assert metrics["metrics"] == compute_metrics(preds.label, proba, [0, 1], "binary")
    assert metrics["primary_metric"]["value"] > 0.5  # it learned something in three tiny epochs
    # the classical baseline, fitted on train (stopped early on val), scored on the same rows, reported beside the model
    baseline = preds[["baseline_proba_0", "baseline_proba_1"]].to_numpy()
    assert metrics["baseline"]["metrics"] == compute_metrics(preds.label, baseline, [0, 1], "binary")
    assert metrics["vs_baseline"]["delta"] == metrics["primary_metric"]["value"] - metrics["baseline"]["primary_metric"]["value"]
    text = render_markdown(metrics)
    assert "| metric | fusion model | classical baseline |" in text and "the baseline on roc_auc" in text

    ablation = json.loads((out / "ablation.json").read_text())
    assert set(ablation["modalities"]) == {"image", "tabular", "text"}
    scores = {entry["score"] for entry in ablation["modalities"].values()}
    assert len(scores | {ablation["full"]}) > 1  # masking changes the predictions

    # The zeroed-head model predicts 0.5 everywhere: chance level, whatever is masked.
    constant = json.loads((chain.constant_eval / "metrics.json").read_text())
    assert constant["primary_metric"]["value"] == 0.5
    assert json.loads((chain.constant_eval / "ablation.json").read_text())["modalities"]["image"]["drop"] == 0.0


@pytest.mark.slow
def test_a_model_folder_mixing_two_conversions_is_refused(tiny_model_chain, tmp_path: Path) -> None:
    """New weights beside another run's config (what a file-by-file replacement could leave) are refused."""
    import shutil

    mixed = tmp_path / "model"
    shutil.copytree(tiny_model_chain.trained, mixed)
    shutil.copy2(tiny_model_chain.constant / "manifest.json", mixed / "manifest.json")
    with pytest.raises(StageError, match="model.safetensors is not the file its manifest verified"):
        evaluate(EvaluateParams(model_dir=mixed, data_dir=tiny_model_chain.data_dir, out_dir=tmp_path / "eval"))
    shutil.copy2(tiny_model_chain.trained / "manifest.json", mixed / "manifest.json")
    config = json.loads((mixed / "model_config.json").read_text())
    (mixed / "model_config.json").write_text(json.dumps({**config, "metric": config["metric"]}, indent=1))
    with pytest.raises(StageError, match="model_config.json is not the config its manifest verified"):
        evaluate(EvaluateParams(model_dir=mixed, data_dir=tiny_model_chain.data_dir, out_dir=tmp_path / "eval"))
    assert not (tmp_path / "eval").exists()


@pytest.mark.slow
def test_evaluate_cli_is_deterministic_and_explains_bad_weights(
    tiny_model_chain, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tasks.__main__ import main

    chain = tiny_model_chain
    out = tmp_path / "eval"
    params = Path(__file__).resolve().parents[1] / "params.yaml"

    def args(model_dir: Path) -> list[str]:
        return ["evaluate", "--params", str(params), "--model-dir", str(model_dir), "--data-dir", str(chain.data_dir),
                "--out-dir", str(out)]

    assert main(args(chain.trained)) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["primary_metric"] == "roc_auc" and summary["rows"] == 80
    for name in ("predictions.csv", "ablation.json", "roc.csv", "confusion.csv"):
        assert (out / name).read_bytes() == (chain.trained_eval / name).read_bytes(), name
    expected = json.loads((chain.trained_eval / "metrics.json").read_text())
    assert json.loads((out / "metrics.json").read_text())["metrics"] == expected["metrics"]

    broken = tmp_path / "broken"
    shutil.copytree(chain.trained, broken)
    (broken / "model.safetensors").write_bytes((chain.trained / "model.safetensors").read_bytes()[:1000])
    assert main(args(broken)) == 1
    err = capsys.readouterr().err
    # caught before loading: the damaged file is not the one its conversion verified
    assert f"{broken / 'model.safetensors'} is not the file its manifest verified" in err
    assert "python -m tasks convert" in err
    # The failed run left the previous evaluation in place.
    assert (out / "predictions.csv").read_bytes() == (chain.trained_eval / "predictions.csv").read_bytes()
