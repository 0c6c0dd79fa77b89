"""The statistics of the drift gate (`tasks/intake/drift.py`, also behind `python -m tasks drift`): for
each column of a batch against its reference, a two-sample test whose p-value accounts for how many rows
the batch has, an effect size a person can read, and Holm's correction over every test of one gate run.

Why tests with p-values, and not PSI against fixed thresholds: a batch of the reference's own population
has a PSI, an unseen-code share and a label-rate difference that shrink only as its rows grow, so a fixed
threshold fails healthy small batches and judges large ones too leniently (BENCHMARKS.md). A test's p-value already is "how often would a batch of this size, drawn
from the reference's population, look at least this different"; Holm's step-down correction over all
the gate's tests makes the chance that a same-population batch fails ANY of them at most `alpha`, with no
assumption about how the columns depend on each other. Permutation or bootstrap thresholds would give
the same calibration at ~1,000 times the cost per batch; PSI against its chance level would need that
chance level simulated per column and size. Measured on real rows: BENCHMARKS.md, "Drift gate".

The tests, per role (columns come by role in `DriftColumns`, taken from the dataset schema):
- numeric columns, text lengths, a regression label: two-sample Kolmogorov-Smirnov (scipy); with ties
  (codes like Quantity, VideoAmt) its p-value is conservative. Effect: PSI over the reference's deciles.
- categorical columns, two tests: (1) the shares of the codes the reference has, chi-square of
  homogeneity over the codes the batch expects at least MIN_EXPECTED rows of, the rest pooled (Cochran's
  rule, so the chi-square approximation holds at small batch sizes); effect: PSI over those buckets.
  (2) codes the reference never had: the number of such rows against a binomial whose rate is
  Good-Turing's estimate of the reference's missing mass, (singletons + 1) / (rows + 1) (rare-code columns
  such as a secondary breed carry new codes by chance; a column without rare codes almost never does); effect: the
  batch's share of such rows above that rate.
- a binary label and the share of rows without an image: Fisher's exact test on the 2 x 2 table; effect:
  the difference of the rates. A multiclass or ordinal label: chi-square over its classes (as (1));
  effect: the largest change of a class's share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, model_validator
from scipy import stats

from fusion_model.dataset import DatasetSchema

ProblemType = Literal["binary", "multiclass", "ordinal", "regression"]

PSI_BINS = 10
# Floor for a bin's share before the log: an empty bin counts as holding 1 row in 10,000.
PSI_EPSILON = 1e-4
# Cochran's rule for the chi-square approximation: every bucket expects at least 5 batch rows.
MIN_EXPECTED = 5
OTHER = "other"


class DriftColumns(BaseModel):
    """The columns the gate compares, by role; `from_schema` takes them from a dataset schema."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    numeric: tuple[str, ...] = ()
    categorical: tuple[str, ...] = ()
    text_length: tuple[str, ...] = ()  # text columns whose length (characters) is compared
    label: str | None = None
    problem_type: ProblemType = "binary"
    classes: tuple[int | str, ...] = ()  # the label's classes in order (binary: the positive class last)
    images: tuple[str, ...] = ()  # image path columns; the share of rows without any image is compared

    @classmethod
    def from_schema(cls, schema: DatasetSchema, classes: Sequence[int | str] | None = None) -> DriftColumns:
        """The schema's numerical, categorical, text (as lengths) and image columns, its label and problem
        type; `classes`: the label's classes as the validated tables hold them (default: the schema's)."""
        label = schema.label
        return cls(numeric=tuple(schema.columns.numerical), categorical=tuple(schema.columns.categorical),
                   text_length=tuple(schema.columns.text), label=label.column, problem_type=label.problem_type,
                   classes=tuple(classes if classes is not None else (label.classes or ())),
                   images=tuple(schema.columns.image))

    @model_validator(mode="after")
    def _each_column_once(self) -> DriftColumns:
        named = self.names
        twice = sorted({c for c in named if named.count(c) > 1})
        if twice:
            raise ValueError(f"columns named in more than one role: {', '.join(twice)}; give each one role")
        return self

    @property
    def names(self) -> list[str]:
        """Every column named, in role order."""
        return [*self.numeric, *self.categorical, *self.text_length, *([self.label] if self.label else []),
                *self.images]


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: rejecting where adjusted <= alpha keeps the chance of any false
    rejection at most alpha. Hand-written (six lines): scipy has only Benjamini-Hochberg, and statsmodels
    is not a dependency."""
    p = np.asarray(p_values, dtype=float)
    adjusted, running = np.empty_like(p), 0.0
    for rank, i in enumerate(np.argsort(p, kind="stable")):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()


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
    """The two-sample KS test (gated) and the PSI over the reference's decile buckets (its effect size)."""
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
class ShareFigures:
    """Chi-square of homogeneity of the code shares, reference against batch, over pooled buckets."""

    buckets: list[str]  # codes as text (most frequent first), then OTHER when some were pooled
    reference_shares: list[float]
    batch_shares: list[float]
    chi2: float
    dof: int
    p_value: float
    psi: float
    rows: int  # batch rows compared (those whose code the reference has, for a categorical column)
    largest_change: float  # the largest |batch share - reference share| over the buckets


