"""Dataset over a features table + images, and the DataModule over ``data/validated/``.

Tabular and text features are computed once per table; images are decoded and resized on first use and
kept as uint8 (3000 rows at 64 px are ~37 MB), so later epochs cost no JPEG decoding.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset

from fusion_model.dataset import PROBLEM_TYPES, ROW_ID, DatasetSchema
from fusion_model.metrics import class_indices
from fusion_model.preprocess import Preprocessor


class DataError(ValueError):
    """The validated folder is missing a file or disagrees with its meta.json; the message says the fix."""


class FusionDataset(Dataset):
    """Rows as model inputs; `labels`: class indices (classification) or values (regression), or None."""

    def __init__(
        self, df: pd.DataFrame, pre: Preprocessor, images_root: Path, *, train: bool = False,
        labels: np.ndarray | None = None,
    ) -> None:
        missing = [c for c in pre.image_columns if c not in df.columns]
        if missing:
            raise DataError(f"rows lack the image column(s) {missing}: ';'-separated image paths, empty for no photo")
        self.pre = pre
        self.train = train
        self.rows = list(df.index)
        self.paths = pre.image_paths(df, Path(images_root))
        # 1 where the row has a photo; 0 masks the image input of a row without one
        self.image_mask = torch.tensor([p is not None for p in self.paths], dtype=torch.float32)
        self.categorical = pre.categorical(df)
        self.numeric = pre.numeric(df, in_train=train)
        self.text_ids, self.text_counts = pre.text(df)
        self.tokens = pre.tokens(df)  # a text transformer's (ids, attention mask), or None
        self.labels = torch.from_numpy(np.asarray(labels)) if labels is not None else None
        self._images: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self.paths)

    def image(self, i: int) -> torch.Tensor:
        if i not in self._images:
            path = self.paths[i]
            self._images[i] = (self.pre.load_image(path, self.rows[i]) if path is not None
                               else self.pre.blank_image())
        return self._images[i]

    @property
    def rows_with_images(self) -> int:
        return int(self.image_mask.sum())

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        image = self.pre.normalise(self.image(i))
        if self.train and torch.rand(()) < 0.5:
            image = image.flip(-1)  # horizontal flip only: colour and lighting carry signal
        return self._inputs(i, image)

    def _inputs(self, index: int | torch.Tensor, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """The model's inputs of a row (an int) or of rows (a tensor of indices), beside their images."""
        item = {
            "image": images,
            "image_mask": self.image_mask[index],
            "categorical": self.categorical[index],
            "numeric": self.numeric[index],
            "text_ids": self.text_ids[index],
            "text_counts": self.text_counts[index],
        }
        if self.tokens is not None:
            item["text_tokens"], item["text_attention"] = self.tokens[0][index], self.tokens[1][index]
        if self.labels is not None:
            item["label"] = self.labels[index]
        return item


class BatchedFusionDataset(FusionDataset):
    """The training and validation rows, a batch at a time: the DataLoader calls `__getitems__` with a batch's
    indices, and the tensors are indexed together (one image normalisation per batch) instead of a dict per
    row collated afterwards, which took a sixth of a training step on a 2-core machine. The same tensors,
    and the same random draws in the same order, as the rows one by one."""

    def __getitems__(self, indices: list[int]) -> dict[str, torch.Tensor]:
        images = self.pre.normalise(torch.stack([self.image(i) for i in indices]))
        if self.train:  # one draw per row, in order, as __getitem__ makes them
            flip = torch.tensor([bool(torch.rand(()) < 0.5) for _ in indices])
            images[flip] = images[flip].flip(-1)
        return self._inputs(torch.as_tensor(indices, dtype=torch.int64), images)


def whole_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The collate function of a `BatchedFusionDataset`: its batch is already whole."""
    return batch


@dataclass(frozen=True)
class ValidatedData:
    """The validate stage's output folder, read and checked once."""

    train: pd.DataFrame
    val: pd.DataFrame
    dataset_root: Path
    schema: DatasetSchema
    problem_type: str
    classes: list[int | str]

    @property
    def label(self) -> str:
        return self.schema.label.column

    def labels(self, df: pd.DataFrame) -> np.ndarray:
        """The label column as the model learns it: class indices, or float values (regression)."""
        if self.problem_type == "regression":
            return df[self.label].to_numpy(dtype=np.float32)
        return class_indices(df[self.label].tolist(), self.classes)

    def every_labelled(self) -> ValidatedData:
        """The same data with train + val as its training rows (a refit's)."""
        return dataclasses.replace(self, train=pd.concat([self.train, self.val]))

    @classmethod
    def read(cls, data_dir: str | Path) -> ValidatedData:
        data_dir = Path(data_dir)
        meta_path = data_dir / "meta.json"
        for path in (meta_path, data_dir / "train.parquet", data_dir / "val.parquet"):
            if not path.is_file():
                raise DataError(f"{path} is missing; run `python -m tasks validate` first (or pass --data-dir)")
        meta: dict[str, Any] = json.loads(meta_path.read_text())
        for key in ("dataset_root", "problem_type", "classes", "schema"):
            if key not in meta:
                raise DataError(f"{meta_path} has no {key!r} (an older validate stage wrote it); re-run "
                                "`python -m tasks validate`")
        root = Path(meta["dataset_root"])
        root = root if root.is_absolute() else (data_dir / root)
        if not root.is_dir():
            raise DataError(
                f"{meta_path}: dataset_root {meta['dataset_root']!r} resolves to {root}, which is not a folder; "
                "re-run download and validate"
            )
        if meta["problem_type"] not in PROBLEM_TYPES:
            raise DataError(f"{meta_path}: problem_type {meta['problem_type']!r} is not one of {list(PROBLEM_TYPES)}")
        schema = DatasetSchema.model_validate(meta["schema"])
        classes = list(meta["classes"])
        train = pd.read_parquet(data_dir / "train.parquet")
        val = pd.read_parquet(data_dir / "val.parquet")
        data = cls(train, val, root.resolve(), schema, meta["problem_type"], classes)
        for name, df in (("train", train), ("val", val)):
            if data.label not in df.columns:
                raise DataError(f"{data_dir / (name + '.parquet')} has no {data.label} column; re-run validate")
            if data.problem_type != "regression":
                bad = sorted({str(v) for v in df[data.label].unique()} - {str(c) for c in classes})
                if bad:
                    raise DataError(
                        f"{data_dir / (name + '.parquet')}: labels {bad} are not in meta.json classes {classes}; "
                        "re-run validate"
                    )
            if ROW_ID in df.columns:
                df.index = df[ROW_ID].to_numpy()
        return data


class FusionDataModule(pl.LightningDataModule):
    def __init__(
        self, data: ValidatedData, pre: Preprocessor, *, batch_size: int, num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.data = data
        self.pre = pre
        self.batch_size = batch_size
        self.num_workers = num_workers

    def setup(self, stage: str | None = None) -> None:
        if not hasattr(self, "train_set"):
            data = self.data
            self.train_set = BatchedFusionDataset(data.train, self.pre, data.dataset_root, train=True,
                                                  labels=data.labels(data.train))
            self.val_set = BatchedFusionDataset(data.val, self.pre, data.dataset_root, labels=data.labels(data.val))

    def _loader(self, dataset: FusionDataset, train: bool) -> DataLoader:
        # drop_last in training: a last batch of one row breaks BatchNorm backbones
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=train, num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0, drop_last=train, collate_fn=whole_batch,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)
