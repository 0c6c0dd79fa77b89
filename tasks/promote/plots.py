"""The metric of every challenger and champion over the runs, as one PNG a person opens offline.

Drawn from history.jsonl (every promotion decision, and every rollback): per decision the challenger's
score on the frozen test set, promoted or not, and the champion's score it was compared with; the
champion's line steps up at each promotion and back to the restored model's score at a rollback.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402

from fusion_model.metrics import greater_is_better  # noqa: E402
from tasks._io.files import write_bytes  # noqa: E402

SCORE_HISTORY = "score_history.png"


def write_score_history(decisions: list[dict[str, Any]], out: Path) -> Path | None:
    """Plot `decisions` (history.jsonl, oldest first) into `out`; None when there is nothing to plot."""
    if not decisions:
        return None
    rollbacks = [(r, d["champion_score"]) for r, d in enumerate(decisions, start=1)
                 if d.get("event") == "rollback" and d.get("champion_score") is not None]
    runs = list(range(1, len(decisions) + 1))
    metric = next((d["metric"] for d in reversed(decisions) if d.get("metric")), "score")
    champion: list[float | None] = []
    best = None
    for d in decisions:
        if d.get("event") == "rollback":
            best = d.get("champion_score")
        elif d.get("promoted"):
            best = d.get("challenger_score")
        champion.append(best)
    decisions_only = [(r, d) for r, d in zip(runs, decisions, strict=True) if d.get("event") != "rollback"]
    challenger = {r: d.get("challenger_score") for r, d in decisions_only}
    fig, ax = plt.subplots(figsize=(8, 4), dpi=100)
    ax.step(runs, champion, where="post", color="tab:green", label="champion after the run")
    promoted = [(r, challenger[r]) for r, d in decisions_only if d.get("promoted")]
    kept = [(r, challenger[r]) for r, d in decisions_only if not d.get("promoted")]
    if promoted:
        ax.scatter(*zip(*promoted, strict=True), color="tab:green", marker="^", s=60, label="challenger, promoted", zorder=3)
    if kept:
        ax.scatter(*zip(*kept, strict=True), color="tab:red", marker="x", s=50, label="challenger, not promoted", zorder=3)
    if rollbacks:
        ax.scatter(*zip(*rollbacks, strict=True), color="tab:orange", marker="v", s=60, label="rollback", zorder=3)
    baseline = [(r, d["baseline_score"]) for r, d in decisions_only if d.get("baseline_score") is not None]
    if baseline:
        ax.plot(*zip(*baseline, strict=True), color="grey", linestyle=":", marker=".", label="classical baseline")
    direction = "" if greater_is_better(metric) else " (lower is better)"
    ax.set(title=f"{metric} on the frozen test set, run by run{direction}", xlabel="promotion decision (run) or rollback",
           ylabel=metric)
    ax.set_xticks(runs)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    write_bytes(out, buf.getvalue())
    return out
