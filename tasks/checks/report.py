"""The validation report: GX results -> one typed record -> JSON, markdown and offline HTML.

GX's own Data Docs load CSS/JS from CDNs (blank offline), so we render our own. `render_markdown` is
also what the Prefect flow publishes as a markdown artifact.
"""

from __future__ import annotations

import html
import json
from typing import Any, Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field

from fusion_model.checks import IMAGE_CHECK_COLUMNS, IMAGE_ISSUE
from fusion_model.dataset import ROW_ID, DatasetSchema
from fusion_model.presets import RULES
from tasks.checks.suite import derived_columns, expectation_key, suite_order
from tasks.checks.tables import RawTable

MAX_EXAMPLES = 5
_MAX_CELL = 120

Status = Literal["passed", "failed", "error", "not_evaluated", "skipped"]


class Outcome(BaseModel):
    """One expectation on one table."""

    table: str
    file: str
    expectation: str  # GX type, e.g. expect_column_values_to_be_between
    column: str | None = None  # the CSV column it is about (image checks: Images); None for the table
    check: str = ""
    fix: str = ""
    status: Status
    success: bool
    kwargs: dict[str, Any] = Field(default_factory=dict)
    element_count: int | None = None
    unexpected_count: int | None = None
    unexpected_percent: float | None = None
    examples: list[dict[str, Any]] = Field(default_factory=list)
    note: str = ""  # observed value, missing classes, skip reason or exception message


class TableSummary(BaseModel):
    name: str
    file: str
    rows: int
    columns: list[str]
    extra_columns: list[str] = Field(default_factory=list)
    missing_optional_columns: list[str] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)
    success: bool = True


class ValidationReport(BaseModel):
    success: bool
    dataset_dir: str
    problem_type: str
    classes: list[int | str]
    suite: str
    gx_version: str = ""
    tables: list[TableSummary] = Field(default_factory=list)
    problems: list[str] = Field(default_factory=list)  # file-level failures before any expectation ran
    outcomes: list[Outcome] = Field(default_factory=list)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status in ("failed", "error")]

    @property
    def warnings(self) -> list[str]:
        out = [f"{t.file}: extra column(s) {t.extra_columns} are ignored (not written to the validated tables)"
               for t in self.tables if t.extra_columns]
        out += [f"{t.file}: {n}" for t in self.tables for n in t.notes]
        out += [
            f"{o.file}: {o.column}: {o.unexpected_count} row(s) fail '{o.check}' (within tolerance)"
            for o in self.outcomes if o.status == "passed" and o.unexpected_count
        ]
        return out


# ----------------------------------------------------------------------------------- from GX results
def _cell(value: Any, limit: int = _MAX_CELL) -> Any:
    if isinstance(value, np.generic):  # a numpy scalar (a row id GX hands back): a plain Python value for JSON
        value = value.item()
    if isinstance(value, str) and len(value) > limit:
        return value[: limit - 3] + "..."
    if isinstance(value, float) and pd.isna(value):
        return None
    return value


def _raised(exception_info: dict[str, Any] | None) -> str | None:
    """The exception message GX caught for an expectation, if any (two shapes exist in GX 1.x)."""
    if not exception_info:
        return None
    infos = [exception_info] if "raised_exception" in exception_info else list(exception_info.values())
    messages = [str(i.get("exception_message")) for i in infos if isinstance(i, dict) and i.get("raised_exception")]
    return "; ".join(messages) or None


def _columns_of(kwargs: dict[str, Any]) -> list[str]:
    return [kwargs[k] for k in ("column", "column_A", "column_B") if k in kwargs]


