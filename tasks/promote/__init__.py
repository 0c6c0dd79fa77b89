"""Promote stage: the challenger replaces the champion only when it is better on the same test set."""

from tasks.promote.stage import (
    PromotionDecision,
    history_path,
    promote,
    read_history,
    render_decision_markdown,
)

__all__ = ["PromotionDecision", "history_path", "promote", "read_history", "render_decision_markdown"]
