"""Prefect 3 front-end of the pipeline: flows that wire the `tasks/` stage functions (no logic of their own)."""
