"""Replace a whole folder so readers see the old one or the new one, never a mix and never none.

The new content is written into a temporary folder beside the destination (same filesystem), flushed,
then exchanged with the destination in one atomic `renameat2(RENAME_EXCHANGE)` (Linux 3.15+, ext4, xfs,
btrfs, tmpfs): at every instant the destination is the complete old folder or the complete new one; the
old one, now under the temporary name, is deleted afterwards. Where the exchange is not supported the
swap is two renames (destination -> backup, temporary -> destination), the backup put back if the second
fails; a crash between the two leaves the old folder under its backup name, and `recover_dir` (called by
every writer before it writes) puts it back.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
import uuid
from pathlib import Path

from tasks._io.files import fsync_dir

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def temp_dir_beside(dest: Path, purpose: str = "incoming") -> Path:
    """A new empty folder next to `dest`, hidden, named after it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{purpose}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _backups(dest: Path) -> list[Path]:
    return sorted(dest.parent.glob(f".{dest.name}.old-*"), key=lambda p: p.stat().st_mtime)


def flush_tree() -> None:
    """Put a folder tree on disk before it becomes visible: one `sync` for the whole tree, because an
    fsync per file costs milliseconds each (thousands of images; BENCHMARKS.md, download stage)."""
    os.sync()


def recover_dir(dest: Path) -> Path | None:
    """Undo an interrupted swap: if `dest` is missing but a backup exists, rename the newest back.

    Also deletes temporary folders a crash left behind. Returns the restored backup's old path, if any.
    """
    restored = None
    backups = _backups(dest)
    if not dest.exists() and backups:
        restored = backups[-1]
        os.rename(restored, dest)
        backups = backups[:-1]
    for stale in [*backups, *dest.parent.glob(f".{dest.name}.incoming-*")]:
        shutil.rmtree(stale, ignore_errors=True)
    return restored


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the paths `a` and `b`; False where this system cannot (then nothing changed)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:  # glibc before 2.28
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # filesystem or kernel without the flag
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def swap_dir(tmp: Path, dest: Path, flushed: bool = False) -> None:
    """Make the fully written folder `tmp` become `dest`; the previous `dest` is deleted only afterwards.
    `flushed`: the caller fsynced every file of `tmp` and `tmp` itself (else one `sync` puts the tree on disk)."""
    if not flushed:
        flush_tree()
    if dest.exists() and _exchange(tmp, dest):
        fsync_dir(dest.parent)
        shutil.rmtree(tmp)  # the old content, now under the temporary name
        return
    backup = None
    if dest.exists():
        backup = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dest, backup)
    try:
        os.rename(tmp, dest)
    except OSError:
        if backup is not None:
            os.rename(backup, dest)
        raise
    fsync_dir(dest.parent)
    if backup is not None:
        shutil.rmtree(backup)
