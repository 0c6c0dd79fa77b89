"""Content hashes: of one file, of every file under a folder, and of such a listing."""

from __future__ import annotations

import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file, keyed by its POSIX path relative to `folder`, sorted by path."""
    return {p.relative_to(folder).as_posix(): sha256_file(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def fingerprint(files: dict[str, str]) -> str:
    """One sha256 for a listing of `file_hashes` (the `sha256sum` format of it, hashed)."""
    return hashlib.sha256("".join(f"{h}  {name}\n" for name, h in files.items()).encode()).hexdigest()
