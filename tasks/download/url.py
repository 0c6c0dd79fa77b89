"""The `url` source: stream the PetFinder tutorial zip (optional pinned sha256), check every member, extract it.

The archive holds `petfinder_for_tutorial/{train.csv,test.csv,images/}`; that folder becomes the dataset
folder (data/raw/dataset)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tasks._io.http import fetch
from tasks._io.safe_zip import safe_extract
from tasks.download.manifest import DATASET_DIRNAME
from tasks.errors import StageError
from tasks.params import DownloadParams

ARCHIVE_DIRNAME = "petfinder_for_tutorial"  # the dataset folder inside the tutorial zip


def from_url(p: DownloadParams, staging: Path, new: Path) -> dict[str, Any]:
    """Download `p.url` into `staging`, put its dataset folder at `new/<dataset dir>`; returns the origin record."""
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
    dataset = unpacked / ARCHIVE_DIRNAME
    missing = [f for f in ("train.csv", "test.csv") if not (dataset / f).is_file()]
    if missing:
        raise StageError(
            f"{p.url}: the archive has no {', '.join(f'{ARCHIVE_DIRNAME}/{m}' for m in missing)} "
            f"(first members: {members[:5]}); it is not the PetFinder tutorial layout. Check download.url."
        )
    os.replace(dataset, new / DATASET_DIRNAME)
    return {"source": "url", "url": p.url, "archive_sha256": got.sha256, "archive_bytes": got.bytes,
            "sha256_pinned": bool(p.sha256), "attempts": got.attempts}
