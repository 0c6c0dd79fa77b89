"""Download stage: put the PetFinder tutorial layout under ``out_dir`` (default ``data/raw/``), atomically.

``source: synthetic`` writes the embedded, seeded dataset offline; ``source: url`` streams the tutorial
zip (optional pinned sha256, retries on transient failures only) and extracts it with every member
checked. Either way the new tree is built in a staging folder beside ``out_dir`` and swapped in by
renames only when complete, so ``out_dir`` is never half-written and a failed run leaves the
previous one in place. ``manifest.json`` records the source, hashes, row counts and label counts, with
no timestamps: the same input gives the same bytes (DVC sees no change).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel

from fusion_model import schema
from tasks._io.files import write_json
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks._io.hashing import file_hashes, fingerprint
from tasks.download.local import from_local
from tasks.download.synthetic import generate
from tasks.download.url import from_url
from tasks.errors import StageError
from tasks.params import DownloadParams

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
        elif p.source == "local":
            origin = from_local(p.local, new)
        else:
            origin = from_url(p, staging, new)
        dataset = new / schema.DATASET_DIRNAME
        files = file_hashes(dataset)
        counts = _counts(dataset)
        manifest = {
            **origin,
            # The archive's hash for a download, else a fingerprint of every generated file.
            "sha256": origin.get("archive_sha256") or fingerprint(files),
            "dataset_dir": schema.DATASET_DIRNAME,
            **counts,
            "files": files,  # last: thousands of lines
        }
        write_json(new / MANIFEST, manifest)
        swap_dir(new, out_dir)
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


