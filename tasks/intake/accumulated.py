"""The intake stage's own folder (`intake.out_dir`, data/accumulated): the download stage's dataset plus every
batch taken in, which validate reads (`validate.dataset_dir`: data/accumulated/dataset).

```
data/raw/ (download's, read only here) ─> data/accumulated/dataset/  train.csv + the batches' training shares,
  dataset/ + manifest.json                                            test.csv, photos, holdout/batch-<N>.csv
                                           data/accumulated/manifest.json  base (download's manifest sha256),
                                                                           files, counts, batches
```

- Only the intake stage writes here, and it never writes into the download stage's folder: download's
  manifest.json stays byte for byte what download wrote, so `dvc status` tells the truth about both stages.
- The folder is built on the download's data by hard links (no second copy of the photos) and kept while
  that data is the same (the download manifest's `sha256`, of the archive or of every file); when download
  rebuilt a different base, the folder is built again from it and the batches the ledger took in are taken
  in again from the feed (tasks/intake/stage.py).
- Its manifest.json is the download's description of a dataset folder (`describe`: every file's sha256,
  row and label counts) with `base` (the download manifest it was built on) and `batches` (each batch taken
  in: name, sha256, status, replaced ids, overrides, drift verdict). No timestamps: the same batches on the
  same base give the same bytes.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from tasks._io.files import read_json, write_json
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks.download.manifest import DATASET_DIRNAME, describe, read_manifest
from tasks.errors import StageError

MANIFEST = "manifest.json"
_FIX = "Delete the folder and run `python -m tasks intake` again: it is rebuilt from the download stage's data."


def read_accumulated(out_dir: Path) -> dict[str, Any] | None:
    """The intake folder's manifest, or None before the intake stage first ran."""
    path = Path(out_dir) / MANIFEST
    return read_json(path, _FIX) if path.is_file() and (Path(out_dir) / DATASET_DIRNAME).is_dir() else None


def build_on_base(download_dir: Path, out_dir: Path, label: str) -> dict[str, Any]:
    """`out_dir` on the download stage's current data: kept as it is when built on that data already, else
    built again from it (the batches it held dropped: the caller takes them in again). Returns its manifest."""
    download_dir, out_dir = Path(download_dir), Path(out_dir)
    if out_dir.resolve() == download_dir.resolve():
        raise StageError(f"intake.out_dir {out_dir} is download.out_dir: the intake stage writes a folder of its own "
                         "beside the download's. Fix: set intake.out_dir to another folder (default data/accumulated)")
    base = read_manifest(download_dir) if (download_dir / DATASET_DIRNAME / "train.csv").is_file() else None
    if base is None:
        raise StageError(f"{download_dir / DATASET_DIRNAME / 'train.csv'}: no downloaded dataset to take batches into "
                         f"(or no {download_dir / MANIFEST} beside it); run `python -m tasks download` first (the "
                         "base dataset).")
    built_on = {"manifest": (download_dir / MANIFEST).as_posix(), "sha256": base["sha256"]}
    recover_dir(out_dir)  # an earlier run killed mid-swap: its previous tree back
    current = read_accumulated(out_dir)
    if current is not None and current.get("base", {}).get("sha256") == built_on["sha256"]:
        return current
    staged = temp_dir_beside(out_dir)
    try:
        shutil.copytree(download_dir / DATASET_DIRNAME, staged / DATASET_DIRNAME, copy_function=_link)
        manifest = {"base": built_on, **describe(staged, label, [])}
        write_json(staged / MANIFEST, manifest)
        swap_dir(staged, out_dir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return manifest


def record_batch(root: Path, record: dict[str, Any]) -> dict[str, Any]:
    """Rewrite `root/manifest.json` after a batch joined the dataset in `root` (a staged copy of the folder)."""
    manifest = read_json(root / MANIFEST, _FIX)
    manifest.update(describe(root, manifest["label"], [*manifest.get("batches", []), record]))
    write_json(root / MANIFEST, manifest)
    return manifest


def _link(src: str, dest: str) -> None:
    """Hard-link a file of the download's data (never written in place by either stage); copy across devices."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copy2(src, dest)
