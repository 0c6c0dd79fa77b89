"""The flows' steps as Prefect tasks: each a thin `@task` over the stage function `tasks.<stage>.<stage>`
that `dvc repro` (or `python -m tasks <stage>`) also runs, adding what the Prefect UI shows (markdown and
table artifacts of the stage's own files).

Only the download is retried, and only for a transient failure (network failures are transient); every
other step fails at once (scoring also retries a transient failure: fetching a URL source). The flows that
use them: flows/retrain.py (the retrain flow), flows/train_nodes.py (training and the one conversion across
hosts) and flows/score.py (new rows scored with the champion). Tests call them or `task.fn(...)`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from flows.artifacts import conversion_markdown, run_manifest_markdown, score_markdown, training_markdown
from fusion_model.dataset import DatasetSchema
from tasks._io.files import read_json_if_present
from tasks.errors import StageError, TransientError
from tasks.params import (
    ConvertParams,
    DownloadParams,
    EvaluateParams,
    IntakeParams,
    Params,
    PromoteParams,
    ScoreParams,
    TrainParams,
    ValidateParams,
    VersionParams,
)

# A network outage outlasting tenacity's few seconds of retries inside the download: try again minutes
# later (a 2-minute outage is over by the second retry).
DOWNLOAD_RETRY_DELAYS_S = [30, 120, 300]


def _transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry the download only for a TransientError (network down, 5xx, timeouts); a refused input (a bad
    checksum, an unsafe zip, a 4xx) or a bug is never retried."""
    try:
        state.result()
    except TransientError:
        return True
    except Exception:
        return False
    return False


@task(name="download", retries=len(DOWNLOAD_RETRY_DELAYS_S), retry_delay_seconds=DOWNLOAD_RETRY_DELAYS_S,
      retry_condition_fn=_transient, cache_policy=NO_CACHE)
def download_task(params: DownloadParams, dataset: DatasetSchema) -> Any:
    from tasks.download import download

    return download(params, dataset)


@task(name="intake", retries=0, cache_policy=NO_CACHE)
def intake_task(params: IntakeParams, download: DownloadParams, dataset: DatasetSchema) -> Any:
    """The feed's new batches: each validated alone, gated on drift, joined by id into the download stage's
    data or quarantined."""
    from tasks.intake import intake

    try:
        result = intake(params, download, dataset)
    except StageError:
        _intake_artifacts(params)  # a quarantined batch: its figures and the ledger in the UI, then the flow stops
        raise
    _intake_artifacts(params)
    return result


def _intake_artifacts(params: IntakeParams) -> None:
    """The ledger (every batch: taken, warned, quarantined, why) as a table artifact, and the drift gate's
    report of the latest batch compared as markdown."""
    from tasks.intake.ledger import read_ledger

    ledger = read_ledger(params.feed.ledger)
    if ledger.batches:
        create_table_artifact(
            key="retrain-batches", description="Arriving batches: taken in, warned, quarantined, rejected",
            table=[{"batch": b.batch, "name": b.name, "status": b.status, "check": b.check, "reason": b.reason[:300],
                    "sha256": b.sha256[:12], "rows": b.train_rows + b.holdout_rows,
                    "overrides": "; ".join(b.overrides)} for b in ledger.batches])
    report = params.report_dir / "drift.md"
    drift = read_json_if_present(params.report_dir / "drift.json") or {}
    if report.is_file() and drift.get("batch"):
        verdict = "PASSED" if drift.get("passed") and not drift.get("warned") else (
            "WARNED" if drift.get("passed") else "FAILED")
        markdown = report.read_text() + f"\n\nPer-column drift (PNG): `{params.report_dir / 'drift.png'}`\n"
        create_markdown_artifact(key="retrain-drift", markdown=markdown,
                                 description=f"Drift gate {verdict}: batch {drift['batch']}")


@task(name="validate", retries=0, cache_policy=NO_CACHE)
def validate_task(params: ValidateParams, dataset: DatasetSchema) -> Any:
    from tasks.validate import validate

    try:
        result = validate(params, dataset)
    except StageError:
        # the report says which rows and columns failed: show it in the UI too, then stop the flow
        create_markdown_artifact(
            key="retrain-validation", markdown=validation_markdown(params), description="Validation FAILED"
        )
        raise
    create_markdown_artifact(
        key="retrain-validation", markdown=validation_markdown(params), description="Validation summary"
    )
    return result


