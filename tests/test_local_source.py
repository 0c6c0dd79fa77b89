"""The `local` download source on PetFinder files written in fixtures: the tutorial and Kaggle layouts, a
CSV with its own photos folder, and each real-file quirk (damaged PetIDs, cp1252 bytes, extra columns,
0-4 labels read as binary by the preset's rule, rows without photos). Tables of other schemas:
tests/test_own_tables.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml
from shared_data import shared_file

from fusion_model.dataset import resolve_schema, split_images
from fusion_model.presets import petfinder as schema
from tasks._io.hashing import file_hashes
from tasks.download import download
from tasks.download.manifest import DATASET_DIRNAME
from tasks.download.synthetic import generate
from tasks.errors import StageError
from tasks.params import DownloadParams, LocalParams, SyntheticParams, ValidateParams, load_params
from tasks.validate import ValidationError, validate

ROOT = Path(__file__).resolve().parents[1]
REAL_DOGS = shared_file("petfinder/real/dogs_train.csv")
NO_PHOTO = 3  # Kaggle fixture rows 0..2 have PhotoAmt 0 and no files
MANY = 3  # row 3 gets 11 photos, so numeric order (2 before 10) is visible


def _read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, index_col=0, dtype=str, keep_default_na=False)


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated tutorial-layout folder (binary labels, every row with photos). Read-only."""
    root = tmp_path_factory.mktemp("tutorial")
    generate(root, SyntheticParams(n_train=60, n_test=20, image_size=8, seed=3), "binary")
    return root / DATASET_DIRNAME


@pytest.fixture(scope="module")
def speed_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Generated rows with Kaggle's AdoptionSpeed codes 0-4."""
    root = tmp_path_factory.mktemp("speed")
    generate(root, SyntheticParams(n_train=90, n_test=30, image_size=8, seed=4), "ordinal")
    return root / DATASET_DIRNAME


def _kaggle(src: Path, dest: Path) -> Path:
    """Rewrite a generated dataset into Kaggle's layout: one train.csv without Images (a leading index,
    a `Group` column), photos at train_images/<PetID>-<n>.jpg, an unlabelled test.csv."""
    frame = pd.concat([_read(src / "train.csv"), _read(src / "test.csv")])
    (dest / "train_images").mkdir(parents=True)
    for i, (pet, images) in enumerate(zip(frame["PetID"], frame["Images"], strict=True)):
        paths = split_images(images)
        if i < NO_PHOTO:
            paths = []
        if i == MANY:
            paths = [paths[0]] * 11
        for n, rel in enumerate(paths, start=1):
            shutil.copyfile(src / rel, dest / "train_images" / f"{pet}-{n}.jpg")
        frame.iloc[i, frame.columns.get_loc("PhotoAmt")] = str(len(paths))
    frame = frame.drop(columns=[schema.IMAGES])
    frame["Group"] = "Misc"
    frame.to_csv(dest / "train.csv")
    frame.drop(columns=[schema.LABEL, "Group"]).head(5).to_csv(dest / "test.csv", index=False)
    return dest


@pytest.fixture
def kaggle(speed_rows: Path, tmp_path: Path) -> Path:
    return _kaggle(speed_rows, tmp_path / "kaggle")


def _local(out: Path, **local: object) -> DownloadParams:
    return DownloadParams(source="local", out_dir=out, local=LocalParams(**local))


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _decision(manifest: dict, quirk: str) -> dict:
    found = [d for d in manifest["decisions"] if d["quirk"] == quirk]
    assert found, f"no {quirk} decision in {manifest['decisions']}"
    return found[0]


def _damage(path: Path, rows: list[int], column: str, value: str) -> None:
    frame = _read(path)
    for r in rows:
        frame.iloc[r, frame.columns.get_loc(column)] = value
    frame.to_csv(path)


