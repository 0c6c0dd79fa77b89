"""The bench's peer (bench/peer/runner.py): AutoGluon-Tabular on a split's rows, scored as evaluate scores.

Needs the peer's own venv (`.venv-peer`, built by the bench from bench/peer/requirements.txt: minutes and
a package index), so it is skipped where that venv is not already built, as in CI.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
VENV = ROOT / ".venv-peer"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not any(VENV.glob(".installed-*")), reason="the peer's venv (.venv-peer) is not built")]


def test_the_peer_fits_the_split_once_and_scores_its_test_rows(tiny_validated: Path, tmp_path: Path) -> None:
    from peer.runner import fit, peer_tables

    train, test = peer_tables(tiny_validated)
    splits = {s: pd.read_parquet(tiny_validated / f"{s}.parquet") for s in ("train", "val", "test")}
    assert len(train) == len(splits["train"]) + len(splits["val"]) and len(test) == len(splits["test"])
    images = json.loads((tiny_validated / "meta.json").read_text())["schema"]["columns"]["image"]
    assert images and not set(images) & set(train.columns)  # the photo columns dropped: it reads none

    first = fit(tiny_validated, tmp_path / "cache", time_limit=30)
    assert first.metric == "roc_auc" and 0.5 < first.score <= 1.0 and not first.cached
    # every metric evaluate reports, the primary among them: the bench prints the log loss beside it
    assert first.metrics["roc_auc"] == first.score and 0.0 < first.metrics["log_loss"] < 1.0
    again = fit(tiny_validated, tmp_path / "cache", time_limit=30)
    assert again.cached and again.score == first.score and again.folder == first.folder


def test_a_regression_label_of_few_whole_numbers_is_fitted_as_a_regression(tiny_validated: Path,
                                                                         tmp_path: Path) -> None:
    """AutoGluon left to infer takes a label of five whole numbers for classes (and then refuses rmse): the
    runner says the problem type. The tiny table's rows, their 0-4 label declared a regression."""
    from peer.runner import fit

    validated = tmp_path / "validated"
    shutil.copytree(tiny_validated, validated)
    meta = json.loads((validated / "meta.json").read_text())
    (validated / "meta.json").write_text(json.dumps({**meta, "problem_type": "regression", "classes": None}))
    got = fit(validated, tmp_path / "cache", time_limit=30)
    assert got.metric == "rmse" and got.score > 0
    assert json.loads((got.folder / "fit.json").read_text())["problem_type"] == "regression"
