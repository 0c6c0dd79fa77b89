"""Markdown for the flow's Prefect artifacts, built from the files the stages write (their contracts).

Pure functions of dicts, so they are tested without a Prefect server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Shown first in the training table, when train_summary.json has them.
TRAINING_KEYS: tuple[str, ...] = (
    "strategy", "zero_stage", "world_size", "num_nodes", "precision", "epochs", "steps", "samples_per_s",
    "best_score", "metric", "best_epoch", "stopped_early", "best_checkpoint",
)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return f"`{json.dumps(value, default=str)}`"
    return str(value).replace("|", "\\|").replace("\n", " ")


def key_value_table(data: Mapping[str, Any], first: tuple[str, ...] = ()) -> str:
    keys = [k for k in first if k in data] + [k for k in data if k not in first]
    rows = ["| key | value |", "|---|---|"] + [f"| {k} | {_cell(data[k])} |" for k in keys]
    return "\n".join(rows) + "\n"


def training_markdown(summary: Mapping[str, Any] | None, path: Path, curves: str | Path | None = None) -> str:
    if summary is None:
        return f"# Training\n\n`{path}` was not written.\n"
    link = f"Curves (loss and validation metric per epoch, offline PNG): `{curves}`.\n\n" if curves else ""
    return f"# Training\n\nFrom `{path}`.\n\n{link}" + key_value_table(summary, TRAINING_KEYS)


def conversion_markdown(manifest: Mapping[str, Any] | None, path: Path) -> str:
    if manifest is None:
        return f"# Conversion\n\n`{path}` was not written.\n"
    return f"# Conversion manifest\n\nFrom `{path}`.\n\n" + key_value_table(manifest)


def run_manifest_markdown(manifest_path: Path, summary: Mapping[str, Any]) -> str:
    lines = [
        "# Run manifest",
        "",
        f"Manifest: `{manifest_path}` (git rev, dvc.lock, params, metrics).",
        "",
        f"- git rev: `{summary.get('git_rev')}`" + (" (uncommitted changes)" if summary.get("git_dirty") else ""),
        f"- DVC remote: `{summary.get('remote')}`, pushed: {summary.get('pushed')}",
    ]
    if summary.get("overridden"):
        lines.append(f"- overridden for this run only (params.yaml unchanged): {', '.join(summary['overridden'])}")
    if summary.get("uncommitted_stages"):
        lines.append(f"- not committed to dvc.lock (it keeps describing params.yaml): "
                     f"{', '.join(summary['uncommitted_stages'])}")
    lines += ["", "| stage | output | md5 |", "|---|---|---|"]
    for stage, outs in (summary.get("outs") or {}).items():
        lines += [f"| {stage} | `{path}` | `{md5}` |" for path, md5 in outs.items()]
    return "\n".join(lines) + "\n"


def score_markdown(summary: Mapping[str, Any]) -> str:
    """The scoring run (tasks.score.ScoreSummary as a dict): the model, the rows scored and rejected, per drop."""
    model, scored = summary["model"], summary.get("scored") or []
    lines = [
        "# Scoring", "",
        f"Model: version **{model['version']}**, sha256 `{model['sha256']}` (`{model.get('folder')}`).", "",
        f"**{summary['rows_scored']} row(s) scored, {summary['rows_rejected']} rejected** in {len(scored)} drop(s) "
        f"of `{summary['source']}` ({summary['kind']}); {len(summary.get('already') or [])} drop(s) already scored, "
        f"{len(summary.get('refused') or [])} refused.",
    ]
    if scored:
        lines += ["", "| drop | rows | scored | rejected | output |", "|---|---|---|---|---|"]
        lines += [f"| {_cell(d['drop'])} | {d['rows']} | {d['scored']} | {d['rejected']} | `{d['out_dir']}` |"
                  for d in scored]
    if summary.get("refused"):
        lines += ["", "## Refused (nothing written for them)", ""] + [f"- {_cell(r)}" for r in summary["refused"]]
    return "\n".join(lines) + "\n"
