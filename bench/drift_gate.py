"""The drift gate on real rows: how often it fails batches of the reference's own population (false fails),
and how often it catches three real shifts (power), by batch size; rates, not times.

    python bench/drift_gate.py                    # 20 shuffles, params.yaml's intake.drift_gate
    python bench/drift_gate.py --seeds 5 --csv /data/dogs_train.csv

The cases (bench/drift_cases.py): real dog rows of PetFinder.my, a 5,000-row reference per seeded
shuffle, every disjoint same-population batch of 100, 200 and 400 rows after it; a cat batch, an Age
shifted by +12 months and a fast-adoption rate moved by +15 points, at 100, 200 and 400 rows, made from the
first --shift-draws disjoint batches of each size per shuffle; and, for context, smaller shifts (Age +3 /
+6 months, rate +5 / +10 points). Also the smallest Holm-adjusted p-value of each same-population batch
(how far from alpha the gate's noise stays). Prints markdown tables for BENCHMARKS.md and writes
bench/results/drift_gate.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import drift_cases as cases  # noqa: E402

from fusion_model.dataset import resolve_schema  # noqa: E402
from tasks._io.files import write_json  # noqa: E402
from tasks.intake.drift import drift_gate  # noqa: E402
from tasks.intake.drift_stats import DriftColumns  # noqa: E402
from tasks.params import load_params  # noqa: E402

SIZES = (100, 200, 400)
SHIFTS = {  # name -> (the column that must be named, how the batch is made)
    "cats": ("Type", lambda ref, after, batch, rng, size: cases.cats(batch, rng)),
    "Age +12 months": ("Age", lambda ref, after, batch, rng, size: cases.older(batch, 12)),
    "fast rate +15 points": ("AdoptionSpeed", lambda ref, after, batch, rng, size: cases.faster(ref, after, size, rng, 0.15)),
    "Age +6 months": ("Age", lambda ref, after, batch, rng, size: cases.older(batch, 6)),
    "Age +3 months": ("Age", lambda ref, after, batch, rng, size: cases.older(batch, 3)),
    "fast rate +10 points": ("AdoptionSpeed", lambda ref, after, batch, rng, size: cases.faster(ref, after, size, rng, 0.10)),
    "fast rate +5 points": ("AdoptionSpeed", lambda ref, after, batch, rng, size: cases.faster(ref, after, size, rng, 0.05)),
}


def _rate(k: int, n: int) -> str:
    """k/n as a percentage with its 95 % Wilson interval (n batches are few: say how sure the rate is)."""
    if n == 0:
        return "-"
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return f"{100 * p:.1f} % ({100 * max(0.0, centre - half):.1f}-{100 * min(1.0, centre + half):.1f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=None, help="the real dog rows (default: the shared data folder's)")
    parser.add_argument("--seeds", type=int, default=20, help="seeded shuffles, each with its own reference")
    parser.add_argument("--shift-draws", type=int, default=5, help="shifted batches per shift, size and shuffle")
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "drift_gate.json")
    args = parser.parse_args(argv)
    csv = args.csv or ((cases.shared_data() or Path("/nonexistent")) / cases.DOGS)
    if not csv.is_file():
        print(f"error: {csv}: no such file; pass --csv, or set SHARED_DATA to the folder holding {cases.DOGS}",
              file=sys.stderr)
        return 2
    gate = load_params(args.params).intake.drift_gate
    columns = DriftColumns.from_schema(resolve_schema({"preset": "petfinder"}))
    rows = cases.load_dogs(csv)
    null = {size: Counter() for size in SIZES}
    smallest: dict[int, list[float]] = {size: [] for size in SIZES}
    named: dict[int, Counter] = {size: Counter() for size in SIZES}
    power = {(name, size): Counter() for name in SHIFTS for size in SIZES}
    also: dict[tuple[str, int], Counter] = {key: Counter() for key in power}
    started, calls = time.perf_counter(), 0
    for seed in range(args.seeds):
        reference, after = cases.split(rows, seed)
        rng = np.random.default_rng(seed)
        for size in SIZES:
            for draw, batch in enumerate(cases.batches(after, size)):
                report = drift_gate(reference, batch, columns, gate)
                calls += 1
                null[size].update(batches=1, failed=not report.passed, warned=report.warned)
                named[size].update(report.drifted)
                smallest[size].append(min(t.p_adjusted for c in report.columns.values() for t in c.tests))
                if draw >= args.shift_draws:
                    continue
                for name, (column, make) in SHIFTS.items():
                    shifted = drift_gate(reference, make(reference, after, batch, rng, size), columns, gate)
                    calls += 1
                    power[name, size].update(batches=1, failed=not shifted.passed,
                                             named=column in shifted.drifted)
                    also[name, size].update(c for c in shifted.drifted if c != column)
    seconds = time.perf_counter() - started

    print(f"{len(rows)} real dog rows, {args.seeds} shuffles, reference {cases.REFERENCE_ROWS} rows; "
          f"{calls} gate calls, {seconds / calls * 1000:.0f} ms each\n")
    print("| batch rows | batches | failed (95 % interval) | warned | columns named in the fails |")
    print("|---|---|---|---|---|")
    for size in SIZES:
        c = null[size]
        print(f"| {size} | {c['batches']} | {_rate(c['failed'], c['batches'])} | {_rate(c['warned'], c['batches'])} "
              f"| {', '.join(f'{k} {v}' for k, v in named[size].most_common()) or '-'} |")
    print("\nsmallest Holm-adjusted p-value per same-population batch, 1st / 5th / 50th percentile:")
    for size in SIZES:
        q = np.quantile(smallest[size], [0.01, 0.05, 0.5])
        print(f"- {size} rows: {q[0]:.3g} / {q[1]:.3g} / {q[2]:.3g}")
    print("\n| shift | column | " + " | ".join(f"{s} rows: failed naming it" for s in SIZES) + " |")
    print("|---|---|" + "---|" * len(SIZES))
    for name, (column, _) in SHIFTS.items():
        cells = [_rate(power[name, s]["named"], power[name, s]["batches"]) for s in SIZES]
        print(f"| {name} | {column} | " + " | ".join(cells) + " |")
    print("\nother columns also named at 200 rows (times):")
    for name in SHIFTS:
        print(f"- {name}: {', '.join(f'{k} {v}' for k, v in also[name, 200].most_common(6)) or 'none'}")

    write_json(args.out, {
        "rows": len(rows), "seeds": args.seeds, "reference_rows": cases.REFERENCE_ROWS,
        "drift_gate": gate.model_dump(), "seconds_per_call": seconds / calls,
        "same_population": {str(s): dict(null[s]) | {"named": dict(named[s]),
                                                     "smallest_p_adjusted": sorted(smallest[s])} for s in SIZES},
        "shifts": {name: {str(s): dict(power[name, s]) | {"also_named": dict(also[name, s])} for s in SIZES}
                   for name in SHIFTS},
    })
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
