"""Append-only JSON-lines logs (the champion registry's champions.jsonl and history.jsonl): one JSON object
per line, each append written in one call and fsynced.

A crash in the middle of an append can leave the last line cut short. A reader skips that line with a
warning (every line before it is whole) and the next append cuts it off before writing, so the log is
whole again. A cut-short record with a whole one after it on the same line (an append made after such a
crash by a writer without this repair) keeps the whole one, with a warning. Any other line that is not a
JSON object is damage a crash cannot cause: an error naming the file and the line.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from tasks.errors import StageError

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)
_RECORD_START = b'{"'


def _record(line: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _salvage(line: bytes) -> dict[str, Any] | None:
    """The whole record that ends `line` after a cut-short one, if there is one."""
    start = line.find(_RECORD_START, 1)
    while start != -1:
        if (record := _record(line[start:])) is not None:
            return record
        start = line.find(_RECORD_START, start + 1)
    return None


def read_jsonl_numbered(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, record) for every whole record of `path`, oldest first; [] when it does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    lines = [(n, line) for n, line in enumerate(path.read_bytes().split(b"\n"), start=1) if line.strip()]
    out = []
    for k, (n, line) in enumerate(lines):
        if (record := _record(line)) is not None:
            out.append((n, record))
        elif (record := _salvage(line)) is not None:
            log.warning("%s:%d: a cut-short record precedes a whole one on this line (an append after a crash); "
                        "the whole one is kept, the cut-short part skipped", path, n)
            out.append((n, record))
        elif k == len(lines) - 1:
            log.warning("%s:%d: the last line is cut short (%d bytes that are not a whole JSON record), as a crash "
                        "in the middle of an append leaves it; it is skipped, and the next write to %s removes it",
                        path, n, len(line), path.name)
        else:
            raise StageError(
                f"{path}:{n}: not a JSON record, and not the last line (a crash can only cut the last line "
                f"short), so the file is damaged. Restore {path.name} from a backup, or move line {n} out of it "
                "by hand after reading it.")
    return out


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every whole record of `path`, oldest first (see the module's note on cut-short lines)."""
    return [record for _, record in read_jsonl_numbered(path)]


def read_jsonl_as(path: Path, model: type[M]) -> list[M]:
    """`read_jsonl` parsed as `model`; a whole line that is not one is an error naming the file and line."""
    out = []
    for n, record in read_jsonl_numbered(path):
        try:
            out.append(model.model_validate(record))
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
            raise StageError(f"{path}:{n}: not a {model.__name__} record ({problems}). Restore {path.name} from "
                             f"a backup, or move line {n} out of it by hand after reading it.") from None
    return out


def append_jsonl(path: Path, record: str) -> None:
    """Append one record (a JSON object on one line) and fsync; a cut-short last line is removed first, a
    whole last record missing only its newline gets it."""
    path = Path(path)
    line = record.strip().encode("utf-8")
    if b"\n" in line or _record(line) is None:
        raise ValueError(f"not one JSON object on one line: {record[:200]!r}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as f:  # created if absent; "a": every write lands at the end
        f.seek(0)
        data = f.read()
        body = data.rstrip(b"\n")
        start = body.rfind(b"\n") + 1
        last = body[start:]
        prefix = b""
        if last.strip() and _record(last) is None and _salvage(last) is None:
            f.truncate(start)
            log.warning("%s:%d: removed the cut-short last line (%d bytes) before appending", path,
                        body.count(b"\n") + 1, len(last))
        elif data and not data.endswith(b"\n"):
            prefix = b"\n"
        f.write(prefix + line + b"\n")
        f.flush()
        os.fsync(f.fileno())
