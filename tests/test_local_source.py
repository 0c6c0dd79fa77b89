"""The `local` download source on real files written in fixtures: the tutorial and Kaggle layouts, a CSV
with its own photos folder, and each real-file quirk (damaged PetIDs, cp1252 bytes, extra columns,
0-4 labels, rows without photos). Rows without photos are checked on the download's own output only."""

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

from fusion_model import schema
from tasks._io.hashing import file_hashes
from tasks.download import download
from tasks.download.synthetic import generate
from tasks.errors import StageError
from tasks.params import DownloadParams, LocalParams, SyntheticParams, load_params

ROOT = Path(__file__).resolve().parents[1]
REAL_DOGS = ROOT.parent / "shared" / "petfinder" / "real" / "dogs_train.csv"
NO_PHOTO = 3  # Kaggle fixture rows 0..2 have PhotoAmt 0 and no files
MANY = 3  # row 3 gets 11 photos, so numeric order (2 before 10) is visible


def _read(path: Path) -> pd.DataFrame:
    return pd.read_csv(path, index_col=0, dtype=str, keep_default_na=False)


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated tutorial-layout folder (binary labels, every row with photos). Read-only."""
    root = tmp_path_factory.mktemp("tutorial")
    generate(root, SyntheticParams(n_train=60, n_test=20, image_size=8, label_kind="binary", seed=3))
    return root / schema.DATASET_DIRNAME


@pytest.fixture(scope="module")
def multiclass_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multiclass")
    generate(root, SyntheticParams(n_train=90, n_test=30, image_size=8, label_kind="multiclass", seed=4))
    return root / schema.DATASET_DIRNAME


def _kaggle(src: Path, dest: Path) -> Path:
    """Rewrite a generated dataset into Kaggle's layout: one train.csv without Images (a leading index,
    a `Group` column), photos at train_images/<PetID>-<n>.jpg, an unlabelled test.csv."""
    frame = pd.concat([_read(src / "train.csv"), _read(src / "test.csv")])
    (dest / "train_images").mkdir(parents=True)
    for i, (pet, images) in enumerate(zip(frame["PetID"], frame["Images"], strict=True)):
        paths = schema.split_images(images)
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
def kaggle(multiclass_rows: Path, tmp_path: Path) -> Path:
    return _kaggle(multiclass_rows, tmp_path / "kaggle")


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
    dataset = out / schema.DATASET_DIRNAME
    for name in ("train.csv", "test.csv"):
        assert (dataset / name).read_bytes() == (tutorial / name).read_bytes()
    assert file_hashes(dataset / "images") == file_hashes(tutorial / "images")
    assert summary.source == "local" and summary.rows == {"train": 60, "test": 20}
    manifest = _manifest(out)
    assert manifest["layout"] == "tutorial" and manifest["split"] == {"kind": "files", "test": "test.csv"}
    assert manifest["label_rule"]["source_labels"] == "binary" and manifest["label_rule"]["rule"] == "kept as in the file"
    assert set(manifest["inputs"]) == {"train.csv", "test.csv"}
    assert sum(manifest["images"].values()) == len(list((tutorial / "images").iterdir()))

    checked = validate(ValidateParams(dataset_dir=dataset, out_dir=tmp_path / "validated", report_dir=tmp_path / "reports"))
    assert checked.rows["test"] == 20


def test_kaggle_layout_derives_images_splits_and_maps_speed_to_binary(kaggle: Path, tmp_path: Path) -> None:
    out = tmp_path / "raw"
    summary = download(_local(out, path=kaggle))
    dataset = out / schema.DATASET_DIRNAME
    train, test = _read(dataset / "train.csv"), _read(dataset / "test.csv")
    assert list(train.columns) == list(schema.ALL_COLUMNS) and list(test.columns) == list(schema.ALL_COLUMNS)
    assert len(train) + len(test) == 120 and len(test) == 24  # test_fraction 0.2; the unlabelled test.csv unused

    source = _read(kaggle / "train.csv")
    both = pd.concat([train, test]).loc[source.index]  # the input's index is kept as the row id
    speed = source[schema.LABEL].astype(int)
    assert (both[schema.LABEL].astype(int) == (speed <= 2).astype(int)).all()
    assert (both["Description"] == source["Description"]).all()

    images = both[schema.IMAGES]
    assert (images.iloc[:NO_PHOTO] == "").all()
    pet = both["PetID"].iloc[MANY]
    assert schema.split_images(images.iloc[MANY]) == [f"images/{pet}-{n}.jpg" for n in range(1, 12)]
    named = {p for cell in images for p in schema.split_images(cell)}
    assert named == {f"images/{p.name}" for p in (dataset / "images").iterdir()}
    assert all((kaggle / "train_images" / Path(p).name).read_bytes() == (dataset / p).read_bytes() for p in named)

    manifest = _manifest(out)
    assert manifest["layout"] == "kaggle" and manifest["layout_detected_by"] == "train.csv has no Images column"
    assert manifest["split"]["kind"] == "stratified" and manifest["split"]["seed"] == 42
    assert manifest["label_rule"]["rule"] == "AdoptionSpeed 0-2 -> 1 (fast), 3-4 -> 0 (slow)"
    assert _decision(manifest, "extra_columns")["columns"] == ["Group"]
    assert "Kaggle's test.csv" in _decision(manifest, "unlabelled_test")["action"]
    assert sum(d["rows"] for d in manifest["decisions"] if d["quirk"] == "no_photos") == NO_PHOTO
    assert summary.label_counts == manifest["label_counts"]
    positive = int((speed <= 2).sum())
    assert int(summary.label_counts["train"]["1"]) + int(summary.label_counts["test"]["1"]) == positive


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
    assert len(list((out / schema.DATASET_DIRNAME / "images").iterdir())) == n_photos

    # without images_dir and no train_images/ beside the CSV: every row is kept, with no photo
    bare = tmp_path / "bare"
    download(_local(bare, path=csv))
    rows = pd.concat([_read(bare / schema.DATASET_DIRNAME / f"{s}.csv") for s in ("train", "test")])
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
    assert "download.local.drop_bad_pet_ids: true" in message
    assert file_hashes(out) == before
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []

    download(_local(out, path=kaggle, drop_bad_pet_ids=True))
    manifest = _manifest(out)
    assert sum(manifest["rows"].values()) == 117
    dropped = _decision(manifest, "bad_pet_ids")
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
    rows = pd.concat([_read(out / schema.DATASET_DIRNAME / f"{s}.csv") for s in ("train", "test")])
    pet = frame["PetID"].iloc[7]
    assert rows.loc[rows["PetID"] == pet, "Description"].item() == "friendly, café trained"
    assert rows.loc[rows["PetID"] == pet, "Name"].item() == "René"
    used = _decision(_manifest(out), "encoding")
    assert used["fallback_encoding"] == "cp1252" and used["cells"] == 2 and used["rows"] == 1
    assert used["first_rows"] == [9] and used["columns"] == ["Name", "Description"]


@pytest.mark.parametrize(
    ("local", "expect"),
    [({}, "binary<=2"), ({"fast_max_speed": 1}, "binary<=1"), ({"label_kind": "multiclass"}, "kept"),
     ({"source_labels": "speed", "label_kind": "multiclass"}, "kept")],
)
def test_label_rule_on_adoption_speed_codes(kaggle: Path, tmp_path: Path, local: dict, expect: str) -> None:
    out = tmp_path / "raw"
    download(_local(out, path=kaggle, **local))
    source = _read(kaggle / "train.csv")[schema.LABEL].astype(int)
    dataset = out / schema.DATASET_DIRNAME
    got = pd.concat([_read(dataset / f"{s}.csv") for s in ("train", "test")]).loc[source.index][schema.LABEL].astype(int)
    want = source if expect == "kept" else (source <= int(expect[-1])).astype(int)
    assert (got == want).all()
    rule = _manifest(out)["label_rule"]
    assert rule["source_labels"] == "speed" and rule["label_kind"] == local.get("label_kind", "binary")


def test_binary_labels_are_kept_and_cannot_become_multiclass(tutorial: Path, tmp_path: Path) -> None:
    download(_local(tmp_path / "raw", path=tutorial, source_labels="binary"))
    assert _manifest(tmp_path / "raw")["label_rule"]["source_labels"] == "binary"
    with pytest.raises(StageError, match="multiclass 0-4 cannot be recovered.*label_kind: binary"):
        download(_local(tmp_path / "raw", path=tutorial, label_kind="multiclass"))
    with pytest.raises(StageError, match=r"\[2, 3, 4\] in rows 4, 5, 6.*source_labels"):
        download(_local(tmp_path / "raw", path=_kaggle_copy(tutorial, tmp_path), source_labels="binary"))


def _kaggle_copy(tutorial: Path, tmp_path: Path) -> Path:
    """The tutorial rows with AdoptionSpeed codes 0-4 (cycled), Kaggle layout."""
    dest = _kaggle(tutorial, tmp_path / "kaggle_codes")
    frame = _read(dest / "train.csv")
    frame[schema.LABEL] = [str(i % 5) for i in range(len(frame))]
    frame.to_csv(dest / "train.csv")
    return dest


def test_unlabelled_rows_and_missing_columns_are_refused_with_the_fix(kaggle: Path, tmp_path: Path) -> None:
    _damage(kaggle / "train.csv", [2], schema.LABEL, "")
    with pytest.raises(StageError, match=r"column AdoptionSpeed: empty or not an integer in rows 4 \(1 row"):
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
    params["download"].update(source="local", local={"path": str(kaggle), "seed": 1},
                              report_dir=str(tmp_path / "reports"))
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = tmp_path / "raw"
    done = subprocess.run(
        [sys.executable, "-m", "tasks", "download", "--params", str(tmp_path / "params.yaml"), "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["source"] == "local"
    assert "extra_columns: dropped ['Group']" in done.stderr  # each decision is also printed as it is taken


@pytest.mark.skipif(not REAL_DOGS.is_file(), reason=f"{REAL_DOGS} absent (real rows are never in the repository)")
def test_the_real_dogs_file(tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"40 PetID\(s\) are not 9 lower-case hex digits"):
        download(_local(tmp_path / "raw", path=REAL_DOGS))
    started = time.perf_counter()
    summary = download(_local(tmp_path / "raw", path=REAL_DOGS, drop_bad_pet_ids=True))
    assert time.perf_counter() - started < 60
    assert sum(summary.rows.values()) == 8092
    ones = sum(int(c.get("1", 0)) for c in summary.label_counts.values())
    zeros = sum(int(c.get("0", 0)) for c in summary.label_counts.values())
    assert ones + zeros == 8092 and 3700 < ones < 3769  # README: 3,769 fast of all 8,132 rows
    manifest = _manifest(tmp_path / "raw")
    assert manifest["inputs"] == {"dogs_train.csv": "63481931bff2d1713a18c74429c48c070139ffd96d1e7e6445fc803324f1740c"}
    assert _decision(manifest, "bad_pet_ids")["dropped"] == 40
