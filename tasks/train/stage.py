"""Train stage: launch the per-rank entry point as its own process group and wait for it.

Lightning's ``ddp`` re-executes ``sys.argv`` once per rank, so training inline would re-run the caller
(a Prefect flow body) on every rank. Instead this function starts ``torchrun ... -m fusion_model.fit``
(ddp, deepspeed) or one ``python -m fusion_model.fit`` that spawns its ranks (ddp_spawn) in a new
session, streams its output line by line to the caller's logger, and when any rank fails (or the caller
is interrupted or sent SIGTERM) ends the launcher and every rank, then raises ``StageError`` with the
rank's error and the log's tail. Neither torch nor Lightning is imported here.
"""

from __future__ import annotations

import collections
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fusion_model.config import TrainConfig, processes_per_node
from fusion_model.layout import CURVES, LAST_CHECKPOINT, LIVE_DIR, TRAIN_SUMMARY
from fusion_model.quiet import is_printed_noise
from tasks._io.files import write_text
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks._io.ports import free_port
from tasks._io.processes import preexec_die_with_parent
from tasks.errors import StageError
from tasks.train.curves import write_curves
from tasks.train.process_tree import ProcessTree, sigterm_raises

log = logging.getLogger(__name__)

TAIL_LINES = 60
_ERROR_LINE = re.compile(r"^\s*(\[rank\d+\]:?\s*)?[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*")
CONFIG_NAME = "train_config.json"
LOOPBACK_INTERFACE = "lo"
LOG_NAME = "train.log"


class TrainSummary(BaseModel):
    strategy: str
    zero_stage: int | None = None
    world_size: int
    num_nodes: int
    accelerator: str
    precision: str
    epochs: int
    steps: int
    samples_per_s: float | None = None
    steps_per_s: float | None = None
    metric: str
    monitor: str
    best_score: float | None = None
    best_checkpoint: str | None = None
    last_checkpoint: str
    checkpoint_kind: str
    resumed_from: str | None = None
    fit_wall_s: float
    best_epoch: int | None = None
    stopped_early: bool = False
    # the members of the kept epoch: settings, validation score alone, weight in the mix (fusion_model/fit.py)
    portfolio: dict[str, Any] | None = None
    # train.candidates: which one was kept, and each one's keys, validation score and best epoch
    chosen_candidate: int | None = None
    candidates: list[dict[str, Any]] | None = None
    # the kept model fitted again on train + val: rows, epochs, steps, wall time (fusion_model/fit.py refit)
    refit: dict[str, Any] | None = None
    wall_s: float | None = None  # launch to exit, start-up included
    out_dir: str | None = None
    curves: str | None = None  # the PNG of loss and validation metric per epoch


def _default_logger() -> logging.Logger:
    """The module logger; on a bare CLI (no logging configured) it prints to stderr, so progress shows."""
    if not logging.getLogger().hasHandlers() and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


def _cuda_devices() -> int:
    """GPUs visible to the ranks, without initialising CUDA in this (the caller's) process."""
    if shutil.which("nvidia-smi") is None:
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def node_processes(p: TrainConfig) -> int:
    """Ranks on this node: `train.devices`, or for `auto` the rule of `fusion_model.config.processes_per_node`."""
    gpus = _cuda_devices() if p.accelerator in ("auto", "gpu") else 0
    if p.accelerator == "gpu" and gpus == 0:
        raise StageError("train.accelerator is 'gpu' but no CUDA device is visible; set it to auto or cpu")
    return processes_per_node(p.devices, gpus)


def staging_dir(p: TrainConfig) -> Path:
    """Where a run trains until it succeeds: beside out_dir, hidden, one per out_dir. It survives a failed or
    killed run (its last.ckpt is what `resume` continues) and becomes out_dir in one rename on success."""
    out_dir = Path(p.out_dir)
    return out_dir.parent / f".{out_dir.name}.staging"


def _check_inputs(p: TrainConfig) -> None:
    if p.multi_host:
        raise StageError(
            f"train.hosts lists {len(p.hosts)} hosts ({', '.join(h.name for h in p.hosts)}): the retrain flow starts "
            "one node job per host (`prefect deployment run retrain/on-demand`; README, \"Training across "
            "machines\"). To train on this machine alone, set train.hosts to []."
        )
    for name in ("train.parquet", "val.parquet", "meta.json"):
        if not (Path(p.data_dir) / name).is_file():
            raise StageError(
                f"{Path(p.data_dir) / name} is missing; run `python -m tasks validate` first "
                "(or point train.data_dir at a validated folder)"
            )
    if p.num_nodes > 1 and p.master_port is None:
        raise StageError("num_nodes > 1 needs train.master_port (and master_addr) shared by every node")


