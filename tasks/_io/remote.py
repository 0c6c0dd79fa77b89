"""The DVC remote as the one store every host reaches: folders in, folders out, files under a run's prefix.

A run across machines assumes no shared disk. What one host makes and another needs goes through the DVC
remote the project is configured with (`.dvc/config`, or `dvc remote modify --local`): any kind DVC
supports (a folder, HTTP, SSH, S3, ...). Two ways, both DVC's own machinery:

- `push_folder` / `pull_folder`: a folder as a DVC tree object (`<md5>.dir`), content-addressed in the
  remote's `files/md5/` exactly as `dvc push` stores it, so a file the version step pushes later (or pushed
  before) is stored once; the puller rebuilds the tree's hash from what it checked out.
- `RunFiles`: plain files under `runs/<run id>/` beside DVC's objects (never inside them: `dvc gc` leaves
  the prefix alone), each read back with its sha256 checked by the caller.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tasks._io.files import publish, temp_path_beside
from tasks.errors import StageError

RUNS_PREFIX = "runs"
_CHUNK = 1 << 20


@contextlib.contextmanager
def open_repo(root: Path = Path(".")) -> Iterator[Any]:
    """The DVC repository at `root` (the project checkout a run works in)."""
    from dvc.exceptions import NotDvcRepoError
    from dvc.repo import Repo

    try:
        repo = Repo(str(root))
    except NotDvcRepoError:
        raise StageError(
            f"{Path(root).resolve()}: not a DVC repository; a run across hosts moves its data through the DVC "
            "remote, so run it from the project checkout (it has .dvc/)"
        ) from None
    try:
        yield repo
    finally:
        repo.close()


def remote_of(repo: Any, name: str | None) -> Any:
    """DVC's handle on remote `name` (None: the default remote), or a StageError that says how to set one."""
    from dvc.config import NoRemoteError, RemoteNotFoundError

    try:
        return repo.cloud.get_remote(name, command="push")
    except (NoRemoteError, RemoteNotFoundError) as e:
        raise StageError(
            f"DVC remote {name or '(default)'}: {e}. Every host reads and writes the run's data there: add one "
            "that all hosts reach (`dvc remote add -d storage <url>`), or name it in `version.remote`."
        ) from None


def describe(remote: Any) -> str:
    """The remote's name and URL, for messages."""
    return f"{remote.name} ({remote.fs.unstrip_protocol(remote.path)})"


def push_folder(repo: Any, remote_name: str | None, folder: Path) -> str:
    """Put `folder` in the repo's cache as a DVC tree and push the tree and its files; returns its md5."""
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.transfer import transfer

    cache = repo.cache.local
    staging, _, tree = build(cache, str(Path(folder).resolve()), repo.fs, "md5", ignore=repo.dvcignore)
    transfer(staging, cache, {tree.hash_info}, shallow=False, hardlink=False)
    remote = remote_of(repo, remote_name)
    result = repo.cloud.push([tree.hash_info, *(oid for _, _, oid in tree)], remote=remote.name)
    if result.failed:
        raise StageError(f"{folder}: {len(result.failed)} file(s) could not be pushed to {describe(remote)}; "
                         "check that the remote is reachable and writable from this host, then re-run")
    return tree.hash_info.value


def pull_folder(repo: Any, remote_name: str | None, md5: str, folder: Path) -> None:
    """Make `folder` hold exactly the tree `md5` from the remote (files not in it are removed), then prove it
    by hashing what was checked out."""
    from dvc_data.hashfile import load
    from dvc_data.hashfile.build import build
    from dvc_data.hashfile.checkout import checkout
    from dvc_data.hashfile.hash_info import HashInfo

    cache = repo.cache.local
    remote = remote_of(repo, remote_name)
    tree_id = HashInfo("md5", md5)
    result = repo.cloud.pull([tree_id], remote=remote.name)
    if result.failed or not cache.exists(md5):
        raise StageError(f"{describe(remote)}: the tree {md5} is not there; the run that published it pushed to "
                         "another remote, or it was removed. Point every host at the same DVC remote.")
    tree = load(cache, tree_id)
    result = repo.cloud.pull([oid for _, _, oid in tree], remote=remote.name)
    if result.failed:
        raise StageError(f"{describe(remote)}: {len(result.failed)} file(s) of tree {md5} could not be fetched; "
                         "check that the remote is reachable from this host, then re-run")
    target = Path(folder).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    checkout(str(target), repo.fs, tree, cache, force=True)
    _, _, built = build(cache, str(target), repo.fs, "md5", dry_run=True)
    if built.hash_info.value != md5:
        raise StageError(f"{folder}: after checkout it hashes to {built.hash_info.value}, not {md5}; the cache or "
                         "the remote holds a damaged file. Run `dvc cache dir` to find the cache, remove it, re-run.")


class RunFiles:
    """Files of one run under `<remote>/runs/<run_id>/`, through the remote's own filesystem."""

    def __init__(self, remote: Any, run_id: str) -> None:
        if not run_id or "/" in run_id or run_id.startswith("."):
            raise StageError(f"run id {run_id!r}: must be a plain name (no '/', not starting with '.')")
        self.remote, self.run_id = remote, run_id
        self.fs = remote.fs
        self.root = self.fs.join(remote.path, RUNS_PREFIX, run_id)

    def path(self, rel: str) -> str:
        parts = [p for p in rel.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise StageError(f"{rel!r}: not a relative path inside the run's folder")
        return self.fs.join(self.root, *parts)

    def url(self, rel: str) -> str:
        return self.fs.unstrip_protocol(self.path(rel))

    def put(self, local: Path, rel: str) -> None:
        target = self.path(rel)
        with contextlib.suppress(NotImplementedError):  # object stores and HTTP have no folders to make
            self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
        self.fs.put_file(str(local), target)

    def exists(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(rel)))

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open(self.path(rel), "rb") as f:
            return f.read()

    def get(self, rel: str, local: Path) -> tuple[str, int]:
        """Download `rel` to `local` (written beside it, then renamed); returns its sha256 and size."""
        local.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_path_beside(local)
        digest, size = hashlib.sha256(), 0
        try:
            with self.fs.open(self.path(rel), "rb") as src, open(tmp, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    size += len(chunk)
                    dst.write(chunk)
            publish(tmp, local)
        finally:
            if tmp.exists():
                os.unlink(tmp)
        return digest.hexdigest(), size
