"""The real-row cases the drift gate is measured on (bench/drift_gate.py) and tested with
(tests/test_drift_real.py): a reference and same-population batches of real dog rows, and three shifts.

Rows: `petfinder/real/dogs_train.csv` of the shared data folder (`$SHARED_DATA`, else `<repo>/../shared`,
else `/work/shared`): 8,132 real PetFinder.my dog rows; the 40 whose PetID a spreadsheet damaged are
dropped (as `download.local.drop_bad_pet_ids: true` does), leaving 8,092; the binary label is
AdoptionSpeed <= 2 -> 1 (fast), as the download stage makes it. The file has no photos, so the image
column is absent and skipped by the gate.

- reference: the first 5,000 rows of a seeded shuffle; same-population batches: consecutive, disjoint
  slices of the 3,092 rows after them.
- cats: a batch of real dog rows turned into cats. Type becomes 2; Breed1 is drawn uniformly from the 66
  cat breeds of fusion_model/codes/breed_labels.csv (Type 2); Breed2 stays 0 where it was 0, else is
  drawn the same way. Every other column (colours, sizes, fur, age, text) stays the dog row's: no real
  cat rows are at hand, so the batch differs only where it must, a lower bound of how far a real cat
  batch moves.
- older: a batch whose Age is shifted by +12 months (every row).
- faster: a batch whose fast-adoption rate is the reference's plus 15 points: drawn from the rows after
  the reference, that many fast rows and the rest slow ones (the other columns move only as far as they
  go with the label in real rows).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd

from fusion_model.presets import petfinder as schema

ROOT = Path(__file__).resolve().parents[1]
DOGS = Path("petfinder") / "real" / "dogs_train.csv"
REFERENCE_ROWS = 5000
FAST_MAX_SPEED = 2  # AdoptionSpeed 0-2 (adopted within 30 days) -> 1 fast
AGE_SHIFT_MONTHS = 12
RATE_SHIFT = 0.15


def shared_data() -> Path | None:
    """The shared data folder holding `petfinder/real/dogs_train.csv`, or None when there is none."""
    candidates = [Path(os.environ["SHARED_DATA"])] if os.environ.get("SHARED_DATA") else []
    candidates += [ROOT.parent / "shared", Path("/work/shared")]
    return next((c for c in candidates if (c / DOGS).is_file()), None)


def load_dogs(path: Path) -> pd.DataFrame:
    """The real dog rows with a valid PetID, binary label, Name/Description as text ("" for empty)."""
    rows = pd.read_csv(path, index_col=0, keep_default_na=False, na_values={c: [""] for c in schema.NUMERIC_COLUMNS})
    rows = rows[rows["PetID"].astype(str).str.fullmatch(r"[0-9a-f]{9}")].drop(columns=["Group"], errors="ignore")
    rows[schema.LABEL] = (rows[schema.LABEL].astype(int) <= FAST_MAX_SPEED).astype(int)
    return rows.reset_index(drop=True)


def split(rows: pd.DataFrame, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(reference, the rows after it) of one seeded shuffle."""
    shuffled = rows.iloc[np.random.default_rng(seed).permutation(len(rows))].reset_index(drop=True)
    return shuffled.iloc[:REFERENCE_ROWS].reset_index(drop=True), shuffled.iloc[REFERENCE_ROWS:].reset_index(drop=True)


def batches(after: pd.DataFrame, size: int) -> list[pd.DataFrame]:
    """Consecutive disjoint same-population batches of `size` rows."""
    return [after.iloc[i:i + size].reset_index(drop=True) for i in range(0, len(after) - size + 1, size)]


def cat_breeds() -> np.ndarray:
    return np.array(sorted(b for b, (animal, _) in schema.breeds().items() if animal == 2))


def cats(batch: pd.DataFrame, rng: np.random.Generator) -> pd.DataFrame:
    out = batch.copy()
    breeds = cat_breeds()
    out["Type"] = 2
    out["Breed1"] = rng.choice(breeds, len(out))
    out["Breed2"] = np.where(out["Breed2"].to_numpy() == 0, 0, rng.choice(breeds, len(out)))
    return out


def older(batch: pd.DataFrame, months: int = AGE_SHIFT_MONTHS) -> pd.DataFrame:
    return batch.assign(Age=batch["Age"] + months)


def faster(reference: pd.DataFrame, after: pd.DataFrame, size: int, rng: np.random.Generator,
           points: float = RATE_SHIFT) -> pd.DataFrame:
    """`size` rows of `after` whose fast rate is the reference's + `points`."""
    label = after[schema.LABEL].to_numpy()
    n_fast = int(round(size * (reference[schema.LABEL].mean() + points)))
    chosen = np.r_[rng.choice(np.flatnonzero(label == 1), n_fast, replace=False),
                   rng.choice(np.flatnonzero(label == 0), size - n_fast, replace=False)]
    return after.iloc[rng.permutation(chosen)].reset_index(drop=True)
