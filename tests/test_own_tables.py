"""Tables of any schema: declared in params.yaml `dataset:`, read by the local source, validated by the
suite the schema gives; every bad input named with its file, row or column and leaving the data as it
was. Tables are made in fixtures (real rows: tests/test_real_datasets.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from PIL import Image

from fusion_model.dataset import SchemaError, resolve_schema
from tasks._io.hashing import file_hashes
from tasks.dataset import infer_section
from tasks.download import download
from tasks.download.manifest import DATASET_DIRNAME
from tasks.errors import StageError
from tasks.params import DownloadParams, LocalParams, ParamsError, ValidateParams, load_params
from tasks.validate import ValidationError, validate

ROOT = Path(__file__).resolve().parents[1]

PRODUCTS = {
    "preset": None, "id": "sku",
    "label": {"column": "season", "problem_type": "multiclass"},
    "columns": {"image": ["photo"], "text": ["Product Name", "Review Text"],
                "categorical": ["colour", "Article Type"], "numerical": ["price", "year"]},
    "frequency": ["Article Type"],
}


def _photo(path: Path, shade: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((24, 24, 3), shade, dtype=np.uint8)).save(path, quality=90)


@pytest.fixture(scope="module")
def products(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A product table as a user exports it: an unnamed index column, column names with spaces, multi-line
    and empty text cells, photos under their own root (not beside the CSV), a rare class."""
    root = tmp_path_factory.mktemp("products")
    rng = np.random.default_rng(0)
    seasons = np.array(["Fall", "Summer", "Winter"])[rng.integers(0, 3, 160)]
    seasons[:3] = "Spring"  # too rare to learn: merged into "other" by the default rule
    rows = []
    for i, season in enumerate(seasons):
        rel = f"img/{i:04d}.jpg" if i % 10 else ""  # every tenth product has no photo
        if rel:
            _photo(root / "photos" / rel, {"Summer": 220, "Winter": 40}.get(season, 128))
        rows.append({
            "sku": f"SKU-{i:05d}", "Product Name": f"{season.lower()} jacket model {i}",
            "Review Text": "" if i % 9 == 0 else f"warm and cosy, bought {i % 5} of them,\nfits well ({i})",
            "colour": ["Navy", "Red", "White"][i % 3], "Article Type": ["Jackets", "Tshirts"][i % 2],
            "price": f"{rng.gamma(2, 20):.2f}", "year": 2010 + i % 6, "photo": rel, "season": season,
        })
    table = root / "export" / "products.csv"
    table.parent.mkdir()
    pd.DataFrame(rows).to_csv(table)  # pandas writes the leading unnamed index column
    return root


def _download(products: Path, out: Path, dataset: dict | None = None, **local: object) -> object:
    params = DownloadParams(source="local", out_dir=out, local=LocalParams(
        path=products / "export" / "products.csv", images_dir=products / "photos", **local))
    return download(params, resolve_schema(dataset or PRODUCTS))


def _validate(out: Path, tmp_path: Path, dataset: dict | None = None) -> object:
    return validate(ValidateParams(dataset_dir=out / DATASET_DIRNAME, out_dir=tmp_path / "validated",
                                   report_dir=tmp_path / "reports"), resolve_schema(dataset or PRODUCTS))


def _set_cell(raw: Path, split: str, row: int, column: str, value: str) -> pd.DataFrame:
    """Write `value` into one cell (the row's position) of a downloaded split's CSV; the edited table."""
    path = raw / DATASET_DIRNAME / f"{split}.csv"
    frame = pd.read_csv(path, index_col=0, keep_default_na=False, dtype=str)
    frame.iloc[row, frame.columns.get_loc(column)] = value
    frame.to_csv(path)
    return frame


