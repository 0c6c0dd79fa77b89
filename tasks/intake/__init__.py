"""Intake stage: arriving batches from the feed, checked alone, gated on drift, joined by id or quarantined."""

from tasks.intake.stage import IntakeSummary, intake

__all__ = ["IntakeSummary", "intake"]
