"""The JSON reader every stage uses, and a file copy, over the library's atomic writes
(fusion_model/files.py: a reader sees the old file or the new one, never half of one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, BinaryIO

from fusion_model.files import (  # noqa: F401 -- the stages' one import of the writes
    fsync_dir,
    publish,
    stale_temps,
    temp_path_beside,
    write_bytes,
    write_json,
    write_text,
    write_with,
)
from tasks.errors import StageError


def copy_file(src: Path, dest: Path) -> None:
    def fill(f: BinaryIO) -> None:
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 20)

    write_with(dest, fill)


def read_json(path: Path, fix: str) -> dict[str, Any]:
    """A JSON object another stage wrote; missing, unreadable or not an object -> StageError ending with `fix`."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise StageError(f"{path}: missing. {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise StageError(f"{path}: not valid JSON ({e}). {fix}") from None
    if not isinstance(data, dict):
        raise StageError(f"{path}: expected a JSON object, found {type(data).__name__}. {fix}")
    return data


def read_json_if_present(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path`, or None when it is absent or unreadable (a report then says so)."""
    try:
        return read_json(path, "")
    except StageError:
        return None
