"""The `local` source: real PetFinder files on disk, rewritten into the tutorial layout validation reads.

`download.local.path` is a folder or one CSV. Layouts (`layout: auto` tells them by the `Images` column):
- tutorial: train.csv (+ test.csv) with `Images` (';'-separated `images/<file>` paths); the photos the kept
  rows name are linked or copied into the new `images/`, the CSV cells kept as they are;
- kaggle: train.csv without `Images`, photos at `train_images/<PetID>-<n>.jpg`; `Images` is derived from
  the photos actually present (n in numeric order), empty for a row with none (PhotoAmt 0 or not found).
Kaggle's test.csv has no labels, so it cannot be the test set: without a labelled test.csv the labelled
rows are split (scikit-learn `train_test_split`, stratified by the label, seeded).

Labels: a file holding only 0/1 is taken as binary and kept (`source_labels: auto`); otherwise its cells
are AdoptionSpeed codes 0-4, kept for `label_kind: multiclass` and, for `binary`, mapped
`code <= fast_max_speed` (default 2: adopted within 30 days) -> 1 fast, else 0 slow.

Output: `<new>/petfinder_for_tutorial/{train.csv,test.csv,images/}`, CSVs with the leading unnamed index
column (the input's row ids), the schema columns in `ALL_COLUMNS` order, "\\n" line ends; the same input
gives the same bytes. The returned origin record (source, inputs' sha256, label rule, split, images, every
decision) goes into manifest.json (tasks/download/stage.py).
"""

from __future__ import annotations

import os
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np
from sklearn.model_selection import train_test_split

from fusion_model import schema
from tasks._io.files import write_text
from tasks._io.hashing import sha256_file
from tasks.download.local_table import (
    Decisions,
    Table,
    check_columns,
    check_pet_ids,
    label_codes,
    read_table,
    spreadsheet_rows,
)
from tasks.errors import StageError
from tasks.params import LocalParams

_PHOTO = re.compile(r"([0-9a-f]{9})-([1-9][0-9]*)\.jpg")
_SPEEDS = frozenset(range(5))


@dataclass
class Source:
    root: Path  # the folder the CSVs (and tutorial image paths) are relative to
    train: Path
    test: Path | None
    layout: str
    detected_by: str
    images_dir: Path | None  # tutorial: what `images/` in the paths means; kaggle: train photos
    test_images_dir: Path | None


def from_local(p: LocalParams, new: Path) -> dict[str, Any]:
    """Write `new/<dataset dir>` from `p.path`; return the origin record for manifest.json."""
    src = _locate(p)
    decisions = Decisions()
    inputs = {_name(src, src.train): sha256_file(src.train)}
    train = read_table(_name(src, src.train), src.train, p, decisions)
    test = None
    if src.test is not None:
        inputs[_name(src, src.test)] = sha256_file(src.test)
        test = read_table(_name(src, src.test), src.test, p, decisions)
        if schema.LABEL not in test.cells.columns or not test.cells[schema.LABEL].str.strip().ne("").any():
            decisions.add(test.name, "unlabelled_test", f"not used: no {schema.LABEL} labels (as Kaggle's test.csv); "
                          f"the test set is split from {train.name}")
            test = None

    required = tuple(c for c in schema.REQUIRED_COLUMNS if c != schema.IMAGES or src.layout == "tutorial")
    tables = [t for t in (train, test) if t is not None]
    for t in tables:
        check_columns(t, (*required, "PetID") if src.layout == "kaggle" else required)
    tables = [check_pet_ids(t, p, decisions) for t in tables]
    codes = [label_codes(t) for t in tables]
    labels, label_rule = _label_rule(tables, codes, p)
    for t, y in zip(tables, labels, strict=True):
        t.cells[schema.LABEL] = y.astype(str)

    if len(tables) == 2:
        train, test = tables
        split = {"kind": "files", "test": test.name}
    else:
        train, test, split = _split(tables[0], labels[0], p)

    dataset = new / schema.DATASET_DIRNAME
    (dataset / "images").mkdir(parents=True)
    images = _kaggle_images if src.layout == "kaggle" else _tutorial_images
    placed: dict[str, int] = defaultdict(int)
    for split_name, t in (("train", train), ("test", test)):
        folder = src.test_images_dir if t.path == src.test else src.images_dir
        images(t, split_name, folder, src, dataset, placed, decisions)

    for split_name, t in (("train", train), ("test", test)):
        columns = [c for c in schema.ALL_COLUMNS if c in t.cells.columns]
        frame = t.cells[columns].set_axis(t.row_ids.to_numpy(), axis=0)
        write_text(dataset / f"{split_name}.csv", frame.to_csv(lineterminator="\n"))
    return {
        "source": "local",
        "local": p.model_dump(mode="json"),
        "layout": src.layout,
        "layout_detected_by": src.detected_by,
        "inputs": inputs,  # sha256 of each CSV read
        "label_rule": label_rule,
        "split": split,
        "images": dict(sorted(placed.items())),
        "decisions": decisions.items,
    }


