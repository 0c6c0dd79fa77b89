"""Feature preprocessing fitted on the training split only and saved with the model as plain JSON.

The columns come from the dataset schema (fusion_model/dataset.py). Tabular: the numbers and the
frequencies of the `frequency` columns (training rows sharing the row's value: listings per rescuer), then
their label means (fusion_model/target_encoding.py; with `labels`), are log1p-transformed when never
negative in training (skewed counts and amounts) and standardised, with bins for piecewise-linear encodings
(an MLP bends where trees would split); a missing number becomes the training mean. Categorical values
(canonical text) map through a train vocabulary (0 = unseen value).
Text: the text columns joined, lower-cased, cut into word 1..`text_ngrams`-grams hashed into
`text_buckets` (crc32: stable everywhere, no vocabulary to download); each row is its distinct n-grams with
their counts. Which buckets count, their idf and n-gram order are fitted here too, but are tables of the
model (`text_tables`, loaded into its buffers), so they travel in model.safetensors, not in JSON. Images:
one image per row (``image_index`` among the photos of all image columns, falling back to the last one a
row has), resized to a square and normalised with fixed channel statistics; a row without photos gets a
blank image and a mask of 0, so the model ignores its image input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from PIL import Image

from fusion_model import target_encoding
from fusion_model.dataset import (
    DatasetSchema,
    canonical,
    integer_codes,
    integer_valued,
    row_images,
    sort_classes,
)
from fusion_model.pair_bins import fit_pair_trees, pair_codes, paired_numbers, path_names
from fusion_model.text_grams import GramMemo, fit_text_tables, gram_counts, hashed_grams

# ImageNet statistics: a fixed, documented choice that also suits a local pretrained weights file.
IMAGE_MEAN = (0.485, 0.456, 0.406)
IMAGE_STD = (0.229, 0.224, 0.225)
FREQUENCY_SUFFIX = " frequency"  # the numeric input counting a `frequency` column's value


def _frequency_key(df: pd.DataFrame, column: str) -> pd.Series:
    """The key a frequency is counted by, the same at fit and at transform: the canonical text of the cell
    ("" when empty or when the column is absent: no key), as a target encoding's key."""
    return target_encoding.key_values(df, [column])


def _bin_edges(z: np.ndarray, n_bins: int, labels: np.ndarray | None, ordered: bool, min_rows: int) -> list[float]:
    """Bin edges of one standardised input: a label-fitted tree's leaves, else quantiles; one bin when the
    training rows hold a single value (nothing to split)."""
    if len(np.unique(z)) < 2:
        return [float(z.min(initial=0.0)) - 1.0, float(z.max(initial=0.0)) + 1.0]
    n_bins = min(n_bins, len(z) - 1)  # compute_bins wants fewer bins than rows (a tiny table)
    if labels is None or n_bins < 2:
        return [float(e) for e in np.unique(np.quantile(z, np.linspace(0, 1, max(n_bins, 1) + 1)))]
    from rtdl_num_embeddings import compute_bins

    edges = compute_bins(torch.as_tensor(z[:, None], dtype=torch.float32), n_bins=n_bins,
                         tree_kwargs={"min_samples_leaf": min_rows, "min_impurity_decrease": 1e-4},
                         y=torch.as_tensor(labels, dtype=torch.float32 if ordered else torch.int64),
                         regression=ordered)[0]
    return [float(e) for e in edges]


class PreprocessError(ValueError):
    """Input rows cannot be turned into features; the message names the row, column and fix."""


