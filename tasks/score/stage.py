"""Score stage: new rows scored with the champion, drop by drop, each drop's outputs written whole.

```
score.source ─> drop ─> its table, each row checked ─> good rows: the champion's predictions
  (a folder of drops, or      (tasks/score/rows.py)      bad rows: row, column, value, reason
   a URL listing: the feed
   kinds of tasks/intake)  ─> out_dir/<drop>/predictions.csv, rejects.jsonl, manifest.json (model version, sha256)
```

- The model is loaded once for the whole run (fusion_model.model_watch.load_model: the weights' sha256
  checked against the store folder's name, a strict load, one probe row); every drop of the run is scored
  by it and its manifest names it. No champion yet is an error saying how to get one.
- A drop's folder is built beside `out_dir` and swapped into place complete (tasks/_io/folders.py): a
  failure, a kill or a power cut leaves every drop's folder as it was (complete or absent), and the next
  run scores what is missing.
- A drop already scored (its manifest names the same content sha256) is skipped; `rescore: true` scores it
  again and replaces its folder whole. New content under a name already scored is refused, as intake
  refuses it: drop it under a new name.
- A drop that cannot be scored at all (a table that does not read, a column the model needs missing, a name
  that cannot be a folder name) is refused, with nothing written for it; the other drops are still scored,
  then `ScoreRefused` names each refused drop, the reason and the fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
from filelock import FileLock, Timeout
from pydantic import BaseModel

from fusion_model.model_watch import CHAMPIONS_LOG, LoadedModel, load_model
from tasks._io.files import read_json_if_present, write_json, write_text
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks._io.hashing import sha256_file
from tasks.errors import StageError, TransientError
from tasks.intake.feed import TABLE_SUFFIXES, Drop, Fetching, list_drops, table_of
from tasks.params import FeedParams, ScoreParams
from tasks.score.rows import check_rows, predict_rows, read_rows

MANIFEST = "manifest.json"
PREDICTIONS = "predictions.csv"
REJECTS = "rejects.jsonl"
OUTPUT_FILES = (PREDICTIONS, REJECTS, MANIFEST)
# a drop's name becomes its output folder's: one plain path part, never hidden (the staging folders are)
FOLDER_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._ -]*$")


class DropScore(BaseModel):
    drop: str
    sha256: str
    rows: int
    scored: int
    rejected: int
    out_dir: str


class ScoreSummary(BaseModel):
    source: str
    kind: str  # folder | url
    model: dict[str, str]  # version, sha256, folder
    seen: int = 0  # drops in the source
    scored: list[DropScore] = []
    already: list[str] = []  # drops scored by an earlier run (skipped)
    refused: list[str] = []  # drops that could not be scored, each with the reason and the fix
    rows_scored: int = 0
    rows_rejected: int = 0
    message: str = ""
    seconds: float = 0.0


class ScoreRefused(StageError):
    """Some drops could not be scored (each named with its fix); `summary` says what the run did write."""

    def __init__(self, message: str, summary: ScoreSummary) -> None:
        super().__init__(message)
        self.summary = summary


def load_champion(champion_dir: Path) -> LoadedModel:
    """The model at `champion_dir` (the registry's link, or a converted model folder), loaded and verified."""
    if champion_dir.is_symlink() and not champion_dir.exists():
        raise StageError(
            f"{champion_dir} links to {champion_dir.parent / os.readlink(champion_dir)}, which does not exist: the "
            "champion's model is gone, so nothing can be scored. Roll back to a model the store still holds "
            "(`python -m tasks champion list`, then `python -m tasks champion rollback --to VERSION`) or restore "
            "the folder from a backup, then score again")
    if not champion_dir.exists():
        raise StageError(
            f"{champion_dir}: no champion yet, so there is no model to score with. Train and promote one first: "
            "`python -m flows.retrain` (or `prefect deployment run 'retrain/on-demand'`) promotes its model when "
            "it beats the classical baseline; or set score.champion_dir to a converted model folder (data/model)")
    folder = champion_dir.resolve()
    log_file = champion_dir.parent / CHAMPIONS_LOG if champion_dir.is_symlink() else folder.parent.parent / CHAMPIONS_LOG
    try:
        return load_model(folder, log_file)
    except (OSError, ValueError) as e:  # PredictError and a damaged file
        raise StageError(
            f"{champion_dir} ({folder}): the model cannot be loaded ({e}). Roll back to a model that loads "
            "(`python -m tasks champion rollback`) or promote a new one, then score again") from None


def _drops(params: ScoreParams, model: LoadedModel, work: Path) -> list[Drop]:
    """The source's drops, read by the intake's feed readers (intake.feed's folder and url kinds)."""
    if params.kind == "folder":
        folder = Path(params.source)
        if not folder.is_dir():
            raise StageError(
                f"{folder}: no such folder (score.source). Put the rows to score there (per drop a folder with a "
                "table and its photos, or a CSV / Parquet table), or set score.source to the folder or the URL of "
                "a listing they arrive at")
        feed = FeedParams(kind="folder", path=folder, glob=params.glob)
    else:
        feed = FeedParams(kind="url", url=params.source)
    return list_drops(feed, model.predictor.schema, work, Fetching(params.timeout_s, params.max_attempts))


@contextmanager
def _lock(out_dir: Path) -> Iterator[None]:
    """Two scoring runs writing one out_dir would score the same drops twice: refuse the second at once."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(out_dir.parent / f".{out_dir.name}.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise StageError(f"another scoring run is writing {out_dir} (it holds {lock.lock_file}); wait for it to "
                         "finish. The score deployments queue their runs by themselves") from None
    try:
        yield
    finally:
        lock.release()


def _write(dest: Path, predictions: pd.DataFrame, rejects: list[dict[str, Any]], manifest: dict[str, Any]) -> None:
    """The drop's three files, built in a folder beside `dest` and swapped in whole."""
    staged = temp_dir_beside(dest)
    try:
        predictions.to_csv(staged / PREDICTIONS, index=False, lineterminator="\n")
        write_text(staged / REJECTS, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rejects))
        write_json(staged / MANIFEST, {**manifest, "files": {n: sha256_file(staged / n) for n in (PREDICTIONS, REJECTS)}})
        swap_dir(staged, dest)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def score_drop(drop: Drop, model: LoadedModel, params: ScoreParams, extra: dict[str, Any]) -> DropScore | None:
    """Score one drop into `out_dir/<drop name>/`; None when an earlier run scored the same content."""
    out_dir = Path(params.out_dir)
    if not FOLDER_NAME.match(drop.name) or drop.name.strip(".") == "":
        raise StageError(f"drop {drop.name!r}: its name cannot be a folder name under {out_dir}; rename it (letters, "
                         "digits, '.', '_', '-' and spaces, not starting with '.')")
    dest = out_dir / drop.name
    recover_dir(dest)  # an interrupted swap of an earlier run: its complete folder back, its leftovers gone
    before = read_json_if_present(dest / MANIFEST)
    if dest.exists() and before is None:
        raise StageError(f"{dest}: exists but is not a scoring output (no {MANIFEST}); move it away, then score again")
    if before is not None and not params.rescore:
        if (before.get("drop") or {}).get("sha256") == drop.sha256:
            return None
        raise StageError(
            f"{drop.origin} has changed since it was scored into {dest} (sha256 "
            f"{str((before.get('drop') or {}).get('sha256'))[:12]}... then, {drop.sha256[:12]}... now); a drop's "
            "content never changes under its name. Drop the new rows under a new name, or set score.rescore: "
            f"true to score it again and replace {dest}")
    if drop.path.is_file() and drop.path.suffix.lower() not in TABLE_SUFFIXES:
        raise StageError(f"{drop.origin}: a drop is a CSV or Parquet table, or a folder holding one; rename it, or "
                         "narrow score.glob so it is not taken as a drop")
    table = table_of(drop.path)
    root = drop.path if drop.path.is_dir() else drop.path.parent  # photo paths are relative to the drop's folder
    inside = table.relative_to(drop.path).as_posix() if drop.path.is_dir() else table.name
    # messages name the table where its sender can find it: a fetched copy is gone after the run
    shown = table if params.kind == "folder" else drop.origin if drop.path.is_file() else f"{drop.origin}: {inside}"
    predictor = model.predictor
    rows = read_rows(table, predictor.schema.columns.text, shown)
    checked = check_rows(rows, predictor.schema, root, params.workers, shown)
    predictions = predict_rows(predictor, checked.good, root, params.batch_size, shown)
    counts = {"rows": len(rows), "scored": len(predictions), "rejected": len(checked.rejects)}
    _write(dest, predictions, checked.rejects, {
        "drop": {"name": drop.name, "origin": drop.origin, "sha256": drop.sha256,
                 "table": inside},
        "model": {**model.names(), "version_source": model.version_source, "folder": str(model.folder),
                  "problem_type": predictor.problem_type, "classes": predictor.classes},
        **counts, "columns": [str(c) for c in predictions.columns], "ignored_columns": checked.ignored_columns,
        "scored_at": datetime.now(UTC).isoformat(timespec="seconds"), **extra,
    })
    return DropScore(drop=drop.name, sha256=drop.sha256, out_dir=str(dest), **counts)


