"""Dataset over a features table + images, and the DataModule over ``data/validated/``.

Tabular and text features are computed once per table; images are decoded and resized on first use and
kept as uint8 (3000 rows at 64 px are ~37 MB), so later epochs cost no JPEG decoding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset

from fusion_model.preprocess import Preprocessor
from fusion_model.schema import IMAGES, LABEL, LABEL_SETS


class DataError(ValueError):
    """The validated folder is missing a file or disagrees with its meta.json; the message says the fix."""


class FusionDataset(Dataset):
    def __init__(
        self, df: pd.DataFrame, pre: Preprocessor, images_root: Path, *, train: bool = False,
        with_labels: bool = True,
    ) -> None:
        if IMAGES not in df.columns:
            raise DataError(f"rows lack the {IMAGES} column: ';'-separated image paths, empty for no photo")
        self.pre = pre
        self.train = train
        self.rows = list(df.index)
        self.paths = [pre.image_path(cell, Path(images_root)) for cell in df[IMAGES]]
        # 1 where the row has a photo; 0 masks the image input of a row without one
        self.image_mask = torch.tensor([p is not None for p in self.paths], dtype=torch.float32)
        self.categorical = pre.categorical(df)
        self.numeric = pre.numeric(df, in_train=train)
        self.text_ids, self.text_counts = pre.text(df)
        self.labels = torch.tensor(df[LABEL].to_numpy(dtype="int64")) if with_labels else None
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
        item = {
            "image": image,
            "image_mask": self.image_mask[i],
            "categorical": self.categorical[i],
            "numeric": self.numeric[i],
            "text_ids": self.text_ids[i],
            "text_counts": self.text_counts[i],
        }
        if self.labels is not None:
            item["label"] = self.labels[i]
        return item


@dataclass(frozen=True)
class ValidatedData:
    """The validate stage's output folder, read and checked once."""

    train: pd.DataFrame
    val: pd.DataFrame
    dataset_root: Path
    label_kind: str
    classes: list[int]

    @classmethod
    def read(cls, data_dir: str | Path) -> ValidatedData:
        data_dir = Path(data_dir)
        meta_path = data_dir / "meta.json"
        for path in (meta_path, data_dir / "train.parquet", data_dir / "val.parquet"):
            if not path.is_file():
                raise DataError(f"{path} is missing; run `python -m tasks validate` first (or pass --data-dir)")
        meta: dict[str, Any] = json.loads(meta_path.read_text())
        for key in ("dataset_root", "label_kind", "classes"):
            if key not in meta:
                raise DataError(f"{meta_path} has no {key!r}; re-run `python -m tasks validate`")
        root = Path(meta["dataset_root"])
        root = root if root.is_absolute() else (data_dir / root)
        if not root.is_dir():
            raise DataError(
                f"{meta_path}: dataset_root {meta['dataset_root']!r} resolves to {root}, which is not a folder; "
                "re-run download and validate"
            )
        classes = [int(c) for c in meta["classes"]]
        if meta["label_kind"] not in LABEL_SETS:
            raise DataError(f"{meta_path}: label_kind {meta['label_kind']!r} is not one of {list(LABEL_SETS)}")
        train = pd.read_parquet(data_dir / "train.parquet")
        val = pd.read_parquet(data_dir / "val.parquet")
        for name, df in (("train", train), ("val", val)):
            if LABEL not in df.columns:
                raise DataError(f"{data_dir / (name + '.parquet')} has no {LABEL} column; re-run validate")
            bad = sorted({int(v) for v in df[LABEL].unique()} - set(classes))
            if bad:
                raise DataError(
                    f"{data_dir / (name + '.parquet')}: labels {bad} are not in meta.json classes {classes}; "
                    "re-run validate"
                )
            if "row_id" in df.columns:
                df.index = df["row_id"].to_numpy()
        return cls(train, val, root.resolve(), meta["label_kind"], classes)


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
            self.train_set = FusionDataset(self.data.train, self.pre, self.data.dataset_root, train=True)
            self.val_set = FusionDataset(self.data.val, self.pre, self.data.dataset_root)

    def _loader(self, dataset: FusionDataset, train: bool) -> DataLoader:
        # drop_last in training: a last batch of one row breaks BatchNorm backbones
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=train, num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0, drop_last=train,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)
