"""The champion registry: every promoted model kept, content-addressed, and one symlink naming the champion.

```
models/                              (the folder holding champion_dir)
  champion -> store/<sha256>         a relative symlink, replaced by one atomic rename
  store/<sha256>/                    one folder per promoted model, named by its weights' sha256, never
                                     changed: model.safetensors, model_config.json, manifest.json,
                                     metrics.json, promotion.json, run_manifest.json (when the run had one)
  champions.jsonl                    one line per promotion and per rollback
  history.jsonl                      every promotion decision, promoted or not, and every rollback
```

A reader of `champion/` follows the link once and sees one complete, immutable folder: the old champion or
the new one, never none and never a mix (a reader that opened the old one keeps reading it). A store
folder is built under a temporary name and renamed into place complete. Changes happen under the
promotion lock; a crash between the link flip and its log line is repaired on the next call from the
promotion.json the store folder carries, and a log line a crash cut short is skipped with a warning and
removed by the next append (tasks/_io/jsonl.py). A champion link whose store folder is gone is refused
(`dangling_link_problem`): nothing is compared with, or promoted over, a model that is not there.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel

from fusion_model.layout import WEIGHTS
from tasks._io.files import fsync_dir, read_json_if_present, write_json
from tasks._io.folders import flush_tree, temp_dir_beside
from tasks._io.hashing import sha256_file
from tasks._io.jsonl import append_jsonl, read_jsonl_as
from tasks.errors import StageError

STORE = "store"
LOG_NAME = "champions.jsonl"
PROMOTION_FILE = "promotion.json"
RUN_MANIFEST_FILE = "run_manifest.json"


class ChampionEvent(BaseModel):
    """One line of champions.jsonl."""

    event: Literal["promoted", "rollback"]
    version: int  # the promotion's number (1, 2, ...); a rollback names the version it went back to
    sha256: str
    at: str
    metric: str | None = None
    score: float | None = None
    run_id: str | None = None
    reason: str = ""
    previous_sha256: str | None = None


def store_dir(champion_dir: Path) -> Path:
    return champion_dir.parent / STORE


def log_path(champion_dir: Path) -> Path:
    return champion_dir.parent / LOG_NAME


def current_sha(champion_dir: Path) -> str | None:
    """The sha256 of the champion's weights (the store folder the link names), None without a champion."""
    if champion_dir.is_symlink():
        return Path(os.readlink(champion_dir)).name
    return None


def dangling_link_problem(champion_dir: Path) -> str | None:
    """Why the champion link cannot be used when it names a store folder that is gone, else None."""
    if not champion_dir.is_symlink() or champion_dir.exists():
        return None
    target = champion_dir.parent / os.readlink(champion_dir)
    return (f"{champion_dir} is a link to {target}, which does not exist: the champion's model is gone, so "
            "nothing can be compared with it and nothing is promoted. Repair the registry, then promote again: "
            "roll back to a model the store still holds (`python -m tasks champion list`, then `python -m tasks "
            f"champion rollback --to VERSION`), restore {target} from a backup, or remove the link "
            f"(`rm {champion_dir}`) to let the next challenger become champion without a comparison.")


def read_log(champion_dir: Path) -> list[ChampionEvent]:
    return read_jsonl_as(log_path(champion_dir), ChampionEvent)


def _append(champion_dir: Path, event: ChampionEvent) -> None:
    append_jsonl(log_path(champion_dir), event.model_dump_json())


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _point_at(champion_dir: Path, sha: str) -> None:
    """Flip the champion link to store/<sha> in one rename: readers see the old target or the new one."""
    link = champion_dir.parent / f".{champion_dir.name}.link-{os.getpid()}"
    link.unlink(missing_ok=True)
    os.symlink(Path(STORE) / sha, link)
    os.replace(link, champion_dir)
    fsync_dir(champion_dir.parent)


