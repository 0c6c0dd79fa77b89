"""Version step: record in DVC exactly what a run produced, push it, and write a run manifest.

`dvc commit` of the pipeline's stages makes `dvc.lock` describe the outputs now in the workspace (so
`dvc status` and `dvc repro` agree with the run), `dvc push` copies them to the configured remote, and the
run manifest (git rev, dvc.lock, the parameters the run used, its overrides, metrics) names all of it in
one JSON file that promotion and the Prefect artifacts point to.

A run never writes params.yaml. A stage whose section this run overrode (and every stage after it) is
not committed: dvc.lock keeps describing params.yaml as committed, and `dvc status` truthfully reports
those outputs as changed; the run manifest is that run's record. DVC refuses a second command on a repo
while one runs: this step serialises its own calls with a file lock and tells DVC to wait for the repo
lock instead of failing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from filelock import FileLock, Timeout
from pydantic import BaseModel

from tasks._io.files import write_json
from tasks._io.git import has_tracked_changes, head_rev
from tasks.errors import StageError
from tasks.params import FEED_KEYS, Params, VersionParams, load_params

LOCK_FILE = Path(".dvc/tmp/version.lock")


class VersionSummary(BaseModel):
    run_id: str
    manifest: Path
    git_rev: str | None
    git_dirty: bool
    remote: str | None
    pushed: bool
    committed_stages: list[str]
    uncommitted_stages: list[str]  # the run overrode their params: dvc.lock still describes params.yaml
    overridden: list[str]
    outs: dict[str, dict[str, str]]
    metrics: dict[str, Any]


def _run(cmd: list[str], timeout_s: float, what: str, fix: str) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise StageError(f"`{' '.join(cmd[2:])}` did not finish in {timeout_s:.0f} s. {fix}") from None
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-15:])
        raise StageError(f"{what} failed (exit {done.returncode}):\n{tail}\n{fix}")
    return done.stdout


def dvc(*args: str, timeout_s: float = 1800, fix: str = "") -> str:
    """Run one DVC command in the current repo; waits for DVC's repo lock rather than failing on it."""
    cmd = [sys.executable, "-m", "dvc", "--wait-for-lock", *args]
    return _run(cmd, timeout_s, f"`dvc {' '.join(args)}`", fix)


def committable_stages(stages: list[str], params_file: Path, effective: Params | None) -> tuple[list[str], list[str]]:
    """(stages to commit, stages to leave): in pipeline order, a stage whose params section the run overrode
    and every stage after it are left, since dvc.lock would otherwise claim params.yaml's values made them."""
    if effective is None:
        return list(stages), []
    committed = load_params(params_file)
    for i, stage in enumerate(stages):
        if _section(committed, stage) != _section(effective, stage):
            return list(stages[:i]), list(stages[i:])
    return list(stages), []


def _section(params: Params, stage: str) -> Any:
    """A stage's params section as DVC compares it, without the feed keys (which batch arrives is data the
    stage takes in, not configuration: the version step commits a run that took batch N)."""
    return _without_feed(params.model_dump(mode="json", by_alias=True)).get(stage)


def _without_feed(dumped: dict[str, Any]) -> dict[str, Any]:
    synthetic = (dumped.get("download") or {}).get("synthetic")
    if isinstance(synthetic, dict):
        dumped["download"]["synthetic"] = {k: v for k, v in synthetic.items() if k not in FEED_KEYS}
    return dumped


def _batches(params: Params) -> list[dict[str, Any]]:
    """Every arriving batch seen (the intake ledger): what the accumulated data holds, by content sha256, and
    what was quarantined, rejected or readmitted (with the checks a review overrode)."""
    from tasks.intake.ledger import read_ledger

    return [b.model_dump(mode="json") for b in read_ledger(params.intake.feed.ledger).batches]


def overridden_keys(params_file: Path, effective: Params) -> list[str]:
    """The dotted params.yaml keys whose value this run changed."""
    changed: list[str] = []

    def diff(old: Any, new: Any, key: str) -> None:
        if isinstance(old, dict) and isinstance(new, dict):
            for k in new:
                diff(old.get(k), new[k], f"{key}.{k}" if key else k)
        elif old != new:
            changed.append(key)

    diff(_without_feed(load_params(params_file).model_dump(mode="json", by_alias=True)),
         _without_feed(effective.model_dump(mode="json", by_alias=True)), "")
    return changed


def lock_outs(lock: dict[str, Any], stages: list[str]) -> dict[str, dict[str, str]]:
    """stage -> {output path: md5} from a parsed dvc.lock."""
    found = lock.get("stages", {})
    return {s: {o["path"]: o.get("md5", "") for o in found.get(s, {}).get("outs", [])} for s in stages}


