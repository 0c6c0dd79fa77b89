"""What evaluation and promotion read: a complete converted model folder and the validated test table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fusion_model.dataset import DatasetSchema
from fusion_model.layout import CONVERSION_MANIFEST, MODEL_CONFIG, MODEL_FILES, WEIGHTS
from fusion_model.metrics import class_indices
from tasks._io.files import read_json
from tasks._io.hashing import sha256_file
from tasks.errors import StageError


def missing_model_files(model_dir: Path) -> str | None:
    """Why `model_dir` is not a complete conversion output (a file missing), or None."""
    if not model_dir.is_dir():
        return (f"{model_dir}: no model folder. Run `python -m tasks convert` to write model.safetensors, "
                "model_config.json and manifest.json there from the training checkpoint.")
    missing = [name for name in MODEL_FILES if not (model_dir / name).is_file()]
    if missing:
        return (f"{model_dir}: missing {', '.join(missing)}; the folder is not a complete converted model. "
                "Run `python -m tasks convert` (it writes model.safetensors, model_config.json and manifest.json "
                "together) and evaluate again.")
    return None


def model_dir_problem(model_dir: Path) -> str | None:
    """Why `model_dir` cannot be trusted, or None: every file present, and the weights and config the very
    ones its manifest recorded when the conversion verified them (strict load, all finite)."""
    missing = missing_model_files(model_dir)
    if missing:
        return missing
    manifest_path = model_dir / CONVERSION_MANIFEST
    fix = "re-run `python -m tasks convert`"
    try:
        manifest = read_json(manifest_path, fix)
    except StageError as e:
        return str(e)
    verification, output = manifest.get("verification") or {}, manifest.get("output") or {}
    if not (verification.get("strict_load") is True and verification.get("all_finite") is True):
        return f"{manifest_path} does not record a passed verification; {fix}"
    if output.get("sha256") != sha256_file(model_dir / WEIGHTS):
        return f"{model_dir / WEIGHTS} is not the file its manifest verified (sha256 differs); {fix}"
    if output.get("model_config_sha256") != sha256_file(model_dir / MODEL_CONFIG):
        return (f"{model_dir / MODEL_CONFIG} is not the config its manifest verified with these weights "
                f"(sha256 differs, or an older manifest without it); {fix}")
    return None


def check_model_dir(model_dir: Path) -> None:
    """Refuse a model folder that is incomplete or not what its conversion verified, naming why."""
    problem = model_dir_problem(model_dir)
    if problem:
        raise StageError(problem)


@dataclass
class TestSet:
    """The validated test table with what scoring it needs: the schema, the label's classes, the labels as
    the metrics take them (class indices, or values for regression) and the images root."""

    table: pd.DataFrame
    meta: dict[str, Any]
    images_root: Path
    schema: DatasetSchema
    problem_type: str
    classes: list[int | str]

    @property
    def label(self) -> str:
        return self.schema.label.column

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def y(self) -> np.ndarray:
        return self.labels_of(self.table)

    def labels_of(self, df: pd.DataFrame) -> np.ndarray:
        if self.problem_type == "regression":
            return df[self.label].to_numpy(dtype=np.float64)
        try:
            return class_indices(df[self.label].tolist(), self.classes)
        except ValueError as e:
            raise StageError(f"{e}; re-run validate so every table holds the training rows' classes") from None

    def values(self, prediction: np.ndarray) -> np.ndarray:
        """Predicted class indices -> class values (regression: as they are)."""
        if self.problem_type == "regression":
            return np.asarray(prediction)
        values = np.asarray(self.classes, dtype=object)[np.asarray(prediction, dtype=np.int64)]
        return values.astype(np.int64) if all(isinstance(c, int) for c in self.classes) else values


def load_test_set(data_dir: Path) -> TestSet:
    """The validated test table, its meta.json (with the dataset schema) and the images root the table's
    relative paths start from."""
    fix = "Run `python -m tasks validate` to write data/validated/."
    meta = read_json(data_dir / "meta.json", fix)
    for key in ("dataset_root", "label", "problem_type", "classes", "schema"):
        if key not in meta:
            raise StageError(f"{data_dir / 'meta.json'}: no `{key}` key (an older validate stage wrote it). {fix}")
    test_path = data_dir / "test.parquet"
    if not test_path.is_file():
        raise StageError(f"{test_path}: missing. {fix}")
    table = pd.read_parquet(test_path)
    for column in ("row_id", meta["label"]):
        if column not in table.columns:
            raise StageError(f"{test_path}: no `{column}` column. {fix}")
    if table.empty:
        raise StageError(f"{test_path}: no rows to evaluate. Check the raw test.csv and re-run validate.")
    root = Path(meta["dataset_root"])
    images_root = root if root.is_absolute() else data_dir / root
    return TestSet(table=table, meta=meta, images_root=images_root,
                   schema=DatasetSchema.model_validate(meta["schema"]), problem_type=meta["problem_type"],
                   classes=list(meta["classes"]))


def load_predictor(model_dir: Path) -> Any:
    """`fusion_model.predict.Predictor` for a checked model folder; unreadable files become a StageError."""
    from safetensors import SafetensorError

    from fusion_model.predict import Predictor  # torch/timm load only when a model is really needed

    check_model_dir(model_dir)
    try:
        return Predictor.load(model_dir)
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as e:
        raise StageError(
            f"{model_dir}: cannot load the converted model ({type(e).__name__}: {e}). Re-run "
            "`python -m tasks convert` to rewrite it (and train first if the checkpoint is gone)."
        ) from e
