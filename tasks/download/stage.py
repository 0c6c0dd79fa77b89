"""Download stage: put the dataset folder under ``out_dir`` (default ``data/raw/dataset``), atomically.

``source: synthetic`` writes the embedded, seeded PetFinder table offline; ``source: url`` streams the
PetFinder tutorial zip (optional pinned sha256, retries on transient failures only) and extracts it with
every member checked; ``source: local`` rewrites a table on disk declared by params.yaml ``dataset:``. Either way the new tree is built in a staging folder beside ``out_dir`` and swapped in by
renames only when complete, so ``out_dir`` is never half-written and a failed run leaves the
previous one in place. ``manifest.json`` records the source, hashes, row counts and label counts, with
no timestamps: the same input gives the same bytes (DVC sees no change). A run that would rebuild the very
same tree (the embedded table with the same keys, or a URL whose pinned sha256 the tree was extracted from,
every file as the manifest hashed it) keeps it and fetches nothing: a nightly run does not download the
same archive every night. Only this stage writes ``out_dir``: arriving batches join the intake stage's own
folder (``intake.out_dir``), built on this one.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fusion_model.dataset import DatasetSchema, resolve_schema
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks._io.hashing import file_hashes
from tasks.download.local import from_local
from tasks.download.manifest import DATASET_DIRNAME, read_manifest, write_manifest
from tasks.download.synthetic import generate
from tasks.download.url import from_url
from tasks.errors import StageError
from tasks.params import FEED_KEYS, DownloadParams


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
    up_to_date: bool = False  # the tree on disk was already this source's: kept, nothing fetched or rewritten


def download(p: DownloadParams, dataset: DatasetSchema | None = None) -> DownloadSummary:
    """Write ``p.out_dir`` (dataset folder + manifest.json) from the configured source, all or nothing.
    Arriving batches are the intake stage's (tasks/intake), in its own folder. `dataset`: the declared table
    (default: the PetFinder preset)."""
    start = time.perf_counter()
    schema = dataset or resolve_schema({"preset": "petfinder"})
    out_dir = Path(p.out_dir)
    recover_dir(out_dir)  # an earlier run killed mid-swap: put its previous tree back, drop its leftovers
    kept = up_to_date(p, out_dir, schema)
    origin = kept if kept is not None else _build_base(p, out_dir, schema)
    manifest = kept if kept is not None else (read_manifest(out_dir) or {})  # a kept tree's was just read
    return DownloadSummary(
        source=p.source,
        out_dir=str(out_dir),
        dataset_dir=str(out_dir / DATASET_DIRNAME),
        sha256=manifest["sha256"],
        rows=manifest["rows"],
        label_counts=manifest["label_counts"],
        files=len(manifest["files"]),
        seconds=round(time.perf_counter() - start, 3),
        url=origin.get("url"),
        attempts=0 if kept is not None else origin.get("attempts"),
        up_to_date=kept is not None,
    )


def up_to_date(p: DownloadParams, out_dir: Path, schema: DatasetSchema) -> dict[str, Any] | None:
    """The manifest of `out_dir` when this run would rebuild the same bytes, else None: the same base (the
    params and the declared table), for `url` a pinned sha256 the tree came from, and every file as the
    manifest hashed it (a changed or missing file rebuilds). `local` tables and unpinned URLs may change
    without their params changing: they are always read again."""
    if p.source == "local" or (p.source == "url" and not p.sha256):
        return None
    try:
        manifest = read_manifest(out_dir)
    except StageError:  # unreadable: rebuilt
        return None
    if not manifest or manifest.get("base") != base_origin(p, schema):
        return None
    if p.source == "url" and manifest.get("archive_sha256") != (p.sha256 or "").lower():
        return None
    dataset = out_dir / DATASET_DIRNAME
    if not dataset.is_dir() or file_hashes(dataset) != manifest.get("files"):
        return None
    return manifest


def base_origin(p: DownloadParams, schema: DatasetSchema) -> dict[str, Any]:
    """What the base dataset is made from (the feed keys of arriving batches left out)."""
    declared = {"dataset": schema.model_dump(mode="json")}
    if p.source == "synthetic":
        return {"source": "synthetic", "synthetic": p.synthetic.model_dump(mode="json", exclude=FEED_KEYS), **declared}
    if p.source == "local":
        return {"source": "local", "local": p.local.model_dump(mode="json"), **declared}
    return {"source": "url", "url": p.url, "sha256": p.sha256, **declared}


def _petfinder_only(p: DownloadParams, schema: DatasetSchema) -> None:
    if schema.preset != "petfinder":
        what = "the embedded dataset" if p.source == "synthetic" else "download.url (the tutorial zip)"
        raise StageError(
            f"download.source {p.source}: {what} is the PetFinder table, but dataset.preset is "
            f"{schema.preset!r}. Fix: set download.source: local with download.local.path at your table, or "
            "dataset.preset: petfinder")


def _build_base(p: DownloadParams, out_dir: Path, schema: DatasetSchema) -> dict[str, Any]:
    """The base dataset from its source, in a staging folder beside out_dir, swapped in whole."""
    if p.source != "local":
        _petfinder_only(p, schema)
    # Beside out_dir, so the final swap stays on one filesystem (renames, never copies).
    staging = temp_dir_beside(out_dir, "incoming")
    try:
        new = staging / "new"
        new.mkdir()
        if p.source == "synthetic":
            try:
                generate(new, p.synthetic, schema.label.problem_type)
            except ValueError as e:
                raise StageError(f"download.source synthetic: {e}") from None
            # the feed's keys (which batch arrives next) are the intake's: the base's manifest never names them
            origin: dict[str, Any] = {"source": "synthetic",
                                      "synthetic": p.synthetic.model_dump(mode="json", exclude=FEED_KEYS)}
        elif p.source == "local":
            origin = from_local(p.local, new, schema)
        else:
            origin = from_url(p, staging, new)
        write_manifest(new, origin, base_origin(p, schema), schema.label.column)
        swap_dir(new, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return origin
