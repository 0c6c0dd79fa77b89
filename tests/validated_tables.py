"""A small validated-layout folder (train/val/test parquet + meta.json + JPEGs) for model and training tests.

Each row's label is carried by all three modalities (image brightness, Age/Type, a word in the
description), so a model that learns anything reaches a high score in a few steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image

from fusion_model.dataset import resolve_schema
from fusion_model.presets.petfinder import CATEGORICAL_COLUMNS, CODE_RANGES, NUMERIC_COLUMNS


def make_rows(n: int, seed: int, image_dir: Path, prefix: str, problem_type: str = "binary") -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    n_classes = 2 if problem_type == "binary" else 5
    labels = rng.integers(0, n_classes, size=n)
    image_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, y in enumerate(labels):
        level = y / (n_classes - 1)
        row: dict[str, object] = {c: str(rng.integers(CODE_RANGES[c][0], CODE_RANGES[c][1] + 1))
                                  for c in CATEGORICAL_COLUMNS if c in CODE_RANGES}
        row["State"] = str(rng.choice([41326, 41401]))
        row["Type"] = str(1 + int(y % 2))
        row.update({c: float(rng.integers(0, 5)) for c in NUMERIC_COLUMNS})
        row["Quantity"] = 1.0
        row["Age"] = float(max(0.0, 3 + 30 * level + rng.normal(0, 2)))
        row["Name"] = "" if i % 7 == 0 else f"pet{i}"
        row["Description"] = f"{'friendly playful' if y else 'shy quiet'} pet number {i}"
        pixels = np.clip(rng.normal(60 + 140 * level, 20, size=(40, 40, 3)), 0, 255).astype("uint8")
        paths = []
        for k in range(2):  # two images per row: the model uses image_index
            rel = f"images/{prefix}{i}-{k + 1}.jpg"
            Image.fromarray(pixels).save(image_dir.parent / rel, quality=90)
            paths.append(rel)
        row["Images"] = ";".join(paths)
        row["PetID"] = f"{seed:02x}{i:07x}"  # the row key: 9 hex digits, as PetFinder's
        row["AdoptionSpeed"] = int(y)
        rows.append(row)
    df = pd.DataFrame(rows)
    df.insert(0, "row_id", np.arange(n, dtype="int64"))
    return df


def make_validated(root: Path, n_train: int = 64, n_val: int = 32, n_test: int = 32,
                   problem_type: str = "binary") -> Path:
    """Writes root/dataset/images/*.jpg and root/validated/{train,val,test}.parquet + meta.json, as the
    validate stage writes them for the PetFinder preset (codes as text, the label's classes, the schema)."""
    dataset = root / "dataset"
    validated = root / "validated"
    validated.mkdir(parents=True, exist_ok=True)
    tables = {
        "train": make_rows(n_train, 1, dataset / "images", "tr", problem_type),
        "val": make_rows(n_val, 2, dataset / "images", "va", problem_type),
        "test": make_rows(n_test, 3, dataset / "images", "te", problem_type),
    }
    for name, df in tables.items():
        df.to_parquet(validated / f"{name}.parquet", index=False)
    schema = resolve_schema({"preset": "petfinder", "label": {"problem_type": problem_type}})
    classes = [0, 1] if problem_type == "binary" else [0, 1, 2, 3, 4]
    meta = {
        "dataset_root": "../dataset",
        "label": "AdoptionSpeed",
        "problem_type": problem_type,
        "classes": classes,
        "id": schema.id,
        "schema": schema.model_dump(mode="json"),
        "rows": {k: len(v) for k, v in tables.items()},
    }
    (validated / "meta.json").write_text(json.dumps(meta, indent=2))
    return validated
