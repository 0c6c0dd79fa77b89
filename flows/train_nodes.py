"""Training across machines through Prefect: one node job per host, started, watched and stopped by the flow.

`train.hosts` lists the machines. The retrain flow (flows/retrain.py) then, instead of training here:

1. pushes the validated data and the dataset folder to the DVC remote (what every host reaches);
2. runs the `train-node/node` deployment once per host, on that host's work queue (a worker runs on each
   machine), with the run's id as torchrun's rendezvous id; host 0's address is the c10d endpoint;
3. waits for every node: the run fails as soon as one fails, or when a host has not joined the
   rendezvous within `train.join_timeout_s` (named, with what its node job is doing), and the other
   nodes are cancelled (their workers end their ranks);
4. publishes the training summary and curves from the host of global rank 0;
5. in its one conversion task, gathers every host's shards (tasks/convert/gather.py) and converts once.

The node job (`train_node`) runs on its host: fetch inputs, torchrun, upload shards (tasks/train/nodes.py).
It also stops its ranks once the run that started it is over (failed, cancelled, crashed).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from uuid import UUID

from filelock import FileLock, Timeout
from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import FlowRun, StateType
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound
from prefect.runtime import flow_run
from prefect.states import Cancelled, Cancelling

from flows.artifacts import training_markdown
from flows.stage_tasks import convert_task
from fusion_model.config import TrainConfig
from tasks.errors import StageError
from tasks.params import ConvertParams, Params
from tasks.train.nodes import NodeInputs, NodeUpload, fetch_live_log, read_manifest
from tasks.train.process_tree import sigterm_raises
from tasks.train.stage import TrainSummary, staging_dir

NODE_DEPLOYMENT = "train-node/node"
JOIN_TASK = "torchrun"  # a node whose torchrun task has started has reached the rendezvous
POLL_S = 2.0
STOP_WAIT_S = 30.0  # for the workers to confirm a cancellation before the runs are marked cancelled anyway
_BAD = (StateType.FAILED, StateType.CRASHED, StateType.CANCELLED)
_WAITING = (StateType.SCHEDULED, StateType.PENDING, StateType.PAUSED)


# ------------------------------------------------------------------------------------------------ node job


@task(name="fetch-inputs", retries=0, cache_policy=NO_CACHE)
def fetch_inputs_task(inputs: NodeInputs) -> None:
    from tasks.train.nodes import fetch_inputs

    fetch_inputs(inputs)


@task(name=JOIN_TASK, retries=0, cache_policy=NO_CACHE)
def torchrun_task(train: TrainConfig, host: str, run_id: str, parent_flow_run_id: str | None) -> Path:
    from tasks.train.nodes import train_node as run_ranks

    stop = _when_ended(parent_flow_run_id) if parent_flow_run_id else None
    with sigterm_raises():
        return run_ranks(train, host, run_id, logger=get_run_logger(), stop=stop)


@task(name="upload-shards", retries=0, cache_policy=NO_CACHE)
def upload_task(train: TrainConfig, host: str, run_id: str, remote: str | None, out_dir: Path,
                seconds: float) -> NodeUpload:
    from tasks.train.nodes import upload_node

    return upload_node(train, host, run_id, remote, out_dir, seconds)


def _when_ended(parent_flow_run_id: str) -> Callable[[], str | None]:
    """A check for the node's launcher: the reason to stop, once the retrain run that started it has ended."""

    def check() -> str | None:
        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(UUID(parent_flow_run_id)).state
        except Exception:  # the API out of reach for a moment: the ranks go on, the next check decides
            return None
        if state is not None and state.is_final():
            return f"the retrain run {parent_flow_run_id} that started this node ended ({state.name})"
        return None

    return check


