"""Training across machines: one host's share of a run, and what the flow publishes for it.

The retrain flow starts one node job per host of `train.hosts` (flows/train_nodes.py); each runs here, on
its own machine, with no disk shared with the others:

1. `fetch_inputs`: the validated data and the dataset folder, from the DVC remote (`publish_inputs` put
   them there, as DVC trees, before the nodes started);
2. `train_node`: `torchrun --rdzv-backend c10d` with the run's id as the rendezvous id, host 0's address
   as the endpoint and this host's address as `--local-addr`; gloo/NCCL on this host's interface. The
   ranks write their ZeRO shards into this host's folder (DeepSpeed's node-local storage);
3. `upload_node`: every file of that folder to `runs/<run id>/<host>/` on the remote, then a manifest (the
   host, its global ranks, each file's sha256 and rank), last, so its presence means the upload is whole.

The one conversion gathers those uploads (tasks/convert/gather.py). torchrun does the rendezvous,
DeepSpeed the sharding, DVC the transfers; this module only wires them. No Prefect here.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import shutil
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import psutil
from pydantic import BaseModel

from fusion_model.config import HostConfig, TrainConfig
from fusion_model.layout import LIVE_DIR, RANKS_DIR, TRAIN_SUMMARY
from tasks._io.files import write_text
from tasks._io.hashing import sha256_file
from tasks._io.remote import RunFiles, open_repo, pull_folder, push_folder, remote_of
from tasks.errors import StageError
from tasks.train.stage import (
    CONFIG_NAME,
    LOG_NAME,
    _environment,
    node_processes,
    run_process_group,
    staging_dir,
)

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
# a per-rank file of a DeepSpeed checkpoint: zero_pp_rank_<global rank>_mp_rank_00_{optim,model}_states.pt
_RANK_FILE = re.compile(r"(?:^|/)(?:bf16_|fp16_)?zero_pp_rank_(?P<rank>\d+)_mp_rank_\d+_(?:optim|model)_states\.pt$")


class NodeInputs(BaseModel):
    """What every node checks out before it trains: relative folder -> DVC tree md5, and the remote."""

    folders: dict[str, str]
    remote: str | None = None


class UploadedFile(BaseModel):
    path: str  # relative to the host's training folder (POSIX)
    bytes: int
    sha256: str
    rank: int | None = None  # the global rank a per-rank shard belongs to


class NodeUpload(BaseModel):
    """A host's manifest, `runs/<run id>/<host>/manifest.json` on the remote."""

    format: int = MANIFEST_FORMAT
    run_id: str
    host: str
    address: str
    world_size: int
    global_ranks: list[int]
    strategy: str
    zero_stage: int | None
    files: list[UploadedFile]
    seconds: float | None = None  # training, start-up included

    @property
    def primary(self) -> bool:
        """The host of global rank 0: its summary, model config and log are the run's."""
        return 0 in self.global_ranks


def rank_of(path: str) -> int | None:
    m = _RANK_FILE.search(path)
    return int(m["rank"]) if m else None


def _inside(root: Path, path: Path, key: str) -> str:
    resolved_root, resolved = root.resolve(), (root / path).resolve()
    if not resolved.is_relative_to(resolved_root) or resolved == resolved_root:
        raise StageError(
            f"{key} = {path}: with several hosts it must be a folder inside the project ({resolved_root}), "
            "given relative to it, so every host checks it out at the same place"
        )
    return resolved.relative_to(resolved_root).as_posix()


def publish_inputs(p: TrainConfig, dataset_dir: Path, remote: str | None, root: Path = Path(".")) -> NodeInputs:
    """Push the validated data (`train.data_dir`) and the dataset folder its images are in
    (`validate.dataset_dir`) to the DVC remote, as DVC trees: the nodes' inputs."""
    folders = {_inside(root, Path(p.data_dir), "train.data_dir"): Path(p.data_dir),
               _inside(root, Path(dataset_dir), "validate.dataset_dir"): Path(dataset_dir)}
    for rel, folder in folders.items():
        if not (root / folder).is_dir():
            raise StageError(f"{root / folder}: missing; run download and validate before training ({rel})")
    with open_repo(root) as repo:
        name = remote_of(repo, remote).name
        return NodeInputs(folders={rel: push_folder(repo, name, root / rel) for rel in sorted(folders)},
                          remote=name)


