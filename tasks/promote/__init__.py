"""Promote stage: the challenger replaces the champion only when it is better on the same test set; every
promoted model is kept, and the champion can be rolled back (tasks/promote/registry.py)."""

from tasks.promote.stage import (
    PromotionDecision,
    history_path,
    listing,
    promote,
    read_history,
    render_decision_markdown,
    rollback,
)

__all__ = ["PromotionDecision", "history_path", "listing", "promote", "read_history", "render_decision_markdown",
           "rollback"]
