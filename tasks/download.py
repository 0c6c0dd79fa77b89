"""Download stage: put the PetFinder tutorial layout under ``out_dir`` (default ``data/raw/``), atomically.

``source: synthetic`` writes the embedded, seeded dataset offline; ``source: url`` streams the tutorial
zip (optional pinned sha256, retries on transient failures only) and extracts it with every member
checked. Either way the new tree is built in a staging folder beside ``out_dir`` and swapped in by
renames only when complete, so ``out_dir`` is never half-written and a failed run leaves the
previous one in place. ``manifest.json`` records the source, hashes, row counts and label counts, with
no timestamps: the same input gives the same bytes (DVC sees no change).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel

from fusion_model import schema
from tasks.atomic import recover_dir, temp_dir_beside
from tasks.errors import StageError
from tasks.http_fetch import fetch
from tasks.params import DownloadParams
from tasks.safe_zip import safe_extract
from tasks.synthetic import generate

MANIFEST = "manifest.json"


class DownloadSummary(BaseModel):
    source: str
    out_dir: str
    dataset_dir: str
    sha256: str
    rows: dict[str, int]
    label_counts: dict[str, dict[str, int]]
    files: int
    seconds: float
    url: str | None = None
    attempts: int | None = None


def download(p: DownloadParams) -> DownloadSummary:
    """Write ``p.out_dir`` (dataset folder + manifest.json) from the configured source, all or nothing."""
    start = time.perf_counter()
    out_dir = Path(p.out_dir)
    recover_dir(out_dir)  # an earlier run killed mid-swap: put its previous tree back, drop its leftovers
    # Beside out_dir, so the final swap stays on one filesystem (renames, never copies).
    staging = temp_dir_beside(out_dir, "incoming")
    try:
        new = staging / "new"
        new.mkdir()
        if p.source == "synthetic":
            generate(new, p.synthetic)
            origin: dict[str, Any] = {"source": "synthetic", "synthetic": p.synthetic.model_dump(mode="json")}
        else:
            origin = _from_url(p, staging, new)
        dataset = new / schema.DATASET_DIRNAME
        files = _file_hashes(dataset)
        counts = _counts(dataset)
        manifest = {
            **origin,
            # The archive's hash for a download, else a fingerprint of every generated file.
            "sha256": origin.get("archive_sha256") or _fingerprint(files),
            "dataset_dir": schema.DATASET_DIRNAME,
            **counts,
            "files": files,  # last: thousands of lines
        }
        (new / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        # One flush for the whole tree before it becomes visible: fsync per file costs ~3 ms a file here,
        # 20 s for the default dataset.
        os.sync()
        _swap_in(new, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return DownloadSummary(
        source=p.source,
        out_dir=str(out_dir),
        dataset_dir=str(out_dir / schema.DATASET_DIRNAME),
        sha256=manifest["sha256"],
        rows=counts["rows"],
        label_counts=counts["label_counts"],
        files=len(files),
        seconds=round(time.perf_counter() - start, 3),
        url=origin.get("url"),
        attempts=origin.get("attempts"),
    )


def _from_url(p: DownloadParams, staging: Path, new: Path) -> dict[str, Any]:
    part = staging / "archive.zip.part"
    got = fetch(p.url, part, timeout_s=p.timeout_s, max_attempts=p.max_attempts, backoff_s=p.backoff_s)
    if p.sha256 and got.sha256 != p.sha256.lower():
        raise StageError(
            f"GET {p.url}: sha256 {got.sha256} does not match the pinned download.sha256 {p.sha256.lower()} "
            f"({got.bytes} bytes); nothing was written. The file changed upstream or was damaged in transit: "
            "run again, or if the new file is trusted, pin its sha256 in params.yaml."
        )
    archive = part.with_suffix("")  # complete and verified: only now does it look like a zip
    os.replace(part, archive)
    unpacked = staging / "unpacked"
    members = safe_extract(archive, unpacked)
    dataset = unpacked / schema.DATASET_DIRNAME
    missing = [f for f in ("train.csv", "test.csv") if not (dataset / f).is_file()]
    if missing:
        raise StageError(
            f"{p.url}: the archive has no {', '.join(f'{schema.DATASET_DIRNAME}/{m}' for m in missing)} "
            f"(first members: {members[:5]}); it is not the PetFinder tutorial layout. Check download.url."
        )
    os.replace(dataset, new / schema.DATASET_DIRNAME)
    return {"source": "url", "url": p.url, "archive_sha256": got.sha256, "archive_bytes": got.bytes,
            "sha256_pinned": bool(p.sha256), "attempts": got.attempts}


def _swap_in(new: Path, target: Path) -> None:
    """Make `new` appear at `target` by two renames; the old tree is deleted only after that.

    The backup is named as `tasks.atomic` names it, so `recover_dir` restores it after a crash in between.
    """
    backup = None
    if target.exists():
        backup = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, backup)
    try:
        os.rename(new, target)
    except OSError:
        if backup is not None:
            os.rename(backup, target)
        raise
    if backup is not None:
        shutil.rmtree(backup)


def _counts(dataset: Path) -> dict[str, Any]:
    rows: dict[str, int] = {}
    labels: dict[str, dict[str, int]] = {}
    for split in ("train", "test"):
        path = dataset / f"{split}.csv"
        try:
            frame = pd.read_csv(path, index_col=0, keep_default_na=False, low_memory=False)
        except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as e:
            raise StageError(f"{path}: not a readable CSV ({e}); the download is damaged, run the stage again.") from None
        rows[split] = len(frame)
        if schema.LABEL in frame.columns:  # validation reports a missing label; here we only count
            counts = frame[schema.LABEL].astype(str).value_counts()
            labels[split] = {k: int(counts[k]) for k in sorted(counts.index)}
    return {"rows": rows, "label_counts": labels}


def _file_hashes(dataset: Path) -> dict[str, str]:
    """sha256 of every file, keyed by its POSIX path relative to the dataset folder, sorted."""
    out = {}
    for path in sorted(p for p in dataset.rglob("*") if p.is_file()):
        out[path.relative_to(dataset).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def _fingerprint(files: dict[str, str]) -> str:
    return hashlib.sha256("".join(f"{h}  {name}\n" for name, h in files.items()).encode()).hexdigest()
