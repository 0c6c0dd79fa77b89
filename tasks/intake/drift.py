"""The drift gate: compare a new labelled batch with the reference (the rows the current model was trained
on), column by column, before the batch joins the training data.

`drift_gate(reference, batch, columns, thresholds) -> DriftReport` is pure (no files). The columns come
by role (`drift_stats.DriftColumns`: numeric, categorical, text lengths, the label, its problem type and
classes, the image columns), taken from the dataset schema (`DriftColumns.from_schema`). The report's
models and its rendering (`write_drift_report`: drift.json / drift.md / drift.png; `render_drift_markdown`,
also the Prefect artifact) are in `drift_report.py`.

How it decides (the statistics and why they were chosen: `drift_stats.py`; measured: BENCHMARKS.md):
every column gets one or two two-sample tests whose p-values account for the batch's size; Holm's
correction over all the tests of the run turns them into adjusted p-values. A test fails when its
adjusted p-value is at most `alpha_fail` AND its effect is at least the floor of its kind (`min_psi`,
`min_share_change`): the first bounds the chance that a batch of the reference's own population fails at
`alpha_fail` whatever its size; the second keeps a very large batch from failing on a difference too
small to matter. The same with `alpha_warn` warns and lets the run go on. A column takes its worst
test's status. A batch smaller than `min_rows` is refused; columns absent from either table are skipped,
not failed, and listed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel

from fusion_model.checks import image_cells
from fusion_model.dataset import DatasetSchema, split_images
from tasks.intake import drift_stats
from tasks.intake.drift_report import (
    CategoricalDrift,
    ClassRate,
    DriftReport,
    DriftTest,
    ImageDrift,
    LabelDrift,
    NumericDrift,
    UnseenCode,
    _Column,
    unseen_codes_text,
)
from tasks.intake.drift_stats import DriftColumns, ProblemType
from tasks.params import DriftGateParams as DriftThresholds  # params.yaml intake.drift_gate

LENGTH_SUFFIX = "_length"
MISSING_IMAGES = "missing_images"
MAX_CODES_IN_REASON = 5


def _num(x: float) -> float:
    """Six significant digits: readable JSON, and tiny p-values stay visible (not rounded to 0)."""
    return float(f"{float(x):.6g}")


def _nums(xs: list[float]) -> list[float]:
    return [_num(x) for x in xs]


def _absent(column: str, reference: pd.DataFrame, batch: pd.DataFrame) -> str | None:
    missing = [name for name, t in (("reference", reference), ("batch", batch)) if column not in t.columns]
    return f"column '{column}' absent from the {' and the '.join(missing)}" if missing else None


def _test(test: str, about: str, statistic: float, p: float, effect: str, size: float, floor: float) -> DriftTest:
    return DriftTest(test=test, about=about, statistic=_num(statistic), p_value=_num(p), effect=effect,
                     effect_size=_num(size), min_effect=floor)


def _numeric(kind: Literal["numeric", "text_length"], ref: np.ndarray, new: np.ndarray,
             t: DriftThresholds) -> NumericDrift:
    f = drift_stats.numeric_figures(ref, new)
    figures = {k: _nums(v) if isinstance(v, list) else _num(v) for k, v in f.model_dump().items()}
    return NumericDrift(
        kind=kind, **figures,
        tests=[_test("ks", "distribution", f.ks_statistic, f.ks_pvalue, "psi", f.psi, t.min_psi)],
        detail=f"mean {f.reference_mean:.3g} -> {f.batch_mean:.3g}, median {f.reference_median:.3g} -> "
               f"{f.batch_median:.3g}; KS {f.ks_statistic:.3f}; PSI {f.psi:.3f}",
    )


def _categorical(ref: pd.Series, new: pd.Series, t: DriftThresholds) -> CategoricalDrift:
    unseen = drift_stats.unseen_figures(ref, new)
    known = new[new.isin(ref.unique())]  # rows with unseen codes are the other test's
    shares = drift_stats.share_figures(ref, known)
    codes = [UnseenCode(code=c, rows=n) for c, n in unseen.codes.items()]
    excess = max(0.0, unseen.share - unseen.expected_share)
    tests = [_test("unseen_binomial", "rows with a code the reference never had", unseen.rows, unseen.p_value,
                   "unseen_share_above_chance", excess, t.min_share_change)]
    if shares.dof:  # one bucket (a single code, or too few rows to split them): no shares to test
        tests.insert(0, _test("chi2", f"shares of the known codes ({len(shares.buckets)} buckets)", shares.chi2,
                              shares.p_value, "psi", shares.psi, t.min_psi))
    return CategoricalDrift(
        kind="categorical", psi=_num(shares.psi), buckets=shares.buckets,
        reference_shares=_nums(shares.reference_shares), batch_shares=_nums(shares.batch_shares),
        unseen_share=_num(unseen.share), unseen_rows=unseen.rows, expected_unseen_share=_num(unseen.expected_share),
        unseen_codes=codes, tests=tests,
        detail=f"unseen codes in {unseen.share:.1%} of rows (~{unseen.expected_share:.1%} by chance); "
               + (f"shares of the known codes: PSI {shares.psi:.3f}" if shares.dof else
                  f"shares not tested ({len(shares.buckets)} bucket at {len(known)} rows with known codes)"),
    )


def _label(ref: pd.Series, new: pd.Series, problem_type: ProblemType, classes: tuple[int | str, ...],
           t: DriftThresholds) -> LabelDrift | str:
    """The label's drift, or why it cannot be tested (one class bucket at this batch size)."""
    if problem_type == "regression":
        f = drift_stats.numeric_figures(ref.to_numpy(dtype=float), new.to_numpy(dtype=float))
        return LabelDrift(
            kind="label", problem_type=problem_type, reference_mean=_num(f.reference_mean),
            batch_mean=_num(f.batch_mean),
            tests=[_test("ks", "distribution", f.ks_statistic, f.ks_pvalue, "psi", f.psi, t.min_psi)],
            detail=f"mean {f.reference_mean:.3g} -> {f.batch_mean:.3g}; KS {f.ks_statistic:.3f}; PSI {f.psi:.3f}")
    rates = drift_stats.class_rates(ref, new)
    table = {str(c): ClassRate(reference=_num(r), batch=_num(b), difference=_num(b - r)) for c, (r, b) in rates.items()}
    if problem_type == "binary":
        # the positive class is the last of the classes (1 of 0/1)
        positive = classes[-1] if classes else max(rates, key=lambda c: (isinstance(c, str), c))
        f = drift_stats.rate_figures((ref.astype(str) == str(positive)).to_numpy(),
                                     (new.astype(str) == str(positive)).to_numpy())
        test = _test("fisher", f"rate of class {positive}", f.batch_rows, f.p_value, "rate_difference",
                     abs(f.batch_share - f.reference_share), t.min_share_change)
        detail = f"rate of class {positive}: {f.reference_share:.1%} -> {f.batch_share:.1%}"
    else:
        f = drift_stats.share_figures(ref, new)
        if not f.dof:
            return f"one bucket of classes at {len(new)} batch rows: no class shares to compare"
        worst = max(rates, key=lambda c: abs(rates[c][1] - rates[c][0]))
        test = _test("chi2", f"shares of the classes ({len(f.buckets)} buckets)", f.chi2, f.p_value,
                     "max_share_difference", abs(rates[worst][1] - rates[worst][0]), t.min_share_change)
        detail = f"largest change: class {worst} {rates[worst][0]:.1%} -> {rates[worst][1]:.1%}"
    return LabelDrift(kind="label", problem_type=problem_type, rates=table, tests=[test], detail=detail)