def fetch_inputs(inputs: NodeInputs, root: Path = Path(".")) -> None:
    """Check the published folders out into this host's project checkout, exactly (hash-checked)."""
    with open_repo(root) as repo:
        for rel, md5 in inputs.folders.items():
            _inside(root, Path(rel), "input folder")
            pull_folder(repo, inputs.remote, md5, root / rel)


def check_host(host: HostConfig) -> None:
    """This machine must hold the host's address on the host's interface: a node job on the wrong machine, or
    an entry with a typo, fails here instead of in the rendezvous."""
    interfaces = psutil.net_if_addrs()
    if host.interface not in interfaces:
        raise StageError(
            f"host {host.name}: this machine ({socket.gethostname()}) has no interface {host.interface!r} "
            f"(it has {', '.join(sorted(interfaces))}); fix train.hosts' entry, or run the worker of work queue "
            f"{host.work_queue!r} on that host"
        )
    try:
        wanted = ipaddress.ip_address(host.address)
    except ValueError:
        raise StageError(f"host {host.name}: address {host.address!r} is not an IP address; give the address "
                         "the host has on the training network") from None
    held = {a.address.split("%")[0] for a in interfaces[host.interface] if a.family in (socket.AF_INET, socket.AF_INET6)}
    if str(wanted) not in held:
        raise StageError(
            f"host {host.name}: interface {host.interface} holds {', '.join(sorted(held)) or 'no address'}, not "
            f"{host.address}; fix train.hosts' entry, or run the worker of work queue {host.work_queue!r} on that host"
        )


def node_config(p: TrainConfig, nproc: int) -> TrainConfig:
    """The config this host's ranks read: its process count, every host as a node, its own folder."""
    return p.model_copy(update={"devices": nproc, "num_nodes": len(p.hosts), "out_dir": staging_dir(p)})


def node_command(p: TrainConfig, host: HostConfig, run_id: str, nproc: int, config_path: Path) -> list[str]:
    """torchrun with the c10d rendezvous: run id, host 0's endpoint, this host's address; no restarts (a
    failed rank fails the run, as on one machine)."""
    first = p.hosts[0]
    conf = f"join_timeout={int(p.join_timeout_s)},is_host={1 if host.name == first.name else 0}"
    return [
        sys.executable, "-m", "fusion_model.launch",  # torchrun, its stores bound to the given addresses
        "--nnodes", str(len(p.hosts)), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", _endpoint(first.address, p.rendezvous_port),
        "--rdzv-id", run_id, "--rdzv-conf", conf, "--local-addr", host.address,
        "--max-restarts", "0",
        "-m", "fusion_model.fit", "--config", str(config_path),
    ]


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def node_environment(p: TrainConfig, host: HostConfig) -> dict[str, str]:
    env = _environment(p, p.rendezvous_port)
    # gloo (CPU) and NCCL (GPU) open their rank-to-rank sockets on this interface only; without it gloo
    # binds where the host name resolves. A distinct NCCL_HOSTID keeps NCCL from taking two hosts that
    # share a kernel (network namespaces, containers) for one.
    env.update({"GLOO_SOCKET_IFNAME": host.interface, "NCCL_SOCKET_IFNAME": host.interface})
    env.setdefault("NCCL_HOSTID", host.name)
    return env


def train_node(p: TrainConfig, host_name: str, run_id: str,
               logger: logging.Logger | logging.LoggerAdapter | None = None,
               stop: Callable[[], str | None] | None = None) -> Path:
    """Train this host's ranks in the run `run_id` into a fresh folder (train.out_dir's staging folder);
    returns it. Raises StageError with the ranks' first error when any rank fails."""
    logger = logger or logging.getLogger(__name__)
    host = p.host(host_name)
    check_host(host)
    for name in ("train.parquet", "val.parquet", "meta.json"):
        if not (Path(p.data_dir) / name).is_file():
            raise StageError(f"host {host.name}: {Path(p.data_dir) / name} is missing; its inputs were not fetched")
    out_dir = staging_dir(p)
    shutil.rmtree(out_dir, ignore_errors=True)  # shards of an earlier run must not be uploaded with these
    out_dir.mkdir(parents=True)
    nproc = node_processes(p)
    resolved = node_config(p, nproc)
    config_path = out_dir / CONFIG_NAME
    write_text(config_path, resolved.model_dump_json(indent=2))
    cmd = node_command(p, host, run_id, nproc, config_path)
    logger.info("train: host %s (%s on %s), %d process(es), rendezvous %s at %s: %s", host.name, host.address,
                host.interface, nproc, run_id, _endpoint(p.hosts[0].address, p.rendezvous_port), " ".join(cmd))
    run_process_group(cmd, node_environment(p, host), out_dir / LOG_NAME,
                      f"strategy {p.strategy}, host {host.name}", logger, stop)
    return out_dir


