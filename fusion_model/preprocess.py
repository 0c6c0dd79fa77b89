"""Feature preprocessing fitted on the training split only and saved with the model as plain JSON.

Tabular: numeric columns (non-negative counts and amounts) are log1p-transformed, then standardised
with the train mean/std; categorical codes are mapped through
a train vocabulary (index 0 = unseen value). Text: Name + Description are lower-cased, split into word
tokens and hashed into a fixed number of buckets (index 0 = padding), so no vocabulary or download is
needed. Images: one image per row (``image_index``, falling back to the last one a row has), resized to a
square and normalised with fixed channel statistics; a row without photos gets a blank image and a mask
of 0, so the model ignores its image input.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image

from fusion_model.schema import CATEGORICAL_COLUMNS, NUMERIC_COLUMNS, TEXT_COLUMNS, split_images

_TOKEN = re.compile(r"[a-z0-9]+")
# ImageNet statistics: a fixed, documented choice that also suits a local pretrained weights file.
IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)


def _log_amounts(values: np.ndarray) -> np.ndarray:
    """log1p of the non-negative counts and amounts (Age, Fee, ...): they are heavily right-skewed (a few
    fees of thousands), so standardising the raw values would squeeze most rows into a sliver."""
    return np.log1p(np.clip(values, 0, None))


class PreprocessError(ValueError):
    """Input rows cannot be turned into features; the message names the row, column and fix."""


@dataclass
class Preprocessor:
    numeric_columns: list[str]
    numeric_mean: list[float]
    numeric_std: list[float]
    categorical_columns: list[str]
    # column -> sorted list of the codes seen in train; code at position i gets index i + 1.
    vocabularies: dict[str, list[int]]
    text_columns: list[str] = field(default_factory=lambda: list(TEXT_COLUMNS))
    text_buckets: int = 4096
    text_max_tokens: int = 64
    image_size: int = 64
    image_index: int = 0
    image_mean: list[float] = field(default_factory=lambda: list(IMAGE_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(IMAGE_STD))

    # ---- fitting and serialisation -------------------------------------------------------------
    @classmethod
    def fit(
        cls, train: pd.DataFrame, *, text_buckets: int, image_size: int, image_index: int,
        text_max_tokens: int = 64,
    ) -> Preprocessor:
        """Statistics from the training split only (never val/test: that would leak)."""
        missing = [c for c in (*NUMERIC_COLUMNS, *CATEGORICAL_COLUMNS) if c not in train.columns]
        if missing:
            raise PreprocessError(
                f"training table lacks columns {missing}; re-run the validate stage so the table has every "
                "schema column"
            )
        num = _log_amounts(train[list(NUMERIC_COLUMNS)].astype("float64").to_numpy())
        num = pd.DataFrame(num)
        std = num.std(ddof=0).fillna(0.0)
        return cls(
            numeric_columns=list(NUMERIC_COLUMNS),
            numeric_mean=[float(v) for v in num.mean().fillna(0.0)],
            # a constant column would divide by zero: leave it unscaled (std 1)
            numeric_std=[float(v) if v > 1e-12 else 1.0 for v in std],
            categorical_columns=list(CATEGORICAL_COLUMNS),
            vocabularies={c: sorted(int(v) for v in train[c].dropna().unique()) for c in CATEGORICAL_COLUMNS},
            text_buckets=text_buckets,
            text_max_tokens=text_max_tokens,
            image_size=image_size,
            image_index=image_index,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Preprocessor:
        return cls(**data)

    @property
    def cardinalities(self) -> list[int]:
        """Embedding rows per categorical column (+1 for the unseen-value index 0)."""
        return [len(self.vocabularies[c]) + 1 for c in self.categorical_columns]

    # ---- transforms ----------------------------------------------------------------------------
    def _require(self, df: pd.DataFrame, columns: list[str]) -> None:
        missing = [c for c in columns if c not in df.columns]
        if missing:
            raise PreprocessError(f"input rows lack columns {missing}; add them (see fusion_model/schema.py)")

    def numeric(self, df: pd.DataFrame) -> torch.Tensor:
        self._require(df, self.numeric_columns)
        values = _log_amounts(df[self.numeric_columns].astype("float64").to_numpy())
        mean, std = np.asarray(self.numeric_mean), np.asarray(self.numeric_std)
        values = np.where(np.isnan(values), mean, values)  # a missing value becomes the train mean
        return torch.from_numpy(((values - mean) / std).astype(np.float32))

    def categorical(self, df: pd.DataFrame) -> torch.Tensor:
        self._require(df, self.categorical_columns)
        out = np.zeros((len(df), len(self.categorical_columns)), dtype=np.int64)
        for j, col in enumerate(self.categorical_columns):
            lookup = {code: i + 1 for i, code in enumerate(self.vocabularies[col])}
            codes = pd.to_numeric(df[col], errors="coerce")
            out[:, j] = [lookup.get(int(v), 0) if pd.notna(v) else 0 for v in codes]
        return torch.from_numpy(out)

    def tokens(self, text: str) -> list[int]:
        """Hashed word ids in 1..text_buckets-1 (crc32: stable across processes, unlike hash())."""
        words = _TOKEN.findall(text.lower())[: self.text_max_tokens]
        return [1 + zlib.crc32(w.encode()) % (self.text_buckets - 1) for w in words]

    def text(self, df: pd.DataFrame) -> torch.Tensor:
        """[rows, text_max_tokens] token ids, right-padded with 0."""
        self._require(df, self.text_columns)
        out = np.zeros((len(df), self.text_max_tokens), dtype=np.int64)
        joined = df[self.text_columns].fillna("").astype(str).agg(" ".join, axis=1)
        for i, text in enumerate(joined):
            ids = self.tokens(text)
            out[i, : len(ids)] = ids
        return torch.from_numpy(out)

    def image_path(self, cell: object, images_root: Path) -> Path | None:
        """The row's photo to use (`image_index`, else its last one); None for a row without photos."""
        paths = split_images(cell)
        if not paths:
            return None
        return images_root / paths[min(self.image_index, len(paths) - 1)]

    def load_image(self, path: Path, row: object) -> torch.Tensor:
        """uint8 [3, size, size]: decoded and resized once, normalised per batch by `normalise`."""
        try:
            with Image.open(path) as im:
                im = im.convert("RGB").resize((self.image_size, self.image_size), Image.BILINEAR)
                arr = np.asarray(im, dtype=np.uint8)
        except FileNotFoundError:
            raise PreprocessError(
                f"row {row}: image {path} does not exist; check --images-root / dataset_root and the Images column"
            ) from None
        except OSError as e:
            raise PreprocessError(f"row {row}: image {path} cannot be decoded ({e}); replace or drop the row") from None
        return torch.from_numpy(arr.copy()).permute(2, 0, 1).contiguous()

    def blank_image(self) -> torch.Tensor:
        """uint8 [3, size, size] at the normalisation mean: zeros once normalised (a row without photos)."""
        mean = torch.tensor(self.image_mean).view(3, 1, 1) * 255.0
        return mean.round().to(torch.uint8).expand(3, self.image_size, self.image_size).contiguous()

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 [..., 3, H, W] -> float32 normalised."""
        mean = torch.tensor(self.image_mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(self.image_std, dtype=torch.float32).view(3, 1, 1)
        return (images.float() / 255.0 - mean) / std
