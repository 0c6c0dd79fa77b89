"""Arriving data: land batch N, check it on its own, gate it on drift, and take it into the accumulated dataset.

```
data/incoming/batch-<N>/        the landing area: the batch as it arrived (train.csv + images/, tutorial layout)
data/quarantine/batch-<N>/      a refused batch, with the report that refused it; it never joins
data/raw/dataset/
  train.csv                     the base training rows and every accepted batch's training share
  test.csv                      the frozen test set (the base dataset's): every run is scored on it
  holdout/batch-<N>.csv         each accepted batch's held-out share, scored beside the test set
data/raw/manifest.json          `batches`: what was taken in, when and with which drift figures
```

A batch is validated alone with the same GX suite as the data set, then compared with the accumulated
training rows (tasks/validate/drift.py). Refused (validation) or stopped (a failing drift gate): it is
moved to quarantine with its report and the accumulated data is unchanged; a warning lets it join and
says so. Joining builds the new data set beside data/raw (images hard-linked) and swaps it in whole. The
same batch taken in twice is a no-op, so `dvc repro` and the flow agree.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fusion_model.dataset import DatasetSchema
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks._io.hashing import file_hashes, fingerprint
from tasks.download.manifest import DATASET_DIRNAME, MANIFEST, add_batch, read_manifest
from tasks.download.synthetic.generator import generate_batch
from tasks.errors import StageError
from tasks.params import DownloadParams
from tasks.validate.drift import DriftReport, drift_gate, write_drift_report
from tasks.validate.drift_stats import DriftColumns
from tasks.validate.report import failure_message, render_markdown, report_json
from tasks.validate.stage import HOLDOUT_DIR, ValidationError, check_tables
from tasks.validate.tables import (
    LabelRule,
    label_rule,
    read_raw,
    training_codes,
    typed_table,
    validation_frame,
)


class DriftGateError(StageError):
    """The batch moved too far from the data the model was trained on; the report names the columns."""


def batch_name(batch: int) -> str:
    return f"batch-{batch:04d}"


def taken_in(out_dir: Path) -> list[dict[str, Any]]:
    """The batches the accumulated dataset holds (data/raw/manifest.json), oldest first."""
    return (read_manifest(out_dir) or {}).get("batches", [])


def last_batch_seen(p: DownloadParams) -> int:
    """The highest batch taken in or quarantined: the nightly run takes the next one."""
    seen = [b["batch"] for b in taken_in(Path(p.out_dir))]
    seen += [int(q.name.split("-")[1]) for q in Path(p.quarantine_dir).glob("batch-*") if q.is_dir()]
    return max(seen, default=0)


def land(p: DownloadParams, schema: DatasetSchema) -> Path:
    """Put batch `p.synthetic.batch` in the landing area (the embedded source emits it there)."""
    landed = Path(p.incoming_dir) / batch_name(p.synthetic.batch)
    if p.source == "synthetic":
        generate_batch(landed, p.synthetic, p.synthetic.batch, schema.label.problem_type)
    elif not (landed / "train.csv").is_file():
        raise StageError(
            f"{landed / 'train.csv'}: batch {p.synthetic.batch} has not arrived. Land it there in the tutorial "
            "layout (train.csv with Images, images/), or set download.synthetic.batch to a batch that arrived."
        )
    return landed


def _typed(dataset_dir: Path, name: str, file: str, schema: DatasetSchema,
           rule: LabelRule | None = None) -> tuple[pd.DataFrame, LabelRule]:
    """A table of the dataset typed as the validate stage types it (no file checks: already done), and the
    label rule of the training rows (decided on this table unless given)."""
    table = read_raw(name, dataset_dir / file, schema)
    rule = rule or label_rule(table, schema)
    return typed_table(validation_frame(table, schema, rule, dataset_dir, workers=1, image_checks=False),
                       schema, rule), rule


def _quarantine(p: DownloadParams, landed: Path, reports: dict[str, str]) -> Path:
    """Move a refused batch out of the landing area, its reports beside its files."""
    dest = Path(p.quarantine_dir) / landed.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(dest, ignore_errors=True)
    os.rename(landed, dest)
    for name, text in reports.items():
        (dest / name).write_text(text)
    return dest


def take_in(p: DownloadParams, schema: DatasetSchema) -> dict[str, Any]:
    """Land, validate, gate and join batch `p.synthetic.batch` (>= 1) into `p.out_dir`; returns its record."""
    out_dir, batch = Path(p.out_dir), p.synthetic.batch
    dataset = out_dir / DATASET_DIRNAME
    if not (dataset / "train.csv").is_file():
        raise StageError(f"{dataset / 'train.csv'}: no accumulated dataset to take batch {batch} into; run the "
                         "download stage with download.synthetic.batch: 0 first (the base dataset).")
    done = next((b for b in taken_in(out_dir) if b["batch"] == batch), None)
    if done is not None:
        return {**done, "already_taken_in": True}
    landed = land(p, schema)
    report_dir = p.drift_reports

    reference, rule = _typed(dataset, "train", "train.csv", schema)
    report, frames, _rule = check_tables(landed, [("batch", "train.csv")], schema, workers=2, rule=rule,
                                         seen=training_codes(reference, schema))
    if not report.success:
        where = _quarantine(p, landed, {"validation.json": report_json(report), "validation.md": render_markdown(report)})
        raise ValidationError(f"batch {batch} is refused and quarantined in {where}; it does not join the data. "
                              + failure_message(report, str(where / "validation.md")))

    rows = typed_table(frames["batch"], schema, rule)
    gate = drift_gate(reference, rows, DriftColumns.from_schema(schema, rule.classes), p.drift_gate)
    gate.batch = batch
    write_drift_report(gate, report_dir)
    if not gate.passed:  # quarantined with its figures
        where = _quarantine(p, landed, {"drift.json": gate.model_dump_json(indent=2)})
        raise DriftGateError(f"batch {batch} stopped by the drift gate before training and quarantined in {where}: "
                             f"{gate.reason} Report: {report_dir / 'drift.md'}. The accumulated data and the champion "
                             "are unchanged; fix the feed (the report names the columns that moved and by how much).")
    return _join(p, landed, batch, gate)


def _join(p: DownloadParams, landed: Path, batch: int, gate: DriftReport) -> dict[str, Any]:
    """The accumulated dataset plus this batch (its training share appended, its holdout beside), swapped in."""
    out_dir = Path(p.out_dir)
    recover_dir(out_dir)
    staged = temp_dir_beside(out_dir)
    try:
        _copy_tree_linked(out_dir, staged)
        dataset = staged / DATASET_DIRNAME
        arrived = pd.read_csv(landed / "train.csv", index_col=0, dtype=str, keep_default_na=False)
        rng = np.random.default_rng([p.synthetic.seed, batch, 1])
        held = np.zeros(len(arrived), dtype=bool)
        held[rng.permutation(len(arrived))[: int(round(len(arrived) * p.holdout_fraction))]] = True
        train = pd.read_csv(dataset / "train.csv", index_col=0, dtype=str, keep_default_na=False)
        pd.concat([train, arrived[~held]]).to_csv(dataset / "train.csv", lineterminator="\n")
        (dataset / HOLDOUT_DIR).mkdir(exist_ok=True)
        arrived[held].to_csv(dataset / HOLDOUT_DIR / f"{batch_name(batch)}.csv", lineterminator="\n")
        for image in sorted((landed / "images").iterdir()):
            os.link(image, dataset / "images" / image.name)
        record = {"batch": batch, "train_rows": int((~held).sum()), "holdout_rows": int(held.sum()),
                  "sha256": fingerprint(file_hashes(landed)), "drift": {"warned": gate.warned,
                                                                        "warnings": gate.warnings}}
        add_batch(staged, record)
        swap_dir(staged, out_dir)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return record


def _copy_tree_linked(src: Path, dest: Path) -> None:
    """Copy `src` into the existing folder `dest`, hard-linking files (images never change once written)."""
    shutil.copytree(src, dest, copy_function=os.link, dirs_exist_ok=True)
    for rewritten in (dest / MANIFEST, dest / DATASET_DIRNAME / "train.csv"):
        data = rewritten.read_bytes()  # these change: a file of their own, not a link into the old tree
        rewritten.unlink()
        rewritten.write_bytes(data)