def upload_node(p: TrainConfig, host_name: str, run_id: str, remote: str | None, out_dir: Path,
                seconds: float | None = None) -> NodeUpload:
    """Upload every file of this host's training folder, then its manifest, under `runs/<run id>/<host>/`."""
    host = p.host(host_name)
    ranks = sorted(json.loads(f.read_text())["rank"] for f in (out_dir / RANKS_DIR).glob("rank-*.json"))
    if not ranks:
        raise StageError(f"host {host.name}: {out_dir / RANKS_DIR} records no rank; its ranks never started "
                         f"training (see {out_dir / LOG_NAME})")
    world = {json.loads(f.read_text())["world_size"] for f in (out_dir / RANKS_DIR).glob("rank-*.json")}
    files = []
    for path in sorted(f for f in out_dir.rglob("*") if f.is_file()):
        rel = path.relative_to(out_dir).as_posix()
        rank = rank_of(rel)
        if rank is not None and rank not in ranks:
            raise StageError(f"host {host.name}: {path} belongs to rank {rank}, which did not run here "
                             f"(ranks {ranks}); the folder mixes runs. Re-run training.")
        files.append(UploadedFile(path=rel, bytes=path.stat().st_size, sha256=sha256_file(path), rank=rank))
    manifest = NodeUpload(run_id=run_id, host=host.name, address=host.address, world_size=world.pop(),
                          global_ranks=ranks, strategy=p.strategy,
                          zero_stage=p.zero_stage if p.strategy == "deepspeed" else None, files=files,
                          seconds=seconds)
    with open_repo() as repo:
        run_files = RunFiles(remote_of(repo, remote), run_id)
        for f in files:
            run_files.put(out_dir / f.path, f"{host.name}/{f.path}")
        manifest_file = out_dir.parent / f".{out_dir.name}.{MANIFEST}"
        write_text(manifest_file, manifest.model_dump_json(indent=2))
        try:
            run_files.put(manifest_file, f"{host.name}/{MANIFEST}")  # last: its presence means the upload is whole
        finally:
            manifest_file.unlink(missing_ok=True)
    return manifest


def read_manifest(run_files: RunFiles, host: str) -> NodeUpload:
    rel = f"{host}/{MANIFEST}"
    if not run_files.exists(rel):
        raise StageError(
            f"host {host}: no upload manifest at {run_files.url(rel)}: its node job never finished uploading "
            f"its shards for run {run_files.run_id}. See that node job's log; re-run training."
        )
    manifest = NodeUpload.model_validate_json(run_files.read_bytes(rel))
    if manifest.host != host or manifest.run_id != run_files.run_id:
        raise StageError(f"{run_files.url(rel)}: records host {manifest.host} of run {manifest.run_id}; the "
                         "remote's run folder was overwritten. Re-run training.")
    return manifest


def fetch_live_log(run_files: RunFiles, manifest: NodeUpload, into: Path) -> dict:
    """The primary host's training summary and DVCLive log, downloaded (hash-checked) into `into`."""
    wanted = [f for f in manifest.files if f.path == TRAIN_SUMMARY or f.path.startswith(f"{LIVE_DIR}/")]
    for f in wanted:
        digest, _ = run_files.get(f"{manifest.host}/{f.path}", into / f.path)
        if digest != f.sha256:
            raise StageError(f"host {manifest.host}: {run_files.url(f'{manifest.host}/{f.path}')} has sha256 "
                             f"{digest}, its manifest records {f.sha256}: damaged upload. Re-run training.")
    if not (into / TRAIN_SUMMARY).is_file():
        raise StageError(f"host {manifest.host} (global rank 0) uploaded no {TRAIN_SUMMARY}; see its node job's log")
    return json.loads((into / TRAIN_SUMMARY).read_text())