def _images(ref: pd.Series, new: pd.Series, t: DriftThresholds) -> ImageDrift:
    def without(cells: pd.Series) -> np.ndarray:
        return cells.map(lambda c: not split_images(c)).to_numpy(dtype=bool)

    f = drift_stats.rate_figures(without(ref), without(new))
    return ImageDrift(
        kind="images", reference_share=_num(f.reference_share), batch_share=_num(f.batch_share),
        reference_rows_without_image=f.reference_rows, batch_rows_without_image=f.batch_rows,
        tests=[_test("fisher", "share of rows without an image", f.batch_rows, f.p_value, "rate_difference",
                     abs(f.batch_share - f.reference_share), t.min_share_change)],
        detail=f"rows without an image: {f.reference_share:.1%} -> {f.batch_share:.1%}",
    )


def _numbers(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").dropna().to_numpy(dtype=float)


def _text_lengths(s: pd.Series) -> np.ndarray:
    return s.fillna("").astype(str).str.len().to_numpy(dtype=float)


def _explain(name: str, c: _Column, level: Literal["warn", "fail"], t: DriftThresholds) -> str:
    d = c.decisive
    alpha = t.alpha_fail if level == "fail" else t.alpha_warn
    codes = f"; unseen codes (rows): {unseen_codes_text(c.unseen_codes, MAX_CODES_IN_REASON)}" \
        if isinstance(c, CategoricalDrift) and c.unseen_codes and d.test == "unseen_binomial" else ""
    return (f"{name} ({d.about}: {d.test} p {d.p_adjusted:.2g} after Holm <= {alpha:g}, {d.effect} "
            f"{d.effect_size:.3g} >= {d.min_effect:g}; {c.detail}{codes})")


def _thresholds(thresholds: DriftThresholds | BaseModel | Mapping[str, Any] | None) -> DriftThresholds:
    """DriftThresholds from itself, another model with the same fields (params.yaml's section) or a dict."""
    if thresholds is None:
        return DriftThresholds()
    if isinstance(thresholds, DriftThresholds):
        return thresholds
    return DriftThresholds.model_validate(
        thresholds.model_dump() if isinstance(thresholds, BaseModel) else dict(thresholds))


def no_batch_report(thresholds: DriftThresholds | BaseModel | Mapping[str, Any] | None = None) -> DriftReport:
    """The report of a run that took in no arriving batch: nothing compared, nothing to stop."""
    return DriftReport(passed=True, warned=False, drifted=[], warnings=[], reference_rows=0, batch_rows=0,
                       reason="no arriving batch in this run: nothing was compared",
                       thresholds=_thresholds(thresholds))


def _judge(columns: Mapping[str, _Column], t: DriftThresholds) -> int:
    """Holm over every test of every column, then each test's and each column's status; the test count."""
    tests = [test for c in columns.values() for test in c.tests]
    for test, adjusted in zip(tests, drift_stats.holm([x.p_value for x in tests]), strict=True):
        test.p_adjusted = _num(adjusted)
        big_enough = test.effect_size >= test.min_effect
        test.status = "fail" if big_enough and adjusted <= t.alpha_fail else \
            "warn" if big_enough and adjusted <= t.alpha_warn else "ok"
    for c in columns.values():
        c.status = c.decisive.status
    return len(tests)


def drift_gate(reference: pd.DataFrame, batch: pd.DataFrame, columns: DriftColumns | DatasetSchema,
               thresholds: DriftThresholds | BaseModel | Mapping[str, Any] | None = None) -> DriftReport:
    """Compare `batch` with `reference` over the columns named by role in `columns` (a dataset schema
    is read as `DriftColumns.from_schema(schema)`).

    `thresholds` may also be any pydantic model or mapping with DriftThresholds' fields (it is re-read
    as DriftThresholds, so an unknown field is an error)."""
    t = _thresholds(thresholds)
    if isinstance(columns, DatasetSchema):
        columns = DriftColumns.from_schema(columns)
    # an empty categorical cell is a missing value, not a code
    reference = reference.replace({c: {"": np.nan} for c in columns.categorical if c in reference.columns})
    batch = batch.replace({c: {"": np.nan} for c in columns.categorical if c in batch.columns})
    report = DriftReport(passed=False, warned=False, drifted=[], warnings=[], reason="", reference_rows=len(reference),
                         batch_rows=len(batch), columns_by_role=columns, thresholds=t)
    small = [f"the {name} has {len(table)} rows, fewer than min_rows={t.min_rows}"
             for name, table in (("batch", batch), ("reference", reference)) if len(table) < t.min_rows]
    if small:
        report.reason = "; ".join(small) + ": too few rows to judge drift; nothing was compared"
        return report

    compared: dict[str, NumericDrift | CategoricalDrift | LabelDrift | ImageDrift] = {}
    for col in columns.numeric:
        if why := _absent(col, reference, batch):
            report.skipped[col] = why
            continue
        ref, new = _numbers(reference[col]), _numbers(batch[col])
        if ref.size == 0 or new.size == 0:
            report.skipped[col] = f"column '{col}' has no numbers in the {'reference' if ref.size == 0 else 'batch'}"
            continue
        compared[col] = _numeric("numeric", ref, new, t)
    for col in columns.text_length:
        if why := _absent(col, reference, batch):
            report.skipped[col + LENGTH_SUFFIX] = why
            continue
        compared[col + LENGTH_SUFFIX] = _numeric("text_length", _text_lengths(reference[col]),
                                                 _text_lengths(batch[col]), t)
    for col in columns.categorical:
        if why := _absent(col, reference, batch):
            report.skipped[col] = why
        elif reference[col].notna().sum() == 0 or batch[col].notna().sum() == 0:
            report.skipped[col] = f"column '{col}' has no codes in the {'reference' if reference[col].notna().sum() == 0 else 'batch'}"
        else:
            compared[col] = _categorical(reference[col].dropna(), batch[col].dropna(), t)
    if columns.label is not None:
        col = columns.label
        if why := _absent(col, reference, batch):
            report.skipped[col] = why
        elif reference[col].notna().sum() == 0 or batch[col].notna().sum() == 0:
            report.skipped[col] = f"column '{col}' has no labels in the {'reference' if reference[col].notna().sum() == 0 else 'batch'}"
        else:
            label = _label(reference[col].dropna(), batch[col].dropna(), columns.problem_type, columns.classes, t)
            if isinstance(label, str):
                report.skipped[col] = label
            else:
                compared[col] = label
    if columns.images:
        if why := _absent(columns.images[0], reference, batch):
            report.skipped[MISSING_IMAGES] = why
        else:
            compared[MISSING_IMAGES] = _images(image_cells(reference, columns.images),
                                               image_cells(batch, columns.images), t)

    report.tests = _judge(compared, t)
    report.columns = dict(compared)
    report.drifted = [n for n, c in compared.items() if c.status == "fail"]
    report.warnings = [n for n, c in compared.items() if c.status == "warn"]
    report.passed, report.warned = not report.drifted, bool(report.warnings)
    parts = []
    if report.drifted:
        parts.append(f"drift in {len(report.drifted)} column(s): "
                     + "; ".join(_explain(n, compared[n], "fail", t) for n in report.drifted))
    if report.warnings:
        parts.append(f"warning for {len(report.warnings)} column(s): "
                     + "; ".join(_explain(n, compared[n], "warn", t) for n in report.warnings))
    if not parts:
        parts.append(f"all {len(compared)} compared columns look like the reference's population "
                     f"({report.tests} tests, Holm-adjusted p > {t.alpha_warn:g} or effect below its floor)")
    if report.skipped:
        parts.append(f"skipped: {', '.join(report.skipped)}")
    report.reason = ". ".join(parts)
    return report
