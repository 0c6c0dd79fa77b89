"""A /predict request body as the rows a Predictor scores, refused with the field and reason when unusable.

Body: `{"rows": [{column: value, ...}, ...]}`, one object per row with every column the model was trained
on (model_config.json `dataset`; a label column is ignored). Values: numbers, strings or null. An image
cell is one of:

- a string: ';'-separated paths relative to the server's --images-root (as in the CSV files);
- `{"base64": "<the photo's bytes, base64>"}` (a `data:image/...;base64,` prefix is allowed in it);
- a list of those, for several photos (the model uses the one its `image_index` picks, as for a CSV).

Uploaded photos are written to a temporary folder of the request (`RequestRows.close` removes it); when a
request mixes uploads and paths, the path photos are linked (or copied) into that folder too, after the
same safety check, so the predictor reads every photo from one root as it does for a CSV.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from fusion_model.checks import image_path_problem
from fusion_model.dataset import IMAGE_SEPARATOR, DatasetSchema, split_images

MAX_ROWS = 4096  # per request: more rows belong in a file for `python -m fusion_model.predict`
MAX_IMAGE_BYTES = 20 * 1024 * 1024  # one decoded upload
MAX_PROBLEMS = 50  # shown per refusal (the count of the rest is given)
UPLOADS = "uploads"
FROM_ROOT = "root"  # where a mixed request's path photos are linked inside the request folder


class RequestError(Exception):
    """A request the server refuses: `problems` are {"loc", "msg", "type"} as FastAPI's own validation errors."""

    def __init__(self, status: int, problems: list[dict[str, Any]], fix: str | None = None) -> None:
        super().__init__("; ".join(p["msg"] for p in problems))
        self.status = status
        self.problems = problems
        self.fix = fix or "fix the fields named in `detail` and send it again"

    def body(self) -> dict[str, Any]:
        shown = self.problems[:MAX_PROBLEMS]
        more = len(self.problems) - len(shown)
        return {"detail": shown, "message": f"{len(self.problems)} problem(s) in the request"
                + (f" ({more} not shown)" if more else "") + f"; {self.fix}"}


def problem(loc: list[Any], msg: str, kind: str) -> dict[str, Any]:
    return {"loc": ["body", *loc], "msg": msg, "type": kind}


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON; send null for a missing number")


