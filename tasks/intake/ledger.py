"""The intake ledger (`intake.feed.ledger`, data/intake/batches.json): every batch the feed delivered,
by content sha256, and what became of it. It is the intake stage's DVC output, so `dvc.lock` names it
and git keeps what the accumulated data holds; the accumulated data's own manifest (`intake.out_dir`)
lists the batches it holds as well.

Statuses: `taken` (joined), `warned` (joined; the drift gate warned), `quarantined` (refused, waiting in
the quarantine folder for review, with the reason), `readmitted` (joined after review; the overridden
checks in `overrides`), `rejected` (refused for good after review).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from tasks._io.files import read_json, write_json

Status = Literal["taken", "warned", "quarantined", "readmitted", "rejected"]
JOINED: frozenset[str] = frozenset({"taken", "warned", "readmitted"})


class BatchRecord(BaseModel):
    batch: int
    name: str  # the drop's name in the feed
    sha256: str  # of the drop's content
    origin: str = ""
    status: Status
    reason: str = ""  # why it was quarantined, warned or rejected
    check: str = ""  # which check refused it: validation | drift | join
    train_rows: int = 0
    holdout_rows: int = 0
    replaced: list[str] = Field(default_factory=list)  # ids whose older row this batch replaced (on_duplicate: update)
    overrides: list[str] = Field(default_factory=list)  # checks a review overrode (readmit)
    quarantine: str | None = None  # the folder it waits in


class Ledger(BaseModel):
    batches: list[BatchRecord] = Field(default_factory=list)

    def by_name(self, name: str) -> BatchRecord | None:
        return next((b for b in self.batches if b.name == name), None)

    def by_sha(self, sha256: str) -> BatchRecord | None:
        return next((b for b in self.batches if b.sha256 == sha256), None)

    def get(self, batch: int) -> BatchRecord | None:
        return next((b for b in self.batches if b.batch == batch), None)

    def next_number(self) -> int:
        return max((b.batch for b in self.batches), default=0) + 1

    def put(self, record: BatchRecord) -> None:
        self.batches = [b for b in self.batches if b.batch != record.batch] + [record]
        self.batches.sort(key=lambda b: b.batch)

    def joined(self) -> list[BatchRecord]:
        return [b for b in self.batches if b.status in JOINED]


def read_ledger(path: Path) -> Ledger:
    path = Path(path)
    if not path.is_file():
        return Ledger()
    data: dict[str, Any] = read_json(path, "Restore it from git (it is the intake stage's output), or delete it to "
                                           "start the ledger again.")
    return Ledger.model_validate(data)


def write_ledger(path: Path, ledger: Ledger) -> None:
    write_json(Path(path), ledger.model_dump(mode="json"))
