"""Promote stage: the challenger replaces the champion only if it is better on the same test set.

The challenger is `model_dir` (the converted model) with `eval_dir/metrics.json` (its evaluation). It
becomes the champion when its validation passed, its conversion verified, it does not lose to the
classical baseline, and its primary metric beats the champion's by at least `min_delta`; the first model
becomes champion. Scores are compared on one test set: when the champion's metrics.json was computed on
another one (its fingerprint differs), the champion is re-scored on the current test set first.
Every promoted model is kept in the registry (tasks/promote/registry.py: content-addressed folders, the
champion a symlink flipped atomically, `python -m tasks champion list|rollback`), a file lock serialises
promotions, and every decision (and every rollback) is appended to `history.jsonl` next to the champion.
A champion link whose model is gone refuses the promotion: nothing is promoted without a comparison.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from filelock import FileLock, Timeout
from pydantic import BaseModel

from fusion_model.layout import MODEL_FILES, WEIGHTS
from fusion_model.metrics import greater_is_better
from tasks._io import hashing
from tasks._io.files import read_json, read_json_if_present
from tasks._io.hashing import sha256_file
from tasks._io.jsonl import append_jsonl, read_jsonl
from tasks.errors import StageError
from tasks.evaluate.inputs import (
    TestSet,
    load_predictor,
    load_test_set,
    missing_model_files,
    model_dir_problem,
)
from tasks.evaluate.metrics import fingerprint_test_set, primary_score
from tasks.params import PromoteParams
from tasks.promote import registry
from tasks.promote.plots import SCORE_HISTORY, write_score_history

CHAMPION_FILES: tuple[str, ...] = (*MODEL_FILES, "metrics.json")
HISTORY_NAME = "history.jsonl"


class PromotionDecision(BaseModel):
    event: Literal["decision"] = "decision"  # history.jsonl also holds rollbacks (RollbackRecord)
    timestamp: str
    promoted: bool
    reason: str
    metric: str
    challenger_score: float
    champion_score: float | None
    min_delta: float
    champion_rescored: bool
    validation_passed: bool
    baseline_score: float | None = None  # the classical baseline on the same test rows (metrics.json)
    test_fingerprint: str
    challenger_sha256: str
    previous_champion_sha256: str | None
    champion_dir: Path
    data_sha256: str  # the validated tables this decision was made on (train, val, test, meta.json)
    run_id: str | None = None
    champion_version: int | None = None  # the registry's version number when promoted
    # both models on the newest arriving batch's held-out rows (the decision itself is on the test set)
    holdout: dict[str, Any] | None = None
    drift_warnings: list[str] = []  # columns the drift gate warned on for the batch this run took in


class RollbackRecord(BaseModel):
    """A rollback, in history.jsonl beside the decisions: which promoted version became champion again."""

    event: Literal["rollback"] = "rollback"
    timestamp: str
    reason: str
    metric: str | None
    champion_score: float | None  # the restored model's score when it was promoted
    champion_version: int
    champion_sha256: str
    previous_champion_sha256: str | None
    champion_dir: Path
    run_id: str | None  # the run that trained the restored model


def history_path(champion_dir: Path) -> Path:
    return champion_dir.parent / HISTORY_NAME


def score_history_path(champion_dir: Path) -> Path:
    """The PNG of every challenger's and champion's score over the runs, beside history.jsonl."""
    return champion_dir.parent / SCORE_HISTORY


def _metric_of(metrics: dict[str, Any], path: Path, fix: str) -> tuple[str, float]:
    try:
        name, value = metrics["primary_metric"]["name"], float(metrics["primary_metric"]["value"])
    except (KeyError, TypeError, ValueError):
        raise StageError(f"{path}: no numeric primary_metric.name/value. {fix}") from None
    if not math.isfinite(value):
        raise StageError(f"{path}: primary metric {name} is {value}, not a number. {fix}")
    return name, value


def read_challenger(p: PromoteParams) -> dict[str, Any]:
    """The challenger's metrics.json, refused unless it is the evaluation of exactly this model file."""
    missing = missing_model_files(p.model_dir)
    if missing:
        raise StageError(missing)
    metrics_path = p.eval_dir / "metrics.json"
    fix = "Run `python -m tasks evaluate` on this model first."
    metrics = read_json(metrics_path, fix)
    _metric_of(metrics, metrics_path, fix)
    model_sha = sha256_file(p.model_dir / WEIGHTS)
    evaluated_sha = (metrics.get("model") or {}).get("sha256")
    if evaluated_sha != model_sha:
        raise StageError(
            f"{metrics_path} was computed for model sha256 {evaluated_sha}, but {p.model_dir / WEIGHTS} "
            f"has sha256 {model_sha}: the evaluation is stale. Run `python -m tasks evaluate` again, then promote."
        )
    if not (metrics.get("test_set") or {}).get("fingerprint"):
        raise StageError(f"{metrics_path}: no test_set.fingerprint. {fix}")
    return metrics