def test_tutorial_layout_is_written_back_byte_for_byte_and_validates(tutorial: Path, tmp_path: Path) -> None:
    from tasks.params import ValidateParams
    from tasks.validate import validate

    out = tmp_path / "raw"
    summary = download(_local(out, path=tutorial))
    dataset = out / DATASET_DIRNAME
    for name in ("train.csv", "test.csv"):
        assert (dataset / name).read_bytes() == (tutorial / name).read_bytes()
    assert file_hashes(dataset / "images") == file_hashes(tutorial / "images")
    assert summary.source == "local" and summary.rows == {"train": 60, "test": 20}
    manifest = _manifest(out)
    assert manifest["layout"] == "table" and manifest["split"] == {"kind": "files", "test": "test.csv"}
    assert set(manifest["inputs"]) == {"train.csv", "test.csv"}
    assert sum(manifest["images"].values()) == len(list((tutorial / "images").iterdir()))

    checked = validate(ValidateParams(dataset_dir=dataset, out_dir=tmp_path / "validated", report_dir=tmp_path / "reports"))
    assert checked.rows["test"] == 20


def test_kaggle_layout_derives_images_splits_and_validation_maps_speed_to_binary(kaggle: Path, tmp_path: Path) -> None:
    out = tmp_path / "raw"
    summary = download(_local(out, path=kaggle))
    dataset = out / DATASET_DIRNAME
    train, test = _read(dataset / "train.csv"), _read(dataset / "test.csv")
    columns = list(schema.ALL_COLUMNS)  # the file's order, the derived image column last
    assert list(train.columns) == columns and list(test.columns) == columns
    assert len(train) + len(test) == 120 and len(test) == 24  # test_fraction 0.2; the unlabelled test.csv unused

    source = _read(kaggle / "train.csv")
    both = pd.concat([train, test]).loc[source.index]  # the input's index is kept as the row id
    speed = source[schema.LABEL].astype(int)
    assert (both[schema.LABEL].astype(int).to_numpy() == speed.to_numpy()).all()  # the file's labels, as they are
    assert (both["Description"] == source["Description"]).all()
    # the preset's binary rule, at validation: AdoptionSpeed 0-2 (adopted within 30 days) -> 1, 3-4 -> 0
    validate(ValidateParams(dataset_dir=dataset, out_dir=tmp_path / "validated", report_dir=tmp_path / "reports"))
    meta = json.loads((tmp_path / "validated" / "meta.json").read_text())
    assert meta["label_rule"]["positive"] == ["0", "1", "2"] and meta["label_rule"]["negative"] == ["3", "4"]
    typed = pd.concat([pd.read_parquet(tmp_path / "validated" / f"{s}.parquet") for s in ("train", "val", "test")])
    labels = typed.set_index("row_id")[schema.LABEL].loc[source.index.astype(int)].to_numpy()
    assert (labels == (speed <= 2).astype(int).to_numpy()).all()

    images = both[schema.IMAGES]
    assert (images.iloc[:NO_PHOTO] == "").all()
    pet = both["PetID"].iloc[MANY]
    assert split_images(images.iloc[MANY]) == [f"images/{pet}-{n}.jpg" for n in range(1, 12)]
    named = {p for cell in images for p in split_images(cell)}
    assert named == {f"images/{p.name}" for p in (dataset / "images").iterdir()}
    assert all((kaggle / "train_images" / Path(p).name).read_bytes() == (dataset / p).read_bytes() for p in named)

    manifest = _manifest(out)
    assert manifest["layout"] == "kaggle" and manifest["layout_detected_by"] == "train.csv has no image column Images"
    assert manifest["split"]["kind"] == "stratified" and manifest["split"]["seed"] == 42
    assert _decision(manifest, "extra_columns")["columns"] == ["Group"]
    assert "Kaggle's test.csv" in _decision(manifest, "unlabelled_test")["action"]
    assert sum(d["rows"] for d in manifest["decisions"] if d["quirk"] == "no_photos") == NO_PHOTO
    assert summary.label_counts == manifest["label_counts"]
    assert sum(int(n) for c in summary.label_counts.values() for n in c.values()) == 120


