"""The peer, side by side: AutoGluon-Tabular fitted on the very rows the network trains on, scored on the
same test rows with the project's own metric functions.

AutoGluon lives in its own virtual environment (`.venv-peer`, created here from requirements.txt; it pins
its own versions, so it never shares the project's). It reads the rows as a user hands them over: the
download stage's CSV (the file's own columns and types), the label as validate resolved it, the image
columns dropped (it reads no photos). Its training rows are validate's train + val (the network fits on
train and picks its epoch and portfolio candidate on val: both are rows it learns from); its test rows
are validate's test rows. Results are cached by the sha256 of those two files, the job and the peer's
requirements: the split does not change between runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REQUIREMENTS = HERE / "requirements.txt"
FIT_SCRIPT = HERE / "fit_autogluon.py"
# AutoGluon's name for each problem type's primary metric (fusion_model/metrics.py names them too)
EVAL_METRIC = {"binary": "roc_auc", "multiclass": "f1_macro", "ordinal": "quadratic_kappa", "regression": "rmse"}
# said, not inferred: AutoGluon takes a label of whole numbers with few values (ages in months) for classes
PROBLEM_TYPE = {"binary": "binary", "multiclass": "multiclass", "ordinal": "multiclass", "regression": "regression"}
TIME_LIMIT_S = 600
PRESETS = "medium_quality"


class PeerUnavailable(RuntimeError):
    """The peer's environment cannot be built here (no registry, no Python 3.11)."""


def peer_python(venv: Path = ROOT / ".venv-peer") -> Path:
    """The peer venv's interpreter, (re)installed when requirements.txt changed since the last install."""
    python = venv / "bin" / "python"
    stamp = venv / f".installed-{hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]}"
    if stamp.is_file():
        return python
    try:
        if not python.is_file():
            subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-r", str(REQUIREMENTS)], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        raise PeerUnavailable(f"cannot build the peer's environment {venv} ({e}); it needs the package index") from e
    for old in venv.glob(".installed-*"):
        old.unlink()
    stamp.touch()
    return python


@dataclass(frozen=True)
class PeerResult:
    score: float
    metric: str
    fit_wall_s: float
    cached: bool
    best_model: str
    folder: Path
    metrics: dict[str, float | None]  # every test metric evaluate reports (log loss beside the primary)


def _meta(validated: Path) -> dict:
    return json.loads((validated / "meta.json").read_text())


def _raw_root(validated: Path, meta: dict) -> Path:
    root = Path(meta["dataset_root"])
    return root if root.is_absolute() else (validated / root).resolve()


def peer_tables(validated: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(training rows, test rows) as the user's CSV has them, label as validate resolved it, no image columns."""
    meta = _meta(validated)
    raw, label = _raw_root(validated, meta), meta["label"]
    drop = list(meta["schema"]["columns"]["image"])
    tables = []
    for raw_name, splits in (("train.csv", ("train", "val")), ("test.csv", ("test",))):
        source = pd.read_csv(raw / raw_name, index_col=0)
        rows = pd.concat([pd.read_parquet(validated / f"{s}.parquet", columns=["row_id", label]) for s in splits])
        table = source.loc[rows["row_id"].to_numpy()].drop(columns=drop, errors="ignore")
        table[label] = rows[label].to_numpy()
        tables.append(table)
    return tables[0], tables[1]


def _class_index(values: pd.Series, classes: list) -> np.ndarray:
    lookup = {str(c): i for i, c in enumerate(classes)}
    return values.map(lambda v: lookup[str(v)]).to_numpy(dtype=np.int64)


def score(validated: Path, predictions: pd.DataFrame) -> tuple[str, dict[str, float | None]]:
    """The peer's primary metric's name and every test metric, with fusion_model.metrics, as evaluate scores
    the network."""
    sys.path.insert(0, str(ROOT))
    from fusion_model.metrics import compute_metrics, primary_metric_name

    meta = _meta(validated)
    problem, classes, label = meta["problem_type"], meta["classes"], meta["label"]
    test = pd.read_parquet(validated / "test.parquet", columns=["row_id", meta["label"]]).set_index("row_id")
    predictions = predictions.loc[test.index]
    name = primary_metric_name(problem)
    if problem == "regression":
        got = compute_metrics(test[label].to_numpy(float), predictions["prediction"].to_numpy(float), problem)
    else:
        proba = None
        if problem in ("binary", "multiclass"):
            proba = predictions[[f"proba_{c}" for c in classes]].to_numpy(float)
        got = compute_metrics(_class_index(test[label], classes), _class_index(predictions["prediction"], classes),
                              problem, len(classes), proba)
    return name, got


def fit(validated: Path, cache_dir: Path, time_limit: int = TIME_LIMIT_S, venv: Path = ROOT / ".venv-peer"
        ) -> PeerResult:
    """AutoGluon-Tabular on `validated`'s split (cached by the split's sha256 and the peer's version)."""
    meta = _meta(validated)
    train, test = peer_tables(validated)
    cache_dir.mkdir(parents=True, exist_ok=True)
    job = {"label": meta["label"], "problem_type": PROBLEM_TYPE[meta["problem_type"]],
           "eval_metric": EVAL_METRIC[meta["problem_type"]], "time_limit": time_limit, "presets": PRESETS}
    digest = hashlib.sha256()
    for part in (train.to_csv().encode(), test.to_csv().encode(), json.dumps(job, sort_keys=True).encode(),
                 REQUIREMENTS.read_bytes(), FIT_SCRIPT.read_bytes()):
        digest.update(hashlib.sha256(part).digest())
    folder = cache_dir / digest.hexdigest()[:20]
    cached = (folder / "fit.json").is_file()
    if not cached:
        python = peer_python(venv)
        work = folder.with_name(folder.name + ".partial")
        work.mkdir(parents=True, exist_ok=True)
        train.to_csv(work / "train.csv")
        test.drop(columns=[meta["label"]]).to_csv(work / "test.csv")
        (work / "job.json").write_text(json.dumps({**job, "train": str(work / "train.csv"),
                                                   "test": str(work / "test.csv"), "out_dir": str(work)}))
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        started = time.perf_counter()
        with open(work / "fit.log", "w") as log:
            done = subprocess.run([str(python), str(FIT_SCRIPT), str(work / "job.json")], stdout=log,
                                  stderr=subprocess.STDOUT, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"AutoGluon failed ({done.returncode}); see {work / 'fit.log'}")
        info = json.loads((work / "fit.json").read_text())
        info["process_wall_s"] = round(time.perf_counter() - started, 1)
        (work / "fit.json").write_text(json.dumps(info, indent=2))
        shutil.rmtree(work / "models", ignore_errors=True)  # hundreds of MB of fitted models; the scores stay
        os.replace(work, folder)
    info = json.loads((folder / "fit.json").read_text())
    name, metrics = score(validated, pd.read_csv(folder / "predictions.csv", index_col=0))
    return PeerResult(score=float(metrics[name]), metric=name, fit_wall_s=info["fit_wall_s"], cached=cached,
                      best_model=info["best_model"], folder=folder, metrics=metrics)