def validation_status(report: Path) -> tuple[bool, str]:
    """Whether the last validation run passed, from its JSON report, with a reason for history."""
    if not report.is_file():
        return False, f"no validation report at {report}; run `python -m tasks validate`"
    try:
        data = json.loads(report.read_text())
    except json.JSONDecodeError as e:
        return False, f"validation report {report} is not valid JSON ({e}); run `python -m tasks validate`"
    success = data.get("success") if isinstance(data, dict) else None
    if success is True:
        return True, "validation passed"
    return False, f"validation did not pass ({report}: success={success!r})"


def conversion_status(model_dir: Path) -> tuple[bool, str]:
    """Whether convert verified exactly these files (strict load, all finite), from its manifest.json."""
    problem = model_dir_problem(model_dir)
    return (False, problem) if problem else (True, "conversion verified")


def baseline_status(metrics: dict[str, Any], path: Path) -> tuple[bool, str]:
    """Whether the challenger is at least as good as the classical baseline scored in the same evaluation."""
    vs = metrics.get("vs_baseline")
    if not isinstance(vs, dict) or "delta" not in vs:
        return False, (f"{path} has no baseline score, and promote.require_beat_baseline is true: run evaluate "
                       "with evaluate.baseline: true, or set promote.require_beat_baseline: false")
    if vs.get("improvement", vs["delta"]) < 0:
        return False, (f"the challenger loses to the classical baseline: {vs['metric']} {vs['model']:.4f} vs "
                       f"baseline {vs['baseline']:.4f} ({vs['delta']:+.4f}) on the same test rows")
    return True, f"beats the classical baseline ({vs['model']:.4f} vs {vs['baseline']:.4f})"


def _champion_state(champion_dir: Path) -> dict[str, Any] | None:
    """The champion's metrics.json, None when there is no champion; an incomplete champion is refused."""
    if not champion_dir.exists():
        return None
    missing = [n for n in CHAMPION_FILES if not (champion_dir / n).is_file()]
    if missing:
        raise StageError(
            f"{champion_dir}: the champion lacks {', '.join(missing)}, so it cannot be compared. Restore it "
            f"(e.g. `dvc checkout` or from a backup), or move the folder away to make the next model champion."
        )
    return read_json(champion_dir / "metrics.json", "Restore the champion's metrics.json.")


def rescore(model_dir: Path, data_dir: Path, batch_size: int, metric: str) -> float | None:
    """A model's `metric` on the current test set; None if it predicts another label set."""
    test = load_test_set(data_dir)
    return score_on(model_dir, test, test.table, batch_size, metric)


def score_on(model_dir: Path, test: TestSet, table: pd.DataFrame, batch_size: int, metric: str) -> float | None:
    """A model's `metric` on a validated table of the test set's data; None if it predicts another label set
    (another label, problem type or classes: its scores would not be comparable)."""
    predictor = load_predictor(model_dir)
    comparable = (predictor.schema.label.column == test.label
                  and (predictor.problem_type == "regression") == (test.problem_type == "regression")
                  and [str(c) for c in predictor.classes] == [str(c) for c in test.classes])
    if not comparable:
        return None
    out = predictor.predict_outputs(table.drop(columns=[test.label]), test.images_root, batch_size=batch_size)
    return primary_score(test.labels_of(table), out, test.problem_type, test.num_classes, metric)


