"""Evaluation: metrics equal scikit-learn's for each problem type, every output file is written and
readable, lower-is-better metrics compare the right way, clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image
from sklearn.metrics import (
    accuracy_score,
    cohen_kappa_score,
    f1_score,
    log_loss,
    mean_absolute_error,
    r2_score,
    roc_auc_score,
)

from fusion_model.dataset import resolve_schema
from fusion_model.metrics import compute_metrics
from fusion_model.predict import Predictions
from tasks.errors import StageError
from tasks.evaluate import OUTPUT_FILES, evaluate, render_markdown
from tasks.evaluate.inputs import TestSet, check_model_dir, load_test_set
from tasks.evaluate.metrics import fingerprint_test_set, primary_score
from tasks.evaluate.stage import write_evaluation
from tasks.params import EvaluateParams

CLASSES = {"binary": [0, 1], "multiclass": ["Fall", "Spring", "Summer", "Winter"], "ordinal": [1, 2, 3, 4, 5]}


def _binary_case(n: int = 200, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, n)
    p1 = np.clip(0.5 + 0.3 * (y - 0.5) + rng.normal(0, 0.25, n), 0.01, 0.99)
    return y, np.stack([1 - p1, p1], axis=1)


def _classes_case(k: int, n: int = 300, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    logits = rng.normal(0, 1, (n, k))
    logits[np.arange(n), y] += 1.5
    return y, np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)


def _predictions(kind: str, seed: int = 0) -> tuple[np.ndarray, Predictions]:
    """Labels (class indices, or values) and what a model predicted for them."""
    if kind == "binary":
        y, proba = _binary_case(seed=seed)
        return y, Predictions(prediction=proba.argmax(1), proba=proba, score=proba[:, 1])
    if kind == "regression":
        rng = np.random.default_rng(seed)
        y = rng.gamma(2.0, 50.0, 250)
        return y, Predictions(prediction=y + rng.normal(0, 20, len(y)), proba=None, score=None)
    y, proba = _classes_case(len(CLASSES[kind]), seed=seed)
    expected = (proba * np.arange(proba.shape[1])).sum(1)
    return y, Predictions(prediction=proba.argmax(1), proba=proba, score=expected if kind == "ordinal" else None)


def test_binary_metrics_equal_sklearn() -> None:
    y, out = _predictions("binary")
    got = compute_metrics(y, out.prediction, "binary", 2, out.proba)
    assert got == {
        "roc_auc": roc_auc_score(y, out.proba[:, 1]),
        "accuracy": accuracy_score(y, out.prediction),
        "f1": f1_score(y, out.prediction),
        "log_loss": pytest.approx(log_loss(y, out.proba), rel=1e-12),
    }
    assert list(got) == ["roc_auc", "accuracy", "f1", "log_loss"]  # the primary first
    assert primary_score(y, out, "binary", 2) == roc_auc_score(y, out.proba[:, 1])


def test_multiclass_ordinal_and_regression_metrics_equal_sklearn() -> None:
    y, out = _predictions("multiclass")
    assert compute_metrics(y, out.prediction, "multiclass", 4, out.proba) == {
        "macro_f1": f1_score(y, out.prediction, average="macro"),
        "accuracy": accuracy_score(y, out.prediction),
        "log_loss": pytest.approx(log_loss(y, out.proba), rel=1e-12),
    }
    y, out = _predictions("ordinal")
    got = compute_metrics(y, out.prediction, "ordinal", 5, out.proba)
    assert got == {"qwk": cohen_kappa_score(y, out.prediction, weights="quadratic"),
                   "accuracy": accuracy_score(y, out.prediction), "mae": mean_absolute_error(y, out.prediction)}
    assert 0.2 < got["qwk"] < 1
    y, out = _predictions("regression")
    got = compute_metrics(y, out.prediction, "regression")
    assert got == {"rmse": pytest.approx(np.sqrt(np.mean((y - out.prediction) ** 2))),
                   "mae": mean_absolute_error(y, out.prediction), "r2": r2_score(y, out.prediction)}


def test_undefined_primary_metric_and_non_finite_output_are_explained() -> None:
    y = np.zeros(10, dtype=int)
    out = Predictions(prediction=np.zeros(10, dtype=int), proba=np.full((10, 2), 0.5), score=np.full(10, 0.5))
    assert compute_metrics(y, out.prediction, "binary", 2, out.proba)["roc_auc"] is None
    with pytest.raises(StageError, match=r"roc_auc is undefined on this test set \(label counts \{0: 10\}\)"):
        primary_score(y, out, "binary", 2)
    bad = Predictions(prediction=np.full(10, np.nan), proba=None, score=None)
    with pytest.raises(StageError, match=r"non-finite prediction \(row position 0\).*corrupt or diverged"):
        primary_score(np.ones(10), bad, "regression", 0)
    with pytest.raises(ValueError, match=r"metric 'rmse' is not computed for a binary label"):
        primary_score(np.array([0, 1]), out, "binary", 2, "rmse")


def test_fingerprint_ignores_row_order_but_not_content() -> None:
    table = pd.DataFrame({"row_id": [3, 1, 2], "Age": [4, 5, 6], "AdoptionSpeed": [0, 1, 1]})
    same = table.iloc[[2, 0, 1]][["AdoptionSpeed", "row_id", "Age"]]
    assert fingerprint_test_set(table, "AdoptionSpeed") == fingerprint_test_set(same, "AdoptionSpeed")
    relabelled = table.assign(AdoptionSpeed=[1, 1, 1])
    changed = table.assign(Age=[4, 5, 7])
    assert len({fingerprint_test_set(t, "AdoptionSpeed") for t in (table, relabelled, changed)}) == 3


def _test_set(kind: str, y: np.ndarray) -> TestSet:
    label = {"binary": "AdoptionSpeed", "multiclass": "season", "ordinal": "Rating", "regression": "Fee"}[kind]
    schema = resolve_schema({"preset": None, "id": "key", "columns": {"numerical": ["x"]},
                             "label": {"column": label, "problem_type": kind}})
    classes = CLASSES.get(kind, [])
    values = np.asarray(classes, dtype=object)[y] if classes else y
    table = pd.DataFrame({"row_id": np.arange(100, 100 + len(y)), "key": [f"k{i}" for i in range(len(y))],
                          "x": 0.0, label: values})
    return TestSet(table=table, meta={}, images_root=Path("."), schema=schema, problem_type=kind, classes=classes)


def _write_fixed(out_dir: Path, kind: str, baseline: bool = False) -> dict:
    y, out = _predictions(kind)
    test = _test_set(kind, y)
    rng = np.random.default_rng(2)
    if kind == "regression":  # masking a modality adds error
        masked = {m: Predictions(prediction=out.prediction + rng.normal(0, 30, len(y)), proba=None, score=None)
                  for m in ("image", "text")}
    else:  # masking a modality blurs the probabilities towards uniform: the score drops
        k = len(CLASSES[kind])
        masked = {}
        for m in ("image", "text"):
            blurred = 0.5 * out.proba + 0.5 * rng.dirichlet(np.ones(k), len(y))
            masked[m] = Predictions(prediction=blurred.argmax(1), proba=blurred, score=None)
    masked["tabular"] = out
    out_dir.mkdir()
    provenance = {"test_set": {"fingerprint": "sha256:x"}, "model": {"sha256": "y"}}
    other = _predictions(kind, seed=5)[1] if baseline else None
    content = write_evaluation(out_dir, test, out, masked, provenance, baseline=other)
    return {"y": y, "out": out, "test": test, "content": content, "baseline": other}


@pytest.mark.parametrize("kind", ["binary", "multiclass", "ordinal", "regression"])
def test_write_evaluation_writes_every_file(tmp_path: Path, kind: str) -> None:
    case = _write_fixed(tmp_path / "eval", kind)
    out, y, test = tmp_path / "eval", case["y"], case["test"]
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUT_FILES)

    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics == case["content"]
    k = len(CLASSES.get(kind, []))
    assert metrics["metrics"] == compute_metrics(y, case["out"].prediction, kind, k, case["out"].proba)
    name = {"binary": "roc_auc", "multiclass": "macro_f1", "ordinal": "qwk", "regression": "rmse"}[kind]
    assert metrics["primary_metric"] == {"name": name, "value": metrics["metrics"][name],
                                         "greater_is_better": kind != "regression"}
    assert metrics["rows"] == len(y) and metrics["problem_type"] == kind and metrics["test_set"]["fingerprint"] == "sha256:x"
    if kind == "regression":
        assert metrics["label_summary"]["mean"] == pytest.approx(float(np.mean(y)))
    else:
        assert sum(metrics["label_counts"].values()) == len(y)
        assert metrics["label_counts"][str(CLASSES[kind][1])] == int((y == 1).sum())

    preds = pd.read_csv(out / "predictions.csv", keep_default_na=False)
    assert list(preds.columns[:4]) == ["row_id", "key", "label", "prediction"]
    assert preds["row_id"].tolist() == list(range(100, 100 + len(y)))
    if kind == "regression":
        np.testing.assert_allclose(preds["prediction"], case["out"].prediction)
    else:
        assert (preds["prediction"].astype(str) == test.values(case["out"].prediction).astype(str)).all()
        prob_cols = [f"proba_{c}" for c in CLASSES[kind]]
        np.testing.assert_array_equal(preds[prob_cols].to_numpy(), case["out"].proba)  # full precision round trip
        assert ("score" in preds.columns) == (kind == "ordinal")

    ablation = json.loads((out / "ablation.json").read_text())
    assert ablation["metric"] == name and ablation["full"] == metrics["primary_metric"]["value"]
    assert set(ablation["modalities"]) == {"image", "tabular", "text"}
    assert ablation["modalities"]["tabular"]["drop"] == 0.0
    assert ablation["modalities"]["image"]["drop"] > 0  # worse is a positive drop, rmse included
    entry = ablation["modalities"]["text"]
    direction = 1 if kind != "regression" else -1
    assert entry["drop"] == pytest.approx(direction * (ablation["full"] - entry["score"]))

    plots = out / "plots"
    if kind == "regression":
        residuals = pd.read_csv(plots / "residuals.csv")
        assert list(residuals.columns) == ["actual", "predicted"] and len(residuals) == len(y)
        pngs = ("predicted_vs_actual.png", "residuals.png")
        other = {"roc.csv": ["fpr", "tpr", "threshold"], "confusion.csv": ["actual", "predicted"]}
    else:
        roc = pd.read_csv(plots / "roc.csv")
        assert list(roc.columns) == ["fpr", "tpr", "threshold"]
        assert roc.fpr.is_monotonic_increasing and roc.tpr.is_monotonic_increasing
        assert (roc.fpr.iloc[0], roc.tpr.iloc[-1]) == (0, 1)
        confusion = pd.read_csv(plots / "confusion.csv", keep_default_na=False)
        assert list(confusion.columns) == ["actual", "predicted"] and len(confusion) == len(y)
        assert (confusion.predicted.astype(str) == preds.prediction.astype(str)).all()
        pngs = ("roc.png", "confusion_matrix.png")
        other = {"residuals.csv": ["actual", "predicted"]}
    # every CSV dvc.yaml's `plots:` draws exists (a missing one is DVC's load error): the other types' empty
    for name, columns in other.items():
        assert (plots / name).read_text() == ",".join(columns) + "\n", name
    for png in pngs:
        with Image.open(plots / png) as im:
            assert im.format == "PNG" and im.size[0] >= 400


def test_a_lower_is_better_metric_improves_downwards(tmp_path: Path) -> None:
    case = _write_fixed(tmp_path / "eval", "regression", baseline=True)
    vs = case["content"]["vs_baseline"]
    assert vs["metric"] == "rmse" and vs["delta"] == vs["model"] - vs["baseline"]
    assert vs["improvement"] == pytest.approx(vs["baseline"] - vs["model"])
    assert render_markdown(case["content"]).count("(lower is better)") == 1


def test_render_markdown_lists_metrics_counts_and_ablation(tmp_path: Path) -> None:
    case = _write_fixed(tmp_path / "eval", "binary")
    ablation = json.loads((tmp_path / "eval" / "ablation.json").read_text())
    text = render_markdown(case["content"], ablation, plots=[tmp_path / "eval" / "plots" / "roc.png"])
    m = case["content"]["metrics"]
    assert f"| **roc_auc** (primary) | {m['roc_auc']:.4f} |" in text
    assert f"| log_loss | {m['log_loss']:.4f} |" in text
    counts = case["content"]["label_counts"]
    assert f"Test rows: 200 (binary label, counts 0: {counts['0']}, 1: {counts['1']})" in text
    assert f"| image | {ablation['modalities']['image']['score']:.4f} |" in text
    assert f"Plots (open offline): `{tmp_path / 'eval' / 'plots' / 'roc.png'}`" in text


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
    schema = resolve_schema({"preset": "petfinder"}).model_dump(mode="json")
    (tmp_path / "meta.json").write_text(json.dumps({"dataset_root": "../raw", "label": "AdoptionSpeed",
                                                    "problem_type": "binary", "classes": [0, 1], "schema": schema}))
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
    assert metrics["test_set"]["fingerprint"] == fingerprint_test_set(test, "AdoptionSpeed")
    assert metrics["model"]["sha256"] == json.loads((chain.trained / "manifest.json").read_text())["output"]["sha256"]

    preds = pd.read_csv(out / "predictions.csv")
    assert preds.row_id.tolist() == test.row_id.tolist() and preds.PetID.tolist() == test.PetID.tolist()
    assert (preds.label == test.AdoptionSpeed).all()
    proba = preds[["proba_0", "proba_1"]].to_numpy()
    np.testing.assert_allclose(proba.sum(axis=1), 1, atol=1e-6)
    assert metrics["metrics"] == pytest.approx(compute_metrics(preds.label, preds.prediction, "binary", 2, proba))
    assert metrics["primary_metric"]["value"] > 0.5  # it learned something in three tiny epochs
    # the classical baseline, fitted on train (stopped early on val), scored on the same rows, reported beside the model
    baseline = preds[["baseline_proba_0", "baseline_proba_1"]].to_numpy()
    assert metrics["baseline"]["metrics"] == pytest.approx(
        compute_metrics(preds.label, preds.baseline_prediction, "binary", 2, baseline))
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
    for name in ("predictions.csv", "ablation.json", "plots/roc.csv", "plots/confusion.csv"):
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