@flow(name="train-node", log_prints=True)
def train_node(run_id: str, host: str, train: TrainConfig, inputs: NodeInputs,
               parent_flow_run_id: str | None = None) -> NodeUpload:
    """One host's share of a training run across machines; started by the retrain flow, never by hand.

    Args:
        run_id: the retrain run's id: torchrun's rendezvous id and the remote prefix of the uploads.
        host: this host's name in `train.hosts`.
        train: the run's resolved `train` parameters (the same on every host).
        inputs: the DVC trees of the validated data and the dataset folder, and the remote holding them.
        parent_flow_run_id: the retrain flow run; when it ends, this node stops its ranks.
    """
    train.host(host)  # an unknown host fails before anything is fetched
    lock_path = staging_dir(train).parent / ".train-node.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = FileLock(str(lock_path), timeout=0)
        lock.acquire()
    except Timeout:
        raise StageError(f"host {host}: another node job trains in {Path.cwd()} (it holds {lock_path}); one run "
                         "at a time per host") from None
    try:
        started = time.monotonic()
        fetch_inputs_task(inputs)
        out_dir = torchrun_task(train, host, run_id, parent_flow_run_id)
        return upload_task(train, host, run_id, inputs.remote, out_dir, round(time.monotonic() - started, 2))
    finally:
        lock.release()


# ------------------------------------------------------------------------------------------------ the run


def _check_capacity(client: Any, p: TrainConfig) -> str:
    """The node deployment exists, its pool can run every node beside this run, each host has its queue."""
    try:
        deployment = client.read_deployment_by_name(NODE_DEPLOYMENT)
    except ObjectNotFound:
        raise StageError(f"Prefect has no deployment {NODE_DEPLOYMENT}: run `prefect --no-prompt deploy --all` from "
                         "the project root (prefect.yaml declares it)") from None
    pool = client.read_work_pool(deployment.work_pool_name)
    mine = flow_run.get_id()
    here = client.read_flow_run(UUID(mine)).work_pool_name if mine else None
    need = len(p.hosts) + (1 if here == pool.name else 0)
    if pool.concurrency_limit is not None and pool.concurrency_limit < need:
        raise StageError(
            f"work pool {pool.name} runs at most {pool.concurrency_limit} flow run(s) at once, but this run needs "
            f"{need} ({len(p.hosts)} node jobs{' and itself' if need > len(p.hosts) else ''}): the nodes would "
            f"wait forever. Run `prefect work-pool set-concurrency-limit {pool.name} {need}` (and keep retrains "
            f"one at a time with `prefect work-queue set-concurrency-limit default 1 --pool {pool.name}`)."
        )
    for h in p.hosts:
        try:
            client.read_work_queue_by_name(h.work_queue, work_pool_name=pool.name)
        except ObjectNotFound:
            raise StageError(
                f"host {h.name}: work pool {pool.name} has no work queue {h.work_queue!r}. On that host, start its "
                f"worker: `prefect worker start --pool {pool.name} --work-queue {h.work_queue}`"
            ) from None
    return pool.name


def _joined(client: Any, run: FlowRun) -> bool:
    task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
    return any(t.name.startswith(JOIN_TASK) and t.state is not None and t.state.type not in _WAITING
               for t in task_runs)


def _why_absent(p: TrainConfig, host: str, run: FlowRun, pool: str) -> str:
    entry = p.host(host)
    state = run.state.name if run.state else "unknown"
    if run.state is None or run.state.type in _WAITING:
        hint = (f"no worker took it: start one on that host, `prefect worker start --pool {pool} --work-queue "
                f"{entry.work_queue}`, and check that the host reaches the Prefect API")
    else:
        hint = ("it is still fetching its inputs, or cannot start torchrun: see that flow run's log; raise "
                "train.join_timeout_s if the host is only slow")
    return (f"host {host} ({entry.address}) never joined the rendezvous within train.join_timeout_s="
            f"{p.join_timeout_s:g} s: its node job (flow run {run.id}, work queue {entry.work_queue!r}) is {state}; "
            f"{hint}")


