"""Joining a checked batch into the accumulated dataset (the intake stage's folder, `intake.out_dir`) by the
row key (the dataset schema's `id`).

Every refusal is decided before anything is written: a refused batch leaves the accumulated dataset
byte for byte as it was. Refusals name the ids (with the batch's rows, counted from 1 after the header),
the image files and the fix.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from fusion_model.checks import image_cells
from fusion_model.dataset import DatasetSchema, split_images
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks.checks.run import HOLDOUT_DIR
from tasks.download.manifest import DATASET_DIRNAME
from tasks.errors import StageError
from tasks.intake.accumulated import MANIFEST, record_batch

MAX_NAMED = 8


class JoinRefused(StageError):
    """The batch cannot join the accumulated data as it is (ids or image names clash); it is quarantined."""


def read_table(path: Path) -> pd.DataFrame:
    """A dataset CSV (leading index column = row ids) as text."""
    return pd.read_csv(path, index_col=0, dtype=str, keep_default_na=False)


def next_row_id(dataset: Path) -> int:
    """One past the largest row id of every table of the dataset (train, test, holdouts)."""
    paths = [dataset / "train.csv", dataset / "test.csv", *sorted((dataset / HOLDOUT_DIR).glob("*.csv"))]
    ids = [pd.to_numeric(read_table(p).index.to_series(), errors="coerce").max() for p in paths if p.is_file()]
    ids = [int(i) for i in ids if pd.notna(i)]
    return max(ids, default=-1) + 1


def _named(values: list[str]) -> str:
    shown = ", ".join(values[:MAX_NAMED])
    return shown + (f" and {len(values) - MAX_NAMED} more" if len(values) > MAX_NAMED else "")


def _rows_of(ids: pd.Series, wanted: set[str]) -> str:
    rows = [f"{v} (row {i + 1})" for i, v in enumerate(ids.tolist()) if v in wanted]
    return _named(rows)


@dataclass
class JoinPlan:
    """What joining the batch changes: decided (and refused) before anything is written."""

    arrived: pd.DataFrame
    replaced: list[str] = field(default_factory=list)  # ids whose older rows the batch replaces
    drop_rows: dict[str, list[str]] = field(default_factory=dict)  # file (relative) -> row ids removed
    images: list[str] = field(default_factory=list)  # relative paths to link in
    replace_images: list[str] = field(default_factory=list)  # relative paths whose older file is replaced


def plan_join(landed: Path, dataset: Path, schema: DatasetSchema, on_duplicate: str, label: str) -> JoinPlan:
    arrived = read_table(landed / "train.csv")
    plan = JoinPlan(arrived=arrived)
    key = schema.id
    older_images: set[str] = set()
    if key is not None and key in arrived.columns:
        ids = arrived[key].astype(str)
        repeated = sorted(set(ids[ids.duplicated(keep=False)]))
        if repeated:
            raise JoinRefused(
                f"{label}: the id column '{key}' repeats {len(repeated)} id(s) inside the batch: "
                f"{_rows_of(ids, set(repeated))}. Fix: keep one row per id in the batch and drop it again under a "
                "new name")
        test = read_table(dataset / "test.csv")
        if key in test.columns:
            clash = sorted(set(ids) & set(test[key].astype(str)))
            if clash:
                raise JoinRefused(
                    f"{label}: {len(clash)} id(s) of column '{key}' are rows of the frozen test set: "
                    f"{_rows_of(ids, set(clash))}. Rows of the test set are never replaced or repeated. Fix: drop "
                    "these rows from the batch (or give them their own ids) and drop it again under a new name")
        tables = {"train.csv": read_table(dataset / "train.csv")}
        tables |= {f"{HOLDOUT_DIR}/{p.name}": read_table(p) for p in sorted((dataset / HOLDOUT_DIR).glob("*.csv"))}
        taken: dict[str, str] = {}
        for name, table in tables.items():
            if key in table.columns:
                for v in set(table[key].astype(str)) & set(ids):
                    taken[v] = name
        if taken:
            if on_duplicate != "update":
                raise JoinRefused(
                    f"{label}: {len(taken)} id(s) of column '{key}' are already in the accumulated data: "
                    f"{_rows_of(ids, set(taken))}. Fix: drop these rows from the batch and drop it again under a "
                    "new name, or set intake.feed.on_duplicate: update to let the newer rows replace the older "
                    "ones (then `python -m tasks batches readmit N`)")
            plan.replaced = sorted(taken)
            for name, table in tables.items():
                if key in table.columns:
                    older = table[table[key].astype(str).isin(taken)]
                    if len(older):
                        plan.drop_rows[name] = [str(i) for i in older.index]
                        older_images |= {p for cell in image_cells(older, schema.columns.image)
                                         for p in split_images(cell)}
    wanted = sorted({p for cell in image_cells(arrived, schema.columns.image) for p in split_images(cell)})
    clashes = []
    for rel in wanted:
        new, old = landed / rel, dataset / rel
        if not old.exists():
            plan.images.append(rel)
        elif new.read_bytes() == old.read_bytes():
            continue  # the same photo again: nothing to link
        elif rel in older_images:
            plan.replace_images.append(rel)
        else:
            clashes.append(rel)
    if clashes:
        raise JoinRefused(
            f"{label}: {len(clashes)} image file(s) of the batch have the name of a different image already in the "
            f"accumulated data: {_named(clashes)}. Fix: rename these files (and the cells naming them) and drop the "
            "batch again under a new name")
    return plan


def apply_join(plan: JoinPlan, landed: Path, out_dir: Path, batch: int, seed: int, holdout_fraction: float,
               record: dict) -> dict:
    """The accumulated dataset plus the batch landed in `landed` (its training share appended, its holdout
    beside, replaced rows removed), built beside `out_dir` and swapped in whole; `record` joins the batches
    of its manifest.json. Returns the record, row counts filled in."""
    recover_dir(out_dir)
    staged = temp_dir_beside(out_dir)
    try:
        _copy_tree_linked(out_dir, staged, [f"{DATASET_DIRNAME}/{n}" for n in plan.drop_rows])
        dataset = staged / DATASET_DIRNAME
        for name, rows in plan.drop_rows.items():
            table = read_table(dataset / name)
            table[~table.index.astype(str).isin(rows)].to_csv(dataset / name, lineterminator="\n")
        arrived = plan.arrived
        rng = np.random.default_rng([seed, batch, 1])
        held = np.zeros(len(arrived), dtype=bool)
        held[rng.permutation(len(arrived))[: int(round(len(arrived) * holdout_fraction))]] = True
        train = read_table(dataset / "train.csv")
        pd.concat([train, arrived[~held]]).to_csv(dataset / "train.csv", lineterminator="\n")
        (dataset / HOLDOUT_DIR).mkdir(exist_ok=True)
        arrived[held].to_csv(dataset / HOLDOUT_DIR / f"batch-{batch:04d}.csv", lineterminator="\n")
        for rel in plan.images + plan.replace_images:
            dest = dataset / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if dest.exists():
                dest.unlink()
            os.link(landed / rel, dest)
        record |= {"train_rows": int((~held).sum()), "holdout_rows": int(held.sum())}
        record_batch(staged, record)
        swap_dir(staged, out_dir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return record


def _copy_tree_linked(src: Path, dest: Path, rewritten: list[str]) -> None:
    """Copy `src` into the existing folder `dest`, hard-linking files (images never change once written);
    the files this join rewrites get their own copy, never a link into the old tree."""
    shutil.copytree(src, dest, copy_function=os.link, dirs_exist_ok=True)
    for rel in [MANIFEST, f"{DATASET_DIRNAME}/train.csv", *rewritten]:
        path = dest / rel
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
