"""data/raw/manifest.json: what the download stage's dataset folder holds (every file's sha256, row and label
counts) and where it came from. No timestamps: the same input, the same bytes. Only the download stage
writes it; the intake stage reads it and describes its own folder (the base plus the batches taken in)
with the same `describe`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from tasks._io.files import read_json, write_json
from tasks._io.hashing import file_hashes, fingerprint
from tasks.errors import StageError

MANIFEST = "manifest.json"
SPLITS = ("train", "test")
# The dataset folder inside out_dir (data/raw/dataset): train.csv, test.csv, the photos, holdout/.
DATASET_DIRNAME = "dataset"


def counts(dataset: Path, label: str) -> dict[str, Any]:
    """Rows and label counts of train.csv and test.csv."""
    rows: dict[str, int] = {}
    labels: dict[str, dict[str, int]] = {}
    for split in SPLITS:
        path = dataset / f"{split}.csv"
        try:
            frame = pd.read_csv(path, index_col=0, keep_default_na=False, low_memory=False)
        except (pd.errors.ParserError, UnicodeDecodeError, pd.errors.EmptyDataError) as e:
            raise StageError(f"{path}: not a readable CSV ({e}); the download is damaged, run the stage again.") from None
        rows[split] = len(frame)
        if label in frame.columns:  # validation reports a missing label; here we only count
            values = frame[label].astype(str).value_counts()
            labels[split] = {k: int(values[k]) for k in sorted(values.index)}
    return {"rows": rows, "label_counts": labels}


def describe(root: Path, label: str, batches: list[dict[str, Any]] | None = None, archive_sha256: str | None = None
             ) -> dict[str, Any]:
    """A manifest's description of `root/<dataset dir>`: every file's hash, a fingerprint, the counts, and
    with `batches` the arriving batches it holds (the intake stage's folder; the download's holds none)."""
    dataset = root / DATASET_DIRNAME
    files = file_hashes(dataset)
    return {
        # The archive's hash for an untouched download, else a fingerprint of every file.
        "sha256": (archive_sha256 if not batches else None) or fingerprint(files),
        "dataset_dir": DATASET_DIRNAME,
        "label": label,
        **counts(dataset, label),
        **({"batches": batches} if batches is not None else {}),
        "files": files,  # last: thousands of lines
    }


def write_manifest(root: Path, origin: dict[str, Any], base: dict[str, Any], label: str) -> dict[str, Any]:
    """`root/manifest.json` of a freshly built base dataset. `origin`: where it came from (source, url,
    hashes, decisions); `base`: what makes it (the params and the declared table)."""
    manifest = {**origin, "base": base, **describe(root, label, archive_sha256=origin.get("archive_sha256"))}
    write_json(root / MANIFEST, manifest)
    return manifest


def read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / MANIFEST
    return read_json(path, "Run the download stage again to rewrite it.") if path.is_file() else None
