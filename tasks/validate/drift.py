"""The drift gate: compare a new labelled batch with the reference (the rows the current model was trained
on), column by column, before the batch joins the training data.

`drift_gate(reference, batch, thresholds, schema, classes) -> DriftReport` is pure (no files): a column whose
gated figure is above its fail threshold fails the gate and stops the run before training; above its
warn threshold it warns and the run goes on. `write_drift_report` writes drift.json / drift.md /
drift.png; `render_drift_markdown` is also the Prefect artifact.

What is gated (figures from `tasks/validate/drift_stats.py`):
- numeric columns and the Description length: PSI over the reference's decile buckets (KS reported only:
  with thousands of rows its p-value flags harmless differences);
- categorical codes: the share of batch rows with a code the reference never had (Great Expectations
  `ExpectColumnValuesToBeInSet`) and the PSI of the frequent codes + "other"; the worse of the two counts;
- the label: the largest change of a class's rate (binary: the positive rate);
- photos: the change of the share of rows without a photo (empty `Images`).
A batch smaller than `min_rows` is refused. Columns absent from either table are skipped, not failed.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field

from fusion_model.checks import image_cells
from fusion_model.dataset import DatasetSchema, resolve_schema, sort_classes, split_images
from tasks._io.files import write_bytes, write_json, write_text
from tasks.params import DriftGateParams as DriftThresholds  # params.yaml download.drift_gate
from tasks.validate import drift_stats

Status = Literal["ok", "warn", "fail"]
_RANK: dict[str, int] = {"ok": 0, "warn": 1, "fail": 2}
LENGTH_SUFFIX = "_length"
MISSING_PHOTOS = "missing_photos"
MAX_CODES_IN_REASON = 5
MAX_CODES_IN_TABLE = 20


class _Column(BaseModel):
    status: Status
    statistic: str  # the name of the gated figure
    value: float  # the gated figure
    warn: float
    fail: float
    detail: str = ""  # one line for people: the figures behind the status


class NumericDrift(_Column, drift_stats.NumericFigures):
    kind: Literal["numeric", "text_length"]


class UnseenCode(BaseModel):
    code: str
    rows: int


class CategoricalDrift(_Column):
    kind: Literal["categorical"]
    psi: float
    psi_status: Status
    unseen_share: float
    unseen_rows: int
    unseen_status: Status
    unseen_codes: list[UnseenCode]  # most frequent first
    expected_unseen_share: float  # without drift, by chance (Good-Turing: reference codes seen only once)
    gx_success: bool  # GX's verdict on ExpectColumnValuesToBeInSet(mostly=1 - unseen_fail)
    buckets: list[str]
    reference_shares: list[float]
    batch_shares: list[float]


class ClassRate(BaseModel):
    reference: float
    batch: float
    difference: float  # batch - reference


class LabelDrift(_Column):
    kind: Literal["label"]
    rates: dict[str, ClassRate]  # class (as text) -> rates


class PhotoDrift(_Column):
    kind: Literal["photos"]
    reference_share: float
    batch_share: float
    reference_rows_without_photo: int
    batch_rows_without_photo: int


ColumnDrift = Annotated[NumericDrift | CategoricalDrift | LabelDrift | PhotoDrift, Field(discriminator="kind")]


class DriftReport(BaseModel):
    passed: bool  # no column failed and the batch was large enough
    warned: bool  # some column is above its warn threshold
    drifted: list[str]  # columns with status fail
    warnings: list[str]  # columns with status warn
    reason: str  # why it failed / warned, or that it passed
    reference_rows: int
    batch_rows: int
    label: str = ""
    problem_type: str = "binary"
    thresholds: DriftThresholds
    columns: dict[str, ColumnDrift] = Field(default_factory=dict)
    skipped: dict[str, str] = Field(default_factory=dict)  # column -> why it was not compared
    batch: int | None = None  # which arriving batch this is; set by the caller (tasks/download/batches.py)


def _num(x: float) -> float:
    """Six significant digits: readable JSON, and tiny p-values stay visible (not rounded to 0)."""
    return float(f"{float(x):.6g}")


def _nums(xs: list[float]) -> list[float]:
    return [_num(x) for x in xs]


def _status(value: float, warn: float, fail: float) -> Status:
    return "fail" if value > fail else "warn" if value > warn else "ok"


def _absent(column: str, reference: pd.DataFrame, batch: pd.DataFrame) -> str | None:
    missing = [name for name, t in (("reference", reference), ("batch", batch)) if column not in t.columns]
    return f"column '{column}' absent from the {' and the '.join(missing)}" if missing else None


def _numeric(kind: Literal["numeric", "text_length"], ref: np.ndarray, new: np.ndarray,
             t: DriftThresholds) -> NumericDrift:
    f = drift_stats.numeric_figures(ref, new)
    figures = {k: _nums(v) if isinstance(v, list) else _num(v) for k, v in f.model_dump().items()}
    return NumericDrift(
        kind=kind, status=_status(f.psi, t.psi_warn, t.psi_fail), statistic="psi", value=figures["psi"],
        warn=t.psi_warn, fail=t.psi_fail, **figures,
        detail=f"mean {f.reference_mean:.3g} -> {f.batch_mean:.3g}, median {f.reference_median:.3g} -> "
               f"{f.batch_median:.3g}; KS {f.ks_statistic:.3f} (p {f.ks_pvalue:.2g}, not gated)",
    )


def _categorical(ref: pd.Series, new: pd.Series, unseen: drift_stats.UnseenFigures,
                 t: DriftThresholds) -> CategoricalDrift:
    f = drift_stats.category_figures(ref, new)
    psi_status = _status(f.psi, t.category_psi_warn, t.category_psi_fail)
    unseen_status = _status(unseen.share, t.unseen_warn, t.unseen_fail)
    by_psi = (_RANK[psi_status], f.psi / max(t.category_psi_fail, 1e-12))
    by_unseen = (_RANK[unseen_status], unseen.share / max(t.unseen_fail, 1e-12))
    if by_unseen >= by_psi:
        statistic, value, warn, fail, status = "unseen_share", unseen.share, t.unseen_warn, t.unseen_fail, unseen_status
    else:
        statistic, value, warn, fail, status = "category_psi", f.psi, t.category_psi_warn, t.category_psi_fail, psi_status
    codes = [UnseenCode(code=c, rows=n) for c, n in unseen.codes.items()]
    chance = f" (~{f.expected_unseen_share:.1%} expected by chance)" if f.expected_unseen_share >= 0.001 else ""
    return CategoricalDrift(
        kind="categorical", status=status, statistic=statistic, value=_num(value), warn=warn, fail=fail,
        psi=_num(f.psi), psi_status=psi_status, unseen_share=_num(unseen.share), unseen_rows=unseen.rows,
        unseen_status=unseen_status, unseen_codes=codes, expected_unseen_share=_num(f.expected_unseen_share), gx_success=unseen.gx_success, buckets=f.buckets,
        reference_shares=_nums(f.reference_shares), batch_shares=_nums(f.batch_shares),
        detail=f"unseen codes in {unseen.share:.1%} of rows{chance}; category PSI {f.psi:.3f}",
    )


def _label(ref: pd.Series, new: pd.Series, problem_type: str, classes: list[int | str],
           t: DriftThresholds) -> LabelDrift:
    rates = drift_stats.label_rates(ref.dropna(), new.dropna(), classes)
    table = {c: ClassRate(reference=_num(r), batch=_num(b), difference=_num(b - r)) for c, (r, b) in rates.items()}
    positive = str(classes[-1]) if classes else None
    if problem_type == "binary" and positive in rates:
        statistic, (r, b) = "positive_rate_difference", rates[positive]
        value, detail = abs(b - r), f"rate of class {positive}: {r:.1%} -> {b:.1%}"
    else:
        statistic = "max_rate_difference"
        worst = max(rates, key=lambda c: abs(rates[c][1] - rates[c][0]))
        r, b = rates[worst]
        value, detail = abs(b - r), f"largest change: class {worst} {r:.1%} -> {b:.1%}"
    return LabelDrift(kind="label", status=_status(value, t.label_rate_warn, t.label_rate_fail), statistic=statistic,
                      value=_num(value), warn=t.label_rate_warn, fail=t.label_rate_fail, rates=table, detail=detail)


def _photos(ref: pd.Series, new: pd.Series, t: DriftThresholds) -> PhotoDrift:
    ref_missing = int(ref.map(lambda cell: not split_images(cell)).sum())
    new_missing = int(new.map(lambda cell: not split_images(cell)).sum())
    r, b = ref_missing / max(len(ref), 1), new_missing / max(len(new), 1)
    value = abs(b - r)
    return PhotoDrift(
        kind="photos", status=_status(value, t.missing_photo_warn, t.missing_photo_fail),
        statistic="missing_photo_difference", value=_num(value), warn=t.missing_photo_warn,
        fail=t.missing_photo_fail, reference_share=_num(r), batch_share=_num(b),
        reference_rows_without_photo=ref_missing, batch_rows_without_photo=new_missing,
        detail=f"rows without a photo: {r:.1%} -> {b:.1%}",
    )


def _numbers(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").dropna().to_numpy(dtype=float)


def _text_lengths(s: pd.Series) -> np.ndarray:
    return s.fillna("").astype(str).str.len().to_numpy(dtype=float)


def _codes_text(codes: list[UnseenCode], limit: int) -> str:
    text = ", ".join(f"{u.code} ({u.rows})" for u in codes[:limit])
    return text + (f" and {len(codes) - limit} more" if len(codes) > limit else "")


def _explain(name: str, c: _Column, level: Literal["warn", "fail"]) -> str:
    limit = c.fail if level == "fail" else c.warn
    codes = f"; unseen codes (rows): {_codes_text(c.unseen_codes, MAX_CODES_IN_REASON)}" \
        if isinstance(c, CategoricalDrift) and c.unseen_codes else ""
    return f"{name} ({c.statistic} {c.value:.3g} > {level} {limit:g}; {c.detail}{codes})"


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


def drift_gate(reference: pd.DataFrame, batch: pd.DataFrame, thresholds: DriftThresholds,
               schema: DatasetSchema | None = None, classes: list[int | str] | None = None) -> DriftReport:
    """Compare `batch` with `reference` (typed tables of the validate stage) column by column, the columns
    taken by role from `schema` (default: the PetFinder preset); `classes`: the label's classes
    (classification; default: the values either table holds).

    `thresholds` may also be any pydantic model or mapping with DriftThresholds' fields (it is re-read
    as DriftThresholds, so an unknown field is an error)."""
    t = _thresholds(thresholds)
    schema = schema or resolve_schema({"preset": "petfinder"})
    label, problem_type = schema.label.column, schema.label.problem_type
    if classes is None and problem_type != "regression":
        classes = sort_classes(pd.concat([reference.get(label, pd.Series(dtype=str)),
                                          batch.get(label, pd.Series(dtype=str))]).astype(str))
    report = DriftReport(passed=False, warned=False, drifted=[], warnings=[], reason="", label=label,
                         reference_rows=len(reference), batch_rows=len(batch), problem_type=problem_type,
                         thresholds=t)
    small = [f"the {name} has {len(table)} rows, fewer than min_rows={t.min_rows}"
             for name, table in (("batch", batch), ("reference", reference)) if len(table) < t.min_rows]
    if small:
        report.reason = "; ".join(small) + ": too few rows to judge drift; nothing was compared"
        return report

    columns: dict[str, NumericDrift | CategoricalDrift | LabelDrift | PhotoDrift] = {}
    numeric = list(schema.columns.numerical) + ([label] if problem_type == "regression" else [])
    for col in numeric:
        if why := _absent(col, reference, batch):
            report.skipped[col] = why
            continue
        ref, new = _numbers(reference[col]), _numbers(batch[col])
        if ref.size == 0 or new.size == 0:
            report.skipped[col] = f"column '{col}' has no numbers in the {'reference' if ref.size == 0 else 'batch'}"
            continue
        columns[col] = _numeric("numeric", ref, new, t)
    for col in schema.columns.text:
        if why := _absent(col, reference, batch):
            report.skipped[col + LENGTH_SUFFIX] = why
            continue
        columns[col + LENGTH_SUFFIX] = _numeric("text_length", _text_lengths(reference[col]),
                                                _text_lengths(batch[col]), t)

    # an empty categorical cell is a missing value, not a code
    reference = reference.replace({c: {"": np.nan} for c in schema.columns.categorical if c in reference.columns})
    batch = batch.replace({c: {"": np.nan} for c in schema.columns.categorical if c in batch.columns})
    categorical = []
    for col in schema.columns.categorical:
        if why := _absent(col, reference, batch):
            report.skipped[col] = why
        elif reference[col].notna().sum() == 0:
            report.skipped[col] = f"column '{col}' has no codes in the reference"
        else:
            categorical.append(col)
    unseen = drift_stats.unseen_codes(reference, batch, categorical, mostly=1 - t.unseen_fail)
    for col in categorical:
        columns[col] = _categorical(reference[col].dropna(), batch[col].dropna(), unseen[col], t)

    if problem_type != "regression":
        if why := _absent(label, reference, batch):
            report.skipped[label] = why
        else:
            columns[label] = _label(reference[label], batch[label], problem_type, list(classes or []), t)
    if schema.columns.image:
        if why := _absent(schema.columns.image[0], reference, batch):
            report.skipped[MISSING_PHOTOS] = why
        else:
            columns[MISSING_PHOTOS] = _photos(image_cells(reference, schema.columns.image),
                                              image_cells(batch, schema.columns.image), t)

    report.columns = dict(columns)
    report.drifted = [n for n, c in columns.items() if c.status == "fail"]
    report.warnings = [n for n, c in columns.items() if c.status == "warn"]
    report.passed, report.warned = not report.drifted, bool(report.warnings)
    parts = []
    if report.drifted:
        parts.append(f"drift in {len(report.drifted)} column(s): "
                     + "; ".join(_explain(n, columns[n], "fail") for n in report.drifted))
    if report.warnings:
        parts.append(f"warning for {len(report.warnings)} column(s): "
                     + "; ".join(_explain(n, columns[n], "warn") for n in report.warnings))
    if not parts:
        parts.append(f"all {len(columns)} compared columns within their warn thresholds")
    if report.skipped:
        parts.append(f"skipped: {', '.join(report.skipped)}")
    report.reason = ". ".join(parts)
    return report


_STATUS_TEXT = {"ok": "ok", "warn": "**warn**", "fail": "**FAIL**"}
_COLOURS = {"ok": "#2e7d32", "warn": "#f9a825", "fail": "#c62828"}
PLOT_RATIO_CAP = 4.0  # bars beyond 4x their fail threshold are drawn at 4x, with their value written


def _title(report: DriftReport) -> str:
    return "FAILED" if not report.passed else "WARNED" if report.warned else "PASSED"


def render_drift_markdown(report: DriftReport) -> str:
    """The report for people (also the Prefect artifact): verdict, reason, one table row per column."""
    lines = [f"# Drift gate: {_title(report)}", "", report.reason, "",
             f"Reference {report.reference_rows} rows, batch {report.batch_rows} rows, label `{report.label}` "
             f"({report.problem_type}). A figure strictly above its threshold warns / fails.", ""]
    if report.columns:
        lines += ["| column | kind | statistic | value | warn | fail | status | unseen codes (rows) | figures |",
                  "|---|---|---|---:|---:|---:|---|---|---|"]
        for name, c in report.columns.items():
            codes = _codes_text(c.unseen_codes, MAX_CODES_IN_TABLE) if isinstance(c, CategoricalDrift) else ""
            lines.append(f"| {name} | {c.kind} | {c.statistic} | {c.value:.4g} | {c.warn:g} | {c.fail:g} | "
                         f"{_STATUS_TEXT[c.status]} | {codes} | {c.detail} |")
        lines.append("")
    if report.skipped:
        lines += ["Skipped (not compared, not failed):", ""]
        lines += [f"- {name}: {why}" for name, why in report.skipped.items()]
        lines.append("")
    return "\n".join(lines)


def render_drift_png(report: DriftReport) -> bytes:
    """One horizontal bar per column: its gated value / its fail threshold, coloured by status, with a
    tick at its warn ratio and the fail line at 1 (matplotlib's Agg canvas, no pyplot, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(report.columns)[::-1]  # first column at the top
    ratios = [report.columns[n].value / report.columns[n].fail if report.columns[n].fail > 0 else
              (0.0 if report.columns[n].value == 0 else PLOT_RATIO_CAP) for n in names]
    fig = Figure(figsize=(8, 1.6 + 0.32 * max(len(names), 1)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if not names:
        ax.text(0.5, 0.5, report.reason, ha="center", va="center", wrap=True)
        ax.set_axis_off()
    else:
        y = np.arange(len(names))
        ax.barh(y, [min(r, PLOT_RATIO_CAP) for r in ratios], color=[_COLOURS[report.columns[n].status] for n in names])
        for i, n in enumerate(names):
            c = report.columns[n]
            if c.fail > 0:
                ax.plot([c.warn / c.fail] * 2, [i - 0.4, i + 0.4], color="#555555", lw=1.5)
            cut = f" ({ratios[i]:.1f}x, bar cut)" if ratios[i] > PLOT_RATIO_CAP else ""
            ax.text(min(ratios[i], PLOT_RATIO_CAP) + 0.03, i, f"{c.statistic} {c.value:.3g}{cut}", va="center",
                    fontsize=7)
        ax.axvline(1.0, color=_COLOURS["fail"], ls="--", lw=1.2, label="fail threshold")
        ax.plot([], [], color="#555555", lw=1.5, label="warn threshold")
        ax.set_yticks(y, names, fontsize=8)
        ax.set_xlim(0, max(1.25, min(max(ratios), PLOT_RATIO_CAP) * 1.4))  # room for the labels
        ax.set_xlabel("gated value / fail threshold")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.6 / (1.6 + 0.32 * len(names))), ncols=2, fontsize=7)
    ax.set_title(f"Drift gate: {_title(report)} ({report.batch_rows} batch rows vs {report.reference_rows})")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def write_drift_report(report: DriftReport, report_dir: Path) -> list[Path]:
    """`<report_dir>/drift.json` (the model, indented), `drift.md` and `drift.png`, each written atomically."""
    report_dir = Path(report_dir)
    paths = [report_dir / "drift.json", report_dir / "drift.md", report_dir / "drift.png"]
    write_json(paths[0], report.model_dump(mode="json"))
    write_text(paths[1], render_drift_markdown(report))
    write_bytes(paths[2], render_drift_png(report))
    return paths
