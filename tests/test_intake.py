"""The intake stage with a folder feed (tasks/intake): drops joined by the dataset's id, their own index
never trusted, duplicates and image clashes refused by name (the accumulated data unchanged, byte for
byte), the same drop twice a no-op, a changed drop under a used name refused, the quarantine reviewed with
`python -m tasks batches list | readmit | reject`, and the ledger in dvc.lock after `dvc repro`.

The base dataset and the drops' rows come from the embedded generator (small images; enough rows for the
drift gate to be calm on rows of its own population)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fusion_model.dataset import split_images
from fusion_model.presets.petfinder import IMAGES, PET_ID
from tasks.__main__ import main
from tasks.download import download
from tasks.download.manifest import DATASET_DIRNAME
from tasks.download.synthetic.generator import generate_batch
from tasks.errors import StageError
from tasks.intake import intake
from tasks.intake.join import JoinRefused
from tasks.intake.ledger import read_ledger
from tasks.params import (
    DownloadParams,
    FeedParams,
    IntakeParams,
    ParamsError,
    SyntheticParams,
    ValidateParams,
    load_params,
)
from tasks.validate import validate

ROOT = Path(__file__).resolve().parents[1]
N_TRAIN, N_TEST, DROP_ROWS = 400, 100, 80


def _params(root: Path, on_duplicate: str = "refuse") -> IntakeParams:
    return IntakeParams(
        out_dir=root / "data/accumulated", incoming_dir=root / "data/incoming", quarantine_dir=root / "data/quarantine",
        report_dir=root / "reports",
        feed=FeedParams(kind="folder", path=root / "feed", ledger=root / "data/intake/batches.json",
                        on_duplicate=on_duplicate),
    )


def _download(root: Path) -> DownloadParams:
    """The base dataset the batches join (download.out_dir)."""
    return DownloadParams(source="synthetic", out_dir=root / "data/raw", synthetic=SyntheticParams(
        n_train=N_TRAIN, n_test=N_TEST, image_size=8, seed=5, batch_rows=DROP_ROWS))


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _write_params(root: Path, p: IntakeParams, d: DownloadParams) -> Path:
    """A params.yaml for the CLI: the project's, with this test's intake and download sections."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["intake"] = json.loads(p.model_dump_json())
    params["download"] = json.loads(d.model_dump_json())
    path = root / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


