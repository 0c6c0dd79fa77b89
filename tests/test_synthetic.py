"""The embedded dataset: the tutorial's exact layout, byte-identical per seed, learnable per modality."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from fusion_model.dataset import split_images
from fusion_model.presets import petfinder as schema
from tasks.download.manifest import DATASET_DIRNAME
from tasks.download.synthetic import generate
from tasks.download.synthetic.signal_check import modality_aucs
from tasks.params import SyntheticParams


def _hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def _read(dataset: Path, split: str) -> pd.DataFrame:
    return pd.read_csv(dataset / f"{split}.csv", index_col=0, keep_default_na=False)


def test_same_seed_gives_byte_identical_files_and_another_seed_does_not(tmp_path: Path) -> None:
    p = SyntheticParams(n_train=60, n_test=20, image_size=32, seed=7)
    generate(tmp_path / "a", p)
    generate(tmp_path / "b", p)
    generate(tmp_path / "c", p.model_copy(update={"seed": 8}))
    a, b, c = (_hashes(tmp_path / x) for x in "abc")
    assert len(a) > 80  # two CSVs and at least one image per row
    assert a == b
    assert a["dataset/train.csv"] != c["dataset/train.csv"]


def test_layout_and_columns_match_the_tutorial(tiny_raw_dataset: Path) -> None:
    assert sorted(p.name for p in tiny_raw_dataset.iterdir()) == ["images", "test.csv", "train.csv"]
    header = (tiny_raw_dataset / "train.csv").read_text().splitlines()[0].split(",")
    assert header[0] == ""  # the leading unnamed index column
    assert tuple(header[1:]) == schema.ALL_COLUMNS
    train, test = _read(tiny_raw_dataset, "train"), _read(tiny_raw_dataset, "test")
    assert (len(train), len(test)) == (240, 80)
    assert tuple(test.columns) == schema.ALL_COLUMNS
    both = pd.concat([train, test])
    assert both.index.is_unique and both.index.dtype.kind == "i"
    assert both["PetID"].is_unique


def test_codes_are_realistic_and_in_range(tiny_raw_dataset: Path) -> None:
    rows = pd.concat([_read(tiny_raw_dataset, "train"), _read(tiny_raw_dataset, "test")])
    for column, (low, high, _meaning) in schema.CODE_RANGES.items():
        assert rows[column].between(low, high).all(), column
    for column, (low, high) in schema.NUMERIC_BOUNDS.items():
        assert rows[column].between(low, high).all(), column
    breeds = schema.breeds()
    assert all(breeds[b][0] == t or b == 307 for b, t in zip(rows["Breed1"], rows["Type"], strict=True))
    assert set(rows["State"]) <= set(schema.states())
    assert set(rows["Color1"]) <= set(schema.colors())
    assert set(rows[schema.LABEL]) == {0, 1}
    assert (rows["Name"] == "").any() and (rows["Name"] != "").mean() > 0.8
    assert (rows["Description"] == "").any() and (rows["Description"] != "").mean() > 0.9


def test_images_exist_are_jpegs_and_some_rows_have_several(tiny_raw_dataset: Path) -> None:
    rows = _read(tiny_raw_dataset, "train")
    counts = []
    for pet_id, cell, photo_amt in zip(rows["PetID"], rows[schema.IMAGES], rows["PhotoAmt"], strict=True):
        paths = split_images(cell)
        counts.append(len(paths))
        assert paths == [f"images/{pet_id}-{k}.jpg" for k in range(1, len(paths) + 1)]
        assert photo_amt >= len(paths)
    assert min(counts) >= 1 and max(counts) >= 2
    first = tiny_raw_dataset / split_images(rows[schema.IMAGES].iloc[0])[0]
    with Image.open(first) as img:
        assert (img.format, img.mode, img.size) == ("JPEG", "RGB", (32, 32))
    referenced = {p for cell in pd.concat([rows, _read(tiny_raw_dataset, "test")])[schema.IMAGES]
                  for p in split_images(cell)}
    on_disk = {f"images/{p.name}" for p in (tiny_raw_dataset / "images").iterdir()}
    assert referenced == on_disk


def test_ordinal_labels_cover_zero_to_four_like_kaggle(tmp_path: Path) -> None:
    generate(tmp_path, SyntheticParams(n_train=400, n_test=100, image_size=8, seed=3), "ordinal")
    labels = pd.concat([_read(tmp_path / DATASET_DIRNAME, s) for s in ("train", "test")])[schema.LABEL]
    shares = labels.value_counts(normalize=True)
    assert set(labels) == {0, 1, 2, 3, 4}
    assert shares[0] < 0.08  # same-day adoption is rare, as in Kaggle
    assert all(shares[k] > 0.12 for k in (1, 2, 3, 4))


def test_descriptions_use_words_not_placeholders(tiny_raw_dataset: Path) -> None:
    text = " ".join(_read(tiny_raw_dataset, "train")["Description"])
    assert re.search(r"\b(kitten|puppy|cat|dog)\b", text)
    assert len(set(text.lower().split())) > 60


def test_each_modality_is_learnable_and_fusion_is_best(tmp_path: Path) -> None:
    # A few hundred rows: simple linear baselines, so a CNN / text encoder from scratch has signal to find.
    generate(tmp_path, SyntheticParams(n_train=500, n_test=300, image_size=32, seed=11))
    aucs = modality_aucs(tmp_path / DATASET_DIRNAME)
    for modality in ("tabular", "text", "image"):
        assert aucs[modality] > 0.6, aucs
        assert aucs["all"] > aucs[modality] + 0.03, aucs


@pytest.mark.parametrize("bad", [{"n_train": 5}, {"image_size": 4}, {"label_kind": "ordinal"}])
def test_bad_synthetic_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        SyntheticParams(**bad)


def test_the_embedded_table_has_no_regression_label(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no regression label.*download.source: local"):
        generate(tmp_path, SyntheticParams(n_train=20, n_test=10, image_size=8), "regression")