def share_figures(reference: pd.Series, batch: pd.Series, min_expected: int = MIN_EXPECTED) -> ShareFigures:
    """Codes the batch expects >= `min_expected` rows of get a bucket each, the others share OTHER; OTHER
    itself must expect as many, else the rarest bucket joins it. Fewer than two buckets: nothing to test
    at this batch size (p 1)."""
    ref_counts, new_counts = reference.value_counts().to_dict(), batch.value_counts().to_dict()
    n_ref, n = sum(ref_counts.values()), sum(new_counts.values())
    codes = list(dict.fromkeys([*ref_counts, *new_counts]))  # most frequent in the reference first
    expected = {c: ref_counts.get(c, 0) / max(n_ref, 1) * n for c in codes}
    own = [c for c in codes if expected[c] >= min_expected]
    pooled = [c for c in codes if c not in own]
    while own and pooled and sum(expected[c] for c in pooled) < min_expected:
        pooled.append(own.pop())  # the least frequent of the buckets left
    groups = [[c] for c in own] + ([pooled] if pooled else [])
    ref_table = np.array([sum(ref_counts.get(c, 0) for c in g) for g in groups], dtype=float)
    new_table = np.array([sum(new_counts.get(c, 0) for c in g) for g in groups], dtype=float)
    r, b = ref_table / max(n_ref, 1), new_table / max(n, 1)
    chi2, dof, p = 0.0, 0, 1.0
    if len(groups) >= 2 and n > 0 and n_ref > 0:
        result = stats.chi2_contingency(np.vstack([ref_table, new_table]), correction=False)
        chi2, dof, p = float(result.statistic), int(result.dof), float(result.pvalue)
    compared = bool(groups) and n > 0 and n_ref > 0  # else there are no shares to compare
    return ShareFigures(
        buckets=[str(c) for c in own] + ([OTHER] if pooled else []), reference_shares=r.tolist(),
        batch_shares=b.tolist(), chi2=chi2, dof=dof, p_value=p, psi=psi(r, b) if compared else 0.0, rows=n,
        largest_change=float(np.max(np.abs(b - r))) if compared else 0.0,
    )


@dataclass
class UnseenFigures:
    rows: int  # batch rows whose code the reference never had
    share: float  # of the batch's rows
    expected_share: float  # by chance: Good-Turing's missing mass of the reference, (singletons + 1) / (rows + 1)
    p_value: float  # binomial: this many such rows or more, at the expected share
    codes: dict[int | str, int] = field(default_factory=dict)  # code -> rows, most frequent first


def _code(value: object) -> int | str:
    return int(value) if isinstance(value, (int, np.integer)) or (isinstance(value, float) and value.is_integer()) \
        else str(value)


def unseen_figures(reference: pd.Series, batch: pd.Series) -> UnseenFigures:
    """The batch rows with a code the reference never had, against the share expected by chance."""
    ref_counts = reference.value_counts()
    expected = (int((ref_counts == 1).sum()) + 1) / (len(reference) + 1)
    unseen = batch[~batch.isin(ref_counts.index)]
    k, n = len(unseen), len(batch)
    p = float(stats.binomtest(k, n, expected, alternative="greater").pvalue) if n else 1.0
    return UnseenFigures(rows=k, share=k / max(n, 1), expected_share=expected, p_value=p,
                         codes={_code(c): int(m) for c, m in unseen.value_counts().items()})


@dataclass
class RateFigures:
    """Fisher's exact test of one share (a binary label's positive rate, rows without an image)."""

    reference_rows: int  # rows with the property, in the reference
    batch_rows: int
    reference_share: float
    batch_share: float
    p_value: float


def rate_figures(reference: np.ndarray, batch: np.ndarray) -> RateFigures:
    """`reference` and `batch` are booleans: does the row have the property."""
    r, b = int(np.sum(reference)), int(np.sum(batch))
    n_ref, n = len(reference), len(batch)
    result = stats.fisher_exact([[r, n_ref - r], [b, n - b]])
    return RateFigures(reference_rows=r, batch_rows=b, reference_share=r / max(n_ref, 1),
                       batch_share=b / max(n, 1), p_value=float(result.pvalue))


def class_rates(reference: pd.Series, batch: pd.Series) -> dict[int | str, tuple[float, float]]:
    """class -> (share in reference, share in batch), over every class either table has."""
    r, b = reference.value_counts(normalize=True), batch.value_counts(normalize=True)
    classes = sorted(set(r.index) | set(b.index), key=lambda c: (isinstance(c, str), c))
    return {_code(c): (float(r.get(c, 0.0)), float(b.get(c, 0.0))) for c in classes}
