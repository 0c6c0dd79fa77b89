"""The drift gate's report: what it holds (`DriftReport`, one `*Drift` model per compared column, each
with its `DriftTest`s) and how it is shown and kept: `render_drift_markdown` (also the Prefect artifact),
`render_drift_png`, and `write_drift_report` (drift.json / drift.md / drift.png).

How the gate fills it in: tasks/intake/drift.py.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, Field

from tasks._io.files import write_bytes, write_json, write_text
from tasks.intake import drift_stats
from tasks.intake.drift_stats import DriftColumns, ProblemType
from tasks.params import DriftGateParams as DriftThresholds  # params.yaml intake.drift_gate

Status = Literal["ok", "warn", "fail"]
_RANK: dict[str, int] = {"ok": 0, "warn": 1, "fail": 2}
MAX_CODES_IN_TABLE = 20


class DriftTest(BaseModel):
    """One test of the gate: its p-value, Holm's adjusted one, and the effect it must also reach."""

    test: str  # ks | chi2 | unseen_binomial | fisher
    about: str  # what it compares, for people
    statistic: float  # ks: D; chi2: chi-square; unseen_binomial and fisher: the batch rows counted
    p_value: float
    p_adjusted: float = 1.0  # Holm over every test of this gate run
    effect: str  # psi | unseen_share_above_chance | rate_difference | max_share_difference
    effect_size: float
    min_effect: float
    status: Status = "ok"


class _Column(BaseModel):
    status: Status = "ok"
    tests: list[DriftTest]
    detail: str = ""  # one line for people: the figures behind the status

    @property
    def decisive(self) -> DriftTest:
        """The test that gives the column its status (the smallest adjusted p-value among the worst)."""
        return min(self.tests, key=lambda t: (-_RANK[t.status], t.p_adjusted))


class NumericDrift(_Column, drift_stats.NumericFigures):
    kind: Literal["numeric", "text_length"]


class UnseenCode(BaseModel):
    code: int | str
    rows: int


class CategoricalDrift(_Column):
    kind: Literal["categorical"]
    psi: float
    buckets: list[str]
    reference_shares: list[float]
    batch_shares: list[float]
    unseen_share: float
    unseen_rows: int
    expected_unseen_share: float  # without drift, by chance (Good-Turing: reference codes seen only once)
    unseen_codes: list[UnseenCode]  # most frequent first


class ClassRate(BaseModel):
    reference: float
    batch: float
    difference: float  # batch - reference


class LabelDrift(_Column):
    kind: Literal["label"]
    problem_type: ProblemType
    rates: dict[str, ClassRate] = Field(default_factory=dict)  # class (as text) -> rates; not for regression
    reference_mean: float | None = None  # regression
    batch_mean: float | None = None


class ImageDrift(_Column):
    kind: Literal["images"]
    reference_share: float  # rows without an image
    batch_share: float
    reference_rows_without_image: int
    batch_rows_without_image: int


ColumnDrift = Annotated[NumericDrift | CategoricalDrift | LabelDrift | ImageDrift, Field(discriminator="kind")]


class DriftReport(BaseModel):
    passed: bool  # no column failed and the batch was large enough
    warned: bool  # some column warned
    drifted: list[str]  # columns with status fail
    warnings: list[str]  # columns with status warn
    reason: str  # why it failed / warned, or that it passed
    reference_rows: int
    batch_rows: int
    columns_by_role: DriftColumns = DriftColumns()
    tests: int = 0  # how many tests Holm's correction ran over
    thresholds: DriftThresholds
    columns: dict[str, ColumnDrift] = Field(default_factory=dict)
    skipped: dict[str, str] = Field(default_factory=dict)  # column -> why it was not compared
    batch: int | None = None  # which arriving batch this is; set by the caller (tasks/intake)


def unseen_codes_text(codes: list[UnseenCode], limit: int) -> str:
    """`code (rows), ...` for the first `limit` unseen codes, then how many more."""
    text = ", ".join(f"{u.code} ({u.rows})" for u in codes[:limit])
    return text + (f" and {len(codes) - limit} more" if len(codes) > limit else "")


