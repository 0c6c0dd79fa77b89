"""Where the real datasets are when they are beside the project (never in it): tests that read them skip
with a reason when they are absent."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shared_dir() -> Path | None:
    """$SHARED_DATA, else ../shared beside the project, else /work/shared; None when none exists."""
    for candidate in (os.environ.get("SHARED_DATA"), ROOT.parent / "shared", "/work/shared"):
        if candidate and Path(candidate).is_dir():
            return Path(candidate)
    return None


def shared_file(relative: str) -> Path | None:
    """A file of the real datasets, or None when it is not there."""
    base = shared_dir()
    path = base / relative if base is not None else None
    return path if path is not None and path.is_file() else None
