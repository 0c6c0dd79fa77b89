"""Load a converted model folder (``model.safetensors`` + ``model_config.json``) and predict new rows.

``python -m fusion_model.predict --model data/model --csv NEW.csv --images-root DIR --out preds.csv``

Only the converted file is read (never a Lightning or ZeRO checkpoint), so predicting also proves the
conversion. Preprocessing uses the statistics saved at training time; no training data is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader

from fusion_model.dataset import MODALITIES, DatasetSchema
from fusion_model.heads import Outputs
from fusion_model.layout import MODEL_CONFIG, WEIGHTS
from fusion_model.legacy import upgrade_config
from fusion_model.model import FusionModel
from fusion_model.preprocess import Preprocessor

# Above this many rows a progress bar is shown (stderr), below it prediction is quiet.
PROGRESS_MIN_ROWS = 2048


class PredictError(ValueError):
    """The model folder or the input rows cannot be used; the message names the file and the fix."""


def build_model(config: dict[str, Any]) -> FusionModel:
    """A freshly initialised FusionModel shaped as in ``config`` (the contents of model_config.json)."""
    try:
        kwargs = dict(config["model"])
    except (KeyError, TypeError):
        raise PredictError("model config has no 'model' section; use the model_config.json the train stage wrote") from None
    # the trained weights replace whatever the backbone was initialised from: never reload a weights file
    kwargs["pretrained"] = False
    kwargs["text_weights"] = None  # the text transformer's too: it is built from its saved config
    return FusionModel(**kwargs)


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / MODEL_CONFIG
    if not path.is_file():
        raise PredictError(f"{path} is missing; point --model at the convert stage's output folder (data/model)")
    return upgrade_config(json.loads(path.read_text()))


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


@dataclass
class Predictions:
    """Per row: `prediction` (a class index, or a value for regression), class probabilities [rows, classes]
    (classification) and `score` (binary: P(positive class); ordinal: the expected class index)."""

    prediction: np.ndarray
    proba: np.ndarray | None
    score: np.ndarray | None


class Predictor:
    def __init__(self, model: FusionModel, config: dict[str, Any]) -> None:
        self.model = model.eval()
        self.config = config
        self.pre = Preprocessor.from_dict(config["preprocess"])
        self.classes: list[int | str] = list(config["classes"])
        self.problem_type: str = config["problem_type"]
        self.schema = DatasetSchema.model_validate(config["dataset"])

    @classmethod
    def load(cls, model_dir: str | Path) -> Predictor:
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        config = _read_config(model_dir)
        weights = model_dir / WEIGHTS
        if not weights.is_file():
            raise PredictError(f"{weights} is missing; run `python -m tasks convert` to produce it")
        model = build_model(config)
        state = load_file(str(weights))
        for name, value in config.get("missing_buffers", {}).items():  # a model of an older format
            state.setdefault(name, torch.tensor(value))
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise PredictError(
                f"{weights} does not match {model_dir / MODEL_CONFIG} ({str(e).splitlines()[0]}); "
                "convert the checkpoint again from the same training run"
            ) from None
        return cls(model.float(), config)

    def _check_rows(self, df: pd.DataFrame, images_root: Path, source: str | Path | None = None) -> None:
        from fusion_model.checks import check_prediction_rows

        check_prediction_rows(df, images_root, self.schema, source=source)

    @torch.inference_mode()
    def predict_outputs(
        self, df: pd.DataFrame, images_root: str | Path, drop_modalities: Iterable[str] = (), batch_size: int = 256,
        source: str | Path | None = None,
    ) -> Predictions:
        """Predictions for `df` (rows of the training columns; a label column is ignored). `source`: the file
        the rows came from, named (with the 1-based data line) in a refusal.

        ``drop_modalities`` zeroes those modalities' contributions (the ablation of the evaluate stage).
        """
        from fusion_model.data import FusionDataset

        drop = set(drop_modalities)
        unknown = drop - set(MODALITIES)
        if unknown:
            raise PredictError(f"cannot drop {sorted(unknown)}: modalities are {list(MODALITIES)}")
        images_root = Path(images_root)
        self._check_rows(df, images_root, source)
        dataset = FusionDataset(df, self.pre, images_root)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=_collate)
        batches: Iterable[dict[str, torch.Tensor]] = loader
        if len(dataset) >= PROGRESS_MIN_ROWS:
            from tqdm import tqdm

            batches = tqdm(loader, desc="predict", unit="batch", file=sys.stderr)
        parts = [self.model.interpret(self.model(batch, mask=drop)) for batch in batches]
        return _concat(parts, len(self.classes))

    def predict_proba(self, df: pd.DataFrame, images_root: str | Path, drop_modalities: Iterable[str] = (),
                      batch_size: int = 256) -> np.ndarray:
        """Class probabilities [rows, len(classes)], columns in the order of ``self.classes``."""
        if self.problem_type == "regression":
            raise PredictError("a regression model predicts values, not class probabilities; use predict()")
        out = self.predict_outputs(df, images_root, drop_modalities, batch_size)
        assert out.proba is not None
        return out.proba

    def predict(self, df: pd.DataFrame, images_root: str | Path, batch_size: int = 256,
                source: str | Path | None = None) -> pd.DataFrame:
        """One row per input row (same index): the id column (when the rows have it), the prediction (a class,
        or a value in the label's unit), the ordinal score (expected class index) and one probability column
        per class (classification)."""
        out = self.predict_outputs(df, images_root, batch_size=batch_size, source=source)
        return prediction_frame(out, self.problem_type, self.classes, df.index,
                                ids=df[self.schema.id] if self.schema.id and self.schema.id in df.columns else None,
                                id_column=self.schema.id)


def _concat(parts: list[Outputs], num_classes: int) -> Predictions:
    if not parts:
        empty = np.zeros(0)
        return Predictions(prediction=empty, proba=np.zeros((0, num_classes)), score=empty)

    def cat(name: str) -> np.ndarray | None:
        values = [getattr(p, name) for p in parts]
        return None if values[0] is None else torch.cat(values).float().numpy() if name != "prediction" \
            else torch.cat(values).numpy()

    return Predictions(prediction=cat("prediction"), proba=cat("proba"), score=cat("score"))


def prediction_frame(out: Predictions, problem_type: str, classes: list[int | str], index: Any,
                     ids: pd.Series | None = None, id_column: str | None = None) -> pd.DataFrame:
    """Predictions as a table: [id], prediction, [score], [proba_<class>...]."""
    frame = pd.DataFrame(index=index)
    if ids is not None and id_column:
        frame[id_column] = ids.to_numpy()
    if problem_type == "regression":
        frame["prediction"] = out.prediction
        return frame
    frame["prediction"] = np.asarray(classes, dtype=object)[out.prediction.astype(np.int64)]
    if all(isinstance(c, int) for c in classes):
        frame["prediction"] = frame["prediction"].astype(np.int64)
    if problem_type == "ordinal" and out.score is not None:
        frame["score"] = out.score
    if out.proba is not None:
        for i, c in enumerate(classes):
            frame[f"proba_{c}"] = out.proba[:, i]
    return frame


def read_rows_csv(path: Path, text_columns: Iterable[str] = ()) -> pd.DataFrame:
    """A table of rows to predict, with or without a leading unnamed index column; empty text cells -> ""."""
    if not path.is_file():
        raise PredictError(f"{path} does not exist; pass the CSV of rows to predict with --csv")
    df = pd.read_csv(path, keep_default_na=True)
    first = df.columns[0]
    if str(first).startswith("Unnamed: 0") or first == "":
        df = df.set_index(first)
        df.index.name = None
    for col in text_columns:
        if col in df.columns:
            df[col] = df[col].fillna("").astype(str)
    return df


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusion_model.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("data/model"), help="converted model folder")
    parser.add_argument("--csv", type=Path, required=True, help="rows to predict (the training columns, no label)")
    parser.add_argument("--images-root", type=Path, required=True, help="folder the image paths are relative to")
    parser.add_argument("--out", type=Path, required=True, help="CSV to write the predictions to")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    try:
        predictor = Predictor.load(args.model)
        df = read_rows_csv(args.csv, predictor.schema.columns.text)
        preds = predictor.predict(df, args.images_root, batch_size=args.batch_size, source=args.csv)
    except ValueError as e:  # PredictError, PreprocessError and the row checks' errors
        print(f"error: predict: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    preds.to_csv(args.out, index_label="row")
    print(f"wrote {len(preds)} predictions to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
