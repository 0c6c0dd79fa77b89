"""Replace a whole folder so readers see the old one or the new one, never a mix.

The new content is written into a temporary folder beside the destination (same filesystem, so renames
are atomic); the swap is two renames: destination -> backup, temporary -> destination. A crash between
the two leaves the old folder intact under its backup name, and `recover_dir` puts it back.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def temp_dir_beside(dest: Path, purpose: str = "incoming") -> Path:
    """A new empty folder next to `dest`, hidden, named after it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{purpose}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def _backups(dest: Path) -> list[Path]:
    return sorted(dest.parent.glob(f".{dest.name}.old-*"), key=lambda p: p.stat().st_mtime)


def fsync_tree(folder: Path) -> None:
    """Flush every file and the folder itself, so a power cut after the swap cannot lose the content."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def swap_in(tmp: Path, dest: Path) -> None:
    """Make the fully written folder `tmp` become `dest`; the previous `dest` is deleted only afterwards."""
    fsync_tree(tmp)
    backup = None
    if dest.exists():
        backup = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dest, backup)
    os.rename(tmp, dest)
    if backup is not None:
        shutil.rmtree(backup)