def node_files_dir(p: TrainConfig, staging: Path) -> Path:
    """Where this node keeps its own config and log: staging on node 0; beside it on node k > 0, because on a
    shared disk node 0 empties staging when it starts, whenever node k got there first."""
    return staging if p.node_rank == 0 else staging.parent / f"{staging.name}.node{p.node_rank}"


def _prepare_staging(p: TrainConfig, staging: Path) -> str | None:
    """Make `staging` ready for this run; returns what it resumes from (None for a fresh run).

    A fresh run starts from an empty staging folder (a ZeRO folder written by more ranks would otherwise
    keep extra shard files). `resume` continues the interrupted run in staging if there is one, else the
    last finished run (out_dir, copied into staging so out_dir stays as it is until this run succeeds).
    """
    out_dir = Path(p.out_dir)
    if not p.resume:
        if p.node_rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True, exist_ok=True)
        return None
    if (staging / LAST_CHECKPOINT).exists():
        return f"the interrupted run in {staging}"
    if (out_dir / LAST_CHECKPOINT).exists():
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(out_dir, staging, symlinks=True)
        return f"the finished run in {out_dir}"
    raise StageError(
        f"resume: neither {staging / LAST_CHECKPOINT} (an interrupted run) nor {out_dir / LAST_CHECKPOINT} "
        "(a finished one) exists; train once with resume false first"
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):  # a name that does not resolve here is no loopback address
        return False


def build_command(p: TrainConfig, config_path: Path, nproc: int, port: int) -> list[str]:
    entry = ["-m", "fusion_model.fit", "--config", str(config_path)]
    if p.strategy == "ddp_spawn":
        return [sys.executable, *entry]  # Lightning spawns the ranks from this one process
    return [
        sys.executable, "-m", "fusion_model.launch",  # torchrun, its store bound to master_addr
        "--nproc_per_node", str(nproc), "--nnodes", str(p.num_nodes), "--node_rank", str(p.node_rank),
        "--master_addr", p.master_addr, "--master_port", str(port),
        "--max_restarts", "0",
        *entry,
    ]


def _environment(p: TrainConfig, port: int) -> dict[str, str]:
    env = dict(os.environ)
    threads = str(p.threads_per_rank)
    # torchrun sets OMP_NUM_THREADS=1 only when unset; Lightning's spawn sets nothing: set both, always.
    env.update({"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "PYTHONUNBUFFERED": "1"})
    on_cuda = p.accelerator != "cpu" and _cuda_devices() > 0
    env.setdefault("DS_ACCELERATOR", "cuda" if on_cuda else "cpu")  # DeepSpeed would guess, with a warning
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".torch_ext"))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("DVC_STUDIO_OFFLINE", "true")  # DVCLive never reports to a hosted service
    if p.strategy == "deepspeed" and p.zero_stage == 3:
        # glibc raises its mmap threshold as large blocks are freed and then serves ZeRO-3's gathered
        # parameters from a heap it never gives back: a fixed threshold returns each released parameter to
        # the OS, which is what ZeRO-3 is for (a third less peak memory per rank, bench/zero_memory.py)
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    if p.strategy == "ddp_spawn":
        env.update({"MASTER_ADDR": p.master_addr, "MASTER_PORT": str(port)})
    if _is_loopback(p.master_addr):
        # gloo and NCCL's bootstrap listen on the address of the interface they are given (else of the host
        # name or the first interface up): one node on loopback keeps every rank-to-rank socket there too
        env.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)
        env.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_INTERFACE)
    return env


def train(p: TrainConfig, logger: logging.Logger | logging.LoggerAdapter | None = None) -> TrainSummary:
    """Train into the staging folder; on success it replaces `p.out_dir` whole (node 0 only), so a failed
    or killed run leaves the last good checkpoints where they were."""
    logger = logger or _default_logger()
    _check_inputs(p)
    out_dir, staging = Path(p.out_dir), staging_dir(p)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(out_dir)  # a crash between the two renames of an earlier swap
    resuming = _prepare_staging(p, staging)
    if resuming:
        logger.info("train: resuming %s", resuming)
    nproc = node_processes(p)
    port = p.master_port or free_port()
    own = node_files_dir(p, staging)
    own.mkdir(parents=True, exist_ok=True)
    config_path = own / (CONFIG_NAME if p.node_rank == 0 else f"train_config.node{p.node_rank}.json")
    resolved = p.model_copy(update={"devices": nproc, "out_dir": staging})
    write_text(config_path, resolved.model_dump_json(indent=2))
    cmd = build_command(resolved, config_path, nproc, port)
    logger.info("train: %s x %d process(es) on node %d/%d: %s", p.strategy, nproc, p.node_rank, p.num_nodes,
                " ".join(cmd))

    env = _environment(p, port)
    with sigterm_raises():
        summary = _launch(p, cmd, env, staging, logger)
    if p.node_rank == 0:
        summary.curves = str(publish_live_log(p, staging, summary))
        swap_dir(staging, out_dir)
    summary.out_dir = str(out_dir)
    return summary


