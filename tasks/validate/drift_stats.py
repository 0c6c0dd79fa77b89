"""The measurements behind the drift gate (`tasks/validate/drift.py`): PSI, KS, category shares, and the
Great Expectations run that finds codes a batch has and its reference never had.

Pure functions of arrays and frames returning plain numbers; the gate turns them into statuses.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
from pydantic import BaseModel
from scipy import stats

PSI_BINS = 10
# Floor for a bin's share before the log: an empty bin counts as holding 1 row in 10,000.
PSI_EPSILON = 1e-4
# A category is bucketed on its own when it holds at least this share of the reference rows.
FREQUENT_CATEGORY_SHARE = 0.01
OTHER = "other"


def psi(reference_shares: np.ndarray, batch_shares: np.ndarray, epsilon: float = PSI_EPSILON) -> float:
    """Population stability index sum((b - r) * ln(b / r)) over matching buckets, shares floored at epsilon."""
    r = np.clip(np.asarray(reference_shares, dtype=float), epsilon, None)
    b = np.clip(np.asarray(batch_shares, dtype=float), epsilon, None)
    return float(np.sum((b - r) * np.log(b / r)))


def quantile_edges(reference: np.ndarray, bins: int = PSI_BINS) -> np.ndarray:
    """Inner bin edges at the reference's deciles, duplicates collapsed; a value holding a whole decile
    or more (Fee 0, VideoAmt 0, Quantity 1) gets a bin of its own.

    Buckets are (-inf, e0), [e0, e1), ..., [ek, inf). A repeated decile e is a point mass whose bucket
    [e, next edge) would also swallow the values above it, so the next distinct reference value above e
    is added as an edge: without it VideoAmt (96% zeros) would have one bucket and could never drift.
    """
    values = np.asarray(reference, dtype=float)
    deciles = np.quantile(values, np.linspace(0, 1, bins + 1)[1:-1])
    edges = set(np.unique(deciles).tolist())
    distinct = np.unique(values)
    for e in np.unique(deciles[np.r_[False, deciles[1:] == deciles[:-1]]]):
        above = distinct[distinct > e]
        if above.size:
            edges.add(float(above[0]))
    return np.array(sorted(edges))


def bucket_shares(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Share of `values` in each bucket of `quantile_edges` (len(edges) + 1 buckets)."""
    idx = np.searchsorted(edges, np.asarray(values, dtype=float), side="right")
    counts = np.bincount(idx, minlength=len(edges) + 1)
    return counts / max(int(counts.sum()), 1)


class NumericFigures(BaseModel):
    """The figures of one numeric column; the drift report's NumericDrift carries them as they are."""

    psi: float
    bin_edges: list[float]
    reference_shares: list[float]
    batch_shares: list[float]
    ks_statistic: float
    ks_pvalue: float
    reference_mean: float
    batch_mean: float
    reference_median: float
    batch_median: float


def numeric_figures(reference: np.ndarray, batch: np.ndarray) -> NumericFigures:
    """PSI over the reference's decile buckets (gated) and the two-sample KS test (reported)."""
    edges = quantile_edges(reference)
    r, b = bucket_shares(reference, edges), bucket_shares(batch, edges)
    ks = stats.ks_2samp(reference, batch)
    return NumericFigures(
        psi=psi(r, b), bin_edges=edges.tolist(), reference_shares=r.tolist(), batch_shares=b.tolist(),
        ks_statistic=float(ks.statistic), ks_pvalue=float(ks.pvalue),
        reference_mean=float(np.mean(reference)), batch_mean=float(np.mean(batch)),
        reference_median=float(np.median(reference)), batch_median=float(np.median(batch)),
    )


@dataclass
class CategoryFigures:
    psi: float
    buckets: list[str]  # the frequent codes as text, then OTHER
    reference_shares: list[float]
    batch_shares: list[float]
    # Good-Turing: the share of reference rows whose code occurs once estimates the share of new rows of
    # the same distribution carrying a code the reference lacks (Breed2, ~300 rare codes: ~3%).
    expected_unseen_share: float


