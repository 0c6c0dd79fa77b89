"""Write a safetensors file one tensor at a time, straight from byte ranges of other files.

The format is an 8-byte little-endian header length, a JSON header naming every tensor's dtype, shape and
byte range, then the raw little-endian bytes. All shapes are known before any data is read, so the header
goes first and each tensor's bytes follow, copied through a few reusable buffers: memory stays at their size
(plus small casts of non-fp32 buffers), never a multiple of the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tasks.convert.zero_layout import Piece, TensorPlan

SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
CHUNK_BYTES = 8 << 20
RING = 4  # buffers in flight: read, hashed, written, and one spare


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


def _chunks(sources: _Sources, piece: Piece, take: Callable[[], memoryview]):
    """Read one piece into buffers from `take()` (whole elements per chunk), yielding each filled view."""
    item = piece.nbytes // max(piece.numel, 1)
    done = 0
    while done < piece.nbytes:
        buf = take()
        n = min((len(buf) // item) * item, piece.nbytes - done)
        view = buf[:n]
        _read_into(sources.fd(piece.file), view, piece.offset + done)
        yield view
        done += n


def _cast_pieces(sources: _Sources, plan: TensorPlan) -> bytes:
    """Small tensors stored in another dtype (bf16 buffers): read, cast to the output dtype, return bytes."""
    chunks = []
    for piece in plan.pieces:
        raw = bytearray(piece.nbytes)
        _read_into(sources.fd(piece.file), memoryview(raw), piece.offset)
        chunks.append(torch.frombuffer(raw, dtype=piece.dtype) if piece.numel else torch.empty(0, dtype=piece.dtype))
    return torch.cat(chunks).to(plan.dtype).numpy().tobytes()


def output_sha256(plans: list[TensorPlan], metadata: dict[str, str]) -> str:
    """The sha256 the file `write_safetensors(path, plans, metadata)` would have, reading the same byte ranges
    without writing anything: whether an existing output already holds exactly what the source would give."""
    digest = hashlib.sha256(header_bytes(plans, metadata))
    buf = memoryview(bytearray(CHUNK_BYTES))
    sources = _Sources()
    try:
        for plan in plans:
            if not all(p.dtype == plan.dtype for p in plan.pieces):
                digest.update(_cast_pieces(sources, plan))
                continue
            for piece in plan.pieces:
                done = 0
                while done < piece.nbytes:
                    view = buf[: min(len(buf), piece.nbytes - done)]
                    _read_into(sources.fd(piece.file), view, piece.offset + done)
                    digest.update(view)
                    done += len(view)
    finally:
        sources.close()
    return digest.hexdigest()


def write_safetensors(
    path: Path,
    plans: list[TensorPlan],
    metadata: dict[str, str],
    on_tensor: Callable[[int, TensorPlan], None] | None = None,
) -> WriteResult:
    """Write `plans` to `path` (created exclusively) and fsync it; returns the file's sha256.

    A pipeline over a few buffers: this thread reads each chunk and checks it is finite while one thread
    hashes the chunks and another writes them, each in stream order (the reads, the hashing and the writes
    release the interpreter, so they overlap on separate cores). `on_tensor(i, plan)` runs after tensor i's
    bytes are written (progress, tests), in the writing thread.
    """
    head = header_bytes(plans, metadata)
    digest = hashlib.sha256(head)
    ring = [memoryview(bytearray(CHUNK_BYTES)) for _ in range(RING)]
    pending: list[list[Future]] = [[] for _ in range(RING)]  # each buffer's hash and write, until reused
    turn = [0]
    others: list[Future] = []  # callbacks and the jobs of cast tensors (no buffer of the ring)
    sources = _Sources()
    non_finite: list[str] = []
    out_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    hashing, writing = ThreadPoolExecutor(1), ThreadPoolExecutor(1)  # one worker each: stream order

    def take() -> memoryview:
        slot = turn[0] % RING
        for done in pending[slot]:
            done.result()  # that buffer's previous chunk is hashed and written (or its error raised here)
        pending[slot] = []
        turn[0] += 1
        return ring[slot]

    def send(data: memoryview | bytes, slot: int | None) -> None:
        jobs = [hashing.submit(digest.update, data), writing.submit(_write_all, out_fd, memoryview(data))]
        if slot is not None:
            pending[slot] = jobs
        else:  # bytes of its own (a cast tensor): nothing to recycle, but its errors still count
            others.extend(jobs)

    try:
        writing.submit(_write_all, out_fd, memoryview(head)).result()
        for i, plan in enumerate(plans):
            finite = True
            if all(p.dtype == plan.dtype for p in plan.pieces):
                for piece in plan.pieces:
                    for view in _chunks(sources, piece, take):
                        if piece.dtype.is_floating_point and finite:
                            finite = _all_finite(torch.frombuffer(view, dtype=piece.dtype))
                        send(view, (turn[0] - 1) % RING)
            else:
                data = _cast_pieces(sources, plan)
                if plan.dtype.is_floating_point and data:
                    finite = _all_finite(torch.frombuffer(bytearray(data), dtype=plan.dtype))
                send(data, None)
            if not finite:
                non_finite.append(plan.name)
            if on_tensor is not None:
                others.append(writing.submit(on_tensor, i, plan))
        for job in (hashing.submit(lambda: None), writing.submit(os.fsync, out_fd)):
            job.result()
        for job in [*(j for jobs in pending for j in jobs), *others]:
            job.result()  # an error of any chunk's hash or write, or of a callback
    finally:
        hashing.shutdown(wait=True, cancel_futures=True)
        writing.shutdown(wait=True, cancel_futures=True)
        os.close(out_fd)
        sources.close()
    data_bytes = sum(p.nbytes for p in plans)
    return WriteResult(digest.hexdigest(), data_bytes, len(head) + data_bytes, non_finite)