@task(name="train", retries=0, cache_policy=NO_CACHE)
def train_task(params: TrainParams) -> Any:
    from tasks.train import train

    result = train(params, logger=get_run_logger())  # every rank's output, line by line, in the run's logs
    summary_path = params.out_dir / "train_summary.json"
    summary = read_json_if_present(summary_path)
    create_markdown_artifact(
        key="retrain-training", markdown=training_markdown(summary, summary_path, result.curves),
        description="Training summary and curves",
    )
    return result


@task(name="convert", retries=0, cache_policy=NO_CACHE)
def convert_task(params: ConvertParams) -> Any:
    from tasks.convert import convert

    result = convert(params)
    manifest_path = params.out_dir / "manifest.json"
    create_markdown_artifact(
        key="retrain-conversion",
        markdown=conversion_markdown(read_json_if_present(manifest_path), manifest_path),
        description="Conversion manifest",
    )
    return result


@task(name="evaluate", retries=0, cache_policy=NO_CACHE)
def evaluate_task(params: EvaluateParams) -> Any:
    from tasks.evaluate import evaluate, render_markdown

    result = evaluate(params)
    metrics = read_json_if_present(params.out_dir / "metrics.json") or {}
    ablation = read_json_if_present(params.out_dir / "ablation.json")
    create_markdown_artifact(
        key="retrain-metrics", markdown=render_markdown(metrics, ablation), description="Test-set metrics"
    )
    baseline = (metrics.get("baseline") or {}).get("metrics", {})
    create_table_artifact(
        key="retrain-metrics-table",
        table=[{"metric": k, "fusion_model": v, "classical_baseline": baseline.get(k)}
               for k, v in metrics.get("metrics", {}).items()],
        description="Test-set metrics: the fusion model and the classical baseline on the same rows",
    )
    return result


@task(name="version", retries=0, cache_policy=NO_CACHE)
def version_task(params: VersionParams, effective: Params, run_id: str, extra: dict[str, Any]) -> Any:
    from tasks.version import version

    result = version(params, effective=effective, run_id=run_id, extra=extra)
    create_markdown_artifact(
        key="retrain-run-manifest",
        markdown=run_manifest_markdown(result.manifest, result.model_dump(mode="json")),
        description="Run manifest: git rev, dvc.lock hashes, params, metrics",
    )
    return result


@task(name="promote", retries=0, cache_policy=NO_CACHE)
def promote_task(params: PromoteParams, run_manifest: Path | None) -> Any:
    from tasks.promote import promote, render_decision_markdown

    decision = promote(params, run_manifest)  # a promoted model is kept with this run's manifest
    pointer = f"\n\nRun manifest: `{run_manifest}`\n" if run_manifest else "\n"
    create_markdown_artifact(
        key="retrain-promotion",
        markdown=render_decision_markdown(decision) + pointer,
        description="Promotion decision",
    )
    return decision


@task(name="score", retries=len(DOWNLOAD_RETRY_DELAYS_S), retry_delay_seconds=DOWNLOAD_RETRY_DELAYS_S,
      retry_condition_fn=_transient, cache_policy=NO_CACHE)
def score_task(params: ScoreParams, extra: dict[str, Any]) -> Any:
    """New rows scored with the champion (tasks/score); the counts and the model in the UI, a refusal's too."""
    from tasks.score import ScoreRefused, score

    try:
        summary = score(params, extra)
    except ScoreRefused as e:  # the drops that were scored are written: show them, and the refused ones
        _score_artifacts(e.summary)
        raise
    _score_artifacts(summary)
    return summary


def _score_artifacts(summary: Any) -> None:
    data = summary.model_dump(mode="json")
    create_markdown_artifact(key="score-summary", markdown=score_markdown(data), description=summary.message)
    if summary.scored:
        create_table_artifact(
            key="score-drops", description=f"Drops scored by model version {summary.model['version']}",
            table=[{**d, "model_version": summary.model["version"], "model_sha256": summary.model["sha256"]}
                   for d in data["scored"]])


def validation_markdown(params: ValidateParams) -> str:
    """The validate stage's own markdown report (tasks.checks.report.render_markdown wrote it)."""
    report = params.report_dir / "validation.md"
    if report.is_file():
        return report.read_text()
    return f"# Validation\n\n`{report}` was not written; see the task's log.\n"