def _decide(p: PromoteParams, challenger: dict[str, Any]) -> PromotionDecision:
    metric, score = _metric_of(challenger, p.eval_dir / "metrics.json", "")
    fingerprint = challenger["test_set"]["fingerprint"]
    test = load_test_set(p.data_dir)
    current = fingerprint_test_set(test.table, test.label)
    if current != fingerprint:
        raise StageError(
            f"{p.eval_dir / 'metrics.json'} was computed on another test set than {p.data_dir / 'test.parquet'} "
            f"({fingerprint} vs {current}). Run `python -m tasks evaluate` on the current data, then promote."
        )
    passed, refusal = validation_status(p.validation_report)
    if passed:
        passed, refusal = conversion_status(p.model_dir)
    validation_passed = passed
    baseline_score = (challenger.get("vs_baseline") or {}).get("baseline")
    if passed and p.require_beat_baseline:
        passed, refusal = baseline_status(challenger, p.eval_dir / "metrics.json")
    champion = _champion_state(p.champion_dir)
    decision = dict(
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
        metric=metric,
        challenger_score=score,
        champion_score=None,
        min_delta=p.min_delta,
        champion_rescored=False,
        validation_passed=validation_passed,
        baseline_score=baseline_score,
        test_fingerprint=fingerprint,
        challenger_sha256=challenger["model"]["sha256"],
        previous_champion_sha256=None,
        champion_dir=p.champion_dir,
        data_sha256=hashing.fingerprint(hashing.file_hashes(p.data_dir)),
    )
    if champion is not None:
        decision["previous_champion_sha256"] = sha256_file(p.champion_dir / WEIGHTS)
        same_test = (champion.get("test_set") or {}).get("fingerprint") == fingerprint
        champion_metric = (champion.get("primary_metric") or {}).get("name")
        if same_test and champion_metric == metric:
            decision["champion_score"] = _metric_of(champion, p.champion_dir / "metrics.json", "")[1]
        elif passed:  # re-scoring costs a pass over the test set: only when the answer can matter
            decision["champion_rescored"] = True
            decision["champion_score"] = rescore(p.champion_dir, p.data_dir, p.batch_size, metric)

    if not passed:
        return PromotionDecision(promoted=False, reason=refusal, **decision)
    if champion is None:
        return PromotionDecision(promoted=True, reason="first model: no champion yet", **decision)
    old = decision["champion_score"]
    if old is None:
        return PromotionDecision(
            promoted=True,
            reason=f"the champion predicts another label than the current test set's ({test.label}, "
                   f"{test.problem_type}, classes {test.classes})",
            **decision,
        )
    # how much better the challenger is, whichever way the metric points (rmse: lower is better)
    delta = score - old if greater_is_better(metric) else old - score
    on = "re-scored on the current test set" if decision["champion_rescored"] else "same test set"
    lower = "" if greater_is_better(metric) else ", lower is better"
    if delta > 0 and delta >= p.min_delta:
        reason = (f"{metric} {score:.4f} beats champion {old:.4f} by {delta:+.4f} >= min_delta {p.min_delta} "
                  f"({on}{lower})")
        return PromotionDecision(promoted=True, reason=reason, **decision)
    reason = (f"{metric} {score:.4f} vs champion {old:.4f}: improvement {delta:+.4f}, needs > 0 and >= min_delta "
              f"{p.min_delta} ({on}{lower})")
    return PromotionDecision(promoted=False, reason=reason, **decision)


def _holdout_and_drift(p: PromoteParams, challenger: dict[str, Any], decision: PromotionDecision) -> None:
    """Beside the decision (made on the frozen test set): both models on the newest batch's holdout, and
    the drift gate's warnings for that batch, said in the reason."""
    holdout = challenger.get("holdout")
    holdout_path = p.data_dir / "holdout.parquet"
    if holdout and holdout_path.is_file():
        name = decision.metric
        entry = {"file": holdout.get("file"), "rows": holdout.get("rows"),
                 "challenger": (holdout.get("metrics") or {}).get(name), "champion": None}
        if decision.previous_champion_sha256 is not None:
            entry["champion"] = score_on(p.champion_dir, load_test_set(p.data_dir), pd.read_parquet(holdout_path),
                                         p.batch_size, name)
        decision.holdout = entry
    drift = read_json_if_present(p.drift_report) or {}
    if drift.get("warned"):
        decision.drift_warnings = list(drift.get("warnings") or [])
        decision.reason += (f"; the drift gate warned on {', '.join(decision.drift_warnings)} for batch "
                            f"{drift.get('batch')} (see {p.drift_report.with_suffix('.md')})")


def _install(p: PromoteParams, decision: PromotionDecision, run_manifest: dict[str, Any] | None) -> None:
    """Keep the challenger in the registry, then make it the champion (one link flip)."""
    files = {name: p.model_dir / name for name in MODEL_FILES} | {"metrics.json": p.eval_dir / "metrics.json"}
    documents: dict[str, Any] = {registry.PROMOTION_FILE: decision.model_dump(mode="json")}
    if run_manifest is not None:
        documents[registry.RUN_MANIFEST_FILE] = run_manifest
    sha = registry.store(p.champion_dir, files, documents)
    if sha != decision.challenger_sha256:
        raise StageError(f"{p.model_dir / WEIGHTS} changed while it was being promoted; the champion is "
                         "unchanged. Re-run evaluate and promote.")
    decision.champion_version = registry.make_champion(p.champion_dir, sha, decision.model_dump(mode="json")).version


def append_history(path: Path, record: PromotionDecision | RollbackRecord) -> None:
    """One JSON line per decision or rollback, fsynced before the promotion returns (a line a crash cut
    short is removed first: tasks/_io/jsonl.py)."""
    append_jsonl(path, record.model_dump_json())