def _annotate(message: str, p: TrainConfig) -> str:
    """Name the host behind any training address a node's error mentions (gloo names its peer by address)."""
    seen = [f"{h.address} is host {h.name}" for h in p.hosts if h.address in message]
    return f"{message} ({'; '.join(seen)})" if seen else message


def _failure(p: TrainConfig, seen: dict[str, FlowRun], stopped: dict[str, FlowRun], joined: set[str], pool: str,
             run_id: str) -> str:
    """What went wrong, host by host: `seen` the node runs when the failure was noticed, `stopped` after the
    others were stopped."""
    lines = [f"training across hosts failed (run {run_id}):"]
    for host, run in seen.items():
        state = run.state
        if state is not None and state.type in _BAD:
            lines.append(f"- host {host}: {state.name}: " + _annotate((state.message or "").strip()[:1500], p))
        elif host not in joined:
            lines.append("- " + _why_absent(p, host, run, pool))
        else:
            after = stopped[host].state
            lines.append(f"- host {host}: {after.name if after else 'unknown'} (stopped with the run)")
    absent = [h for h in seen if h not in joined]
    if absent:
        lines.insert(1, f"host(s) {', '.join(absent)} never joined the rendezvous.")
    lines.append("Nothing was gathered or converted; the last good checkpoints, model and champion are unchanged.")
    return "\n".join(lines)


def stop_nodes(client: Any, runs: dict[str, FlowRun], reason: str) -> dict[str, FlowRun]:
    """Cancel every node job not finished yet (their workers end the ranks); mark those whose worker does not
    answer within STOP_WAIT_S cancelled anyway (a host that is down cannot confirm)."""
    current = {h: client.read_flow_run(r.id) for h, r in runs.items()}
    for run in current.values():
        if run.state is None or run.state.is_final():
            continue
        waiting = run.state.type in _WAITING
        state = Cancelled(message=reason) if waiting else Cancelling(message=reason)
        with contextlib.suppress(Exception):
            client.set_flow_run_state(run.id, state, force=waiting)
    deadline = time.monotonic() + STOP_WAIT_S
    while time.monotonic() < deadline:
        current = {h: client.read_flow_run(r.id) for h, r in runs.items()}
        if all(r.state is not None and r.state.is_final() for r in current.values()):
            return current
        time.sleep(POLL_S)
    for run in current.values():
        if run.state is not None and not run.state.is_final():
            with contextlib.suppress(Exception):
                client.set_flow_run_state(run.id, Cancelled(
                    message=f"{reason}; its worker did not confirm within {STOP_WAIT_S:g} s (host down?)"), force=True)
    return {h: client.read_flow_run(r.id) for h, r in runs.items()}


def wait_for_nodes(client: Any, p: TrainConfig, runs: dict[str, FlowRun], run_id: str, pool: str,
                   logger: Any) -> None:
    """Until every node job completed; raise StageError (after stopping the others) when one fails or a host
    has not joined the rendezvous by `train.join_timeout_s` after the nodes were started."""
    deadline = time.monotonic() + p.join_timeout_s
    joined: set[str] = set()
    while True:
        current = {h: client.read_flow_run(r.id) for h, r in runs.items()}
        for host, run in current.items():
            if host not in joined and _joined(client, run):
                joined.add(host)
                logger.info("train: host %s reached the rendezvous", host)
        failed = [h for h, r in current.items() if r.state is not None and r.state.type in _BAD]
        late = time.monotonic() > deadline and len(joined) < len(runs)
        if failed or late:
            first = failed[0] if failed else next(h for h in runs if h not in joined)
            reason = (f"host {first} failed" if failed else f"host {first} never joined") + f" (run {run_id})"
            logger.error("train: %s: stopping the other hosts", reason)
            raise StageError(_failure(p, current, stop_nodes(client, current, reason), joined, pool, run_id))
        if all(r.state is not None and r.state.type == StateType.COMPLETED for r in current.values()):
            return
        time.sleep(POLL_S)