def message(summary: ScoreSummary) -> str:
    version, sha = summary.model["version"], summary.model["sha256"][:12]
    named = f"model {sha}" if version == sha else f"model version {version} ({sha})"
    text = (f"{summary.rows_scored} row(s) scored and {summary.rows_rejected} rejected in {len(summary.scored)} "
            f"drop(s) by {named}")
    if summary.already:
        text += f"; {len(summary.already)} drop(s) already scored"
    if summary.refused:
        text += f"; {len(summary.refused)} drop(s) refused"
    return text


def score(params: ScoreParams, extra: dict[str, Any] | None = None) -> ScoreSummary:
    """Score every new drop of `params.source` with the model at `params.champion_dir` into
    `params.out_dir`; `extra` joins each drop's manifest (the flow's run id). Raises ScoreRefused, after the
    other drops are written, when a drop could not be scored."""
    started = time.perf_counter()
    model = load_champion(Path(params.champion_dir))
    out_dir = Path(params.out_dir)
    summary = ScoreSummary(source=params.source, kind=params.kind, model={**model.names(), "folder": str(model.folder)})
    with _lock(out_dir):
        work = temp_dir_beside(out_dir, "feed")  # fetched drops of a URL source, removed at the end
        try:
            drops = _drops(params, model, work)
            summary.seen = len(drops)
            for drop in drops:
                try:
                    done = score_drop(drop, model, params, extra or {})
                except TransientError:
                    raise
                except StageError as e:
                    summary.refused.append(f"{drop.name} ({drop.origin}): {e}")
                    continue
                if done is None:
                    summary.already.append(drop.name)
                else:
                    summary.scored.append(done)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    summary.rows_scored = sum(d.scored for d in summary.scored)
    summary.rows_rejected = sum(d.rejected for d in summary.scored)
    summary.message = message(summary)
    summary.seconds = round(time.perf_counter() - started, 3)
    if summary.refused:
        raise ScoreRefused(f"{len(summary.refused)} drop(s) could not be scored and nothing was written for them: "
                           + "; ".join(summary.refused) + f". Otherwise: {summary.message}. Fix them and score again "
                           "(drops already scored are skipped)", summary)
    return summary
