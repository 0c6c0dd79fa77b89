"""Runs INSIDE the peer's virtual environment (AutoGluon, no project code): fit, predict, report.

    .venv-peer/bin/python bench/peer/fit_autogluon.py JOB.json

JOB.json: {"train": CSV, "test": CSV, "label": column, "problem_type": AutoGluon's, "eval_metric": its name,
"time_limit": seconds, "presets": name, "out_dir": folder}. The CSVs' first column is the row id. Writes
out_dir/predictions.csv (row id, predicted label, one probability column per class) and out_dir/fit.json
(wall time, version, the best model, AutoGluon's leaderboard).
"""

import json
import sys
import time
from pathlib import Path

import pandas as pd
from autogluon.tabular import TabularPredictor, __version__


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    out = Path(job["out_dir"])
    train = pd.read_csv(job["train"], index_col=0)
    test = pd.read_csv(job["test"], index_col=0)
    started = time.perf_counter()
    predictor = TabularPredictor(label=job["label"], problem_type=job["problem_type"],
                                 eval_metric=job["eval_metric"], path=str(out / "models"), verbosity=1)
    predictor.fit(train, time_limit=job["time_limit"], presets=job["presets"])
    fit_s = time.perf_counter() - started
    features = test.drop(columns=[job["label"]], errors="ignore")
    frame = pd.DataFrame({"prediction": predictor.predict(features)}, index=test.index)
    if predictor.problem_type in ("binary", "multiclass"):
        proba = predictor.predict_proba(features)
        for c in proba.columns:
            frame[f"proba_{c}"] = proba[c]
    frame.to_csv(out / "predictions.csv", index_label="row_id")
    board = predictor.leaderboard(silent=True)
    (out / "fit.json").write_text(json.dumps({
        "autogluon": __version__, "problem_type": predictor.problem_type, "fit_wall_s": round(fit_s, 1),
        "best_model": predictor.model_best,
        "leaderboard": board[["model", "score_val", "fit_time"]].head(15).to_dict("records"),
    }, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