def store(champion_dir: Path, files: dict[str, Path], documents: dict[str, Any]) -> str:
    """Keep a model in the store (`files` copied, `documents` written as JSON); returns its sha256.

    The folder is built beside the store and renamed into place complete; a model already kept (the same
    weights) is reused as it is.
    """
    sha = sha256_file(files[WEIGHTS])
    dest = store_dir(champion_dir) / sha
    if dest.is_dir():
        return sha
    tmp = temp_dir_beside(dest)
    try:
        for name, src in files.items():
            shutil.copyfile(src, tmp / name)
        for name, data in documents.items():
            write_json(tmp / name, data)
        if sha256_file(tmp / WEIGHTS) != sha:
            raise StageError(f"{files[WEIGHTS]} changed while it was being stored; the champion is unchanged. "
                             "Re-run evaluate and promote.")
        flush_tree()
        os.rename(tmp, dest)
        fsync_dir(dest.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sha


def adopt_legacy_folder(champion_dir: Path) -> None:
    """A champion kept as a plain folder (an earlier layout) moves into the store and gets its link."""
    if champion_dir.is_symlink() or not champion_dir.is_dir():
        return
    weights = champion_dir / WEIGHTS
    if not weights.is_file():
        raise StageError(f"{champion_dir}: a champion folder without {WEIGHTS}; move it away to start afresh.")
    sha = sha256_file(weights)
    dest = store_dir(champion_dir) / sha
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.exists():
        shutil.rmtree(champion_dir)
    else:
        os.rename(champion_dir, dest)
    _point_at(champion_dir, sha)
    promotion = read_json_if_present(dest / PROMOTION_FILE) or {}
    _append(champion_dir, ChampionEvent(event="promoted", version=_next_version(champion_dir), sha256=sha,
                                        at=promotion.get("timestamp") or _now(), reason="kept from an earlier layout"))


def _next_version(champion_dir: Path) -> int:
    return 1 + sum(1 for e in read_log(champion_dir) if e.event == "promoted")


def reconcile(champion_dir: Path) -> None:
    """Repair what a crash can leave: a half-copied store folder, the link flipped but its promotion not
    yet logged (call under the promotion lock)."""
    for stale in store_dir(champion_dir).glob(".*.incoming-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for link in champion_dir.parent.glob(f".{champion_dir.name}.link-*"):
        link.unlink(missing_ok=True)
    adopt_legacy_folder(champion_dir)
    sha = current_sha(champion_dir)
    if sha is None or dangling_link_problem(champion_dir) or any(e.sha256 == sha for e in read_log(champion_dir)):
        return  # a dangling link is not a promotion to log: promote refuses it, rollback replaces it
    promotion = read_json_if_present(store_dir(champion_dir) / sha / PROMOTION_FILE) or {}
    _append(champion_dir, _promotion_event(champion_dir, sha, promotion, "recovered after an interrupted promotion"))


def _promotion_event(champion_dir: Path, sha: str, promotion: dict[str, Any], reason: str) -> ChampionEvent:
    return ChampionEvent(
        event="promoted", version=_next_version(champion_dir), sha256=sha, at=promotion.get("timestamp") or _now(),
        metric=promotion.get("metric"), score=promotion.get("challenger_score"), run_id=promotion.get("run_id"),
        reason=reason or promotion.get("reason", ""), previous_sha256=promotion.get("previous_champion_sha256"),
    )


def make_champion(champion_dir: Path, sha: str, promotion: dict[str, Any]) -> ChampionEvent:
    """Point the champion at the stored model `sha` and log the promotion (call under the promotion lock)."""
    _point_at(champion_dir, sha)
    event = _promotion_event(champion_dir, sha, promotion, promotion.get("reason", ""))
    _append(champion_dir, event)
    return event


def promotions(champion_dir: Path) -> list[ChampionEvent]:
    """Every promotion, oldest first (versions 1, 2, ...)."""
    return [e for e in read_log(champion_dir) if e.event == "promoted"]


def rollback(champion_dir: Path, to: int | None = None) -> ChampionEvent:
    """Make an earlier promotion the champion again: version `to`, or by default the one promoted before
    the current champion. Byte for byte: the store folder is the one that was promoted."""
    reconcile(champion_dir)
    done = promotions(champion_dir)
    current = current_sha(champion_dir)
    if not done or current is None:
        raise StageError(f"{champion_dir}: no champion yet, nothing to roll back to. Run a retrain first.")
    if to is None:
        # a champion the log lacks (a link set by hand) counts as after every logged promotion
        position = next((i for i, e in enumerate(done) if e.sha256 == current), len(done))
        if position == 0:
            raise StageError(f"{champion_dir}: the champion is the first promotion (version {done[0].version}); "
                             "there is no earlier one to roll back to.")
        target = done[position - 1]
    else:
        matches = [e for e in done if e.version == to]
        if not matches:
            known = ", ".join(str(e.version) for e in done)
            raise StageError(f"{champion_dir}: no promoted version {to}; the versions are {known} "
                             "(`python -m tasks champion list`).")
        target = matches[0]
    folder = store_dir(champion_dir) / target.sha256
    if not (folder / WEIGHTS).is_file() or sha256_file(folder / WEIGHTS) != target.sha256:
        raise StageError(f"{folder}: missing or changed, so version {target.version} cannot be restored; restore the "
                         "models/ folder from a backup.")
    _point_at(champion_dir, target.sha256)
    event = ChampionEvent(event="rollback", version=target.version, sha256=target.sha256, at=_now(),
                          metric=target.metric, score=target.score, run_id=target.run_id,
                          reason=f"rolled back from {current[:12]} to version {target.version}",
                          previous_sha256=current)
    _append(champion_dir, event)
    return event


def listing(champion_dir: Path) -> list[dict[str, Any]]:
    """Every promotion with what it was trained on and how it scored; `current` marks the champion."""
    current = current_sha(champion_dir)
    rows = []
    for e in promotions(champion_dir):
        folder = store_dir(champion_dir) / e.sha256
        run = read_json_if_present(folder / RUN_MANIFEST_FILE) or {}
        promotion = read_json_if_present(folder / PROMOTION_FILE) or {}
        rows.append({
            "version": e.version, "current": e.sha256 == current, "sha256": e.sha256, "promoted_at": e.at,
            "metric": e.metric, "score": e.score, "run_id": e.run_id, "code_rev": (run.get("git") or {}).get("rev"),
            "data_sha256": promotion.get("data_sha256"), "params": run.get("params"), "folder": str(folder),
        })
    return rows


def render_listing(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no champion yet\n"
    lines = ["| | version | sha256 | promoted at | score | run | data | code |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        score = "" if r["score"] is None else f"{r['metric']} {r['score']:.4f}"
        lines.append(f"| {'*' if r['current'] else ''} | {r['version']} | {r['sha256'][:12]} | {r['promoted_at']} | "
                     f"{score} | {r['run_id'] or ''} | {(r['data_sha256'] or '')[:12]} | {(r['code_rev'] or '')[:12]} |")
    return "\n".join(lines) + "\n"


def load_run_manifest(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StageError(f"{path}: the run manifest cannot be read ({e}); re-run the version step.") from None
