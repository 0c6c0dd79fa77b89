"""The drift gate on real PetFinder rows (the shared data folder's dogs_train.csv; skipped without it): it
fails few same-population batches of 100 rows, and catches a cat batch, an older batch and a faster-adopted
batch at 200 rows, naming the column. The cases are bench/drift_cases.py's, the ones BENCHMARKS.md
reports over many shuffles (bench/drift_gate.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import drift_cases as cases  # noqa: E402

from fusion_model.dataset import resolve_schema  # noqa: E402
from tasks.intake.drift import drift_gate  # noqa: E402
from tasks.intake.drift_stats import DriftColumns  # noqa: E402
from tasks.params import DriftGateParams  # noqa: E402

COLUMNS = DriftColumns.from_schema(resolve_schema({"preset": "petfinder"}))
GATE = DriftGateParams()  # params.yaml's intake.drift_gate (test_drift.py checks they agree)
SEED = 0


@pytest.fixture(scope="module")
def split() -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the 5,000-row reference, the 3,092 rows after it) of one seeded shuffle of the real dog rows."""
    shared = cases.shared_data()
    if shared is None:
        pytest.skip(f"no real rows: {cases.DOGS} is in none of $SHARED_DATA, <repo>/../shared, /work/shared "
                    "(set SHARED_DATA to the folder holding it to run these tests)")
    return cases.split(cases.load_dogs(shared / cases.DOGS), SEED)


def test_same_population_batches_of_100_real_rows_fail_at_most_5_percent(split) -> None:
    """Before: params.yaml's absolute thresholds failed 10 of these 30 batches (PSI and unseen-share noise
    at 100 rows); the calibrated gate may fail one at most."""
    reference, after = split
    batches = cases.batches(after, 100)
    reports = [drift_gate(reference, batch, COLUMNS, GATE) for batch in batches]
    failed = [r.reason for r in reports if not r.passed]
    assert len(batches) == 30
    assert len(failed) <= 0.05 * len(batches), failed
    assert all(r.skipped == {"missing_images": "column 'Images' absent from the reference and the batch"}
               for r in reports)  # the real file has no photos; every other column was compared


@pytest.mark.parametrize(("shift", "columns"), [
    ("cats", ["Type", "Breed1"]),
    ("older", ["Age"]),
    ("faster", ["AdoptionSpeed"]),
])
def test_each_real_shift_fails_at_200_rows_naming_its_column(split, shift: str, columns: list[str]) -> None:
    reference, after = split
    rng = np.random.default_rng(SEED)
    batch = after.iloc[:200].reset_index(drop=True)
    assert drift_gate(reference, batch, COLUMNS, GATE).passed  # the same rows, unshifted
    shifted = {"cats": lambda: cases.cats(batch, rng), "older": lambda: cases.older(batch),
               "faster": lambda: cases.faster(reference, after, 200, rng)}[shift]()
    report = drift_gate(reference, shifted, COLUMNS, GATE)
    assert not report.passed
    assert set(columns) <= set(report.drifted), report.reason
    assert all(f"{c} (" in report.reason for c in columns), report.reason
    if shift == "faster":
        rates = report.columns["AdoptionSpeed"].rates["1"]
        assert rates.difference == pytest.approx(cases.RATE_SHIFT, abs=0.005)
    if shift == "cats":
        assert {u.code for u in report.columns["Type"].unseen_codes} == {2}