def test_a_table_of_another_schema_is_read_and_validated(products: Path, tmp_path: Path) -> None:
    summary = _download(products, tmp_path / "raw")
    dataset = tmp_path / "raw" / DATASET_DIRNAME
    train = pd.read_csv(dataset / "train.csv", index_col=0, keep_default_na=False)
    assert list(train.columns) == ["sku", "Product Name", "Review Text", "colour", "Article Type", "price", "year",
                                   "photo", "season"]
    assert summary.rows == {"train": 128, "test": 32}
    assert any("\n" in cell for cell in train["Review Text"])  # multi-line cells survive the round trip
    photos = {p for cell in train["photo"] for p in cell.split(";") if p}
    assert all((dataset / p).is_file() for p in photos)  # placed at the same relative path

    checked = _validate(tmp_path / "raw", tmp_path)
    meta = json.loads((tmp_path / "validated" / "meta.json").read_text())
    assert checked.problem_type == "multiclass" and meta["classes"] == ["Fall", "Summer", "Winter", "other"]
    assert meta["label_rule"]["merged"] == ["Spring"] and meta["label_rule"]["other_class"] == "other"
    assert meta["id"] == "sku" and meta["schema"]["columns"]["text"] == ["Product Name", "Review Text"]
    typed = pd.read_parquet(tmp_path / "validated" / "train.parquet")
    assert typed["price"].dtype == "float64" and typed["year"].dtype == "float64"
    assert typed["sku"].str.startswith("SKU-").all() and typed["season"].dtype != "int64"
    report = json.loads((tmp_path / "reports" / "validation.json").read_text())
    assert report["success"] and report["suite"] == "dataset"


def test_parquet_and_a_labelled_test_table(products: Path, tmp_path: Path) -> None:
    frame = pd.read_csv(products / "export" / "products.csv", index_col=0, keep_default_na=False)
    frame["year"] = frame["year"].astype("int64")
    frame.iloc[:120].to_parquet(tmp_path / "train.parquet")
    frame.iloc[120:].to_csv(tmp_path / "test.csv")
    params = DownloadParams(source="local", out_dir=tmp_path / "raw", local=LocalParams(
        path=tmp_path / "train.parquet", images_dir=products / "photos", test_path=tmp_path / "test.csv"))
    summary = download(params, resolve_schema(PRODUCTS))
    assert summary.rows == {"train": 120, "test": 40}
    manifest = json.loads((tmp_path / "raw" / "manifest.json").read_text())
    assert manifest["split"] == {"kind": "files", "test": "test.csv"}
    train = pd.read_csv(tmp_path / "raw" / DATASET_DIRNAME / "train.csv", index_col=0, keep_default_na=False)
    assert train["year"].iloc[0] == frame["year"].iloc[0]  # whole numbers stay whole


def test_inferred_declaration_runs_as_is(products: Path, tmp_path: Path) -> None:
    """The schema round trip: `dataset infer` drafts the section, the stages take it unchanged."""
    draft = infer_section(products / "export" / "products.csv", products / "photos", "season")
    declared = yaml.safe_load(draft)["dataset"]
    assert declared["id"] == "sku" and declared["columns"]["image"] == ["photo"]
    assert set(declared["columns"]["text"]) >= {"Review Text"} and declared["label"]["problem_type"] == "multiclass"
    assert "# Why each column got its role:" in draft and "#   price: numerical" in draft
    _download(products, tmp_path / "raw", declared)
    assert _validate(tmp_path / "raw", tmp_path, declared).classes


