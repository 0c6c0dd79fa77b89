"""The embedded PetFinder table (the `petfinder` preset): a seeded generator that writes the tutorial layout.

``<out_dir>/dataset/{train.csv,test.csv,images/<PetID>-<n>.jpg}``: CSVs with a leading unnamed index
column, every Kaggle column in order, then ``Images`` (';'-separated relative paths). The label is 0 slow /
1 fast for a binary problem type, AdoptionSpeed 0-4 for an ordinal (or multiclass) one.

Each row gets a hidden score per modality: tabular (computed from its codes), text (tilts the words of its
Description) and image (tilts the lighting, colour and texture of its photos). The label comes from their
weighted sum plus noise, so each modality alone is partly predictive and fusing all three is best.
Arriving data: `generate_batch` draws batch N of new labelled rows from the same population, or from a
drifted one (older animals, unseen codes, a moved label rate, broken photos). The same seed gives
byte-identical files: one numpy Generator drawn in a fixed order, fixed JPEG quality, no
timestamps, integers and strings only in the CSVs.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fusion_model.dataset import IMAGE_SEPARATOR, split_images
from fusion_model.presets import petfinder as pf
from tasks.download.manifest import DATASET_DIRNAME
from tasks.download.synthetic.images import draw_images, encode_jpeg
from tasks.download.synthetic.text import draw_descriptions, draw_names
from tasks.params import SyntheticParams

# Weights of the standardised modality scores in the label's latent, and the latent's noise. Tuned so a
# simple model on a few thousand rows reaches AUC ~0.75 tabular, ~0.72 text, ~0.70 image, ~0.88 all (see
# bench/synthetic_signal.py and BENCHMARKS.md).
W_TABULAR, W_TEXT, W_IMAGE, NOISE = 1.1, 1.0, 0.85, 0.85
# Kaggle AdoptionSpeed shares 4 (not adopted in 100 days) .28, 3 .217, 2 .269, 1 .206, 0 (same day) .027:
# cut points of the latent from the bottom, as standard-normal quantiles of .28, .497, .766, .972.
_MULTICLASS_Z = np.array([-0.583, -0.008, 0.726, 1.911])
EMPTY_NAME_SHARE = 0.06
# Row ids of batch N start at N * this: unique across the base dataset (ids below n_train + n_test) and
# every batch (up to this many rows each).
BATCH_ROW_ID_STRIDE = 1_000_000
# What `drift` can change in an arriving batch (SyntheticParams.drift).
DRIFTS = ("numeric", "codes", "labels", "photos")
EMPTY_DESCRIPTION_SHARE = 0.04

_DOG_BREEDS = np.array(sorted(b for b, (t, _) in pf.breeds().items() if t == 1 and b != 307))
_CAT_BREEDS = np.array(sorted(b for b, (t, _) in pf.breeds().items() if t == 2))
_DOMESTIC_CATS = np.array([264, 265, 266])  # long, medium, short hair
_STATES = np.array(sorted(pf.states()))
_STATE_SHARES = {41326: 0.58, 41401: 0.26, 41327: 0.05, 41336: 0.03, 41330: 0.03}  # Selangor, KL, Penang, ...


def label_kind(problem_type: str) -> str:
    """The generator's label for a problem type: 0/1 (binary), AdoptionSpeed 0-4 (ordinal, multiclass)."""
    if problem_type == "regression":
        raise ValueError("the embedded PetFinder table has no regression label; declare your own table "
                         "(download.source: local) for a regression problem")
    return "binary" if problem_type == "binary" else "speed"


def generate(out_dir: Path, p: SyntheticParams, problem_type: str = "binary") -> dict[str, Any]:
    """Write ``<out_dir>/dataset/`` (replacing one already there); return rows and label counts."""
    rng = np.random.default_rng(p.seed)
    n = p.n_train + p.n_test
    table, image_score, n_images = _draw_rows(rng, n, label_kind(problem_type), drift=())

    dataset = Path(out_dir) / DATASET_DIRNAME
    if dataset.exists():
        shutil.rmtree(dataset)
    (dataset / "images").mkdir(parents=True)
    _write_images(rng, dataset, table, image_score, n_images, p.image_size)

    # Row ids like the tutorial's: a shuffled sample of one index shared by train and test.
    row_ids = rng.permutation(n)
    frame = pd.DataFrame({c: table[c] for c in pf.ALL_COLUMNS}, index=row_ids)
    train, test = frame.iloc[: p.n_train], frame.iloc[p.n_train :]
    train.to_csv(dataset / "train.csv", lineterminator="\n")
    test.to_csv(dataset / "test.csv", lineterminator="\n")
    return {
        "dataset_dir": str(dataset),
        "rows": {"train": len(train), "test": len(test)},
        "label_counts": {"train": _counts(train), "test": _counts(test)},
        "images": int(n_images.sum()),
    }


