"""Reviewing the quarantine: `python -m tasks batches list | readmit N | reject N`.

`readmit N` takes a quarantined batch in after a person looked at it: the check that refused it is
overridden (a drift verdict, or ids already taken in: the newer rows then replace the older ones) and
recorded in the ledger, the accumulated data's manifest (`intake.out_dir`) and so the run manifest. A batch refused by its own
validation, by ids repeated inside it or by an image name clash cannot be readmitted: its files must be fixed and dropped again
under a new name. `reject N` refuses it for good (its files stay in the quarantine folder for reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fusion_model.dataset import DatasetSchema
from tasks.errors import StageError
from tasks.intake.accumulated import build_on_base
from tasks.intake.ledger import BatchRecord, read_ledger, write_ledger
from tasks.intake.stage import check_and_join
from tasks.params import DownloadParams, IntakeParams

# check that refused a batch -> what readmitting it overrides
OVERRIDABLE = {"drift": "drift", "join": "duplicates"}


def listing(p: IntakeParams) -> list[dict[str, Any]]:
    return [b.model_dump(mode="json") for b in read_ledger(p.feed.ledger).batches]


def render(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no batch seen yet\n"
    lines = [f"{'batch':>5}  {'status':<11}  {'rows':>5}  {'sha256':<12}  name  /  why"]
    for r in rows:
        why = f"  [{r['check']}] {r['reason']}" if r["reason"] else ""
        extra = f"  (overrides: {'; '.join(r['overrides'])})" if r["overrides"] else ""
        lines.append(f"{r['batch']:>5}  {r['status']:<11}  {r['train_rows'] + r['holdout_rows']:>5}  "
                     f"{r['sha256'][:12]:<12}  {r['name']}{extra}{why}")
    return "\n".join(lines) + "\n"


def _quarantined(p: IntakeParams, batch: int) -> tuple[Any, BatchRecord, Path]:
    ledger = read_ledger(p.feed.ledger)
    record = ledger.get(batch)
    if record is None:
        known = ", ".join(str(b.batch) for b in ledger.batches) or "none"
        raise StageError(f"batch {batch}: not in the ledger {p.feed.ledger} (batches: {known}); see "
                         "`python -m tasks batches list`")
    if record.status != "quarantined":
        raise StageError(f"batch {batch} ({record.name}) is {record.status}, not quarantined: only a quarantined "
                         "batch can be readmitted or rejected")
    folder = Path(record.quarantine or Path(p.quarantine_dir) / f"batch-{batch:04d}")
    return ledger, record, folder


def readmit(p: IntakeParams, download: DownloadParams, schema: DatasetSchema, batch: int) -> BatchRecord:
    """Take the quarantined batch in, overriding the check that refused it; it joins the accumulated data
    (`p.out_dir`, on the download stage's data: `download.out_dir`)."""
    ledger, record, folder = _quarantined(p, batch)
    override = OVERRIDABLE.get(record.check)
    if override is None or (record.check == "join" and "already in the accumulated data" not in record.reason):
        raise StageError(
            f"batch {batch} ({record.name}) was refused by its {record.check or 'checks'}: {record.reason} That cannot "
            "be overridden: fix the files and drop the batch again under a new name, or reject it")
    if not (folder / "train.csv").is_file():
        raise StageError(f"{folder}: the quarantined batch's files are gone; drop it again under a new name")
    build_on_base(Path(download.out_dir), Path(p.out_dir), schema.label.column)
    record.overrides = sorted({*record.overrides, f"{record.check}: reviewed ({record.reason[:200]})"})
    return check_and_join(p, download, schema, ledger, folder, record, overrides=frozenset({override}))


def reject(p: IntakeParams, batch: int, reason: str = "") -> BatchRecord:
    ledger, record, _folder = _quarantined(p, batch)
    record.status = "rejected"
    record.reason = (reason + " " if reason else "") + f"(was: [{record.check}] {record.reason})"
    ledger.put(record)
    write_ledger(p.feed.ledger, ledger)
    return record