def _examples(result: dict[str, Any], columns: list[str], table: RawTable, frame: pd.DataFrame,
              derived: dict[str, list[str]]) -> list[dict[str, Any]]:
    """Up to 5 failing rows as the CSV holds them (a derived verdict: the cells it was computed from; image
    checks also the file's issue)."""
    index_list = result.get("partial_unexpected_index_list") or []
    positions = pd.Series(range(len(frame)), index=frame[ROW_ID].to_numpy())
    positions = positions[~positions.index.duplicated()]
    examples = []
    for entry in index_list[:MAX_EXAMPLES]:
        rid = entry.get(ROW_ID) if isinstance(entry, dict) else entry
        example: dict[str, Any] = {ROW_ID: _cell(rid)}
        pos = positions.get(rid)
        if pos is None:
            examples.append(example)
            continue
        for col in columns:
            for src in derived.get(col, [col]):
                if src in table.raw.columns:
                    example[src] = _cell(table.raw.at[pos, src])
            if col in IMAGE_CHECK_COLUMNS:
                example["issue"] = _cell(frame.at[pos, IMAGE_ISSUE], limit=4 * _MAX_CELL)  # names the file
        examples.append(example)
    return examples


def outcomes_from_gx(results: list[dict[str, Any]], table: RawTable, frame: pd.DataFrame,
                     schema: DatasetSchema) -> list[Outcome]:
    """Turn one table's GX expectation results (to_json_dict form) into outcomes."""
    derived = derived_columns(schema)
    shown = {RULES[name].name: RULES[name].column for name in schema.checks.rules}  # a rule names its column
    outcomes = []
    for r in results:
        config = r["expectation_config"]
        kwargs = {k: v for k, v in config["kwargs"].items() if k != "batch_id"}
        meta = config.get("meta") or {}
        columns = _columns_of(kwargs)
        sources = [s for c in columns for s in derived.get(c, [c])]
        absent = [s for s in sources if s not in table.raw.columns and s != ROW_ID]
        result = r.get("result") or {}
        status: Status = "passed" if r["success"] else "failed"
        note = ""
        if absent and config["type"] != "expect_column_to_exist":
            if all(a in schema.checks.optional for a in absent):
                status, note = "skipped", f"optional column {absent[0]!r} is absent"
            else:
                status, note = "not_evaluated", f"column {absent[0]!r} is missing"
        elif (err := _raised(r.get("exception_info"))) is not None:
            status, note = "error", f"GX raised: {err}"
        elif "partial_missing_list" in result and result.get("partial_missing_list"):
            note = f"missing: {sorted(result['partial_missing_list'], key=str)}"
        elif "observed_value" in result and not r["success"]:
            note = f"observed: {result['observed_value']}"
        display = columns[0] if columns else None
        if display in derived:
            display = shown.get(display) or ", ".join(derived[display]) or display
        elif len(columns) > 1:
            display = ", ".join(columns)
        value_sets = ("value_set", "value_pairs_set")
        outcomes.append(Outcome(
            table=table.name,
            file=table.path.name,
            expectation=config["type"],
            column=display,
            check=meta.get("check", ""),
            fix=meta.get("fix", ""),
            status=status,
            success=status in ("passed", "skipped"),
            # Long value sets live in the suite file; the report names their size only.
            kwargs={k: (f"<{len(v)} values>" if k in value_sets and isinstance(v, list) and len(v) > 20 else v)
                    for k, v in kwargs.items()},
            element_count=result.get("element_count"),
            unexpected_count=result.get("unexpected_count"),
            unexpected_percent=result.get("unexpected_percent"),
            examples=_examples(result, columns, table, frame, derived) if status in ("failed", "passed") else [],
            note=note,
        ))
    order = suite_order(schema)
    return sorted(outcomes, key=lambda o: order.get(expectation_key(o.expectation, o.kwargs), len(order)))


def table_summary(table: RawTable, outcomes: list[Outcome]) -> TableSummary:
    return TableSummary(
        name=table.name,
        file=table.path.name,
        rows=len(table.raw),
        columns=[c for c in table.raw.columns if c != ROW_ID],
        extra_columns=table.extra_columns,
        missing_optional_columns=table.missing_optional,
        notes=table.notes,
        success=all(o.success for o in outcomes if o.table == table.name),
    )