@dataclass
class Preprocessor:
    numeric_columns: list[str]  # the schema's numerical columns, then "<column> frequency" per frequency column
    numeric_mean: list[float]
    numeric_std: list[float]
    # piecewise-linear encoding: per numeric input, the bin edges (standardised scale, quantiles of train)
    numeric_bins: list[list[float]]
    categorical_columns: list[str]  # the schema's categorical columns, then the numerical ones also coded
    # column -> the values seen in train (canonical text, numbers in numeric order); value i gets index i + 1
    vocabularies: dict[str, list[str]]
    numeric_log: list[bool] = field(default_factory=list)  # per numeric input: log1p (never negative in train)
    frequency_columns: list[str] = field(default_factory=list)
    frequency_codes: list[str] = field(default_factory=list)  # the frequency keys also coded: the last codes but
    # the two-number bins (fusion_model/pair_bins.py): each pair's tree, its nodes' code columns the very last
    pair_trees: list[dict[str, Any]] = field(default_factory=list)
    # frequency column -> training rows per value (keys: canonical text)
    frequency_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    # frequency key (or crossed key) -> value -> its label mean (fusion_model/target_encoding.py); inputs after the counts
    target_tables: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    # table -> the columns whose values make its key: a frequency key, or one crossed with a code (absent: its name)
    target_keys: dict[str, list[str]] = field(default_factory=dict)
    text_columns: list[str] = field(default_factory=list)
    image_columns: list[str] = field(default_factory=list)
    text_buckets: int = 262144
    text_ngrams: int = 3
    text_chars: int = 0  # character grams of 1..text_chars within each word (0: none)
    text_max_features: int = 1024  # distinct n-grams kept per row (the first ones)
    # a text transformer's tokenizer (`tokenizers` JSON), its padding id and length, with train.text_model
    text_tokenizer: str = ""
    text_pad_id: int = 0
    text_max_tokens: int = 0
    image_size: int = 64
    image_index: int = 0
    # "values": numeric() gives the standardised values and the model embeds them over `numeric_bins`
    # (rtdl_num_embeddings' piecewise-linear embeddings); "encodings" (format 2): the values, then each
    # value's position within every bin, as model inputs
    numeric_output: str = "encodings"
    image_mean: list[float] = field(default_factory=lambda: list(IMAGE_MEAN))
    image_std: list[float] = field(default_factory=lambda: list(IMAGE_STD))
    # fitted with the rest but loaded into the model, not saved here (see the module docstring)
    text_tables: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)
    # table -> training row index -> its cross-fitted encoding: what `in_train` reads, not saved
    target_folds: dict[str, dict[Any, np.ndarray]] | None = field(default=None, repr=False, compare=False)

    # ---- fitting and serialisation -------------------------------------------------------------
    @classmethod
    def fit(
        cls, train: pd.DataFrame, schema: DatasetSchema, *, text_buckets: int, image_size: int, image_index: int,
        text_ngrams: int = 3, text_min_df: int = 2, text_max_features: int = 1024, numeric_bins: int = 16,
        numeric_codes_max: int = 0, labels: np.ndarray | None = None, ordered_labels: bool = False,
        bin_min_rows: int = 8, id_as_number: bool = False, codes_as_numbers: bool = False,
        numeric_output: str = "encodings", frequency_codes: bool = False, text_chars: int = 0,
        text_tokenizer: tuple[str, int] | None = None, text_max_tokens: int = 128, pair_bins: bool = False,
        frequency_targets: bool = False, frequency_crosses: bool = False, n_classes: int = 0,
    ) -> Preprocessor:
        """Statistics from the training split only (never val/test: that would leak). A numerical column with
        at most `numeric_codes_max` distinct training values (a year, a count of a few kinds) also enters as
        a code: each value gets its own embedding and logit, as trees split on each value.

        With `labels`, each numeric input's bins are the leaves of a decision tree fitted to the training
        labels (rtdl_num_embeddings.compute_bins: at most `numeric_bins` leaves of >= `bin_min_rows` rows;
        a regression tree when `ordered_labels`), so bins are narrow where the label changes; without, its
        quantiles; with `pair_bins` too, each pair of the numerical columns gets a tree of its own over both
        (same limits), whose leaf enters as a code, after every other. `id_as_number`: a row key whose
        training values are all integers also enters as a number (catalogue numbers and listing ids often
        follow time, as a tree learner finds); `codes_as_numbers`: so do the `integer_codes`.
        `text_tokenizer`: a text transformer's (tokenizer JSON, padding id), for `text_max_tokens`."""
        columns = schema.columns
        missing = [c for c in (*columns.numerical, *columns.categorical, *columns.text) if c not in train.columns]
        if missing:
            raise PreprocessError(
                f"training table lacks columns {missing}; re-run the validate stage so the table has every "
                "declared column"
            )
        coded = [c for c in columns.numerical
                 if 1 < train[c].map(canonical).replace("", None).nunique() <= numeric_codes_max]
        categorical = [*columns.categorical, *coded]
        keys = [c for c in schema.frequency if c not in categorical and c in train.columns] if frequency_codes else []
        categorical += keys  # a key counted for its frequency (a rescuer, an item) also enters as a code, last
        numerical = list(columns.numerical)
        if id_as_number and schema.id and schema.id in train.columns and schema.id not in numerical \
                and integer_valued(train[schema.id]):
            numerical.append(schema.id)
        if codes_as_numbers:
            numerical += [c for c in integer_codes(train, list(columns.categorical)) if c not in numerical]
        pre = cls(
            numeric_columns=[*numerical, *(c + FREQUENCY_SUFFIX for c in schema.frequency)],
            numeric_mean=[], numeric_std=[], numeric_bins=[],
            categorical_columns=categorical,
            vocabularies={c: [str(v) for v in sort_classes(train[c].map(canonical))]
                          + ([""] if (train[c].map(canonical) == "").any() else [])
                          for c in categorical},
            frequency_columns=list(schema.frequency), frequency_codes=keys,
            frequency_counts={c: {k: int(v) for k, v in _frequency_key(train, c).value_counts().items() if k}
                              for c in schema.frequency},
            text_columns=list(columns.text), image_columns=list(columns.image),
            text_buckets=text_buckets, text_ngrams=text_ngrams, text_chars=text_chars,
            text_max_features=text_max_features,
            image_size=image_size, image_index=image_index, numeric_output=numeric_output,
        )
        if frequency_targets and labels is not None and schema.frequency:
            pre.target_folds = {}
            pre.target_keys = target_encoding.keyed_columns(pre.frequency_columns, list(columns.categorical),
                                                            pre.frequency_counts, frequency_crosses)
            for name, keyed in pre.target_keys.items():
                table, pre.target_folds[name] = target_encoding.fit_table(
                    target_encoding.key_values(train, keyed), labels, target_encoding.target_type(n_classes))
                pre.target_tables[name] = table
                pre.numeric_columns += target_encoding.column_names(name, table)
        if text_tokenizer is not None and pre.text_columns:
            pre.text_tokenizer, pre.text_pad_id = text_tokenizer
            pre.text_max_tokens = text_max_tokens
        values = pre._numeric_values(train, in_train=True)
        pre.numeric_log = [bool(np.nanmin(values[:, j], initial=0.0) >= 0) for j in range(values.shape[1])]
        raw = pre._logged(values)
        mean, std = np.nanmean(raw, axis=0), np.nanstd(raw, axis=0)
        mean, std = np.nan_to_num(mean), np.nan_to_num(std)
        pre.numeric_mean = [float(v) for v in mean]
        # a constant column would divide by zero: leave it unscaled (std 1)
        pre.numeric_std = [float(v) if v > 1e-12 else 1.0 for v in std]
        z = (np.where(np.isnan(raw), mean, raw) - mean) / np.asarray(pre.numeric_std)
        pre.numeric_bins = [_bin_edges(z[:, j], numeric_bins, labels, ordered_labels, bin_min_rows)
                            for j in range(z.shape[1])]
        if pair_bins and labels is not None:
            paired = paired_numbers([len(e) for e in pre.numeric_bins[: len(numerical)]])
            pre.pair_trees = [p for p in fit_pair_trees(z[:, paired], [numerical[j] for j in paired], labels,
                                                        ordered_labels, numeric_bins, bin_min_rows)
                              if not set(path_names(p)) & set(train.columns)]
            for name, codes in pair_codes(pre.pair_trees, pre.numeric_columns, z).items():
                pre.categorical_columns.append(name)
                pre.vocabularies[name] = [str(v) for v in np.unique(codes)]
        pre.text_tables = fit_text_tables(pre._joined(train), pre._grams(), pre.text_ngrams, pre.text_chars,
                                          pre.text_buckets, pre.text_max_features, text_min_df) if pre.text_columns else None
        return pre

    def to_dict(self) -> dict[str, Any]:
        folds, self.target_folds = self.target_folds, None  # not copied by asdict: the training rows' only
        data = asdict(self)
        self.target_folds = folds
        data.pop("text_tables")
        data.pop("target_folds")
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Preprocessor:
        return cls(**data)

    @property
    def cardinalities(self) -> list[int]:
        """Embedding rows per categorical column (+1 for the unseen-value index 0)."""
        return [len(self.vocabularies[c]) + 1 for c in self.categorical_columns]

    @property
    def n_numeric(self) -> int:
        """Numeric inputs of the model: the standardised values, then (encodings) every piecewise-linear bin."""
        if self.numeric_output == "values":
            return len(self.numeric_columns)
        return len(self.numeric_columns) + sum(len(e) - 1 for e in self.numeric_bins)

    @property
    def text_vocab_size(self) -> int:
        """Rows of the model's text table (kept buckets + the padding row 0)."""
        return len(self.text_tables["idf"]) if self.text_tables is not None else 1

    # ---- transforms ----------------------------------------------------------------------------
    def _require(self, df: pd.DataFrame, columns: list[str]) -> None:
        missing = [c for c in columns if c not in df.columns]
        if missing:
            raise PreprocessError(f"input rows lack columns {missing}; add them (see fusion_model/schema.py)")

    def _numeric_values(self, df: pd.DataFrame, in_train: bool) -> np.ndarray:
        """The numerical columns (NaN when missing) and the frequencies. A training row's counts leave the
        row itself out, so they mean what they mean for a new row: the other rows sharing its value."""
        n_plain = len(self.plain_numeric_columns)
        self._require(df, self.numeric_columns[:n_plain])
        parts = [df[self.numeric_columns[:n_plain]].apply(pd.to_numeric, errors="coerce").to_numpy(dtype=float)]
        for col in self.frequency_columns:
            keys = _frequency_key(df, col)
            counts = keys.map(self.frequency_counts.get(col, {})).fillna(0).to_numpy(dtype=float, copy=True)
            counts[keys.to_numpy() == ""] = 0
            if in_train:
                counts = np.clip(counts - 1, 0, None)
            parts.append(counts[:, None])
        parts += [target_encoding.encode(target_encoding.key_values(df, self.target_keys.get(name, [name])), table,
                                         (self.target_folds or {}).get(name) if in_train else None)
                  for name, table in self.target_tables.items()]
        return np.concatenate(parts, axis=1) if parts else np.zeros((len(df), 0))

    @property
    def target_inputs(self) -> int:
        """How many numeric inputs the frequency keys' target encodings fill, the last ones."""
        return sum(len(t[target_encoding.UNSEEN]) for t in self.target_tables.values())

    @property
    def plain_numeric_columns(self) -> list[str]:
        """The numeric inputs read from the row's own columns (not the frequency keys' counts and encodings)."""
        derived = len(self.frequency_columns) + self.target_inputs
        return self.numeric_columns[: len(self.numeric_columns) - derived]

    def _logged(self, values: np.ndarray) -> np.ndarray:
        """log1p of the inputs never negative in training: counts and amounts are heavily right-skewed (a few
        fees of thousands), so standardising the raw values would squeeze most rows into a sliver."""
        out = values.copy()
        for j, log in enumerate(self.numeric_log):
            if log:
                out[:, j] = np.log1p(np.clip(out[:, j], 0, None))
        return out

    def _standardised(self, df: pd.DataFrame, in_train: bool) -> np.ndarray:
        mean, std = np.asarray(self.numeric_mean), np.asarray(self.numeric_std)
        raw = self._logged(self._numeric_values(df, in_train))
        raw = np.where(np.isnan(raw), mean, raw)  # a missing value becomes the train mean
        return (raw - mean) / std

    @property
    def pair_columns(self) -> int:
        """How many code columns the two-number bins fill, the last ones: one per depth of each pair's tree."""
        return sum(len(path_names(p)) for p in self.pair_trees)

    def numeric(self, df: pd.DataFrame, in_train: bool = False) -> torch.Tensor:
        """[rows, n_numeric]: standardised values, then their piecewise-linear encodings. `in_train`: the
        rows are the training rows themselves (their frequencies leave each row out)."""
        z = self._standardised(df, in_train)
        if self.numeric_output == "values":
            return torch.from_numpy(z.astype(np.float32))
        parts = [z]
        for j, edges in enumerate(self.numeric_bins):
            low, high = np.asarray(edges[:-1]), np.asarray(edges[1:])
            parts.append(np.clip((z[:, j : j + 1] - low) / np.maximum(high - low, 1e-9), 0.0, 1.0))
        return torch.from_numpy(np.concatenate(parts, axis=1).astype(np.float32))

    def categorical(self, df: pd.DataFrame) -> torch.Tensor:
        z = self._standardised(df, False) if self.pair_trees else None  # no pairs, no numbers needed
        pairs = {k: pd.Series(v.astype(str), index=df.index)
                 for k, v in pair_codes(self.pair_trees, self.numeric_columns, z).items()}
        self._require(df, [c for c in self.categorical_columns if c not in pairs])
        out = np.zeros((len(df), len(self.categorical_columns)), dtype=np.int64)
        for j, col in enumerate(self.categorical_columns):
            lookup = {code: i + 1 for i, code in enumerate(self.vocabularies[col])}
            values = pairs[col] if col in pairs else df[col].map(canonical)
            out[:, j] = values.map(lookup).fillna(0).to_numpy(dtype=np.int64)
        return torch.from_numpy(out)

    def _joined(self, df: pd.DataFrame) -> pd.Series:
        self._require(df, self.text_columns)
        if not self.text_columns:
            return pd.Series("", index=df.index, dtype=object)
        return df[self.text_columns].fillna("").astype(str).agg(" ".join, axis=1)

    def text(self, df: pd.DataFrame) -> tuple[torch.Tensor, torch.Tensor]:
        """([rows, width] hashed n-gram ids, [rows, width] their counts), right-padded with 0; width is the
        most distinct n-grams any of these rows has (at most text_max_features). Each text's grams are
        remembered (text_grams.GramMemo): the fit's, the linear member's and the data loader's rows are one
        table's."""
        memo = self._grams()
        rows = [memo.get(text) or memo.remember(text, gram_counts(
                    hashed_grams(text, self.text_ngrams, self.text_chars, self.text_buckets), self.text_max_features))
                for text in self._joined(df)]
        width = max(1, max((len(r[0]) for r in rows), default=1))
        ids = np.zeros((len(rows), width), dtype=np.int64)
        counts = np.zeros((len(rows), width), dtype=np.float32)
        for i, (row_ids, row_counts) in enumerate(rows):
            ids[i, : len(row_ids)], counts[i, : len(row_ids)] = row_ids, row_counts
        return torch.from_numpy(ids), torch.from_numpy(counts)

    def _grams(self) -> GramMemo:
        return self.__dict__.setdefault("_gram_memo", GramMemo())

    def __getstate__(self) -> dict[str, Any]:  # sent to another process (spawned ranks, loader workers): no memo
        return {k: v for k, v in self.__dict__.items() if k != "_gram_memo"}

    def tokens(self, df: pd.DataFrame) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The text transformer's token ids and attention mask [rows, text_max_tokens] of the joined text
        columns; None without a text model."""
        if not self.text_tokenizer:
            return None
        from fusion_model.text_encoder import tokenize

        return tokenize(self._joined(df).tolist(), self.text_tokenizer, self.text_max_tokens, self.text_pad_id)

    def image_paths(self, df: pd.DataFrame, images_root: Path) -> list[Path | None]:
        """Each row's photo to use (`image_index` among its photos, else its last one); None without photos."""
        out: list[Path | None] = []
        for row in df[[c for c in self.image_columns if c in df.columns]].to_dict("records"):
            paths = row_images(row, self.image_columns)
            out.append(images_root / paths[min(self.image_index, len(paths) - 1)] if paths else None)
        return out

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