def test_a_csv_path_with_a_separate_images_dir(kaggle: Path, tmp_path: Path) -> None:
    csv = tmp_path / "export" / "pets.csv"
    csv.parent.mkdir()
    shutil.copyfile(kaggle / "train.csv", csv)
    photos = tmp_path / "elsewhere" / "photos"
    shutil.copytree(kaggle / "train_images", photos)

    out = tmp_path / "raw"
    download(_local(out, path=csv, images_dir=photos, test_fraction=0.25, seed=7))
    manifest = _manifest(out)
    assert set(manifest["inputs"]) == {"pets.csv"} and manifest["split"]["test_fraction"] == 0.25
    n_photos = len(list(photos.iterdir()))
    assert len(list((out / DATASET_DIRNAME / "images").iterdir())) == n_photos

    # without images_dir and no train_images/ beside the CSV: every row is kept, with no photo
    bare = tmp_path / "bare"
    download(_local(bare, path=csv))
    rows = pd.concat([_read(bare / DATASET_DIRNAME / f"{s}.csv") for s in ("train", "test")])
    assert len(rows) == 120 and (rows[schema.IMAGES] == "").all()
    assert "no photos folder" in _decision(_manifest(bare), "no_photos")["action"]


def test_damaged_pet_ids_are_refused_leaving_data_raw_untouched_then_dropped_when_allowed(
    kaggle: Path, tmp_path: Path
) -> None:
    _damage(kaggle / "train.csv", [4, 9, 30], "PetID", "7.76E+08")
    out = tmp_path / "raw"
    download(DownloadParams(out_dir=out, synthetic=SyntheticParams(n_train=20, n_test=10, image_size=8)))
    before = file_hashes(out)

    with pytest.raises(StageError) as e:
        download(_local(out, path=kaggle))
    message = str(e.value)
    assert str(kaggle / "train.csv") in message and "column PetID" in message
    assert "rows 6, 11, 32 (3 rows; header = row 1)" in message and "'7.76E+08'" in message
    assert "download.local.drop_bad_ids: true" in message
    assert file_hashes(out) == before
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []

    download(_local(out, path=kaggle, drop_bad_pet_ids=True))  # the key's earlier name still works
    manifest = _manifest(out)
    assert sum(manifest["rows"].values()) == 117
    dropped = _decision(manifest, "bad_ids")
    assert dropped["dropped"] == 3 and dropped["first_rows"] == [6, 11, 32]


def test_bytes_that_are_not_utf8_are_decoded_with_the_named_fallback(kaggle: Path, tmp_path: Path) -> None:
    path = kaggle / "train.csv"
    frame = _read(path)
    frame.iloc[7, frame.columns.get_loc("Description")] = "friendly, caf\x00 trained"
    frame.iloc[7, frame.columns.get_loc("Name")] = "Ren\x00"
    data = frame.to_csv().encode("utf-8").replace(b"\x00", b"\xe9")  # cp1252 e-acute: invalid UTF-8
    path.write_bytes(data)

    with pytest.raises(StageError, match=r"not utf-8 in rows 9 \(1 row; header = row 1\), columns \['Name', 'Description'\]"):
        download(_local(tmp_path / "refused", path=kaggle, fallback_encoding=None))

    out = tmp_path / "raw"
    download(_local(out, path=kaggle, test_fraction=0.5))
    rows = pd.concat([_read(out / DATASET_DIRNAME / f"{s}.csv") for s in ("train", "test")])
    pet = frame["PetID"].iloc[7]
    assert rows.loc[rows["PetID"] == pet, "Description"].item() == "friendly, café trained"
    assert rows.loc[rows["PetID"] == pet, "Name"].item() == "René"
    used = _decision(_manifest(out), "encoding")
    assert used["fallback_encoding"] == "cp1252" and used["cells"] == 2 and used["rows"] == 1
    assert used["first_rows"] == [9] and used["columns"] == ["Name", "Description"]


@pytest.mark.parametrize(("problem_type", "expect"), [("binary", "fast"), ("ordinal", "kept")])
def test_adoption_speed_codes_as_binary_or_ordinal(kaggle: Path, tmp_path: Path, problem_type: str,
                                                   expect: str) -> None:
    schema_ = resolve_schema({"preset": "petfinder", "label": {"problem_type": problem_type}})
    out = tmp_path / "raw"
    download(_local(out, path=kaggle), schema_)
    validate(ValidateParams(dataset_dir=out / DATASET_DIRNAME, out_dir=tmp_path / "validated",
                            report_dir=tmp_path / "reports"), schema_)
    source = _read(kaggle / "train.csv")[schema.LABEL].astype(int)
    typed = pd.concat([pd.read_parquet(tmp_path / "validated" / f"{s}.parquet") for s in ("train", "val", "test")])
    got = typed.set_index("row_id")[schema.LABEL].loc[source.index.astype(int)].to_numpy()
    assert (got == (source if expect == "kept" else (source <= 2).astype(int)).to_numpy()).all()
    meta = json.loads((tmp_path / "validated" / "meta.json").read_text())
    assert meta["classes"] == ([0, 1] if expect == "fast" else [0, 1, 2, 3, 4])