def flatten_metrics(shown: dict[str, Any]) -> dict[str, Any]:
    """`dvc metrics show --json` ({"": {"data": {file: {"data": values}}}}) -> {file: values}, workspace only."""
    files = shown.get("", {}).get("data", {})
    return {path: entry.get("data", entry.get("error")) for path, entry in files.items()}


def _check_repo(params: VersionParams) -> None:
    if not Path(".dvc").is_dir():
        raise StageError(
            f"{Path.cwd()}: not a DVC repository (no .dvc/ folder). Run from the project root, or run "
            "`git init && dvc init` and add a remote (`dvc remote add -d storage <folder>`) first."
        )
    if not Path("dvc.yaml").is_file():
        raise StageError(f"{Path.cwd() / 'dvc.yaml'}: missing; the version step commits the stages it declares.")
    unknown = [s for s in params.stages if not _stage_declared(s)]
    if unknown:
        raise StageError(
            f"dvc.yaml: no stage named {', '.join(unknown)}. Fix `version.stages` in {params.params_file} "
            "to name stages of dvc.yaml."
        )


def _stage_declared(stage: str) -> bool:
    return stage in (yaml.safe_load(Path("dvc.yaml").read_text()) or {}).get("stages", {})


def default_remote() -> str | None:
    """The `core.remote` of .dvc/config (config.local and the user's config included), read in-process."""
    from dvc.config import Config

    return Config.from_cwd()["core"].get("remote") or None


def version(
    params: VersionParams,
    effective: Params | None = None,
    run_id: str | None = None,
    extra: dict[str, Any] | None = None,
) -> VersionSummary:
    """Commit the stages `effective` did not override to dvc.lock, push what a later run or rollback needs,
    write `<manifest_dir>/<run_id>.json`.

    `effective`: the parameters the run used (the flow's overrides applied), recorded in the manifest;
    params.yaml is never written. `extra` goes into the manifest as is (e.g. the flow run's id).
    Run from the repository root.
    """
    _check_repo(params)
    run_id = run_id or datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:6]
    commit, left = committable_stages(params.stages, params.params_file, effective)
    overridden = overridden_keys(params.params_file, effective) if effective is not None else []
    # the weights, data and metrics a rollback or a later run needs; the optimizer shards only when asked
    push = [s for s in commit if params.push_checkpoints or s != "train"]
    LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(LOCK_FILE), timeout=params.lock_timeout_s):
            remote = params.remote or default_remote()
            if params.push and remote is None:  # before anything changes
                raise StageError(
                    "no DVC remote to push to: .dvc/config names no default remote. Add one "
                    "(`dvc remote add -d storage /path/to/folder`) or set `version.remote` / "
                    "`version.push: false` in params.yaml."
                )
            commit_fix = (
                "Every stage's outputs must exist: run the missing stage (`python -m tasks <stage>`) or "
                "`dvc repro`, then version again."
            )
            if commit:
                dvc("commit", "--force", *commit, timeout_s=params.lock_timeout_s, fix=commit_fix)
            pushed = False
            if params.push and push:
                dvc(
                    "push", "--remote", remote, *push, timeout_s=params.lock_timeout_s,
                    fix=f"The outputs are committed locally (dvc.lock); fix the remote `{remote}` and run "
                    "`dvc push`.",
                )
                pushed = True
            lock_file = Path("dvc.lock")
            lock = (yaml.safe_load(lock_file.read_text()) or {}) if lock_file.is_file() else {}
            metrics = flatten_metrics(json.loads(dvc("metrics", "show", "--json", timeout_s=300) or "{}"))
    except Timeout:
        raise StageError(
            f"{LOCK_FILE}: another version step has held this lock for over {params.lock_timeout_s:.0f} s. "
            "Wait for it to finish, or raise `version.lock_timeout_s`; delete the file only if no retrain runs."
        ) from None
    rev, dirty = head_rev(), has_tracked_changes()
    outs = lock_outs(lock, commit)
    manifest_path = params.manifest_dir / f"{run_id}.json"
    used = effective.model_dump(mode="json", by_alias=True) if effective is not None else load_params(
        params.params_file).model_dump(mode="json", by_alias=True)
    write_json(
        manifest_path,
        {
            "run_id": run_id,
            "created_at": datetime.now(UTC).isoformat(),
            "git": {"rev": rev, "dirty": dirty},
            "dvc": {"remote": remote, "pushed": pushed, "stages": commit, "pushed_stages": push if pushed else [],
                    "uncommitted_stages": left, "outs": outs, "lock": lock},
            "overridden": overridden,
            "params": used,  # what this run used: params.yaml as committed, with its overrides applied
            "metrics": metrics,
            "batches": _batches(effective or load_params(params.params_file)),
            **(extra or {}),
        },
    )
    return VersionSummary(
        run_id=run_id, manifest=manifest_path, git_rev=rev, git_dirty=dirty, remote=remote, pushed=pushed,
        committed_stages=commit, uncommitted_stages=left, overridden=overridden, outs=outs, metrics=metrics,
    )