def parse_body(raw: bytes) -> list[Any]:
    """The `rows` list of a body; RequestError 400 for text that is not JSON, 422 for the wrong shape."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as e:
        raise RequestError(400, [problem([], f"the body is not valid JSON ({e}); send "
                                             '{"rows": [{column: value, ...}, ...]} with Content-Type: application/json',
                                         "json_invalid")]) from None
    if not isinstance(body, dict):
        raise RequestError(422, [problem([], f"the body is a JSON {type(body).__name__}, not an object; send "
                                             '{"rows": [...]}', "object_expected")])
    if "rows" not in body:
        raise RequestError(422, [problem(["rows"], "field required: the rows to predict, a list of objects "
                                                   "(column -> value)", "missing")])
    rows = body["rows"]
    if not isinstance(rows, list):
        raise RequestError(422, [problem(["rows"], f"must be a list of row objects, not a JSON {type(rows).__name__}",
                                         "list_expected")])
    if not rows:
        raise RequestError(422, [problem(["rows"], "is empty: send at least one row", "too_short")])
    if len(rows) > MAX_ROWS:
        raise RequestError(422, [problem(["rows"], f"has {len(rows)} rows, more than {MAX_ROWS} per request; split "
                                                   "it, or score a file with `python -m fusion_model.predict`",
                                         "too_long")])
    return rows


def _scalar_problem(value: Any, role: str) -> str | None:
    if value is None or isinstance(value, str):
        return None
    if isinstance(value, bool):
        return "wrong type: a boolean; send a number or a string" if role == "numerical" else None
    if isinstance(value, int | float):
        return None
    return f"wrong type: a JSON {'object' if isinstance(value, dict) else 'list'}; send a number, a string or null"


@dataclass
class RequestRows:
    """The rows of one request as a DataFrame (index 0..n-1 = position in `rows`) and the images root to
    score them against. `uploads` maps each written upload's path (relative to the root) to its cell."""

    frame: pd.DataFrame
    images_root: Path
    uploads: dict[str, tuple[int, str]]
    _tmp: tempfile.TemporaryDirectory[str] | None = None

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class _Images:
    """Turns image cells into ';'-separated relative paths, writing uploads into a request folder."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self.tmp: tempfile.TemporaryDirectory[str] | None = None
        self.uploads: dict[str, tuple[int, str]] = {}
        self.paths: list[str] = []  # the path photos (relative to the root), checked safe

    def folder(self) -> Path:
        if self.tmp is None:
            self.tmp = tempfile.TemporaryDirectory(prefix="fusion-serve-")
            Path(self.tmp.name, UPLOADS).mkdir()
        return Path(self.tmp.name)

    def cell(self, value: Any, i: int, col: str, problems: list[dict[str, Any]]) -> str:
        items = value if isinstance(value, list) else [value]
        out = []
        for k, item in enumerate(items):
            if item is None:
                continue
            if isinstance(item, str):
                for rel in split_images(item):
                    why = ("this server has no --images-root; send the photo itself as {\"base64\": ...}"
                           if self.root is None else image_path_problem(rel, self.root))
                    if why:
                        problems.append(problem(["rows", i, col], f"image path {rel!r}: {why}", "unsafe_path"))
                    else:
                        self.paths.append(rel)
                        out.append(rel)
            elif isinstance(item, dict) and set(item) == {"base64"} and isinstance(item["base64"], str):
                name = self._upload(item["base64"], i, col, k, problems)
                if name:
                    out.append(name)
            else:
                problems.append(problem(["rows", i, col], "wrong type for an image cell: send a relative path "
                                        "string, {\"base64\": \"...\"}, a list of those, or null", "image_type"))
        return IMAGE_SEPARATOR.join(out)

    def _upload(self, text: str, i: int, col: str, k: int, problems: list[dict[str, Any]]) -> str | None:
        if text.startswith("data:") and "," in text:
            text = text.split(",", 1)[1]  # a data URL's payload
        text = "".join(text.split())  # MIME-style line breaks are not part of the data
        try:
            data = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as e:
            problems.append(problem(["rows", i, col], f"base64 photo {k}: not valid base64 ({e})", "base64_invalid"))
            return None
        if not data or len(data) > MAX_IMAGE_BYTES:
            problems.append(problem(["rows", i, col], f"base64 photo {k}: {len(data)} bytes; a photo must have 1 to "
                                    f"{MAX_IMAGE_BYTES} bytes", "base64_size"))
            return None
        name = f"{UPLOADS}/row{i}-{len(self.uploads)}"  # unique in the request; the cell it came from is kept
        Path(self.folder(), name).write_bytes(data)
        self.uploads[name] = (i, col)
        return name

    def root_for_request(self, frame: pd.DataFrame, columns: list[str]) -> Path:
        """The configured root when there are no uploads; else the request folder, the path photos linked
        into it under root/ (the cells rewritten to match)."""
        if self.tmp is None and self.root is not None:
            return self.root
        # uploads, or no --images-root at all (an empty request folder: no photo is ever read from it)
        self.folder()
        assert self.tmp is not None and (self.root is not None or not self.paths)
        for rel in self.paths:
            dest = Path(self.tmp.name, FROM_ROOT, rel)
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = os.path.realpath(Path(self.root, rel))  # checked inside the root above
                try:
                    os.link(src, dest)
                except OSError:  # another filesystem, or no permission to link: a copy reads the same
                    try:
                        shutil.copyfile(src, dest)
                    except FileNotFoundError:
                        continue  # the predictor names the missing file
        if self.paths:
            for col in columns:
                frame[col] = frame[col].map(lambda cell: IMAGE_SEPARATOR.join(
                    p if p in self.uploads else f"{FROM_ROOT}/{p}" for p in split_images(cell)))
        return Path(self.tmp.name)


def request_rows(rows: list[Any], schema: DatasetSchema, images_root: Path | None) -> RequestRows:
    """Check every row against the schema and build the frame; RequestError 422 lists every problem."""
    needed = [c for c in schema.required_features if c != schema.id]
    role = schema.role_of
    images = _Images(images_root)
    problems: list[dict[str, Any]] = []
    clean: list[dict[str, Any]] = []
    try:
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                problems.append(problem(["rows", i], f"a row must be an object (column -> value), not a JSON "
                                        f"{type(row).__name__}", "object_expected"))
                continue
            for col in needed:
                if col not in row:
                    problems.append(problem(["rows", i, col], f"missing: every row needs the columns {needed} "
                                            "(null for an empty value)", "missing"))
            out = dict(row)
            for col, value in row.items():
                if role.get(col) == "image":
                    out[col] = images.cell(value, i, col, problems)
                elif (why := _scalar_problem(value, role.get(col, ""))) is not None:
                    problems.append(problem(["rows", i, col], why, "wrong_type"))
            clean.append(out)
        if problems:
            raise RequestError(422, problems)
        frame = pd.DataFrame(clean, index=pd.RangeIndex(len(clean)))
        for col in schema.columns.text:  # as read_rows_csv: an empty text is "", numbers become their text
            if col in frame.columns:
                frame[col] = frame[col].fillna("").astype(str)
        image_columns = [c for c in schema.columns.image if c in frame.columns]
        root = images.root_for_request(frame, image_columns)
    except BaseException:
        if images.tmp is not None:
            images.tmp.cleanup()
        raise
    return RequestRows(frame=frame, images_root=root, uploads=images.uploads, _tmp=images.tmp)
