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
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader

from fusion_model.layout import MODEL_CONFIG, WEIGHTS
from fusion_model.model import FusionModel
from fusion_model.preprocess import Preprocessor
from fusion_model.schema import MODALITIES

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
    return FusionModel(**kwargs)


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / MODEL_CONFIG
    if not path.is_file():
        raise PredictError(f"{path} is missing; point --model at the convert stage's output folder (data/model)")
    return json.loads(path.read_text())


def _collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


class Predictor:
    def __init__(self, model: FusionModel, config: dict[str, Any]) -> None:
        self.model = model.eval()
        self.config = config
        self.pre = Preprocessor.from_dict(config["preprocess"])
        self.classes: list[int] = [int(c) for c in config["classes"]]
        self.label_kind: str = config["label_kind"]

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
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise PredictError(
                f"{weights} does not match {model_dir / MODEL_CONFIG} ({str(e).splitlines()[0]}); "
                "convert the checkpoint again from the same training run"
            ) from None
        return cls(model.float(), config)

    def _check_rows(self, df: pd.DataFrame, images_root: Path) -> pd.DataFrame:
        try:
            from fusion_model.checks import check_prediction_rows
        except ImportError:
            return df
        checked = check_prediction_rows(df, images_root)
        return checked if isinstance(checked, pd.DataFrame) else df

    @torch.inference_mode()
    def predict_proba(
        self, df: pd.DataFrame, images_root: str | Path, drop_modalities: Iterable[str] = (),
        batch_size: int = 256,
    ) -> np.ndarray:
        """Class probabilities [rows, len(classes)], columns in the order of ``self.classes``.

        ``drop_modalities`` zeroes those modalities' contributions (the ablation of the evaluate stage).
        """
        from fusion_model.data import FusionDataset

        drop = set(drop_modalities)
        unknown = drop - set(MODALITIES)
        if unknown:
            raise PredictError(f"cannot drop {sorted(unknown)}: modalities are {list(MODALITIES)}")
        images_root = Path(images_root)
        df = self._check_rows(df, images_root)
        dataset = FusionDataset(df, self.pre, images_root, with_labels=False)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=_collate)
        batches: Iterable[dict[str, torch.Tensor]] = loader
        if len(dataset) >= PROGRESS_MIN_ROWS:
            from tqdm import tqdm

            batches = tqdm(loader, desc="predict", unit="batch", file=sys.stderr)
        out = [self.model(batch, mask=drop).float().softmax(dim=-1).numpy() for batch in batches]
        if not out:
            return np.zeros((0, len(self.classes)), dtype=np.float32)
        return np.concatenate(out)

    def predict(self, df: pd.DataFrame, images_root: str | Path, batch_size: int = 256) -> pd.DataFrame:
        """One row per input row (same index): the predicted class and one probability column per class."""
        proba = self.predict_proba(df, images_root, batch_size=batch_size)
        result = pd.DataFrame(
            {f"proba_{c}": proba[:, i] for i, c in enumerate(self.classes)}, index=df.index,
        )
        result.insert(0, "prediction", np.asarray(self.classes)[proba.argmax(axis=1)])
        return result


def read_rows_csv(path: Path) -> pd.DataFrame:
    """A PetFinder CSV, with or without the tutorial's leading unnamed index column."""
    if not path.is_file():
        raise PredictError(f"{path} does not exist; pass the CSV of rows to predict with --csv")
    df = pd.read_csv(path, keep_default_na=True)
    first = df.columns[0]
    if str(first).startswith("Unnamed: 0") or first == "":
        df = df.set_index(first)
        df.index.name = None
    for col in ("Name", "Description"):
        if col in df.columns:
            df[col] = df[col].fillna("").astype(str)
    return df


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusion_model.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("data/model"), help="converted model folder")
    parser.add_argument("--csv", type=Path, required=True, help="rows to predict (PetFinder columns + Images)")
    parser.add_argument("--images-root", type=Path, required=True, help="folder the Images paths are relative to")
    parser.add_argument("--out", type=Path, required=True, help="CSV to write the predictions to")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    try:
        predictor = Predictor.load(args.model)
        df = read_rows_csv(args.csv)
        preds = predictor.predict(df, args.images_root, batch_size=args.batch_size)
    except ValueError as e:  # PredictError, PreprocessError and the row checks' errors
        print(f"error: predict: {e}", file=sys.stderr)
        return 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    preds.to_csv(args.out, index_label="row")
    print(f"wrote {len(preds)} predictions to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
