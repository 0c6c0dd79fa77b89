"""Checks of a dataset's tables, run by the validate stage on the whole data and by the intake stage on each
arriving batch: one place for both (tasks/checks/run.py)."""