# ------------------------------------------------------------------------------------------ messages
def _example_text(example: dict[str, Any]) -> str:
    rid = example.get(ROW_ID)
    rest = ", ".join(f"{k}={v!r}" for k, v in example.items() if k != ROW_ID)
    return f"row_id {rid}" + (f" ({rest})" if rest else "")


def describe(o: Outcome) -> str:
    """One line per failed expectation: file, column, rule, how many rows, examples, fix."""
    where = f"{o.file}, column '{o.column}'" if o.column else o.file
    if o.expectation == "expect_column_to_exist":
        return f"{where}: missing (required column). Fix: {o.fix}"
    text = f"{where}: expected {o.check}"
    if o.status == "error":
        return f"{text}; could not be checked: {o.note}. Fix: {o.fix}"
    if o.unexpected_count is not None:
        text += f"; {o.unexpected_count} of {o.element_count} row(s) fail"
    if o.note:
        text += f"; {o.note}"
    if o.examples:
        text += "; e.g. " + "; ".join(_example_text(e) for e in o.examples)
    return f"{text}. Fix: {o.fix}"


def failure_message(report: ValidationReport, report_path: str) -> str:
    lines = [f"validation of {report.dataset_dir} failed ({len(report.failures) + len(report.problems)} problem(s); "
             f"full report: {report_path}):"]
    lines += [f"- {p}" for p in report.problems]
    lines += [f"- {describe(o)}" for o in report.failures]
    blocked: dict[tuple[str, str], int] = {}
    for o in report.outcomes:
        if o.status == "not_evaluated":
            blocked[(o.file, o.note)] = blocked.get((o.file, o.note), 0) + 1
    lines += [f"- {f}: {n} further expectation(s) not evaluated because {why}" for (f, why), n in blocked.items()]
    lines.append("Nothing under the validated output folder was replaced; the last good output is kept.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ markdown
def _md(value: Any) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(_md(c) for c in row) + " |" for row in rows]
    return out


