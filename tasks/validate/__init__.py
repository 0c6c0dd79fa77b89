"""Validate stage: the GX 1.x suite on the raw tables, offline reports, typed train/val/test tables."""

from tasks.validate.stage import ValidateSummary, ValidationError, validate

__all__ = ["ValidateSummary", "ValidationError", "validate"]
