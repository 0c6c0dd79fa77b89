"""Gather a run across hosts into one checkpoint folder, every shard accounted for, before the one conversion.

Each host uploaded its training folder to `runs/<run id>/<host>/` on the DVC remote with a manifest
(tasks/train/nodes.py). DeepSpeed's conversion needs every rank's shard in one folder; this assembles that
folder beside `convert.checkpoint_dir` and swaps it in only when it is complete:

- the manifests' global ranks must cover 0 .. world size - 1, each rank on exactly one host;
- every per-rank file kind (optimizer states; model states under ZeRO-3) must exist for every rank, from
  the host that ran that rank: a missing one is refused naming the host and the rank;
- every file is downloaded with its sha256 checked against the manifest: a damaged one is refused naming
  the host, the rank and the file;
- the run's other files (model config, summary, `latest`, ...) come from the host of global rank 0;
  each other host's log is kept as `train.<host>.log`.

Nothing is written to `checkpoint_dir` unless all of it holds: a refused gather leaves the last good
checkpoints where they were.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from pydantic import BaseModel

from fusion_model.layout import LIVE_DIR
from tasks._io.folders import flush_tree, recover_dir, swap_dir, temp_dir_beside
from tasks._io.remote import RunFiles, open_repo, remote_of
from tasks.errors import StageError
from tasks.train.nodes import MANIFEST, NodeUpload, UploadedFile, read_manifest
from tasks.train.stage import LOG_NAME


class GatherSummary(BaseModel):
    run_id: str
    checkpoint_dir: Path
    world_size: int
    hosts: dict[str, list[int]]  # host -> its global ranks
    shards_per_host: dict[str, int]  # per-rank ZeRO files each host contributed
    files: int
    bytes: int


def _rank_template(path: str, rank: int) -> str:
    """The name of a per-rank file with its rank taken out: the same for every rank's copy."""
    return re.sub(rf"zero_pp_rank_{rank}_", "zero_pp_rank_{rank}_", path, count=1)


def _check_ranks(manifests: dict[str, NodeUpload]) -> tuple[int, dict[int, str]]:
    sizes = {m.world_size for m in manifests.values()}
    if len(sizes) != 1:
        found = ", ".join(f"{h}: {m.world_size}" for h, m in manifests.items())
        raise StageError(f"the hosts' manifests disagree on the world size ({found}): they are not one run. "
                         "Re-run training.")
    world = sizes.pop()
    owner: dict[int, str] = {}
    for host, m in manifests.items():
        for r in m.global_ranks:
            if r in owner:
                raise StageError(f"global rank {r} is claimed by hosts {owner[r]} and {host}; the uploads mix runs. "
                                 "Re-run training.")
            owner[r] = host
    missing = [r for r in range(world) if r not in owner]
    if missing:
        raise StageError(f"world size {world} but no host uploaded global rank(s) {missing}; hosts and their ranks: "
                         + ", ".join(f"{h} {m.global_ranks}" for h, m in manifests.items())
                         + ". A host's upload is incomplete: re-run training.")
    return world, owner


def plan(manifests: dict[str, NodeUpload]) -> tuple[int, dict[int, str], dict[str, tuple[str, UploadedFile]]]:
    """(world size, rank -> host, destination path -> (host, file)) for a complete, consistent set of uploads."""
    world, owner = _check_ranks(manifests)
    primary = owner[0]
    chosen: dict[str, tuple[str, UploadedFile]] = {}
    kinds: set[str] = set()
    for host, m in manifests.items():
        for f in m.files:
            if f.rank is not None:
                if owner.get(f.rank) != host:
                    raise StageError(f"host {host}: uploaded {f.path} of rank {f.rank}, which ran on host "
                                     f"{owner.get(f.rank)}; the uploads mix runs. Re-run training.")
                chosen[f.path] = (host, f)
                kinds.add(_rank_template(f.path, f.rank))
            elif f.path.startswith(f"{LIVE_DIR}/"):
                continue  # the training curves: published by the train step, not part of the checkpoint
            elif f.path == LOG_NAME and host != primary:
                chosen[f"train.{host}.log"] = (host, f)
            elif host == primary:
                chosen[f.path] = (host, f)
    for kind in sorted(kinds):
        for r in range(world):
            path = kind.replace("{rank}", str(r))
            if path not in chosen:
                raise StageError(
                    f"host {owner[r]}, rank {r}: {path} is missing from its upload (manifest "
                    f"runs/{manifests[owner[r]].run_id}/{owner[r]}/{MANIFEST}). That rank did not finish saving, or "
                    "the upload was cut short: re-run training."
                )
    return world, owner, chosen


def gather(checkpoint_dir: Path, hosts: list[str], run_id: str, remote: str | None,
           root: Path = Path(".")) -> GatherSummary:
    """Assemble the run's uploads into `checkpoint_dir` (swapped in whole), or refuse naming host and rank."""
    with open_repo(root) as repo:
        run_files = RunFiles(remote_of(repo, remote), run_id)
        manifests = {host: read_manifest(run_files, host) for host in hosts}
        world, owner, chosen = plan(manifests)
        checkpoint_dir = Path(checkpoint_dir)
        recover_dir(checkpoint_dir)
        staged = temp_dir_beside(checkpoint_dir)
        try:
            for dest, (host, f) in sorted(chosen.items()):
                rel = f"{host}/{f.path}"
                who = f"host {host}, rank {f.rank}" if f.rank is not None else f"host {host}"
                try:
                    digest, size = run_files.get(rel, staged / dest)
                except FileNotFoundError:
                    raise StageError(f"{who}: {run_files.url(rel)} is listed in its manifest but missing from the "
                                     "remote; the upload was cut short or removed. Re-run training.") from None
                if digest != f.sha256 or size != f.bytes:
                    raise StageError(
                        f"{who}: {f.path} is damaged: {run_files.url(rel)} has sha256 {digest} ({size} bytes), its "
                        f"manifest records {f.sha256} ({f.bytes} bytes). Nothing was converted; re-run training."
                    )
            flush_tree()
            swap_dir(staged, checkpoint_dir)
        finally:
            shutil.rmtree(staged, ignore_errors=True)
    shards = {h: sum(1 for src, f in chosen.values() if src == h and f.rank is not None) for h in hosts}
    return GatherSummary(
        run_id=run_id, checkpoint_dir=checkpoint_dir, world_size=world,
        hosts={h: manifests[h].global_ranks for h in hosts}, shards_per_host=shards, files=len(chosen),
        bytes=sum(f.bytes for _, f in chosen.values()),
    )