def render_markdown(report: ValidationReport) -> str:
    """The report as markdown: verdict, tables, failures with example rows, warnings, every expectation."""
    verdict = "PASSED" if report.success else "FAILED"
    lines = [
        f"# Data validation: {verdict}",
        "",
        f"Dataset `{report.dataset_dir}` · problem type `{report.problem_type}`, classes {report.classes} · "
        f"suite `{report.suite}` · Great Expectations {report.gx_version}",
        "",
    ]
    if report.tables:
        lines += ["## Tables", ""]
        lines += _md_table(
            ["table", "file", "rows", "extra columns", "absent optional columns", "verdict"],
            [[t.name, t.file, t.rows, ", ".join(t.extra_columns) or "-", ", ".join(t.missing_optional_columns) or "-",
              "passed" if t.success else "failed"] for t in report.tables],
        )
        lines.append("")
    if report.problems or report.failures:
        lines += [f"## Failures ({len(report.problems) + len(report.failures)})", ""]
        lines += [f"- {p}" for p in report.problems]
        for o in report.failures:
            lines += [f"### {o.file} · {o.column or 'table'} · {o.check}", ""]
            count = f"{o.unexpected_count} of {o.element_count} rows. " if o.unexpected_count is not None else ""
            lines += [f"{count}{o.note + '. ' if o.note else ''}Fix: {o.fix}", ""]
            if o.examples:
                header = list(dict.fromkeys(k for e in o.examples for k in e))
                lines += _md_table(header, [[e.get(k, "") for k in header] for e in o.examples])
                lines.append("")
    if report.warnings:
        lines += ["## Warnings", ""] + [f"- {w}" for w in report.warnings] + [""]
    if report.outcomes:
        lines += ["## All expectations", ""]
        lines += _md_table(
            ["table", "column", "check", "expectation", "status", "unexpected"],
            [[o.table, o.column or "(table)", o.check, o.expectation, o.status,
              "" if o.unexpected_count is None else o.unexpected_count] for o in report.outcomes],
        )
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- html
_CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:2rem auto;max-width:70rem;color:#222;
padding:0 1rem}h1 .passed{color:#17702f}h1 .failed{color:#b3261e}table{border-collapse:collapse;margin:.5rem 0 1.5rem;
font-size:.9rem}th,td{border:1px solid #ccc;padding:.25rem .5rem;text-align:left;vertical-align:top}
th{background:#f3f3f3}tr.failed td,tr.error td{background:#fdecea}tr.not_evaluated td{background:#fff6e0}
tr.skipped td{color:#777}code{background:#f3f3f3;padding:0 .2rem}.fix{color:#444}
"""


def _h(value: Any) -> str:
    return html.escape(str(value))


def _html_table(header: list[str], rows: list[list[Any]], classes: list[str] | None = None) -> str:
    head = "".join(f"<th>{_h(c)}</th>" for c in header)
    body = "".join(
        f"<tr class='{_h(classes[i]) if classes else ''}'>" + "".join(f"<td>{_h(c)}</td>" for c in row) + "</tr>"
        for i, row in enumerate(rows)
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: ValidationReport) -> str:
    """A self-contained page (inline CSS, no scripts, no network) with the same content as the markdown."""
    verdict = "passed" if report.success else "failed"
    parts = [
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>Data validation: {verdict}</title><style>{_CSS}</style></head><body>",
        f"<h1>Data validation: <span class='{verdict}'>{verdict.upper()}</span></h1>",
        f"<p>Dataset <code>{_h(report.dataset_dir)}</code> · problem type <code>{_h(report.problem_type)}</code>, "
        f"classes {_h(report.classes)} · suite <code>{_h(report.suite)}</code> · Great Expectations "
        f"{_h(report.gx_version)}</p>",
    ]
    if report.tables:
        parts.append("<h2>Tables</h2>")
        parts.append(_html_table(
            ["table", "file", "rows", "extra columns", "absent optional columns", "verdict"],
            [[t.name, t.file, t.rows, ", ".join(t.extra_columns) or "-", ", ".join(t.missing_optional_columns) or "-",
              "passed" if t.success else "failed"] for t in report.tables],
            ["" if t.success else "failed" for t in report.tables],
        ))
    if report.problems or report.failures:
        parts.append(f"<h2>Failures ({len(report.problems) + len(report.failures)})</h2>")
        if report.problems:
            parts.append("<ul>" + "".join(f"<li>{_h(p)}</li>" for p in report.problems) + "</ul>")
        for o in report.failures:
            parts.append(f"<h3>{_h(o.file)} · {_h(o.column or 'table')} · {_h(o.check)}</h3>")
            count = f"{o.unexpected_count} of {o.element_count} rows. " if o.unexpected_count is not None else ""
            parts.append(f"<p>{_h(count)}{_h(o.note + '. ' if o.note else '')}<span class='fix'>Fix: {_h(o.fix)}</span></p>")
            if o.examples:
                header = list(dict.fromkeys(k for e in o.examples for k in e))
                parts.append(_html_table(header, [[e.get(k, "") for k in header] for e in o.examples]))
    if report.warnings:
        parts.append("<h2>Warnings</h2><ul>" + "".join(f"<li>{_h(w)}</li>" for w in report.warnings) + "</ul>")
    if report.outcomes:
        parts.append("<h2>All expectations</h2>")
        parts.append(_html_table(
            ["table", "column", "check", "expectation", "status", "unexpected"],
            [[o.table, o.column or "(table)", o.check, o.expectation, o.status,
              "" if o.unexpected_count is None else o.unexpected_count] for o in report.outcomes],
            [o.status for o in report.outcomes],
        ))
    parts.append("</body></html>\n")
    return "".join(parts)


def report_json(report: ValidationReport) -> str:
    data = report.model_dump(mode="json")
    data["warnings"] = report.warnings
    data["failed"] = len(report.failures) + len(report.problems)
    return json.dumps(data, indent=2, default=str) + "\n"