@task(name="train", retries=0, cache_policy=NO_CACHE)
def train_across_hosts(params: Params, run_id: str) -> TrainSummary:
    """Train on every host of `train.hosts` (see the module docstring); returns the run's training summary."""
    from tasks.train.nodes import publish_inputs

    logger = get_run_logger()
    p, remote = params.train, params.version.remote
    started = time.monotonic()
    with get_client(sync_client=True) as client:
        pool = _check_capacity(client, p)
        inputs = publish_inputs(p, params.validate_.dataset_dir, remote)
        logger.info("train: inputs on DVC remote %s: %s", inputs.remote, inputs.folders)
        runs: dict[str, FlowRun] = {}
        try:
            with sigterm_raises():
                for h in p.hosts:
                    runs[h.name] = run_deployment(
                        NODE_DEPLOYMENT, timeout=0, work_queue_name=h.work_queue, as_subflow=True,
                        flow_run_name=f"{run_id}-{h.name}",
                        parameters={"run_id": run_id, "host": h.name, "train": p.model_dump(mode="json"),
                                    "inputs": inputs.model_dump(mode="json"), "parent_flow_run_id": flow_run.get_id()},
                    )
                    logger.info("train: host %s: node job %s on work queue %s", h.name, runs[h.name].id, h.work_queue)
                wait_for_nodes(client, p, runs, run_id, pool, logger)
        except StageError:
            raise
        except BaseException:  # cancelled or interrupted: the node jobs must not train on
            with contextlib.suppress(Exception):
                stop_nodes(client, runs, f"the retrain run {run_id} was stopped")
            raise
    return _publish_summary(p, run_id, remote, started)


def _publish_summary(p: TrainConfig, run_id: str, remote: str | None, started: float) -> TrainSummary:
    """The summary and DVCLive log of the host of global rank 0: curves into train.live_dir, an artifact."""
    from tasks._io.remote import RunFiles, open_repo, remote_of
    from tasks.train.stage import publish_live_log

    with open_repo() as repo:
        run_files = RunFiles(remote_of(repo, remote), run_id)
        manifests = {h.name: read_manifest(run_files, h.name) for h in p.hosts}
        primary = next((m for m in manifests.values() if m.primary), None)
        if primary is None:
            raise StageError(f"run {run_id}: no host's manifest lists global rank 0 ("
                             + ", ".join(f"{h} {m.global_ranks}" for h, m in manifests.items())
                             + "); the uploads are incomplete. Re-run training.")
        beside = Path(p.live_dir).parent  # the log is renamed into train.live_dir: the same filesystem
        beside.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=beside, prefix=".train-live-") as tmp:
            raw = fetch_live_log(run_files, primary, Path(tmp))
            summary = TrainSummary.model_validate(raw)
            summary.wall_s = round(time.monotonic() - started, 2)
            summary.curves = str(publish_live_log(p, Path(tmp), summary))
    summary.out_dir = str(p.out_dir)
    ranks = {h: m.global_ranks for h, m in manifests.items()}
    create_markdown_artifact(
        key="retrain-training",
        markdown=training_markdown({**raw, "hosts": ranks, "wall_s": summary.wall_s},
                                   Path(run_files.url(f"{primary.host}/train_summary.json")), summary.curves),
        description=f"Training summary and curves ({len(p.hosts)} hosts)",
    )
    return summary


@task(name="convert", retries=0, cache_policy=NO_CACHE)
def convert_across_hosts(params: ConvertParams, train: TrainConfig, run_id: str, remote: str | None) -> Any:
    """The one conversion: gather every host's shards into `convert.checkpoint_dir` (hash- and count-checked),
    then convert them as on one machine."""
    from tasks.convert.gather import gather

    gathered = gather(params.checkpoint_dir, [h.name for h in train.hosts], run_id, remote)
    get_run_logger().info("convert: gathered %d file(s), %d bytes, world size %d from %s", gathered.files,
                          gathered.bytes, gathered.world_size, gathered.hosts)
    return convert_task.fn(params)