def _drop(folder: Path, table: pd.DataFrame, *images_from: Path) -> Path:
    """A drop folder: `table` as train.csv written with a fresh 0..n-1 index (DataFrame.to_csv), and every
    image its cells name, copied from the first of `images_from` that has it."""
    folder.mkdir(parents=True)
    table.reset_index(drop=True).to_csv(folder / "train.csv")
    for cell in table[IMAGES]:
        for rel in split_images(cell):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(next(f / rel for f in images_from if (f / rel).is_file()), folder / rel)
    return folder


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The base dataset (downloaded, and the intake's accumulated data built on it from an empty feed), and
    three batches of new rows of the same population (tables + images)."""
    root = tmp_path_factory.mktemp("intake")
    d = _download(root)
    download(d)
    (root / "feed").mkdir()
    assert intake(_params(root), d).taken == []
    rows = {}
    for n in (1, 2, 3):
        generate_batch(root / f"generated/{n}", d.synthetic, n)
        rows[n] = pd.read_csv(root / f"generated/{n}/train.csv", index_col=0, dtype=str, keep_default_na=False)
    return {"root": root, "rows": rows}


@pytest.fixture
def project(base: dict, tmp_path: Path) -> dict:
    """A copy of the base dataset with an empty feed folder."""
    root = tmp_path / "p"
    shutil.copytree(base["root"] / "data", root / "data")
    (root / "feed").mkdir()
    return {"root": root, "p": _params(root), "d": _download(root), "rows": base["rows"],
            "generated": base["root"] / "generated"}


def _train(root: Path) -> pd.DataFrame:
    return pd.read_csv(root / "data/accumulated/dataset/train.csv", index_col=0, dtype=str, keep_default_na=False)


def test_intake_leaves_the_download_output_as_download_wrote_it_and_validate_reads_the_batch(
        project: dict, tmp_path: Path) -> None:
    """Each stage writes only its own outputs. Before: intake appended each batch to download's
    data/raw/manifest.json and joined its rows into download's folder; now they join the intake's own
    folder (intake.out_dir), the one validate reads by default."""
    root, p, d = project["root"], project["p"], project["d"]
    written = (root / "data/raw/manifest.json").read_bytes()
    raw = _tree(root / "data/raw")
    _drop(root / "feed/2026-12-03", project["rows"][1], project["generated"] / "1")
    assert intake(p, d).taken == [1]
    assert (root / "data/raw/manifest.json").read_bytes() == written
    assert _tree(root / "data/raw") == raw
    accumulated = json.loads((p.out_dir / "manifest.json").read_text())
    assert [b["batch"] for b in accumulated["batches"]] == [1]
    assert accumulated["base"]["sha256"] == json.loads(written)["sha256"]
    # the batch's rows reach validate (by default it reads the intake's folder) and so training
    assert ValidateParams().dataset_dir == IntakeParams().out_dir / DATASET_DIRNAME
    validate(ValidateParams(dataset_dir=p.out_dir / DATASET_DIRNAME, out_dir=tmp_path / "validated",
                            report_dir=tmp_path / "reports", workers=1))
    ids = set(project["rows"][1][PET_ID])
    fit = pd.concat([pd.read_parquet(tmp_path / f"validated/{split}.parquet") for split in ("train", "val")])
    held = round(DROP_ROWS * 0.2)
    assert len(ids & set(fit[PET_ID].astype(str))) == DROP_ROWS - held
    assert set(pd.read_parquet(tmp_path / "validated/holdout.parquet")[PET_ID].astype(str)) <= ids


def test_a_changed_download_rebuilds_the_accumulated_data_and_takes_the_batches_in_again(project: dict) -> None:
    """The base changed (another download): the intake's folder is built again on it, and the batches the
    ledger took in, still in the feed, join it again."""
    root, p, d = project["root"], project["p"], project["d"]
    _drop(root / "feed/drop-r", project["rows"][1], project["generated"] / "1")
    assert intake(p, d).taken == [1]
    changed = d.model_copy(update={"synthetic": d.synthetic.model_copy(update={"n_train": N_TRAIN + 20})})
    download(changed)
    assert intake(p, changed).taken == [1]
    manifest = json.loads((p.out_dir / "manifest.json").read_text())
    assert manifest["base"]["sha256"] == json.loads((root / "data/raw/manifest.json").read_text())["sha256"]
    assert [b["batch"] for b in manifest["batches"]] == [1]
    assert len(_train(root)) == N_TRAIN + 20 + DROP_ROWS - round(DROP_ROWS * 0.2)


@pytest.mark.slow
def test_a_fresh_index_batch_gets_new_row_ids_and_the_same_drop_again_is_a_no_op(project: dict) -> None:
    """Before: the batch's 0..n-1 index became row ids the base already had (duplicates in train.csv)."""
    root, p, d = project["root"], project["p"], project["d"]
    _drop(root / "feed/2026-12-01", project["rows"][1], project["generated"] / "1")
    summary = intake(p, d)
    assert summary.taken == [1] and summary.batches_taken_in == [1]
    train = _train(root)
    assert train.index.is_unique and train[PET_ID].is_unique
    assert len(train) == N_TRAIN + DROP_ROWS - round(DROP_ROWS * 0.2)
    new_ids = train.index[N_TRAIN:].astype(int)
    assert new_ids.min() >= N_TRAIN + N_TEST  # after every row id the data already had
    ledger = read_ledger(p.feed.ledger)
    # taken in (a drift warning on a small batch lets it join and says so)
    assert [(b.batch, b.name) for b in ledger.batches] == [(1, "2026-12-01")]
    assert ledger.batches[0].status in ("taken", "warned")
    manifest = json.loads((root / "data/accumulated/manifest.json").read_text())
    assert [(b["batch"], b["sha256"]) for b in manifest["batches"]] == [(1, ledger.batches[0].sha256)]

    before = _tree(root / "data/accumulated")
    again = intake(p, d)  # the same drop, and the same content under another name: nothing new
    shutil.copytree(root / "feed/2026-12-01", root / "feed/2026-12-01-resent")
    resent = intake(p, d)
    assert again.taken == [] and resent.taken == [] and len(resent.already) == 2
    assert _tree(root / "data/accumulated") == before


def test_a_changed_drop_under_a_used_name_is_refused_naming_it(project: dict) -> None:
    root, p, d = project["root"], project["p"], project["d"]
    drop = _drop(root / "feed/drop-a", project["rows"][1], project["generated"] / "1")
    intake(p, d)
    before = _tree(root / "data/accumulated")
    changed = pd.read_csv(drop / "train.csv", index_col=0, dtype=str, keep_default_na=False)
    changed.loc[0, "Age"] = "7"
    changed.to_csv(drop / "train.csv")
    with pytest.raises(StageError, match=r"feed drop 'drop-a' .* has changed since it was seen as batch 1"):
        intake(p, d)
    assert _tree(root / "data/accumulated") == before


def test_duplicate_ids_are_refused_naming_them_and_quarantined_with_the_reason(project: dict) -> None:
    root, p, d = project["root"], project["p"], project["d"]
    taken = _train(root).iloc[:3]  # three rows the data already holds (their photos too)
    table = pd.concat([project["rows"][2], taken], ignore_index=True)
    _drop(root / "feed/drop-b", table, root / "data/raw/dataset", project["generated"] / "2")
    before = _tree(root / "data/accumulated")
    with pytest.raises(JoinRefused) as err:
        intake(p, d)
    message = str(err.value)
    assert "3 id(s) of column 'PetID' are already in the accumulated data" in message
    assert f"{taken[PET_ID].iloc[0]} (row {DROP_ROWS + 1})" in message and "on_duplicate: update" in message
    assert _tree(root / "data/accumulated") == before  # byte for byte
    quarantined = root / "data/quarantine/batch-0001"
    assert (quarantined / "train.csv").is_file() and "join:" in (quarantined / "reason.txt").read_text()
    [record] = read_ledger(p.feed.ledger).batches
    assert record.status == "quarantined" and record.check == "join"


def test_ids_repeated_inside_a_batch_are_refused(project: dict) -> None:
    root, p, d = project["root"], project["p"], project["d"]
    rows = project["rows"][2]
    table = pd.concat([rows, rows.iloc[[5]]], ignore_index=True)
    _drop(root / "feed/drop-c", table, project["generated"] / "2")
    before = _tree(root / "data/accumulated")
    with pytest.raises(StageError, match=rf"'PetID': expected PetID unique .*PetID='{rows[PET_ID].iloc[5]}'"):
        intake(p, d)  # the batch's own validation names them first (the join checks again)
    assert _tree(root / "data/accumulated") == before


def test_with_on_duplicate_update_the_newer_row_replaces_the_older_and_is_recorded(project: dict) -> None:
    root, d = project["root"], project["d"]
    p = _params(root, on_duplicate="update")
    older = _train(root).iloc[:2].copy()
    newer = older.assign(Age=["99", "98"])
    _drop(root / "feed/drop-d", pd.concat([project["rows"][2], newer], ignore_index=True), root / "data/raw/dataset",
          project["generated"] / "2")
    summary = intake(p, d)
    assert summary.taken == [1]
    [record] = read_ledger(p.feed.ledger).batches
    assert record.replaced == sorted(older[PET_ID])
    train = _train(root)
    holdout = pd.read_csv(root / "data/accumulated/dataset/holdout/batch-0001.csv", index_col=0, dtype=str)
    both = pd.concat([train, holdout])
    assert both[PET_ID].is_unique  # one row per id: the newer
    assert sorted(both.set_index(PET_ID).loc[older[PET_ID], "Age"]) == ["98", "99"]
    manifest = json.loads((root / "data/accumulated/manifest.json").read_text())
    assert manifest["batches"][0]["replaced"] == sorted(older[PET_ID])


def test_an_image_name_clash_is_refused_by_name(project: dict) -> None:
    """Before: a raw FileExistsError from os.link."""
    root, p, d = project["root"], project["p"], project["d"]
    rows = project["rows"][3].copy()
    drop = _drop(root / "feed/drop-e", rows, project["generated"] / "3")
    existing = split_images(_train(root)[IMAGES].iloc[0])[0]  # a photo of a row already taken in
    mine = split_images(rows[IMAGES].iloc[0])[0]
    rows.loc[rows.index[0], IMAGES] = rows[IMAGES].iloc[0].replace(mine, existing)
    rows.reset_index(drop=True).to_csv(drop / "train.csv")
    shutil.copyfile(drop / mine, drop / existing)  # other bytes under a name the data already has
    before = _tree(root / "data/accumulated")
    with pytest.raises(JoinRefused, match=rf"image file\(s\) .* different image already in the accumulated data: "
                                          rf"{existing}"):
        intake(p, d)
    assert _tree(root / "data/accumulated") == before


@pytest.mark.slow
def test_the_quarantine_is_reviewed_with_the_batches_cli(project: dict, capsys: pytest.CaptureFixture[str]) -> None:
    root, p, d = project["root"], project["p"], project["d"]
    params = _write_params(root, p, d)
    taken = _train(root).iloc[:2]
    _drop(root / "feed/a", pd.concat([project["rows"][1], taken], ignore_index=True), root / "data/raw/dataset",
          project["generated"] / "1")
    with pytest.raises(JoinRefused):
        intake(p, d)
    shutil.rmtree(root / "feed/a")
    rows = project["rows"][2]
    _drop(root / "feed/b", pd.concat([rows, rows.iloc[[0]]], ignore_index=True), project["generated"] / "2")
    with pytest.raises(StageError):
        intake(p, d)
    capsys.readouterr()

    assert main(["batches", "--params", str(params), "list"]) == 0
    listing = capsys.readouterr().out
    assert "quarantined" in listing and "[join]" in listing and "[validation]" in listing
    # b repeats an id inside itself: no review can take that in
    assert main(["batches", "--params", str(params), "readmit", "2"]) == 1
    assert "cannot be overridden" in capsys.readouterr().err
    assert main(["batches", "--params", str(params), "reject", "2", "--reason", "a broken export"]) == 0
    capsys.readouterr()
    # a holds ids taken in already: readmitted, its newer rows replace the older, the override recorded
    assert main(["batches", "--params", str(params), "readmit", "1"]) == 0
    readmitted = json.loads(capsys.readouterr().out)
    assert readmitted["status"] == "readmitted" and readmitted["replaced"] == sorted(taken[PET_ID])
    assert any(o.startswith("join: reviewed") for o in readmitted["overrides"])
    assert main(["batches", "--params", str(params), "list", "--json"]) == 0
    statuses = {b["batch"]: b["status"] for b in json.loads(capsys.readouterr().out)}
    assert statuses == {1: "readmitted", 2: "rejected"}
    manifest = json.loads((root / "data/accumulated/manifest.json").read_text())
    assert [b["batch"] for b in manifest["batches"]] == [1] and manifest["batches"][0]["overrides"]
    assert not (root / "data/quarantine/batch-0001").exists() and (root / "data/quarantine/batch-0002").is_dir()
    assert main(["batches", "--params", str(params), "readmit", "2"]) == 1  # rejected: not quarantined any more
    assert "is rejected, not quarantined" in capsys.readouterr().err


@pytest.mark.slow
def test_validate_refuses_repeated_row_ids_naming_them_instead_of_crashing(base: dict, tmp_path: Path) -> None:
    """What a hand-landed batch with a fresh index used to leave behind: before, validate crashed with
    `PydanticSerializationError: Unable to serialize unknown type: numpy.int64` writing its report."""
    from tasks.params import ValidateParams
    from tasks.validate import ValidationError, validate

    dataset = tmp_path / "dataset"
    shutil.copytree(base["root"] / "data/raw/dataset", dataset)
    train = pd.read_csv(dataset / "train.csv", index_col=0, dtype=str, keep_default_na=False)
    pd.concat([train, train.iloc[:20].reset_index(drop=True)]).to_csv(dataset / "train.csv")
    with pytest.raises(ValidationError, match=r"column 'row_id': expected the file's leading index column is unique"):
        validate(ValidateParams(dataset_dir=dataset, out_dir=tmp_path / "validated", report_dir=tmp_path / "reports",
                                workers=1))
    report = json.loads((tmp_path / "reports/validation.json").read_text())
    assert report["success"] is False


def test_a_url_feed_takes_the_drops_its_listing_names(project: dict, tmp_path: Path) -> None:
    """kind url: a listing of drop URLs (file:// here; http(s) goes through the download's retries)."""
    root, d = project["root"], project["d"]
    rows = project["rows"][1]
    served = tmp_path / "served"
    _drop(served / "first", rows, project["generated"] / "1")
    shutil.make_archive(str(served / "first"), "zip", served, "first")
    (served / "listing.txt").write_text(f"# drops\nnightly-1 file://{served / 'first.zip'}\n")
    p = project["p"].model_copy(update={"feed": FeedParams(kind="url", url=f"file://{served / 'listing.txt'}",
                                                           ledger=root / "data/intake/batches.json")})
    assert intake(p, d).taken == [1]
    [record] = read_ledger(p.feed.ledger).batches
    assert record.name == "nightly-1" and record.origin.endswith("first.zip")
    assert intake(p, d).already == [f"nightly-1: batch 1, {record.status}"]


@pytest.mark.slow
def test_dvc_lock_names_the_batches_the_data_holds(tmp_path: Path) -> None:
    """`dvc repro intake` in a throwaway git + DVC copy with a folder feed: dvc.lock records the ledger,
    which names the batch by content sha256; the download stage's entry claims no batch number."""
    from project_copy import dvc, make_project

    project = make_project(tmp_path / "project", {"intake": {"feed": {"kind": "folder", "path": "feed"}}})
    generate_batch(tmp_path / "rows", SyntheticParams(image_size=32, seed=7, batch_rows=60), 1)
    _drop(project / "feed/2026-12-02", pd.read_csv(tmp_path / "rows/train.csv", index_col=0, dtype=str,
                                                   keep_default_na=False), tmp_path / "rows")
    dvc(project, "repro", "intake")
    # the download stage's output is as download wrote it: dvc.lock's hash holds and `dvc status` says so
    # (before, intake rewrote data/raw/manifest.json and joined into data/raw: download showed as modified)
    assert dvc(project, "status", "download").stdout.strip() == "Data and pipelines are up to date."
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    ledger = json.loads((project / "data/intake/batches.json").read_text())
    [record] = ledger["batches"]
    assert record["name"] == "2026-12-02" and record["status"] in ("taken", "warned")
    intake_outs = {o["path"]: o for o in lock["stages"]["intake"]["outs"]}
    assert "data/intake/batches.json" in intake_outs and "data/accumulated" in intake_outs
    assert intake_outs["data/intake/batches.json"]["md5"] == hashlib.md5(
        (project / "data/intake/batches.json").read_bytes()).hexdigest()
    for stage in ("download", "intake"):  # no stage claims which batch arrived: the ledger says
        tracked = lock["stages"][stage]["params"]["params.yaml"]
        assert not any(k.startswith("download.synthetic.batch") for k in tracked), (stage, tracked)
    manifest = json.loads((project / "data/accumulated/manifest.json").read_text())
    assert [b["sha256"] for b in manifest["batches"]] == [record["sha256"]]
    assert "batches" not in json.loads((project / "data/raw/manifest.json").read_text())


def test_a_parquet_drop_is_taken_in_like_a_csv(project: dict) -> None:
    root, p, d = project["root"], project["p"], project["d"]
    drop = _drop(root / "feed/drop-p", project["rows"][1], project["generated"] / "1")
    table = pd.read_csv(drop / "train.csv", index_col=0, dtype=str, keep_default_na=False)
    (drop / "train.csv").unlink()
    table.to_parquet(drop / "rows.parquet")
    assert intake(p, d).taken == [1]
    assert _train(root)[PET_ID].is_unique and len(_train(root)) == N_TRAIN + DROP_ROWS - round(DROP_ROWS * 0.2)


# --- params.yaml `intake:` ------------------------------------------------------------------------------


def test_params_yaml_declares_the_intake_section_right_after_download_with_its_defaults() -> None:
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    sections = list(raw)
    assert sections[sections.index("download") + 1] == "intake"
    assert load_params(ROOT / "params.yaml").intake == IntakeParams()
    assert not {"feed", "drift_gate", "holdout_fraction", "incoming_dir", "quarantine_dir", "report_dir"} & set(
        raw["download"])


def test_an_old_params_yaml_with_the_intake_keys_under_download_is_refused_naming_each(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before the intake stage had its own section these keys were download's: an old file must say where
    each one went, not fail on an unknown key (or silently use the defaults)."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["download"] |= {"feed": {"kind": "folder", "path": "feed"}, "report_dir": "reports", "holdout_fraction": 0.3}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    with pytest.raises(ParamsError) as err:
        load_params(path)
    for key in ("feed", "holdout_fraction", "report_dir"):
        assert f"download.{key}: moved to the intake: section (intake.{key}); move the key there" in str(err.value)
    assert "drift_gate" not in str(err.value)  # only the keys the file has
    assert main(["intake", "--params", str(path)]) == 1
    assert "download.feed: moved to the intake: section (intake.feed)" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"download\.incoming_dir: moved to the intake: section"):
        DownloadParams(incoming_dir="data/incoming")


def test_intake_before_download_or_into_the_download_folder_is_refused_with_the_fix(tmp_path: Path) -> None:
    p, d = _params(tmp_path), _download(tmp_path)
    with pytest.raises(StageError, match=r"data/raw/dataset/train\.csv: no downloaded dataset .* run `python -m "
                                         r"tasks download` first"):
        intake(p, d)
    with pytest.raises(StageError, match=r"intake\.out_dir .* is download\.out_dir: .* Fix: set intake\.out_dir"):
        intake(p.model_copy(update={"out_dir": d.out_dir}), d)
    assert not (tmp_path / "data").exists()
