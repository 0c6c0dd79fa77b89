"""The `local` source: a table on disk (any dataset schema), rewritten into the layout validation reads.

`download.local.path` is one of (`layout: auto` tells them apart):
- table: a CSV or Parquet file, or a folder with train.csv (+ a labelled test.csv, as the PetFinder
  tutorial's); its image cells are paths relative to `images_dir` (default: the table's folder);
  `test_path` names a labelled test table;
- kaggle (the PetFinder preset only, when the table has no image column): photos at
  `train_images/<PetID>-<n>.jpg` beside it (or in `images_dir`); the image cell is derived from the photos
  present (n in numeric order), empty for a row with none.
Without a labelled test table the labelled rows are split (scikit-learn `train_test_split`, stratified by
the label, seeded). The label's classes are decided later, by validation, from the training rows.

Output: `<new>/dataset/{train.csv,test.csv,<photos>}`: CSVs with a leading unnamed index column (the
input's row ids), the declared columns in the file's order, "\\n" line ends; the photos a row names are
hard-linked (or copied) to the same relative path under the dataset folder. The same input gives the same
bytes. The returned origin record (inputs' sha256, split, images, every decision) goes into manifest.json.
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

from fusion_model.checks import image_path_problem
from fusion_model.dataset import IMAGE_SEPARATOR, DatasetSchema, canonical, split_images
from fusion_model.presets import petfinder as pf
from tasks._io.files import write_text
from tasks._io.hashing import sha256_file
from tasks.download.local_table import (
    Decisions,
    Table,
    check_columns,
    check_ids,
    check_labels,
    read_table,
)
from tasks.download.manifest import DATASET_DIRNAME
from tasks.errors import StageError
from tasks.params import LocalParams

_PHOTO = re.compile(r"([0-9a-f]{9})-([1-9][0-9]*)\.jpg")
# names the dataset folder keeps for itself: a photo may not land on them
RESERVED = frozenset({"train.csv", "test.csv", "holdout"})
# a class with fewer rows is stratified together with the other rare ones (scikit-learn needs two per class)
_MIN_STRATUM = 2


@dataclass
class Source:
    root: Path  # the folder the tables are named relative to (in the manifest)
    train: Path
    test: Path | None
    layout: str
    detected_by: str
    images_dir: Path | None  # the images root (kaggle: the train photos folder)
    test_images_dir: Path | None


def from_local(p: LocalParams, new: Path, schema: DatasetSchema) -> dict[str, Any]:
    """Write `new/<dataset dir>` from `p.path`; return the origin record for manifest.json."""
    src = _locate(p, schema)
    decisions = Decisions()
    inputs = {_name(src, src.train): sha256_file(src.train)}
    train = read_table(_name(src, src.train), src.train, p, decisions, schema)
    test = None
    label = schema.label.column
    if src.test is not None:
        inputs[_name(src, src.test)] = sha256_file(src.test)
        test = read_table(_name(src, src.test), src.test, p, decisions, schema)
        if label not in test.cells.columns or not test.cells[label].str.strip().ne("").any():
            if p.test_path is not None:
                raise StageError(f"{src.test}: download.local.test_path has no {label} labels; a test table must be "
                                 "labelled. Fix: point test_path at a labelled table, or set it to null (a split)")
            decisions.add(test.name, "unlabelled_test", f"not used: no {label} labels (as Kaggle's test.csv); "
                          f"the test set is split from {train.name}")
            test = None

    required = [c for c in schema.required_features if c not in schema.columns.image or src.layout != "kaggle"]
    required.append(label)
    if src.layout == "kaggle":
        required.append(pf.PET_ID)  # the photos are found by it
    tables = [t for t in (train, test) if t is not None]
    for t in tables:
        check_columns(t, required, schema)
        check_labels(t, schema)
    tables = [check_ids(t, p, decisions, schema) for t in tables]
    if len(tables) == 2:
        train, test = tables
        split = {"kind": "files", "test": test.name}
    else:
        train, test, split = _split(tables[0], schema, p)

    dataset = new / DATASET_DIRNAME
    dataset.mkdir(parents=True)
    placed: dict[str, int] = defaultdict(int)
    for split_name, t in (("train", train), ("test", test)):
        folder = src.test_images_dir if t.path == src.test else src.images_dir
        if src.layout == "kaggle":
            _kaggle_images(t, split_name, folder, dataset, placed, decisions)
        else:
            _place_images(t, split_name, folder, schema, dataset, placed, decisions)

    for split_name, t in (("train", train), ("test", test)):
        frame = t.cells.set_axis(t.row_ids.to_numpy(), axis=0)  # the file's declared columns, in its order
        write_text(dataset / f"{split_name}.csv", frame.to_csv(lineterminator="\n"))
    return {
        "source": "local",
        "local": p.model_dump(mode="json"),
        "layout": src.layout,
        "layout_detected_by": src.detected_by,
        "inputs": inputs,  # sha256 of each table read
        "split": split,
        "images": dict(sorted(placed.items())),
        "decisions": decisions.items,
    }


def _header(path: Path) -> set[str]:
    """The column names of a table file (its first line, or the Parquet schema)."""
    if path.suffix.lower() in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        return set(pq.read_schema(path).names)
    with open(path, "rb") as f:
        line = f.readline()
    return {h.strip().decode("utf-8", "replace") for h in re.split(rb'[,"\r\n]+', line) if h.strip()}


def _locate(p: LocalParams, schema: DatasetSchema) -> Source:
    if p.path is None:
        raise StageError("download.local.path is not set; point it at your table (a CSV or Parquet file) or a "
                         "dataset folder in params.yaml")
    path = Path(p.path)
    if path.is_dir() and not (path / "train.csv").is_file():
        for inner in (DATASET_DIRNAME, "petfinder_for_tutorial"):  # an unpacked archive: its dataset folder
            if (path / inner / "train.csv").is_file():
                path = path / inner
                break
    if not path.exists():
        raise StageError(f"download.local.path: {path} does not exist; point it at your table or dataset folder")
    if p.images_dir is not None and not Path(p.images_dir).is_dir():
        raise StageError(f"download.local.images_dir: {p.images_dir} is not a folder; fix the path or set null")
    test = Path(p.test_path) if p.test_path is not None else None
    if test is not None and not test.is_file():
        raise StageError(f"download.local.test_path: {test} is not a file; point it at a labelled test table or "
                         "set null")
    given = Path(p.images_dir) if p.images_dir is not None else None
    if path.is_file():
        root, train = path.parent, path
    else:
        root, train = path, path / "train.csv"
        if not train.is_file():
            raise StageError(f"{train}: not found; a dataset folder holds train.csv (or point download.local.path "
                             "at the table file itself)")
        if test is None and (path / "test.csv").is_file():
            test = path / "test.csv"
    layout, detected_by = p.layout, "download.local.layout"
    if layout == "auto":
        # PetFinder's Kaggle export has no image column: its photos are found by PetID
        has_images = bool(set(schema.columns.image) & _header(train))
        kaggle = not has_images and schema.preset == "petfinder" and pf.IMAGES in schema.columns.image
        layout = "kaggle" if kaggle else "table"
        detected_by = (f"{train.name} {'has' if has_images else 'has no'} image column "
                       f"{schema.columns.image[0] if schema.columns.image else '(none declared)'}")
    if layout == "kaggle":
        if schema.preset != "petfinder" or pf.IMAGES not in schema.columns.image:
            raise StageError("download.local.layout kaggle is PetFinder's Kaggle folder (photos named "
                             "<PetID>-<n>.jpg); it needs dataset.preset: petfinder with its image column. Use "
                             "layout: table for another table")
        found = {n: root / n for n in ("train_images", "test_images") if (root / n).is_dir()}
        return Source(root, train, test, layout, detected_by, given or found.get("train_images"),
                      found.get("test_images") or given or found.get("train_images"))
    # a table (or the tutorial's folder of tables): image cells relative to the images root
    return Source(root, train, test, "table", detected_by, given or root, given or root)


def _name(src: Source, path: Path) -> str:
    try:
        return path.relative_to(src.root).as_posix()
    except ValueError:
        return path.name


def _split(table: Table, schema: DatasetSchema, p: LocalParams) -> tuple[Table, Table, dict[str, Any]]:
    """Seeded split of one labelled table, stratified by the label (classification); each side keeps the
    file's row order. Classes too small to stratify (fewer than two rows) are stratified together."""
    label = schema.label.column
    stratify = None
    if schema.label.is_classification:
        values = table.cells[label].map(canonical)
        counts = values.value_counts()
        stratify = values.where(values.map(counts) >= _MIN_STRATUM, "(rare classes)").to_numpy()
    try:
        train_pos, test_pos = train_test_split(
            np.arange(len(table.cells)), test_size=p.test_fraction, random_state=p.seed, stratify=stratify
        )
    except ValueError as e:
        raise StageError(
            f"{table.path}: cannot split {len(table.cells)} labelled rows into train/test stratified by {label} "
            f"with download.local.test_fraction {p.test_fraction} ({e}). Fix: more rows per class, another "
            "test_fraction, or a labelled test table (download.local.test_path)"
        ) from None

    def part(positions: np.ndarray) -> Table:
        keep = np.sort(positions)
        return Table(table.name, table.path, table.cells.iloc[keep].reset_index(drop=True),
                     table.row_ids.iloc[keep].reset_index(drop=True))

    record = {"kind": "stratified" if stratify is not None else "random", "of": table.name,
              "test_fraction": p.test_fraction, "seed": p.seed, "by": "sklearn train_test_split"}
    if stratify is not None:
        record["stratified_by"] = label
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