def _locate(p: LocalParams) -> Source:
    if p.path is None:
        raise StageError("download.local.path is not set; point it at a PetFinder folder or CSV in params.yaml")
    path = Path(p.path)
    if path.is_dir() and not (path / "train.csv").is_file() and (path / schema.DATASET_DIRNAME / "train.csv").is_file():
        path = path / schema.DATASET_DIRNAME  # the tutorial zip unpacked: its dataset folder
    if path.is_dir():
        root, train = path, path / "train.csv"
        test = path / "test.csv" if (path / "test.csv").is_file() else None
    elif path.is_file():
        root, train, test = path.parent, path, None
    else:
        raise StageError(f"download.local.path: {path} does not exist; point it at a PetFinder folder or CSV")
    if not train.is_file():
        raise StageError(f"{train}: not found; download.local.path must hold train.csv (or be a CSV file)")
    if p.images_dir is not None and not Path(p.images_dir).is_dir():
        raise StageError(f"download.local.images_dir: {p.images_dir} is not a folder; fix the path or set null")
    layout, detected_by = p.layout, "download.local.layout"
    if layout == "auto":
        with open(train, "rb") as f:
            header = f.readline()
        has_images = schema.IMAGES.encode() in re.split(rb'[,"\r\n\s]+', header)
        layout = "tutorial" if has_images else "kaggle"
        detected_by = f"{train.name} {'has' if has_images else 'has no'} {schema.IMAGES} column"
    given = Path(p.images_dir) if p.images_dir is not None else None
    if layout == "tutorial":
        return Source(root, train, test, layout, detected_by, given or root / "images", given or root / "images")
    found = {n: root / n for n in ("train_images", "test_images") if (root / n).is_dir()}
    return Source(root, train, test, layout, detected_by, given or found.get("train_images"),
                  found.get("test_images") or given or found.get("train_images"))


def _name(src: Source, path: Path) -> str:
    return path.relative_to(src.root).as_posix()


def _label_rule(tables: list[Table], codes: list[np.ndarray], p: LocalParams) -> tuple[list[np.ndarray], dict[str, Any]]:
    seen = sorted({int(v) for c in codes for v in np.unique(c)})
    kind, detected_by = p.source_labels, "download.local.source_labels"
    if kind == "auto":
        kind = "binary" if set(seen) <= {0, 1} else "speed"
        detected_by = f"values {seen}: " + ("only 0/1" if kind == "binary" else "not only 0/1")
    allowed = {0, 1} if kind == "binary" else _SPEEDS
    for t, c in zip(tables, codes, strict=True):
        bad = np.flatnonzero(~np.isin(c, sorted(allowed)))
        if len(bad):
            raise StageError(
                f"{t.path}: column {schema.LABEL}: {sorted({int(v) for v in c[bad]})} in {spreadsheet_rows(bad)} "
                f"are not {'binary 0/1' if kind == 'binary' else 'AdoptionSpeed codes 0-4'} labels. Fix: correct "
                "those rows, or set download.local.source_labels to what the file holds (binary | speed)"
            )
    if kind == "binary" and p.label_kind == "multiclass":
        raise StageError(
            f"{tables[0].path}: its {schema.LABEL} labels are binary 0/1; multiclass 0-4 cannot be recovered from "
            "them. Fix: set download.local.label_kind: binary (and validate.label_kind: binary)"
        )
    rule: dict[str, Any] = {"source_labels": kind, "detected_by": detected_by, "label_kind": p.label_kind}
    if kind == "speed" and p.label_kind == "binary":
        k = p.fast_max_speed
        rule["rule"] = f"AdoptionSpeed 0-{k} -> 1 (fast), {k + 1}-4 -> 0 (slow)"
        rule["fast_max_speed"] = k
        return [(c <= k).astype("int64") for c in codes], rule
    rule["rule"] = "kept as in the file"
    return codes, rule


