"""The retrain flow: every stage, in the order of ARCHITECTURE.md (download ... version, promote).

Each step is a thin Prefect task (flows/stage_tasks.py) over the stage function `tasks.<stage>.<stage>`
that `dvc repro` also runs. Only the download is retried (network failures are transient); a refused
dataset or a failed training stops the flow before any later step, so nothing versioned or promoted
changes. Training runs as its own process group (see tasks/train/), so this flow's body runs once however
many ranks train.

Run it directly (Prefect starts a temporary local server):
    python -m flows.retrain                       # params.yaml, embedded dataset
    python -m flows.retrain --source url          # the real PetFinder tutorial zip
    python -m flows.retrain --set train.max_epochs=2 --set train.strategy=ddp
or through the deployments in prefect.yaml (README, "Prefect").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from filelock import FileLock, Timeout
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import BaseModel, ValidationError

from flows.overrides import ParamOverrides, overrides_dict, parse_set, resolve_params
from flows.stage_tasks import (
    convert_task,
    download_task,
    evaluate_task,
    intake_task,
    promote_task,
    train_task,
    validate_task,
    version_task,
)
from tasks._io.files import read_json_if_present
from tasks._io.processes import start_reaper
from tasks.errors import StageError
from tasks.params import Params, ParamsError

RUN_LOG_NAME = "flow_runs.jsonl"


class RetrainResult(BaseModel):
    run_id: str
    curves: Path | None = None
    metrics: dict[str, Any]
    run_manifest: Path | None
    promoted: bool | None
    champion_dir: Path
    eval_dir: Path
    intake: str = ""  # which batches this run took in (or "no new batch"); a quarantine fails the run naming it


def _append_run_log(log_dir: Path, event: str, run_id: str, **fields: Any) -> None:
    """One line per start/finish/failure of this flow's body: an audit of retrains in this workspace."""
    log_dir.mkdir(parents=True, exist_ok=True)
    record = {"event": event, "run_id": run_id, "pid": os.getpid(), "time": datetime.now(UTC).isoformat(), **fields}
    with open(log_dir / RUN_LOG_NAME, "a") as f:
        f.write(json.dumps(record, default=str) + "\n")


@contextmanager
def _workspace_lock(log_dir: Path) -> Iterator[None]:
    """Two retrains in one workspace would overwrite each other's files: refuse the second at once."""
    log_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(log_dir / ".retrain.lock"), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise StageError(
            f"another retrain is running in {Path.cwd()} (it holds {lock.lock_file}); wait for it to finish. "
            "Deployments queue runs by themselves (concurrency limit 1)."
        ) from None
    try:
        yield
    finally:
        lock.release()


def _run_id() -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{(flow_run.get_id() or 'local')[:8]}"


@flow(name="retrain", log_prints=True)
def retrain(
    params_path: Path = Path("params.yaml"),
    source: Literal["synthetic", "url"] | None = None,
    overrides: ParamOverrides | None = None,  # type: ignore[valid-type]
    promote_model: bool = True,
    version_outputs: bool = True,
    next_batch: bool = False,
) -> RetrainResult:
    """Retrain, version and (if better) promote the fusion model of the table params.yaml `dataset:` declares.

    Args:
        params_path: params.yaml to read, relative to the project root (the working directory).
        source: "synthetic" (embedded offline dataset) or "url" (download `download.url`); None keeps
            params.yaml's `download.source`.
        overrides: params.yaml keys to replace for this run, e.g. {"train": {"max_epochs": 1}}.
        promote_model: compare with the champion and promote if better.
        version_outputs: `dvc commit` + `dvc push` the outputs and write a run manifest.
        next_batch: take in the batch after the last one seen (taken in or quarantined), as the nightly
            run does: `download.synthetic.batch` for this run (what arrives is data, not configuration).
    """
    logger = get_run_logger()
    changes = overrides_dict(overrides)
    if source is not None:
        changes.setdefault("download", {})["source"] = source
    params = resolve_params(params_path, changes)
    if next_batch and params.intake.feed.kind == "synthetic":
        from tasks.intake.stage import last_batch_seen

        batch = last_batch_seen(params.intake) + 1
        changes.setdefault("download", {}).setdefault("synthetic", {})["batch"] = batch
        params = resolve_params(params_path, changes)
        logger.info("retrain: taking in batch %d", batch)
    run_id = _run_id()
    log_dir = params.version.manifest_dir
    with _workspace_lock(log_dir):
        _append_run_log(log_dir, "started", run_id, flow_run_id=flow_run.get_id(), overrides=changes)
        try:
            result = _pipeline(params, run_id, promote_model, version_outputs, changes)
        except BaseException as e:
            _append_run_log(log_dir, "failed", run_id, error=f"{type(e).__name__}: {e}"[:500])
            raise
        _append_run_log(log_dir, "finished", run_id, promoted=result.promoted)
    logger.info("retrain %s finished: %s", run_id, json.dumps(result.metrics, default=str))
    # the run's final state message says what became of the arriving data (a quarantine fails the run,
    # its error naming the batch); the flow's return value is the result itself
    promoted = {True: "promoted", False: "not promoted", None: "promotion not run"}[result.promoted]
    return Completed(message=f"retrain {run_id}: {result.intake}; {promoted}", data=result)  # type: ignore[return-value]


