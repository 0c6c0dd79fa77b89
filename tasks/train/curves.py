"""The training curves a person opens: loss and the validation metric per epoch, from DVCLive's log.

Reads the series DVCLive wrote (`plots/metrics/<name>.tsv`: step, value) and its `epoch.tsv` (which step
ends which epoch), draws loss (train and validation) and the monitored validation metric per epoch as one
offline PNG, the best epoch (the checkpoint kept) marked, and where early stopping ended the run.
"""

from __future__ import annotations

import csv
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402


def read_series(live_dir: Path, name: str) -> list[tuple[int, float]]:
    """(step, value) rows of one DVCLive metric, e.g. `val/auc`; [] when it was never logged."""
    path = live_dir / "plots" / "metrics" / f"{name}.tsv"
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        rows = list(csv.reader(f, delimiter="\t"))
    return [(int(r[0]), float(r[-1])) for r in rows[1:] if r and r[-1] not in ("", "nan")]


def per_epoch(live_dir: Path, name: str) -> list[tuple[int, float]]:
    """(epoch, value), epochs counted from 1, for a metric logged once per epoch."""
    epoch_of = {step: int(epoch) + 1 for step, epoch in read_series(live_dir, "epoch")}
    return [(epoch_of[step], value) for step, value in read_series(live_dir, name) if step in epoch_of]


def write_curves(live_dir: Path, out: Path, monitor: str, best_epoch: int | None, stopped_early: bool) -> Path:
    """Draw the curves of the run logged in `live_dir` into the PNG `out`."""
    fig, (loss_ax, metric_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for name, label in (("train/loss_epoch", "train"), ("val/loss", "validation")):
        points = per_epoch(live_dir, name)
        if points:
            loss_ax.plot(*zip(*points, strict=True), marker="o", label=label)
    loss_ax.set(title="Loss per epoch", xlabel="epoch", ylabel="cross-entropy")
    points = per_epoch(live_dir, monitor)
    if points:
        metric_ax.plot(*zip(*points, strict=True), marker="o", color="tab:green", label=monitor)
    metric_ax.set(title=f"{monitor} per epoch", xlabel="epoch", ylabel=monitor)
    for ax in (loss_ax, metric_ax):
        if best_epoch is not None:
            ax.axvline(best_epoch, color="tab:red", linestyle="--", label=f"best epoch {best_epoch} (kept)")
        if stopped_early and points:
            ax.axvline(points[-1][0], color="grey", linestyle=":", label="early stop")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out
