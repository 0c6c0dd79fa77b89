"""Declaring a table: draft the `dataset:` section of params.yaml from the table itself (`infer`)."""

from tasks.dataset.infer import infer, infer_section

__all__ = ["infer", "infer_section"]