def _pipeline(params: Params, run_id: str, promote_model: bool, version_outputs: bool, changes: dict) -> RetrainResult:
    download_task(params.download, params.schema)
    intake = intake_task(params.intake, params.download, params.schema)
    validate_task(params.validate_, params.schema)
    if params.train.multi_host:  # a node job per host (flows/train_nodes.py); the one conversion gathers them
        from flows.train_nodes import convert_across_hosts, train_across_hosts

        trained = train_across_hosts(params, run_id)
        convert_across_hosts(params.convert, params.train, run_id, params.version.remote)
    else:
        trained = train_task(params.train)
        convert_task(params.convert)
    evaluate_task(params.evaluate)
    metrics = read_json_if_present(params.evaluate.out_dir / "metrics.json") or {}
    manifest = None
    if version_outputs:
        extra = {"flow_run_id": flow_run.get_id(), "overrides": changes}
        manifest = version_task(params.version, params, run_id, extra).manifest
    promoted = None
    if promote_model:
        decision = promote_task(params.promote, manifest)
        promoted = decision.promoted
        if manifest is not None:
            _annotate(manifest, {"promotion": decision.model_dump(mode="json")})
    return RetrainResult(
        run_id=run_id, curves=trained.curves, metrics=metrics, run_manifest=manifest, promoted=promoted,
        champion_dir=params.promote.champion_dir, eval_dir=params.evaluate.out_dir, intake=intake.message,
    )


def _annotate(manifest: Path, fields: dict[str, Any]) -> None:
    from tasks._io.files import write_json

    data = json.loads(manifest.read_text())
    write_json(manifest, {**data, **fields})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m flows.retrain", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml", type=Path, help="params file (default params.yaml)")
    parser.add_argument("--source", choices=["synthetic", "url"], help="dataset source (default: params.yaml)")
    parser.add_argument(
        "--set", dest="assignments", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one params.yaml key for this run (repeatable), e.g. --set train.max_epochs=2",
    )
    parser.add_argument("--next-batch", action="store_true",
                        help="take in the batch after the last one seen, as the nightly deployment does")
    parser.add_argument("--no-promote", action="store_true", help="stop after versioning; keep the champion")
    parser.add_argument("--no-version", action="store_true", help="skip dvc commit/push and the run manifest")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        overrides = ParamOverrides.model_validate(parse_set(args.assignments))
        resolve_params(args.params, overrides_dict(overrides))  # fail before Prefect starts
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print(f"error: --set: {e}", file=sys.stderr)
        return 2
    start_reaper()  # a SIGKILL of this process must not leave Prefect's temporary server running
    state = retrain(
        params_path=args.params, source=args.source, overrides=overrides,
        promote_model=not args.no_promote, version_outputs=not args.no_version, next_batch=args.next_batch,
        return_state=True,
    )
    if not state.is_completed():
        print(f"error: the retrain flow ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    result: RetrainResult = state.result()
    _print_outcome(result)
    return 0


def _print_outcome(result: RetrainResult) -> None:
    from tasks.evaluate import render_markdown

    eval_dir = result.eval_dir
    print(render_markdown(result.metrics, read_json_if_present(eval_dir / "ablation.json")) if result.metrics else "")
    pngs = ", ".join(str(p) for p in sorted((eval_dir / "plots").glob("*.png")))
    print(f"plots: {pngs}, training curves {result.curves} (offline PNGs)")
    if result.run_manifest:
        print(f"run manifest: {result.run_manifest}")
    if result.promoted is not None:
        print(f"champion: {result.champion_dir} ({'promoted this run' if result.promoted else 'kept'})")


if __name__ == "__main__":
    sys.exit(main())