def publish_live_log(p: TrainConfig, staging: Path, summary: TrainSummary) -> Path:
    """Move the run's DVCLive log out of the checkpoint folder into `live_dir`, whole, with its curves PNG."""
    live_dir = Path(p.live_dir)
    log = staging / LIVE_DIR
    if not log.is_dir():
        raise StageError(f"training wrote no DVCLive log at {log}; see {staging / LOG_NAME}")
    write_curves(log, log / CURVES, summary.monitor, summary.best_epoch, summary.stopped_early)
    recover_dir(live_dir)
    staged = temp_dir_beside(live_dir)
    staged.rmdir()
    os.rename(log, staged)
    swap_dir(staged, live_dir)
    return live_dir / CURVES


def run_process_group(cmd: list[str], env: dict[str, str], log_path: Path, detail: str,
                      logger: logging.Logger | logging.LoggerAdapter,
                      stop: Callable[[], str | None] | None = None) -> None:
    """Run the launcher `cmd` in a session of its own, its output streamed line by line to `logger` and
    `log_path`; when it fails, raise StageError with its first rank error and the log's tail (`detail` says
    which run). `stop()`, asked every few seconds, ends the whole group when it returns a reason."""
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    errors: list[str] = []  # exception lines of the ranks: the launcher's own summary comes last
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        env=env, start_new_session=True,  # its own group: the caller's Ctrl-C does not hit the ranks twice
        preexec_fn=preexec_die_with_parent(signal.SIGTERM),  # a killed caller takes the launcher down too
    )
    # Every rank holds the pipe open: once the launcher exits, whatever it left (a rank stuck in a
    # collective, a dataloader worker) is ended, so the pipe closes and reading ends.
    tree = ProcessTree(proc)
    watchdog = threading.Thread(target=tree.watch, daemon=True)
    watchdog.start()
    stopped: list[str] = []
    if stop is not None:
        threading.Thread(target=_stop_when_asked, args=(proc, tree, stop, stopped), daemon=True).start()
    try:
        with log_path.open("w") as log_file:
            assert proc.stdout is not None
            for line in proc.stdout:
                line = line.rstrip("\n")
                log_file.write(line + "\n")
                log_file.flush()
                tail.append(line)
                if _ERROR_LINE.match(line) and "ChildFailedError" not in line and len(errors) < 5:
                    errors.append(line.strip())
                if not is_printed_noise(line):  # a library's known print (fusion_model/quiet.py); kept in the log
                    logger.info("%s", line)
        rc = proc.wait()
    except BaseException:
        tree.kill()  # interrupted caller (Ctrl-C, flow cancelled): leave no rank behind
        raise
    finally:
        watchdog.join(timeout=30)
    if stopped:
        raise StageError(f"training stopped ({detail}): {stopped[0]}; full log: {log_path}")
    if rc != 0:
        first = f"first error: {errors[0]}\n" if errors else ""
        text = "\n".join(tail)
        raise StageError(
            f"training failed (exit code {rc}, {detail}); full log: {log_path}.\n{first}Last lines:\n{text}"
        )


def _stop_when_asked(proc: subprocess.Popen[str], tree: ProcessTree, stop: Callable[[], str | None],
                     stopped: list[str], interval_s: float = 3.0) -> None:
    while proc.poll() is None:
        reason = stop()
        if reason:
            stopped.append(reason)
            tree.kill()
            return
        time.sleep(interval_s)


def _launch(p: TrainConfig, cmd: list[str], env: dict[str, str], out_dir: Path,
            logger: logging.Logger | logging.LoggerAdapter) -> TrainSummary:
    """Run `cmd` (the ranks write into `out_dir`, the staging folder) and read the summary it wrote."""
    started = time.monotonic()
    log_path = node_files_dir(p, out_dir) / (LOG_NAME if p.node_rank == 0 else f"train.node{p.node_rank}.log")
    run_process_group(cmd, env, log_path, f"strategy {p.strategy}", logger)
    summary_path = out_dir / TRAIN_SUMMARY
    if p.node_rank > 0 and not summary_path.is_file():  # on a shared disk node 0 may have published staging already
        summary_path = Path(p.out_dir) / TRAIN_SUMMARY
    if not summary_path.is_file():
        raise StageError(f"training exited cleanly but wrote no {summary_path}; see {log_path}")
    summary = TrainSummary.model_validate_json(summary_path.read_text())
    summary.wall_s = round(time.monotonic() - started, 2)
    logger.info("train: done in %.1f s, best %s %s", summary.wall_s, summary.monitor, summary.best_score)
    return summary