def read_history(champion_dir: Path) -> list[dict[str, Any]]:
    """Every decision and rollback, oldest first (a last line a crash cut short is skipped, with a warning)."""
    return read_jsonl(history_path(champion_dir))


def render_decision_markdown(decision: PromotionDecision) -> str:
    """A short markdown summary of a promotion decision, for a Prefect artifact and the terminal."""

    def fmt(v: float | None) -> str:
        return "none" if v is None else f"{v:.4f}"

    verdict = "promoted to champion" if decision.promoted else "not promoted"
    rescored = " (re-scored on the current test set)" if decision.champion_rescored else ""
    return (
        f"**Challenger {verdict}.** {decision.reason}\n\n"
        "| | score |\n|---|---|\n"
        f"| challenger {decision.metric} | {fmt(decision.challenger_score)} |\n"
        f"| champion {decision.metric}{rescored} | {fmt(decision.champion_score)} |\n"
        f"| classical baseline {decision.metric} (same test rows) | {fmt(decision.baseline_score)} |\n"
        + (f"| challenger on the newest batch's holdout | {fmt(decision.holdout['challenger'])} |\n"
           f"| champion on the newest batch's holdout | {fmt(decision.holdout['champion'])} |\n"
           if decision.holdout else "")
        + "\n"
        f"Champion folder: `{decision.champion_dir}`; history: `{history_path(decision.champion_dir)}`; every "
        f"run's scores (PNG): `{score_history_path(decision.champion_dir)}`.\n"
    )


def _promotion_lock(champion_dir: Path, timeout_s: float) -> FileLock:
    champion_dir.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(champion_dir.parent / f".{champion_dir.name}.lock", timeout=timeout_s)


def _lock_timeout(champion_dir: Path, lock: FileLock, timeout_s: float, what: str) -> StageError:
    return StageError(f"another promotion or rollback into {champion_dir} held {lock.lock_file} for {timeout_s:g} s "
                      f"(promote.lock_timeout_s); wait for it to finish (the lock is released when its process "
                      f"exits) and {what} again, or raise promote.lock_timeout_s.")


def rollback(champion_dir: Path, to: int | None = None, lock_timeout_s: float = 600) -> registry.ChampionEvent:
    """Make an earlier promoted model the champion again (see `registry.rollback`), under the promotion lock;
    the rollback is logged in champions.jsonl and history.jsonl, and the score history is redrawn."""
    lock = _promotion_lock(champion_dir, lock_timeout_s)
    try:
        with lock:
            event = registry.rollback(champion_dir, to)
            append_history(history_path(champion_dir), RollbackRecord(
                timestamp=event.at, reason=event.reason, metric=event.metric, champion_score=event.score,
                champion_version=event.version, champion_sha256=event.sha256,
                previous_champion_sha256=event.previous_sha256, champion_dir=champion_dir, run_id=event.run_id))
            write_score_history(read_history(champion_dir), score_history_path(champion_dir))
            return event
    except Timeout:
        raise _lock_timeout(champion_dir, lock, lock_timeout_s, "roll back") from None


def listing(champion_dir: Path, lock_timeout_s: float = 600) -> list[dict[str, Any]]:
    """`registry.listing` read under the promotion lock, so it never shows a promotion half done."""
    if not champion_dir.parent.is_dir():
        return []  # nothing promoted yet: no folder to lock, and listing creates none
    lock = _promotion_lock(champion_dir, lock_timeout_s)
    try:
        with lock:
            return registry.listing(champion_dir)
    except Timeout:
        raise _lock_timeout(champion_dir, lock, lock_timeout_s, "list") from None


def promote(p: PromoteParams, run_manifest: Path | None = None) -> PromotionDecision:
    """Decide, and when the challenger wins make it the champion; `run_manifest` (the version step's JSON of
    this run) is kept with the promoted model and names its run."""
    challenger = read_challenger(p)
    manifest = registry.load_run_manifest(run_manifest)
    lock = _promotion_lock(p.champion_dir, p.lock_timeout_s)
    try:
        with lock:
            registry.reconcile(p.champion_dir)  # what an interrupted promotion left
            if problem := registry.dangling_link_problem(p.champion_dir):
                raise StageError(problem)
            decision = _decide(p, challenger)
            _holdout_and_drift(p, challenger, decision)
            decision.run_id = (manifest or {}).get("run_id")
            if decision.promoted:
                _install(p, decision, manifest)
            append_history(history_path(p.champion_dir), decision)
            write_score_history(read_history(p.champion_dir), score_history_path(p.champion_dir))
    except Timeout:
        raise _lock_timeout(p.champion_dir, lock, p.lock_timeout_s, "promote") from None
    return decision