def category_figures(reference: pd.Series, batch: pd.Series) -> CategoryFigures:
    """PSI over the reference's frequent codes (>= 1% of its rows) plus one bucket for every other code,
    codes the reference never had included."""
    ref_counts = reference.value_counts()
    ref_shares = ref_counts / max(int(ref_counts.sum()), 1)
    frequent = sorted(ref_shares[ref_shares >= FREQUENT_CATEGORY_SHARE].index.tolist())
    batch_shares = batch.value_counts(normalize=True)
    r = [float(ref_shares.get(c, 0.0)) for c in frequent]
    b = [float(batch_shares.get(c, 0.0)) for c in frequent]
    r.append(max(0.0, 1.0 - sum(r)))
    b.append(max(0.0, 1.0 - sum(b)))
    return CategoryFigures(
        psi=psi(np.array(r), np.array(b)), buckets=[str(c) for c in frequent] + [OTHER],
        reference_shares=r, batch_shares=b,
        expected_unseen_share=float((ref_counts == 1).sum() / max(int(ref_counts.sum()), 1)),
    )


@dataclass
class UnseenFigures:
    share: float  # of the batch's rows (GX unexpected_percent / 100)
    rows: int
    codes: dict[str, int] = field(default_factory=dict)  # code -> rows, most frequent first
    gx_success: bool = True


def unseen_codes(reference: pd.DataFrame, batch: pd.DataFrame, columns: list[str],
                 mostly: float) -> dict[str, UnseenFigures]:
    """For each column, the batch rows whose code never occurs in the reference: one GX 1.x run of
    `ExpectColumnValuesToBeInSet(value_set=<reference codes>, mostly=...)` over all columns."""
    if not columns:
        return {}
    import great_expectations as gx
    import great_expectations.expectations as gxe
    from great_expectations.data_context.types.base import ProgressBarsConfig

    context = gx.get_context(mode="ephemeral")  # in memory: nothing on disk, no names to collide with
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    suite = context.suites.add(gx.ExpectationSuite(name="drift-unseen-codes", expectations=[
        gxe.ExpectColumnValuesToBeInSet(column=c, value_set=sorted(pd.unique(reference[c].dropna()).tolist()),
                                        mostly=mostly)
        for c in columns
    ]))
    data = (context.data_sources.add_pandas("drift").add_dataframe_asset("batch")
            .add_batch_definition_whole_dataframe("whole"))
    definition = context.validation_definitions.add(gx.ValidationDefinition(name="drift", data=data, suite=suite))
    # COMPLETE: the whole unexpected_list, so every unseen code is listed with its exact row count.
    result = definition.run(batch_parameters={"dataframe": batch[columns].reset_index(drop=True)},
                            result_format={"result_format": "COMPLETE"})
    out: dict[str, UnseenFigures] = {}
    for r in result.results:
        d: dict[str, Any] = r.to_json_dict()
        if d.get("exception_info", {}).get("raised_exception"):
            raise RuntimeError(f"GX failed on {d['expectation_config']['kwargs']['column']}: "
                               f"{d['exception_info'].get('exception_message')}")
        res = d["result"]
        counts = Counter(str(v) for v in res.get("unexpected_list") or res.get("partial_unexpected_list") or [])
        out[d["expectation_config"]["kwargs"]["column"]] = UnseenFigures(
            share=float(res.get("unexpected_percent") or 0.0) / 100, rows=int(res.get("unexpected_count") or 0),
            codes=dict(counts.most_common()), gx_success=bool(d["success"]),
        )
    return out


def label_rates(reference: pd.Series, batch: pd.Series, classes: list[int | str]) -> dict[str, tuple[float, float]]:
    """class (as text) -> (share in reference, share in batch), over the classes and any class either table has."""
    ref, new = reference.astype(str), batch.astype(str)
    seen = list(dict.fromkeys([*map(str, classes), *sorted(set(ref) | set(new))]))
    r, b = ref.value_counts(normalize=True), new.value_counts(normalize=True)
    return {c: (float(r.get(c, 0.0)), float(b.get(c, 0.0))) for c in seen}