_STATUS_TEXT = {"ok": "ok", "warn": "**warn**", "fail": "**FAIL**"}
_COLOURS = {"ok": "#2e7d32", "warn": "#f9a825", "fail": "#c62828"}
PLOT_LOG_CAP = 12.0  # bars beyond -log10(p) = 12 are drawn at 12, with their value written


def _title(report: DriftReport) -> str:
    return "FAILED" if not report.passed else "WARNED" if report.warned else "PASSED"


def render_drift_markdown(report: DriftReport) -> str:
    """The report for people (also the Prefect artifact): verdict, reason, one table row per test."""
    t = report.thresholds
    lines = [f"# Drift gate: {_title(report)}", "", report.reason, "",
             f"Reference {report.reference_rows} rows, batch {report.batch_rows} rows. A test fails when its "
             f"p-value after Holm's correction over all {report.tests} tests is <= {t.alpha_fail:g} (warns: "
             f"<= {t.alpha_warn:g}) and its effect reaches the floor shown: a batch of the reference's own "
             f"population fails with probability <= {t.alpha_fail:g}, whatever its size.", ""]
    if report.columns:
        lines += ["| column | kind | test | p (Holm) | effect | floor | status | unseen codes (rows) | figures |",
                  "|---|---|---|---:|---|---:|---|---|---|"]
        for name, c in report.columns.items():
            codes = unseen_codes_text(c.unseen_codes, MAX_CODES_IN_TABLE) if isinstance(c, CategoricalDrift) else ""
            for i, x in enumerate(c.tests):
                lines.append(f"| {name} | {c.kind} | {x.test}: {x.about} | {x.p_adjusted:.3g} | {x.effect} "
                             f"{x.effect_size:.3g} | {x.min_effect:g} | {_STATUS_TEXT[x.status]} | "
                             f"{codes if x.test == 'unseen_binomial' else ''} | {c.detail if i == 0 else ''} |")
        lines.append("")
    if report.skipped:
        lines += ["Skipped (not compared, not failed):", ""]
        lines += [f"- {name}: {why}" for name, why in report.skipped.items()]
        lines.append("")
    return "\n".join(lines)


def render_drift_png(report: DriftReport) -> bytes:
    """One horizontal bar per column: -log10 of its decisive test's Holm-adjusted p-value, coloured by
    status, with the warn and fail levels as lines (matplotlib's Agg canvas, no pyplot, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    t = report.thresholds
    names = list(report.columns)[::-1]  # first column at the top
    heights = [-np.log10(max(report.columns[n].decisive.p_adjusted, 1e-300)) for n in names]
    fig = Figure(figsize=(8, 1.6 + 0.32 * max(len(names), 1)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if not names:
        ax.text(0.5, 0.5, report.reason, ha="center", va="center", wrap=True)
        ax.set_axis_off()
    else:
        y = np.arange(len(names))
        ax.barh(y, [min(h, PLOT_LOG_CAP) for h in heights],
                color=[_COLOURS[report.columns[n].status] for n in names])
        for i, n in enumerate(names):
            d = report.columns[n].decisive
            cut = " (cut)" if heights[i] > PLOT_LOG_CAP else ""
            ax.text(min(heights[i], PLOT_LOG_CAP) + 0.1, i, f"p {d.p_adjusted:.2g}{cut}, {d.effect} {d.effect_size:.3g}",
                    va="center", fontsize=7)
        ax.axvline(-np.log10(t.alpha_fail), color=_COLOURS["fail"], ls="--", lw=1.2, label=f"fail: p <= {t.alpha_fail:g}")
        ax.axvline(-np.log10(t.alpha_warn), color="#555555", ls=":", lw=1.2, label=f"warn: p <= {t.alpha_warn:g}")
        ax.set_yticks(y, names, fontsize=8)
        ax.set_xlim(0, max(3.0, min(max(heights), PLOT_LOG_CAP)) * 1.8)  # room for the labels
        ax.set_xlabel("-log10 p after Holm (the decisive test of each column; a fail also needs its effect floor)")
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