def generate_batch(out_dir: Path, p: SyntheticParams, batch: int, problem_type: str = "binary") -> dict[str, Any]:
    """Write batch `batch` (>= 1) of newly arrived labelled rows into `out_dir` (train.csv + images/), in
    the tutorial layout, seeded by (seed, batch): the same batch is the same bytes, another batch other
    rows of the same population; `p.drift` changes that population (see DRIFTS), by `p.drift_size`.

    Row ids continue the base dataset's without clashing: batch N uses N * BATCH_ROW_ID_STRIDE + i.
    """
    if batch < 1:
        raise ValueError(f"batch {batch}: batches start at 1 (batch 0 is the base dataset, `generate`)")
    rng = np.random.default_rng([p.seed, batch])
    drift = tuple(p.drift_kinds)
    table, image_score, n_images = _draw_rows(rng, p.batch_rows, label_kind(problem_type), drift, p.drift_size)
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    (out_dir / "images").mkdir(parents=True)
    _write_images(rng, out_dir, table, image_score, n_images, p.image_size)
    broken = 0
    if "photos" in drift:  # a broken feed: some first photos cut short, as an interrupted upload leaves them
        rows = np.flatnonzero(rng.random(p.batch_rows) < min(1.0, 0.1 * p.drift_size))
        for i in rows:
            path = out_dir / split_images(table["Images"][i])[0]
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 3])
        broken = len(rows)
    row_ids = batch * BATCH_ROW_ID_STRIDE + np.arange(p.batch_rows)
    frame = pd.DataFrame({c: table[c] for c in pf.ALL_COLUMNS}, index=row_ids)
    frame.to_csv(out_dir / "train.csv", lineterminator="\n")
    return {"batch": batch, "rows": len(frame), "label_counts": _counts(frame), "drift": list(drift),
            "drift_size": p.drift_size, "broken_photos": broken}


def _draw_rows(rng: np.random.Generator, n: int, label_kind: str, drift: tuple[str, ...],
               drift_size: float = 1.0) -> tuple[dict[str, Any], np.ndarray, np.ndarray]:
    """The rows' columns, their image scores and image counts; `drift` kinds change the population."""
    table = _draw_tabular(rng, n)
    if "numeric" in drift:  # older animals arrive: Age stretched
        table["Age"] = np.clip(np.rint(table["Age"] * (1 + 1.5 * drift_size)), 0, 255).astype(np.int64)
    if "codes" in drift:  # a form that now records "not specified", codes the base data never holds
        unspecified = rng.random(n) < min(1.0, 0.3 * drift_size)
        table["FurLength"] = np.where(unspecified, 0, table["FurLength"])
        table["MaturitySize"] = np.where(unspecified, 0, table["MaturitySize"])
    tab_score = _standardise(_tabular_effect(table))

    empty_text = rng.random(n) < EMPTY_DESCRIPTION_SHARE
    text_score = np.where(empty_text, 0.0, rng.standard_normal(n))
    image_score = rng.standard_normal(n)
    latent = W_TABULAR * tab_score + W_TEXT * text_score + W_IMAGE * image_score + rng.normal(0, NOISE, n)
    if "labels" in drift:  # adoptions got faster across the board: the label rate moves
        latent = latent + 0.8 * drift_size
    table[pf.LABEL] = _labels(latent, label_kind)

    table["Name"] = draw_names(rng, n, EMPTY_NAME_SHARE)
    table["Description"] = draw_descriptions(
        rng, text_score, table["Type"], table["Age"], table["Color1"], empty_text
    )
    pet_ids = _hex_ids(rng, n, 9, unique=True)
    n_images = rng.choice(np.array([1, 2, 3]), size=n, p=[0.6, 0.25, 0.15])
    table["PhotoAmt"] = np.minimum(n_images + rng.poisson(1.5, n), 30)
    table["PetID"] = pet_ids
    table["Images"] = [
        IMAGE_SEPARATOR.join(f"images/{pid}-{k}.jpg" for k in range(1, int(m) + 1))
        for pid, m in zip(pet_ids, n_images, strict=True)
    ]
    return table, image_score, n_images