def _split(table: Table, labels: np.ndarray, p: LocalParams) -> tuple[Table, Table, dict[str, Any]]:
    """Seeded stratified split of one labelled table; each side keeps the file's row order."""
    try:
        train_pos, test_pos = train_test_split(
            np.arange(len(labels)), test_size=p.test_fraction, random_state=p.seed, stratify=labels
        )
    except ValueError as e:
        raise StageError(
            f"{table.path}: cannot split {len(labels)} labelled rows into train/test stratified by {schema.LABEL} "
            f"with download.local.test_fraction {p.test_fraction} ({e}). Fix: more rows per class, another "
            "test_fraction, or a labelled test.csv beside train.csv"
        ) from None

    def part(positions: np.ndarray) -> Table:
        keep = np.sort(positions)
        return Table(table.name, table.path, table.cells.iloc[keep].reset_index(drop=True),
                     table.row_ids.iloc[keep].reset_index(drop=True))

    record = {"kind": "stratified", "of": table.name, "test_fraction": p.test_fraction, "seed": p.seed,
              "stratified_by": f"{schema.LABEL} after the label rule", "by": "sklearn train_test_split"}
    return part(train_pos), part(test_pos), record


def _place(src: Path, dest: Path, placed: dict[str, int]) -> None:
    """Hard-link `src` at `dest` (same filesystem), else copy it."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
        placed["linked"] += 1
    except OSError:
        shutil.copyfile(src, dest)
        placed["copied"] += 1


def _kaggle_images(table: Table, split: str, folder: Path | None, src: Source, dataset: Path,
                   placed: dict[str, int], decisions: Decisions) -> None:
    """Derive `Images` from `<folder>/<PetID>-<n>.jpg` and place those photos; no photo -> ""."""
    found: dict[str, list[tuple[int, str]]] = defaultdict(list)
    if folder is not None:
        for entry in os.scandir(folder):
            m = _PHOTO.fullmatch(entry.name)
            if m and entry.is_file():
                found[m[1]].append((int(m[2]), entry.name))
    if schema.IMAGES in table.cells.columns:
        decisions.add(table.name, "images_column", f"ignored: layout kaggle derives {schema.IMAGES} from the photos",
                      split=split)
    cells = []
    for pet in table.cells["PetID"]:
        names = [name for _, name in sorted(found.get(pet, []))]
        for name in names:
            _place(folder / name, dataset / "images" / name, placed)  # type: ignore[operator]
        cells.append(schema.IMAGE_SEPARATOR.join(f"images/{name}" for name in names))
    table.cells[schema.IMAGES] = cells
    if folder is None:
        decisions.add(table.name, "no_photos", f"no photos folder (no train_images/ beside the CSV, "
                      f"download.local.images_dir null): {schema.IMAGES} left empty on all {len(cells)} row(s)",
                      split=split, rows=len(cells))
        return
    empty = sum(1 for c in cells if not c)
    if empty:
        decisions.add(table.name, "no_photos", f"{empty} row(s) have no <PetID>-<n>.jpg in {folder}: "
                      f"{schema.IMAGES} left empty", split=split, rows=empty)
    amount = [a.strip() for a in table.cells["PhotoAmt"]]
    differ = sum(1 for a, c in zip(amount, cells, strict=True) if a.isdigit() and int(a) != len(schema.split_images(c)))
    if differ:
        decisions.add(table.name, "photo_amount", f"{differ} row(s) have another number of photos than PhotoAmt "
                      "says: PhotoAmt kept as in the file", split=split, rows=differ)


def _tutorial_images(table: Table, split: str, folder: Path | None, src: Source, dataset: Path,
                     placed: dict[str, int], decisions: Decisions) -> None:
    """Place the photos the `Images` cells name (`images/...` read from `folder`); unsafe or missing paths
    are left in the CSV for validation to refuse with their rows."""
    missing, unsafe = 0, 0
    for rel in sorted({r for cell in table.cells[schema.IMAGES] for r in schema.split_images(cell)}):
        path = PurePosixPath(rel)
        if path.is_absolute() or ".." in path.parts or "\\" in rel or len(path.parts) < 2 or path.parts[0] != "images":
            unsafe += 1
            continue
        source = Path(folder, *path.parts[1:]) if folder is not None else None
        if source is None or not source.is_file():
            missing += 1
        elif not (dataset / rel).exists():
            _place(source, dataset / rel, placed)
    if missing or unsafe:
        decisions.add(table.name, "image_paths", f"{missing} named photo(s) not found and {unsafe} path(s) outside "
                      "images/ not copied: left in the CSV, validation names their rows", split=split,
                      missing=missing, unsafe=unsafe)
    empty = int(table.cells[schema.IMAGES].str.strip().eq("").sum())
    if empty:
        decisions.add(table.name, "no_photos", f"{empty} row(s) have an empty {schema.IMAGES}: kept empty",
                      split=split, rows=empty)
