"""Write a safetensors file one tensor at a time, straight from byte ranges of other files.

The format is an 8-byte little-endian header length, a JSON header naming every tensor's dtype, shape and
byte range, then the raw little-endian bytes. All shapes are known before any data is read, so the header
goes first and each tensor's bytes follow, copied through one reusable buffer: memory stays at the buffer
size (plus small casts of non-fp32 buffers), never a multiple of the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tasks.convert.zero_layout import Piece, TensorPlan

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
CHUNK_BYTES = 16 << 20


@dataclass
class WriteResult:
    sha256: str
    data_bytes: int
    file_bytes: int
    non_finite: list[str] = field(default_factory=list)


def header_bytes(plans: Iterable[TensorPlan], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for plan in plans:
        header[plan.name] = {
            "dtype": SAFETENSORS_DTYPES[plan.dtype],
            "shape": list(plan.shape),
            "data_offsets": [offset, offset + plan.nbytes],
        }
        offset += plan.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw


def _read_into(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise EOFError(f"unexpected end of file at byte {offset + done}")
        done += n


class _Sources:
    """Read-only descriptors of the shard files, opened once each."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        if path not in self._fds:
            self._fds[path] = os.open(path, os.O_RDONLY)
        return self._fds[path]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        view = view[os.write(fd, view):]


def _all_finite(values: torch.Tensor) -> bool:
    """NaN and inf propagate through a sum, so a finite sum proves every element finite in one cheap pass;
    only a non-finite sum (or an overflow of large finite values) needs the exact element-wise check."""
    if bool(torch.isfinite(values.sum())):
        return True
    return bool(values.isfinite().all())


def _stream_piece(sources: _Sources, piece: Piece, out_fd: int, buf: memoryview, digest, finite: list[bool]) -> None:
    """Copy one piece unchanged (same dtype in and out), hashing and checking for NaN/inf on the way."""
    item = piece.nbytes // max(piece.numel, 1)
    step = (len(buf) // item) * item
    done = 0
    while done < piece.nbytes:
        n = min(step, piece.nbytes - done)
        view = buf[:n]
        _read_into(sources.fd(piece.file), view, piece.offset + done)
        if piece.dtype.is_floating_point and finite[0]:
            finite[0] = _all_finite(torch.frombuffer(view, dtype=piece.dtype))
        digest.update(view)
        _write_all(out_fd, view)
        done += n


def _cast_pieces(sources: _Sources, plan: TensorPlan) -> bytes:
    """Small tensors stored in another dtype (bf16 buffers): read, cast to the output dtype, return bytes."""
    chunks = []
    for piece in plan.pieces:
        raw = bytearray(piece.nbytes)
        _read_into(sources.fd(piece.file), memoryview(raw), piece.offset)
        chunks.append(torch.frombuffer(raw, dtype=piece.dtype) if piece.numel else torch.empty(0, dtype=piece.dtype))
    return torch.cat(chunks).to(plan.dtype).numpy().tobytes()


def write_safetensors(
    path: Path,
    plans: list[TensorPlan],
    metadata: dict[str, str],
    on_tensor: Callable[[int, TensorPlan], None] | None = None,
) -> WriteResult:
    """Write `plans` to `path` (created exclusively) and fsync it; returns the file's sha256.

    `on_tensor(i, plan)` runs after tensor i's bytes are written (progress, tests).
    """
    head = header_bytes(plans, metadata)
    digest = hashlib.sha256(head)
    buf = memoryview(bytearray(CHUNK_BYTES))
    sources = _Sources()
    non_finite: list[str] = []
    out_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        _write_all(out_fd, memoryview(head))
        for i, plan in enumerate(plans):
            finite = [True]
            if all(p.dtype == plan.dtype for p in plan.pieces):
                for piece in plan.pieces:
                    _stream_piece(sources, piece, out_fd, buf, digest, finite)
            else:
                data = _cast_pieces(sources, plan)
                if plan.dtype.is_floating_point and data:
                    finite[0] = _all_finite(torch.frombuffer(bytearray(data), dtype=plan.dtype))
                digest.update(data)
                _write_all(out_fd, memoryview(data))
            if not finite[0]:
                non_finite.append(plan.name)
            if on_tensor is not None:
                on_tensor(i, plan)
        os.fsync(out_fd)
    finally:
        os.close(out_fd)
        sources.close()
    data_bytes = sum(p.nbytes for p in plans)
    return WriteResult(digest.hexdigest(), data_bytes, len(head) + data_bytes, non_finite)