def _place_images(table: Table, split: str, root: Path | None, schema: DatasetSchema, dataset: Path,
                  placed: dict[str, int], decisions: Decisions) -> None:
    """Place the photos the image cells name (relative to the images root `root`) at the same relative path
    under the dataset folder; unsafe or missing paths are left in the table for validation to refuse with
    their rows."""
    missing, unsafe, empty = 0, 0, 0
    for col in (c for c in schema.columns.image if c in table.cells.columns):
        cells = table.cells[col]
        empty += int(cells.str.strip().eq("").sum())
        for rel in sorted({r for cell in cells for r in split_images(cell)}):
            parts = PurePosixPath(rel).parts
            if (root is None or image_path_problem(rel, root) is not None or not parts
                    or parts[0] in RESERVED):
                unsafe += 1
                continue
            source = Path(root, *parts)
            if not source.is_file():
                missing += 1
            elif not (dataset / rel).exists():
                _place(source, dataset / rel, placed)
    if missing or unsafe:
        decisions.add(table.name, "image_paths", f"{missing} named photo(s) not found under {root} and {unsafe} "
                      "unsafe path(s) not copied: left in the table, validation names their rows", split=split,
                      missing=missing, unsafe=unsafe)
    if empty:
        decisions.add(table.name, "no_photos", f"{empty} empty image cell(s): kept empty (the model masks the "
                      "image of a row without one)", split=split, rows=empty)


