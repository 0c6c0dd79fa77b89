"""Replace a whole folder so readers see the old one or the new one, never a mix.

The new content is written into a temporary folder beside the destination (same filesystem, so renames
are atomic); the swap is two renames: destination -> backup, temporary -> destination. A failure of the
second rename puts the backup back at once; a crash between the two leaves the old folder intact under
its backup name, and `recover_dir` (called by every stage before it writes) puts it back.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from tasks._io.files import fsync_dir


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


def swap_dir(tmp: Path, dest: Path) -> None:
    """Make the fully written folder `tmp` become `dest`; the previous `dest` is deleted only afterwards."""
    flush_tree()
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
