"""data/raw/manifest.json: what the dataset folder holds (every file's sha256, row and label counts), where
its base came from, and the arriving batches it took in. No timestamps: the same input, the same bytes."""

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


def describe(root: Path, label: str, batches: list[dict[str, Any]], archive_sha256: str | None = None
             ) -> dict[str, Any]:
    """The manifest's description of `root/<dataset dir>`: every file's hash, a fingerprint, the counts."""
    dataset = root / DATASET_DIRNAME
    files = file_hashes(dataset)
    return {
        # The archive's hash for an untouched download, else a fingerprint of every file.
        "sha256": (archive_sha256 if not batches else None) or fingerprint(files),
        "dataset_dir": DATASET_DIRNAME,
        "label": label,
        **counts(dataset, label),
        "batches": batches,
        "files": files,  # last: thousands of lines
    }


def write_manifest(root: Path, origin: dict[str, Any], base: dict[str, Any], label: str) -> dict[str, Any]:
    """`root/manifest.json` of a freshly built base dataset. `origin`: where it came from (source, url,
    hashes, decisions); `base`: what makes it (compared to decide whether accumulated data is kept)."""
    manifest = {**origin, "base": base, **describe(root, label, [], origin.get("archive_sha256"))}
    write_json(root / MANIFEST, manifest)
    return manifest


def add_batch(root: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Rewrite `root/manifest.json` after a batch joined the dataset in `root`."""
    manifest = read_json(root / MANIFEST, "Run the download stage again to rewrite it.")
    manifest.update(describe(root, manifest["label"], [*manifest.get("batches", []), record]))
    write_json(root / MANIFEST, manifest)
    return manifest


def read_manifest(root: Path) -> dict[str, Any] | None:
    path = root / MANIFEST
    return read_json(path, "Run the download stage again to rewrite it.") if path.is_file() else None