def test_binary_tutorial_labels_are_kept_and_a_stray_code_is_refused(tutorial: Path, tmp_path: Path) -> None:
    out = tmp_path / "raw"
    download(_local(out, path=tutorial))
    dataset = out / DATASET_DIRNAME
    params = ValidateParams(dataset_dir=dataset, out_dir=tmp_path / "validated", report_dir=tmp_path / "reports")
    assert validate(params).classes == [0, 1]  # 0/1 in the file: kept, the 0-4 rule does not apply
    _damage(dataset / "train.csv", [3], schema.LABEL, "7")
    with pytest.raises(ValidationError, match=r"AdoptionSpeed='7'"):
        validate(params)


def test_unlabelled_rows_and_missing_columns_are_refused_with_the_fix(kaggle: Path, tmp_path: Path) -> None:
    _damage(kaggle / "train.csv", [2], schema.LABEL, "")
    with pytest.raises(StageError, match=r"column AdoptionSpeed: empty in rows 4 \(1 row"):
        download(_local(tmp_path / "raw", path=kaggle))
    _read(kaggle / "train.csv").drop(columns=["Fee"]).to_csv(kaggle / "train.csv")
    with pytest.raises(StageError, match=r"missing column\(s\) \['Fee'\]"):
        download(_local(tmp_path / "raw", path=kaggle))
    with pytest.raises(StageError, match="download.local.path is not set"):
        download(DownloadParams(source="local", out_dir=tmp_path / "raw"))


def test_same_input_twice_gives_byte_identical_output(kaggle: Path, tmp_path: Path) -> None:
    _damage(kaggle / "train.csv", [5], "PetID", "8.44E+79")
    download(_local(tmp_path / "a", path=kaggle, drop_bad_pet_ids=True))
    download(_local(tmp_path / "b", path=kaggle, drop_bad_pet_ids=True))
    assert file_hashes(tmp_path / "a") == file_hashes(tmp_path / "b")
    assert (tmp_path / "a" / "manifest.json").read_bytes() == (tmp_path / "b" / "manifest.json").read_bytes()


def test_params_yaml_and_the_cli_take_the_local_source(kaggle: Path, tmp_path: Path) -> None:
    assert load_params(ROOT / "params.yaml").download.local == LocalParams()
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["download"].update(source="local", local={"path": str(kaggle), "seed": 1})
    params["intake"]["report_dir"] = str(tmp_path / "reports")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "raw"
    done = subprocess.run(
        [sys.executable, "-m", "tasks", "download", "--params", str(tmp_path / "params.yaml"), "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["source"] == "local"
    assert "extra_columns: dropped ['Group']" in done.stderr  # each decision is also printed as it is taken


def test_the_real_dogs_file(tmp_path: Path) -> None:
    if REAL_DOGS is None:
        pytest.skip("the real dogs file is absent (../shared/petfinder/real; real rows are never in the repository)")
    with pytest.raises(StageError, match=r"40 bad id\(s\) in column PetID: 40 not of the form"):
        download(_local(tmp_path / "raw", path=REAL_DOGS))
    started = time.perf_counter()
    summary = download(_local(tmp_path / "raw", path=REAL_DOGS, drop_bad_ids=True))
    assert time.perf_counter() - started < 60
    assert sum(summary.rows.values()) == 8092
    fast = sum(int(c.get(k, 0)) for c in summary.label_counts.values() for k in ("0", "1", "2"))
    assert 3700 < fast < 3769  # README: 3,769 fast of all 8,132 rows
    manifest = _manifest(tmp_path / "raw")
    assert manifest["inputs"] == {"dogs_train.csv": "63481931bff2d1713a18c74429c48c070139ffd96d1e7e6445fc803324f1740c"}
    assert _decision(manifest, "bad_ids")["dropped"] == 40
