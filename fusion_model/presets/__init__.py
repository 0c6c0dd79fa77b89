"""Presets: known tables declared once (`registry.PRESETS`), with the row rules they implement in code."""

from fusion_model.presets.registry import PRESETS, RULES, RowRule

__all__ = ["PRESETS", "RULES", "RowRule"]
