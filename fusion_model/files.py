"""Atomic single-file writes: the training library's and every stage's (tasks/_io/files.py re-exports them).

Every write goes to a hidden temporary file beside the destination (same folder, so the rename is
atomic), is fsynced, then `os.replace`d over the destination, and the folder is fsynced so the rename
itself survives a power cut. A reader sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def temp_path_beside(path: Path) -> Path:
    """A fresh hidden name next to `path` for content that is not complete yet (see `stale_temps`)."""
    return path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")


def stale_temps(path: Path) -> list[Path]:
    """Temporary files a killed writer of `path` left behind."""
    return sorted(path.parent.glob(f".{path.name}.*.tmp"))


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, dest: Path) -> None:
    """Make the complete file `tmp` become `dest`: fsync it, rename it, fsync the folder."""
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


def write_with(dest: Path, fill: Callable[[BinaryIO], None]) -> None:
    """Write `dest` atomically with `fill(file)`; a failure leaves `dest` as it was and no temporary file."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path_beside(dest)
    try:
        with open(tmp, "wb") as f:
            fill(f)
        publish(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(dest: Path, data: bytes) -> None:
    write_with(dest, lambda f: f.write(data))


def write_text(dest: Path, text: str) -> None:
    write_bytes(dest, text.encode("utf-8"))


def write_json(dest: Path, data: Any) -> None:
    """Indented JSON with a final newline (stable bytes for DVC and git diffs)."""
    write_text(dest, json.dumps(data, indent=2, default=str) + "\n")