def _draw_tabular(rng: np.random.Generator, n: int) -> dict[str, Any]:
    """Codes with realistic marginals (shares from the Kaggle training set, rounded)."""
    t: dict[str, Any] = {}
    t["Type"] = np.where(rng.random(n) < 0.55, 1, 2)
    dog = t["Type"] == 1
    young = rng.random(n) < 0.55
    t["Age"] = np.where(young, rng.integers(1, 13, n), np.clip(np.rint(rng.lognormal(3.3, 0.7, n)), 12, 255))
    t["Age"] = t["Age"].astype(np.int64)

    dog_breed = np.where(rng.random(n) < 0.55, 307, rng.choice(_DOG_BREEDS, n))
    cat_breed = np.where(rng.random(n) < 0.6, rng.choice(_DOMESTIC_CATS, n, p=[0.15, 0.3, 0.55]), rng.choice(_CAT_BREEDS, n))
    t["Breed1"] = np.where(dog, dog_breed, cat_breed)
    second = np.where(dog, np.where(rng.random(n) < 0.5, 307, rng.choice(_DOG_BREEDS, n)), rng.choice(_CAT_BREEDS, n))
    t["Breed2"] = np.where(rng.random(n) < 0.72, 0, second)

    t["Quantity"] = np.where(rng.random(n) < 0.77, 1, np.minimum(2 + rng.geometric(0.45, n) - 1, 20))
    gender = rng.choice(np.array([1, 2]), n, p=[0.43, 0.57])
    t["Gender"] = np.where((t["Quantity"] > 1) & (rng.random(n) < 0.6), 3, gender)

    t["Color1"] = rng.choice(np.arange(1, 8), n, p=[0.5, 0.25, 0.06, 0.05, 0.05, 0.05, 0.04])
    t["Color2"] = np.where(rng.random(n) < 0.3, 0, rng.integers(2, 8, n))
    t["Color3"] = np.where(rng.random(n) < 0.7, 0, rng.integers(3, 8, n))
    t["MaturitySize"] = rng.choice(np.arange(1, 5), n, p=[0.22, 0.69, 0.08, 0.01])
    t["FurLength"] = rng.choice(np.arange(1, 4), n, p=[0.59, 0.34, 0.07])
    t["Vaccinated"] = rng.choice(np.arange(1, 4), n, p=[0.39, 0.48, 0.13])
    t["Dewormed"] = rng.choice(np.arange(1, 4), n, p=[0.56, 0.32, 0.12])
    t["Sterilized"] = rng.choice(np.arange(1, 4), n, p=[0.21, 0.67, 0.12])
    t["Health"] = rng.choice(np.arange(1, 4), n, p=[0.965, 0.032, 0.003])
    t["Fee"] = np.where(rng.random(n) < 0.85, 0, rng.choice(np.array([20, 50, 80, 100, 150, 200, 300, 500]), n))

    shares = np.array([_STATE_SHARES.get(int(s), 0.0) for s in _STATES])
    shares[shares == 0] = (1 - shares.sum()) / np.count_nonzero(shares == 0)
    t["State"] = rng.choice(_STATES, n, p=shares)
    rescuers = _hex_ids(rng, max(1, n // 4), 32, unique=True)
    # A few busy rescuers list many pets, most list one or two (Zipf-like).
    t["RescuerID"] = [rescuers[i] for i in np.minimum(rng.zipf(1.6, n) - 1, len(rescuers) - 1)]
    t["VideoAmt"] = np.where(rng.random(n) < 0.96, 0, rng.integers(1, 4, n))
    return t


def _tabular_effect(t: dict[str, Any]) -> np.ndarray:
    """Adoptability from the codes: young, free, healthy, pure-bred, long-furred singles go fast."""
    breed1 = t["Breed1"]
    purebred = (breed1 != 307) & ~np.isin(breed1, _DOMESTIC_CATS)
    state_effect = np.select([t["State"] == 41401, t["State"] == 41326], [0.35, 0.1], -0.25)
    return (
        -0.55 * np.log1p(t["Age"])
        + 0.5 * (t["Fee"] == 0)
        + 0.45 * purebred
        + 0.2 * (t["Type"] == 2)
        - 0.6 * (t["Health"] - 1)
        + 0.2 * (t["FurLength"] - 1)
        - 0.3 * (t["Quantity"] > 1)
        + 0.2 * (t["MaturitySize"] == 1)
        - 0.3 * (t["MaturitySize"] >= 3)
        + 0.25 * (t["Vaccinated"] == 1)
        - 0.2 * (t["Sterilized"] == 2)
        + state_effect
    )


def _labels(latent: np.ndarray, kind: str) -> np.ndarray:
    if kind == "binary":
        return (latent > 0).astype(np.int64)  # 1 fast, 0 slow
    sd = float(np.sqrt(W_TABULAR**2 + W_TEXT**2 + W_IMAGE**2 + NOISE**2))
    # Higher latent = more adoptable = lower AdoptionSpeed (0 fastest).
    return (4 - np.searchsorted(_MULTICLASS_Z * sd, latent)).astype(np.int64)


def _write_images(
    rng: np.random.Generator,
    dataset: Path,
    table: dict[str, Any],
    image_score: np.ndarray,
    n_images: np.ndarray,
    size: int,
) -> None:
    """Every image of every row; a row's photos share its score and coat colour but not their noise."""
    owner = np.repeat(np.arange(len(n_images)), n_images)
    pixels = draw_images(rng, image_score[owner], np.asarray(table["Color1"])[owner], size)
    k = 0
    for paths in table["Images"]:
        for rel in split_images(paths):
            (dataset / rel).write_bytes(encode_jpeg(pixels[k]))
            k += 1


def _standardise(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / x.std()


def _hex_ids(rng: np.random.Generator, n: int, width: int, unique: bool) -> list[str]:
    digits = rng.integers(0, 16, (n, width))
    ids = ["".join(f"{d:x}" for d in row) for row in digits]
    if unique and len(set(ids)) != n:  # astronomically rare; redraw rather than return duplicates
        return _hex_ids(rng, n, width, unique)
    return ids


def _counts(frame: pd.DataFrame) -> dict[str, int]:
    counts = frame[pf.LABEL].value_counts().sort_index()
    return {str(k): int(v) for k, v in counts.items()}