def test_the_infer_cli_asks_about_ordinal_numbers(tmp_path: Path) -> None:
    table = tmp_path / "reviews.csv"
    pd.DataFrame({"Review Text": [f"great dress number {i}" for i in range(40)], "Rating": [1, 2, 3, 4, 5] * 8,
                  "Recommended": [1, 0] * 20}).to_csv(table, index=False)
    done = subprocess.run([sys.executable, "-m", "tasks", "dataset", "infer", str(table), "--label", "Rating"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "problem_type: ordinal" in done.stdout and "QUESTION: 5 whole numbers 1..5" in done.stdout
    assert "id: null" in done.stdout
    bad = subprocess.run([sys.executable, "-m", "tasks", "dataset", "infer", str(table), "--label", "Stars"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "--label 'Stars' is not a column" in bad.stderr


# ------------------------------------------------------------------------------------------- bad input
def test_a_column_given_two_roles_is_refused_before_anything_runs(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="column 'colour' is given two roles .(text and categorical|categorical and text)."):
        resolve_schema({**PRODUCTS, "columns": {**PRODUCTS["columns"], "text": ["colour"]}})
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["dataset"] = {**PRODUCTS, "columns": {**PRODUCTS["columns"], "numerical": ["price", "colour"]}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ParamsError, match="dataset: .*column 'colour' is given two roles"):
        load_params(tmp_path / "params.yaml")
    with pytest.raises(SchemaError, match="the label 'season' is also an input"):
        resolve_schema({**PRODUCTS, "columns": {**PRODUCTS["columns"], "categorical": ["season"]}})


def test_a_declared_column_the_table_lacks_is_refused_and_the_data_kept(products: Path, tmp_path: Path) -> None:
    _download(products, tmp_path / "raw")
    before = file_hashes(tmp_path / "raw")
    missing = {**PRODUCTS, "columns": {**PRODUCTS["columns"], "categorical": ["colour", "Article Type", "Brand"]}}
    with pytest.raises(StageError, match=r"missing column\(s\) \['Brand'\] that params.yaml dataset: declares"):
        _download(products, tmp_path / "raw", missing)
    assert file_hashes(tmp_path / "raw") == before


def test_duplicate_ids_are_refused_naming_the_rows(products: Path, tmp_path: Path) -> None:
    source = products / "export" / "products.csv"
    frame = pd.read_csv(source, index_col=0, keep_default_na=False)
    frame.loc[7, "sku"] = frame.loc[3, "sku"]
    copy = tmp_path / "dupes" / "products.csv"
    copy.parent.mkdir()
    frame.to_csv(copy)
    params = DownloadParams(source="local", out_dir=tmp_path / "raw",
                            local=LocalParams(path=copy, images_dir=products / "photos"))
    with pytest.raises(StageError) as info:
        download(params, resolve_schema(PRODUCTS))
    assert "2 repeated (rows 5, 9 (2 rows; header = row 1), e.g. ['SKU-00003'])" in str(info.value)
    assert "drop_bad_ids: true" in str(info.value) and not (tmp_path / "raw").exists()


def test_text_in_a_numerical_column_is_refused_naming_the_rows(products: Path, tmp_path: Path) -> None:
    _download(products, tmp_path / "raw")
    frame = _set_cell(tmp_path / "raw", "train", 4, "price", "about 20 EUR")
    with pytest.raises(ValidationError) as info:
        _validate(tmp_path / "raw", tmp_path)
    message = str(info.value)
    assert "train.csv, column 'price': expected a number (or an empty cell)" in message
    assert f"row_id {frame.index[4]} (price='about 20 EUR')" in message
    assert "declare the column as text or categorical" in message
    assert not (tmp_path / "validated").exists()


def test_missing_photos_are_refused_by_name(products: Path, tmp_path: Path) -> None:
    _download(products, tmp_path / "raw")
    dataset = tmp_path / "raw" / DATASET_DIRNAME
    train = pd.read_csv(dataset / "train.csv", index_col=0, keep_default_na=False)
    name = next(p for p in train["photo"] if p)
    (dataset / name).unlink()
    with pytest.raises(ValidationError, match=rf"column 'photo': expected image files exist.*{name}: file not found"):
        _validate(tmp_path / "raw", tmp_path)


def test_labels_that_cannot_be_learned_are_refused(products: Path, tmp_path: Path) -> None:
    _download(products, tmp_path / "raw")
    one_class = {**PRODUCTS, "label": {"column": "colour", "problem_type": "binary"},
                 "columns": {**PRODUCTS["columns"], "categorical": ["Article Type", "season"]}}
    train = tmp_path / "raw" / DATASET_DIRNAME / "train.csv"
    frame = pd.read_csv(train, index_col=0, keep_default_na=False, dtype=str)
    frame.assign(colour="Navy").to_csv(train)
    with pytest.raises(ValidationError, match="column 'colour': every training row holds the same label Navy"):
        _validate(tmp_path / "raw", tmp_path, one_class)
    frame.to_csv(train)
    ordinal = {**PRODUCTS, "label": {"column": "season", "problem_type": "ordinal"}}
    with pytest.raises(ValidationError, match=r"ordinal label must be numeric or have its order given.*"
                                              r"list them low to high in dataset.label.classes"):
        _validate(tmp_path / "raw", tmp_path, ordinal)
    ordered = {**ordinal, "label": {**ordinal["label"], "classes": ["Spring", "Summer", "Fall", "Winter"]}}
    assert _validate(tmp_path / "raw", tmp_path, ordered).classes == ["Spring", "Summer", "Fall", "Winter"]
    refuse = {**PRODUCTS, "label": {**PRODUCTS["label"], "rare_classes": "refuse"}}
    with pytest.raises(ValidationError, match=r"class\(es\) \['Spring'\] have fewer than dataset.label.min_class_rows"):
        _validate(tmp_path / "raw", tmp_path, refuse)


def test_a_class_no_training_row_holds_is_merged_like_a_rare_one(products: Path, tmp_path: Path) -> None:
    """A split can put a class's only row in the test table: with rare classes merged, it is one of them."""
    _download(products, tmp_path / "raw")
    frame = _set_cell(tmp_path / "raw", "test", 0, "season", "Monsoon")
    _validate(tmp_path / "raw", tmp_path)
    typed = pd.read_parquet(tmp_path / "validated" / "test.parquet")
    assert typed.loc[typed["row_id"] == int(frame.index[0]), "season"].tolist() == ["other"]
    # without a merged class there is no class to put it in: refused, the row named
    kept = {**PRODUCTS, "label": {**PRODUCTS["label"], "min_class_rows": 2}}
    with pytest.raises(ValidationError, match=r"column 'season': expected label among the classes.*'Monsoon'"):
        _validate(tmp_path / "raw", tmp_path, kept)


def test_a_regression_label_is_a_number_in_every_row(products: Path, tmp_path: Path) -> None:
    priced = {**PRODUCTS, "label": {"column": "price", "problem_type": "regression", "transform": "log1p"},
              "columns": {**PRODUCTS["columns"], "numerical": ["year"], "categorical": ["colour", "season"]},
              "frequency": []}
    _download(products, tmp_path / "raw", priced)
    summary = _validate(tmp_path / "raw", tmp_path, priced)
    assert summary.problem_type == "regression" and summary.classes == []
    assert pd.read_parquet(tmp_path / "validated" / "train.parquet")["price"].dtype == "float64"
    _set_cell(tmp_path / "raw", "train", 2, "price", "n/a")
    with pytest.raises(ValidationError, match="column 'price': expected the label is a number"):
        _validate(tmp_path / "raw", tmp_path, priced)
    # a column of words declared as a regression label: the type that fits is named, not "fill every cell"
    worded = {**PRODUCTS, "label": {"column": "season", "problem_type": "regression"}}
    _download(products, tmp_path / "worded", worded)
    with pytest.raises(ValidationError, match=r"column 'season': declared a regression label, but 128 of 128 filled "
                                              r"cell\(s\) are not numbers .* set dataset.label.problem_type to "
                                              r"multiclass") as refused:
        _validate(tmp_path / "worded", tmp_path, worded)
    assert "fill every" not in str(refused.value)


def test_a_section_with_its_own_columns_does_not_inherit_the_default_preset(tmp_path: Path) -> None:
    """Written without `preset:` (the whole section replaced) or given as an override beside the file's
    `preset: petfinder`, another table's columns get no PetFinder id pattern, bounds or columns."""
    own = {k: v for k, v in PRODUCTS.items() if k != "preset"}
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["dataset"] = own
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    for loaded in (load_params(tmp_path / "params.yaml"), load_params(ROOT / "params.yaml", {"dataset": own})):
        schema = loaded.dataset.schema
        assert schema.preset is None and schema.id == "sku" and schema.checks.id_pattern is None
        assert schema.columns.numerical == ["price", "year"] and not schema.checks.bounds
    # naming the preset keeps it (its checks of the columns still declared apply)
    named = load_params(ROOT / "params.yaml", {"dataset": {"preset": "petfinder", "columns": {
        "numerical": ["Age", "Fee"]}}}).dataset.schema
    assert named.preset == "petfinder" and set(named.checks.bounds) == {"Age", "Fee"}
    # a section without columns is the default table's
    assert load_params(ROOT / "params.yaml", {"dataset": {"label": {"problem_type": "ordinal"}}}
                       ).dataset.schema.preset == "petfinder"