def _kaggle_images(table: Table, split: str, folder: Path | None, dataset: Path,
                   placed: dict[str, int], decisions: Decisions) -> None:
    """PetFinder's Kaggle layout: derive the image cell from `<folder>/<PetID>-<n>.jpg` and place those
    photos under images/; no photo -> ""."""
    found: dict[str, list[tuple[int, str]]] = defaultdict(list)
    if folder is not None:
        for entry in os.scandir(folder):
            m = _PHOTO.fullmatch(entry.name)
            if m and entry.is_file():
                found[m[1]].append((int(m[2]), entry.name))
    if pf.IMAGES in table.cells.columns:
        decisions.add(table.name, "images_column", f"ignored: layout kaggle derives {pf.IMAGES} from the photos",
                      split=split)
    cells = []
    for pet in table.cells[pf.PET_ID]:
        names = [name for _, name in sorted(found.get(pet, []))]
        for name in names:
            _place(folder / name, dataset / "images" / name, placed)  # type: ignore[operator]
        cells.append(IMAGE_SEPARATOR.join(f"images/{name}" for name in names))
    table.cells[pf.IMAGES] = cells
    if folder is None:
        decisions.add(table.name, "no_photos", f"no photos folder (no train_images/ beside the CSV, "
                      f"download.local.images_dir null): {pf.IMAGES} left empty on all {len(cells)} row(s)",
                      split=split, rows=len(cells))
        return
    empty = sum(1 for c in cells if not c)
    if empty:
        decisions.add(table.name, "no_photos", f"{empty} row(s) have no <PetID>-<n>.jpg in {folder}: "
                      f"{pf.IMAGES} left empty", split=split, rows=empty)
    if pf.PHOTO_AMOUNT in table.cells.columns:
        amount = [a.strip() for a in table.cells[pf.PHOTO_AMOUNT]]
        differ = sum(1 for a, c in zip(amount, cells, strict=True) if a.isdigit() and int(a) != len(split_images(c)))
        if differ:
            decisions.add(table.name, "photo_amount", f"{differ} row(s) have another number of photos than "
                          f"{pf.PHOTO_AMOUNT} says: kept as in the file", split=split, rows=differ)
