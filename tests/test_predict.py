"""Prediction from the converted model: the CLI, the Python API and the evaluation agree; bad rows are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fusion_model.predict import Predictor, read_rows_csv

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _new_rows(chain, tmp_path: Path) -> Path:
    """The raw test CSV without its label, as someone would send new rows (tutorial index column kept)."""
    raw = pd.read_csv(chain.images_root / "test.csv", index_col=0)
    path = tmp_path / "new.csv"
    raw.drop(columns=["AdoptionSpeed"]).to_csv(path)
    return path


def test_cli_api_and_evaluation_give_identical_probabilities(tiny_model_chain, tmp_path: Path) -> None:
    chain = tiny_model_chain
    csv_path, out = _new_rows(chain, tmp_path), tmp_path / "preds.csv"
    done = subprocess.run(
        [sys.executable, "-m", "fusion_model.predict", "--model", str(chain.trained), "--csv", str(csv_path),
         "--images-root", str(chain.images_root), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    cli = pd.read_csv(out, index_col="row")

    api = Predictor.load(chain.trained).predict(read_rows_csv(csv_path), chain.images_root)
    cols = ["proba_0", "proba_1"]
    assert list(cli.columns) == ["PetID", "prediction", *cols] and list(api.columns) == ["PetID", "prediction", *cols]
    assert (cli["PetID"] == api["PetID"]).all()  # the row key comes back with each prediction
    assert cli.index.tolist() == api.index.tolist()
    # The model computes in float32 and the CLI writes float32's shortest repr: compare at that precision.
    np.testing.assert_array_equal(cli[cols].to_numpy(np.float32), api[cols].to_numpy())
    np.testing.assert_array_equal(cli["prediction"], api["prediction"])

    evaluation = pd.read_csv(chain.trained_eval / "predictions.csv", index_col="row_id")
    assert sorted(evaluation.index) == sorted(cli.index)  # row ids are the CSV index
    np.testing.assert_array_equal(evaluation.loc[cli.index, cols].to_numpy(np.float32), cli[cols].to_numpy(np.float32))
    np.testing.assert_array_equal(evaluation.loc[cli.index, "prediction"], cli["prediction"])


def test_image_path_escaping_the_root_is_refused(tiny_model_chain, tmp_path: Path) -> None:
    chain = tiny_model_chain
    rows = read_rows_csv(_new_rows(chain, tmp_path)).head(5).copy()
    bad_row = int(rows.index[2])
    rows.loc[bad_row, "Images"] = "../outside.jpg"
    predictor = Predictor.load(chain.trained)
    with pytest.raises(ValueError) as err:
        predictor.predict(rows, chain.images_root)
    message = str(err.value)
    assert f"row {bad_row}," in message and "'..'" in message and "../outside.jpg" in message
    assert message.count("row ") == 1  # only the bad row is named


def test_the_cli_names_the_file_its_data_line_and_the_id(tiny_model_chain, tmp_path: Path) -> None:
    chain = tiny_model_chain
    rows = read_rows_csv(_new_rows(chain, tmp_path)).head(6).copy()
    rows.iloc[3, rows.columns.get_loc("Images")] = "../outside.jpg"  # the 4th data line of the file
    bad = tmp_path / "bad.csv"
    rows.to_csv(bad)
    header_only = tmp_path / "header_only.csv"
    rows.iloc[:0].to_csv(header_only)
    for path, expected in ((bad, f"{bad} data line 4 (index {int(rows.index[3])!r}, PetID {rows['PetID'].iloc[3]!r})"),
                           (header_only, f"{header_only}: a header and no rows")):
        done = subprocess.run([sys.executable, "-m", "fusion_model.predict", "--model", str(chain.trained), "--csv",
                               str(path), "--images-root", str(chain.images_root), "--out", str(tmp_path / "p.csv")],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 1 and expected in done.stderr, done.stderr
    assert not (tmp_path / "p.csv").exists()


def test_the_ensemble_is_one_converted_file_that_predicts_alone(tiny_model_chain, tmp_path: Path) -> None:
    """params.yaml's fusion: a TabM ensemble split among the portfolio's members, converted once; the
    member weights validation chose travel in the file, and the folder alone predicts (no checkpoint)."""
    import json
    import shutil

    import torch

    chain = tiny_model_chain
    moved = tmp_path / "model"
    shutil.copytree(chain.trained, moved)
    assert sorted(p.name for p in moved.glob("*.safetensors")) == ["model.safetensors"]
    predictor = Predictor.load(moved)
    model = predictor.model
    assert model.fusion == "tabm" and model.k >= model.members >= 2
    summary = json.loads((chain.trained.parents[1] / "checkpoints/train_summary.json").read_text())
    weights = model.member_weights.clone()
    assert [m["weight"] for m in summary["portfolio"]["members"]] == pytest.approx(weights.tolist())
    assert summary["portfolio"]["chosen"] == int(weights.argmax())
    rows = read_rows_csv(_new_rows(chain, tmp_path))
    proba = predictor.predict_proba(rows, chain.images_root)
    alone = []
    # the deep members, then the linear member (fusion_model/wide.py), in the file beside them
    assert model.linear is not None and model.mixed == model.members + 1
    for m in range(model.mixed):  # each member alone; the prediction mixes their probabilities
        model.member_weights.copy_(torch.nn.functional.one_hot(torch.tensor(m), model.mixed).float())
        alone.append(predictor.predict_proba(rows, chain.images_root))
    mixed = sum(w * a for w, a in zip(weights.tolist(), alone, strict=True))
    np.testing.assert_allclose(proba, mixed, rtol=1e-5, atol=1e-6)
    assert not np.allclose(alone[0], alone[1])  # the members differ: their wide logits train apart
    assert not np.allclose(alone[0], alone[-1])
