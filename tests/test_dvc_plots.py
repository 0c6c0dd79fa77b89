"""`dvc plots show` with the project's dvc.yaml and .dvc/config, for every problem type: no load error, and a
page that loads no script from the network (Vega, Vega-Lite and vega-embed inlined from vendor/vega/).

Each case is a git + DVC copy of the project (tests/project_copy.py) holding what the stages write for
their plots: DVCLive's log of a run and its curves PNG (tasks/train/curves.py), and the evaluation's plots
of the problem type, written by the function the evaluate stage calls (tasks/evaluate/plots.py). The full
pipeline's `dvc plots show` is in tests/test_dvc.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from project_copy import ROOT, dvc, make_project, script_sources

from tasks.evaluate.plots import PLOT_CSVS, write_plots
from tasks.train.curves import write_curves

LOAD_ERROR = "DVC failed to load some plots"
ROWS = 60


def _training_log(live_dir: Path) -> None:
    """Three epochs of a run's log, as the Lightning logger writes it, and the curves PNG drawn from it."""
    from dvclive import Live

    with Live(str(live_dir), save_dvc_exp=False, dvcyaml=False) as live:
        for epoch in range(3):
            live.log_metric("epoch", epoch)
            live.log_metric("train/loss_epoch", 0.7 - 0.1 * epoch)
            live.log_metric("val/loss", 0.72 - 0.08 * epoch)
            live.log_metric("val/roc_auc", 0.6 + 0.05 * epoch)
            live.next_step()
    write_curves(live_dir, live_dir / "curves.png", "val/roc_auc", best_epoch=3, stopped_early=False)


def _evaluation(plots: Path, kind: str) -> None:
    """The evaluation's plots of a problem type on seeded predictions."""
    rng = np.random.default_rng(0)
    plots.mkdir(parents=True)
    if kind == "regression":
        y = rng.normal(10, 3, ROWS)
        write_plots(plots, kind, y, y + rng.normal(0, 1, ROWS), None, [], "price")
        return
    classes = ["0", "1"] if kind == "binary" else ["a", "b", "c", "d"]
    y = rng.integers(0, len(classes), ROWS)
    proba = rng.dirichlet(np.ones(len(classes)), ROWS)
    proba[np.arange(ROWS), y] += 0.5
    proba /= proba.sum(axis=1, keepdims=True)
    write_plots(plots, kind, y, proba.argmax(axis=1), proba, classes, "label")


def test_dvc_yaml_draws_exactly_the_csvs_every_evaluation_writes() -> None:
    top = yaml.safe_load((ROOT / "dvc.yaml").read_text())["plots"]
    drawn = {Path(f).name for plot in top for props in plot.values() for f in props["y"]}
    assert drawn == set(PLOT_CSVS)


@pytest.mark.parametrize("kind", ["binary", "multiclass", "ordinal", "regression"])
def test_plots_show_loads_every_plot_and_its_page_needs_no_network(kind: str, tmp_path: Path) -> None:
    """Before: the regression CSV was missing for a classification label (and the classification ones for a
    regression label), and DVC said "failed to load some plots for following revisions: 'workspace'"; the page
    loaded Vega from a CDN, blank offline."""
    root = make_project(tmp_path / "project")
    _training_log(root / "reports/training")
    _evaluation(root / "data/eval/plots", kind)
    done = dvc(root, "plots", "show", "-o", str(tmp_path / "plots"))
    assert LOAD_ERROR not in done.stdout + done.stderr, done.stderr
    page = (tmp_path / "plots/index.html").read_text()
    sources = script_sources(page)
    assert sources and all(s == "inline" for s in sources), sources  # no script fetched from anywhere
    assert not re.search(r"<(?:script|link)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//", page, re.IGNORECASE)
    assert "vegaEmbed" in page and "BSD-3-Clause" in page  # vega-embed is there, with its licence
    titles = ["ROC curve (test set)", "Confusion matrix (test set)", "Predicted vs actual (test set)"]
    drawn = titles[2:] if kind == "regression" else titles[:2]
    for title in titles:  # a Vega-Lite spec with data for the type's plots; nothing for the others' empty CSVs
        assert (f'"text": "{title}"' in page) == (title in drawn), title
