"""Intake stage: each new drop of the feed becomes the next batch, checked, then joined or quarantined.

```
feed drop ─> data/incoming/batch-<N>/ ─> validated alone ─> drift gate ─> joined by id into data/accumulated/dataset/
  (intake.feed)     (landing: train.csv       (the GX suite)     (against the     (train.csv + holdout/batch-<N>.csv)
                     + images, fresh row ids)                     training rows)   or data/quarantine/batch-<N>/
```

- The accumulated data is the stage's own folder (`intake.out_dir`, tasks/intake/accumulated.py): the
  download stage's dataset (`download.out_dir`, read, never written) plus every batch taken in.

- Landing never trusts the drop's own index column: rows get fresh row ids after the accumulated data's.
- A drop already in the ledger (same sha256) is a no-op, whatever became of it; a changed drop under a
  name the ledger holds is refused, naming it (nothing changes: rename the drop).
- A refusal (validation, drift, ids or image names) moves the batch to `data/quarantine/batch-<N>/` with
  `reason.txt` and its report, records it in the ledger, and raises: the accumulated data is unchanged,
  byte for byte. `python -m tasks batches readmit N` takes it in after review, `reject N` refuses it.
- A drift warning lets the batch join and says so (ledger status `warned`).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pandas as pd
from pydantic import BaseModel

from fusion_model.checks import image_cells
from fusion_model.dataset import DatasetSchema, resolve_schema, split_images
from tasks._io.files import write_text
from tasks._io.folders import temp_dir_beside
from tasks.checks.report import failure_message, render_markdown, report_json
from tasks.checks.run import ValidationError, check_tables
from tasks.checks.tables import (
    LabelRule,
    label_rule,
    read_raw,
    training_codes,
    typed_table,
    validation_frame,
)
from tasks.download.manifest import DATASET_DIRNAME
from tasks.errors import StageError
from tasks.intake.accumulated import build_on_base, read_accumulated
from tasks.intake.drift import drift_gate, no_batch_report
from tasks.intake.drift_report import DriftReport, write_drift_report
from tasks.intake.drift_stats import DriftColumns
from tasks.intake.feed import Drop, Fetching, list_drops, table_of
from tasks.intake.join import JoinPlan, JoinRefused, apply_join, next_row_id, plan_join
from tasks.intake.ledger import JOINED, BatchRecord, Ledger, read_ledger, write_ledger
from tasks.params import DownloadParams, IntakeParams

_INDEX_NAMES = ("",)


class DriftGateError(StageError):
    """The batch moved too far from the data the model was trained on; the report names the columns."""


class IntakeSummary(BaseModel):
    feed: str
    seen: int  # drops in the feed
    taken: list[int] = []  # batches joined this run (taken or warned)
    warned: list[int] = []
    already: list[str] = []  # drops the ledger already had (no-op)
    batches_taken_in: list[int] = []  # every batch the accumulated data holds
    message: str = ""
    seconds: float = 0.0


def batch_name(batch: int) -> str:
    return f"batch-{batch:04d}"


def last_batch_seen(p: IntakeParams) -> int:
    """The highest batch in the ledger or the quarantine: the nightly run takes the synthetic batch after it."""
    seen = [b.batch for b in read_ledger(p.feed.ledger).batches]
    seen += [int(q.name.split("-")[1]) for q in Path(p.quarantine_dir).glob("batch-*") if q.is_dir()]
    return max(seen, default=0)


def _read_drop_table(path: Path) -> pd.DataFrame:
    """The drop's table as text, its own index column (if it wrote one) dropped: never trusted."""
    try:
        if path.suffix.lower() == ".parquet":
            frame = pd.read_parquet(path).reset_index(drop=True)
            frame = frame.astype(object).where(frame.notna(), "").astype(str)
        else:
            frame = pd.read_csv(path, dtype=str, keep_default_na=False, na_filter=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError, ValueError, OSError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StageError(f"{path}: not a readable table ({reason}); export the batch as a UTF-8 CSV with one header "
                         "line, or as Parquet") from None
    if len(frame.columns) and (str(frame.columns[0]) in _INDEX_NAMES or str(frame.columns[0]).startswith("Unnamed: 0")):
        frame = frame.drop(columns=frame.columns[0])
    return frame


def land(drop: Drop, landed: Path, schema: DatasetSchema, first_row_id: int) -> Path:
    """Write the drop into `landed` as the dataset's layout: train.csv with fresh row ids from
    `first_row_id`, and every image file its cells name (relative paths kept)."""
    table = table_of(drop.path)
    frame = _read_drop_table(table)
    shutil.rmtree(landed, ignore_errors=True)
    landed.mkdir(parents=True)
    frame.index = pd.RangeIndex(first_row_id, first_row_id + len(frame))
    frame.to_csv(landed / "train.csv", lineterminator="\n")
    root = drop.path if drop.path.is_dir() else drop.path.parent
    for rel in sorted({p for cell in image_cells(frame, schema.columns.image) for p in split_images(cell)}):
        source = (root / rel).resolve()
        if not source.is_file() or not source.is_relative_to(root.resolve()):
            continue  # validation names it: missing, or outside the batch's folder
        dest = landed / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(source, dest)
        except OSError:
            shutil.copyfile(source, dest)
    return landed


def _typed(dataset_dir: Path, name: str, file: str, schema: DatasetSchema,
           rule: LabelRule | None = None) -> tuple[pd.DataFrame, LabelRule]:
    """A table of the dataset typed as the validate stage types it (no file checks: already done), and the
    label rule of the training rows (decided on this table unless given)."""
    table = read_raw(name, dataset_dir / file, schema)
    rule = rule or label_rule(table, schema)
    return typed_table(validation_frame(table, schema, rule, dataset_dir, workers=1, image_checks=False),
                       schema, rule), rule


def quarantine(p: IntakeParams, landed: Path, record: BatchRecord, reports: dict[str, str]) -> Path:
    """Move a refused batch out of the landing area, with `reason.txt` and its reports beside its files."""
    dest = Path(p.quarantine_dir) / landed.name
    if dest.resolve() != landed.resolve():  # a readmitted batch refused again stays where it is
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(dest, ignore_errors=True)
        os.rename(landed, dest)
    write_text(dest / "reason.txt", f"{record.check}: {record.reason}\n")
    for name, text in reports.items():
        write_text(dest / name, text)
    return dest


def _refuse(p: IntakeParams, ledger: Ledger, landed: Path, record: BatchRecord, check: str, reason: str,
            reports: dict[str, str], error: type[StageError]) -> StageError:
    record.status, record.check, record.reason = "quarantined", check, reason
    record.quarantine = str(quarantine(p, landed, record, reports))
    ledger.put(record)
    write_ledger(p.feed.ledger, ledger)
    return error(f"batch {record.batch} ({record.name}) is refused and quarantined in {record.quarantine}; the "
                 f"accumulated data is unchanged. {reason} Review: `python -m tasks batches list`, then "
                 f"`python -m tasks batches readmit {record.batch}` or `reject {record.batch}`.")


def check_and_join(p: IntakeParams, download: DownloadParams, schema: DatasetSchema, ledger: Ledger, landed: Path,
                   record: BatchRecord, overrides: frozenset[str] = frozenset()) -> BatchRecord:
    """Validate the landed batch alone, gate it, join it into `p.out_dir`; or quarantine it and raise.
    `overrides`: the checks a review lets pass (drift, duplicates). `download`: the seed of each batch's
    holdout split (download.synthetic.seed)."""
    out_dir = Path(p.out_dir)
    dataset = out_dir / DATASET_DIRNAME
    label = f"batch {record.batch} ({record.name})"
    reference, rule = _typed(dataset, "train", "train.csv", schema)
    report, frames, _rule = check_tables(landed, [("batch", "train.csv")], schema, workers=2, rule=rule,
                                         seen=training_codes(reference, schema))
    if not report.success:
        raise _refuse(p, ledger, landed, record, "validation",
                      failure_message(report, str(Path(p.quarantine_dir) / landed.name / "validation.md")),
                      {"validation.json": report_json(report), "validation.md": render_markdown(report)},
                      ValidationError)
    rows = typed_table(frames["batch"], schema, rule)
    gate = drift_gate(reference, rows, DriftColumns.from_schema(schema, rule.classes), p.drift_gate)
    gate.batch = record.batch
    write_drift_report(gate, p.report_dir)
    if not gate.passed and "drift" not in overrides:
        raise _refuse(p, ledger, landed, record, "drift",
                      f"The drift gate stopped it: {gate.reason} Report: {p.report_dir / 'drift.md'}.",
                      {"drift.json": gate.model_dump_json(indent=2)}, DriftGateError)
    on_duplicate = "update" if "duplicates" in overrides else p.feed.on_duplicate
    try:
        plan = plan_join(landed, dataset, schema, on_duplicate, label)
    except JoinRefused as e:
        raise _refuse(p, ledger, landed, record, "join", str(e), {}, JoinRefused) from None
    record.replaced = plan.replaced
    if not gate.passed:
        record.overrides = sorted({*record.overrides, f"drift: {', '.join(gate.drifted)}"})
    record.status = "readmitted" if overrides else "warned" if gate.warned else "taken"
    record.reason = gate.reason if gate.warned or not gate.passed else ""
    _joined(p, download, plan, record, gate, landed)
    shutil.rmtree(landed, ignore_errors=True)
    record.quarantine = None
    ledger.put(record)
    write_ledger(p.feed.ledger, ledger)
    return record


def _joined(p: IntakeParams, download: DownloadParams, plan: JoinPlan, record: BatchRecord, gate: DriftReport,
            landed: Path) -> None:
    manifest_record = {"batch": record.batch, "name": record.name, "sha256": record.sha256,
                       "status": record.status, "replaced": record.replaced, "overrides": record.overrides,
                       "drift": {"passed": gate.passed, "warned": gate.warned, "warnings": gate.warnings,
                                 "drifted": gate.drifted}}
    # `landed`: the incoming folder, or the quarantine one (readmit)
    done = apply_join(plan, landed, Path(p.out_dir), record.batch, download.synthetic.seed,
                      p.holdout_fraction, manifest_record)
    record.train_rows, record.holdout_rows = done["train_rows"], done["holdout_rows"]


def intake(p: IntakeParams, download: DownloadParams, dataset: DatasetSchema | None = None) -> IntakeSummary:
    """Take every new drop of `intake.feed` in, oldest first, joining it into the accumulated data
    (`p.out_dir`: the download stage's data, `download.out_dir`, plus the batches taken in); stop at the
    first refused one (quarantined, raised). `download` also gives the embedded feed's batch and generator
    (`download.synthetic`) and a url feed's timeout and tries. `dataset`: the declared table (default:
    the PetFinder preset)."""
    start = time.perf_counter()
    schema = dataset or resolve_schema({"preset": "petfinder"})
    out_dir = Path(p.out_dir)
    build_on_base(Path(download.out_dir), out_dir, schema.label.column)
    ledger = read_ledger(p.feed.ledger)
    summary = IntakeSummary(feed=p.feed.kind, seen=0)
    work = temp_dir_beside(Path(p.incoming_dir), "feed")
    try:
        fetching = Fetching(download.timeout_s, download.max_attempts, download.backoff_s)
        drops = list_drops(p.feed, schema, work, fetching, download.synthetic)
        summary.seen = len(drops)
        # batches the ledger took in but the data lacks (built again on a changed base): taken in again
        in_data = {b.get("sha256") for b in (read_accumulated(out_dir) or {}).get("batches", [])}
        for drop in drops:
            known = ledger.by_sha(drop.sha256)
            if known is not None and (known.status not in JOINED or known.sha256 in in_data):
                summary.already.append(f"{drop.name}: batch {known.batch}, {known.status}")
                continue
            used = ledger.by_name(drop.name)
            if used is not None and used is not known:
                raise StageError(
                    f"feed drop {drop.name!r} ({drop.origin}) has changed since it was seen as batch {used.batch} "
                    f"(sha256 {used.sha256[:12]}... then, {drop.sha256[:12]}... now); a batch's content never changes "
                    "under its name. Fix: drop the new content under a new name (and remove or restore the changed "
                    "one)")
            number = known.batch if known is not None else drop.batch if drop.batch is not None else ledger.next_number()
            if known is None and ledger.get(number) is not None:
                raise StageError(f"batch {number} ({drop.name}) is already in the ledger {p.feed.ledger} as "
                                 f"{ledger.get(number).name!r}; set download.synthetic.batch to a new batch")
            record = BatchRecord(batch=number, name=drop.name, sha256=drop.sha256, origin=drop.origin, status="taken")
            landed = land(drop, Path(p.incoming_dir) / batch_name(number), schema,
                          next_row_id(out_dir / DATASET_DIRNAME))
            done = check_and_join(p, download, schema, ledger, landed, record)
            summary.taken.append(done.batch)
            if done.status == "warned":
                summary.warned.append(done.batch)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not summary.taken:
        write_drift_report(no_batch_report(p.drift_gate), p.report_dir)
    write_ledger(p.feed.ledger, ledger)  # the stage's output exists even before the first batch
    summary.batches_taken_in = [b.batch for b in ledger.joined()]
    summary.message = message(summary)
    summary.seconds = round(time.perf_counter() - start, 3)
    return summary


def message(summary: IntakeSummary) -> str:
    parts = []
    ok = [b for b in summary.taken if b not in summary.warned]
    if ok:
        parts.append(f"batch(es) {', '.join(map(str, ok))} taken in")
    if summary.warned:
        parts.append(f"batch(es) {', '.join(map(str, summary.warned))} taken in with a drift warning")
    if not parts:
        parts.append("no new batch")
    return "; ".join(parts)
