"""Evaluate stage: the converted model on the validated test table: metrics, ablation, offline plots."""

from tasks.evaluate.stage import OUTPUT_FILES, EvaluationSummary, evaluate, render_markdown

__all__ = ["OUTPUT_FILES", "EvaluationSummary", "evaluate", "render_markdown"]
