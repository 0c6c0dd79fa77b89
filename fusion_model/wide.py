"""The wide half of the fusion model: linear paths from sparse inputs straight to the logits.

On real adoption data the text's signal is lexical and nearly linear (a TF-IDF logistic regression is the
strong text baseline; learned text embeddings overfit within two epochs): `TextLogit` is that model inside
the network, trained with it. `CategoryLogit` adds one learned logit per code of each categorical column
(a one-hot linear model) beside the deep tabular path. Both start at zero, so training starts from the
deep part's prediction. Modules take tensors and return tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn


class TextLogit(nn.Module):
    """Logits of a linear model over a row's TF-IDF-weighted hashed n-grams.

    Input: `ids` [rows, width] hashed n-gram buckets (0 = padding) and `counts` [rows, width]. The
    buffers, fitted on the training rows (`Preprocessor.text_tables`), map a bucket to its row of the
    table (0 for a bucket too rare to learn), and give each row its idf and n-gram order. Weight of an
    n-gram: (1 + ln count) * idf, L2-normalised within each n-gram order of the row, so unigrams, bigrams
    and trigrams each weigh as one block. With `chars`, the highest order is the character grams' block:
    the linear member reads it (`row_weights(chars=True)`), these logits do not (they are trained with the
    deep half by Adam, which the many character grams only add noise to).
    """

    def __init__(self, buckets: int, vocab_size: int, num_classes: int, max_order: int = 3, chars: bool = False
                 ) -> None:
        super().__init__()
        self.max_order = max_order
        self.char_order = max_order if chars else None
        self.register_buffer("rows", torch.zeros(buckets, dtype=torch.int64))
        self.register_buffer("idf", torch.zeros(vocab_size, dtype=torch.float32))
        self.register_buffer("order", torch.zeros(vocab_size, dtype=torch.int64))
        self.bag = nn.EmbeddingBag(vocab_size, num_classes, mode="sum")
        nn.init.zeros_(self.bag.weight)

    def load_tables(self, rows: np.ndarray, idf: np.ndarray, order: np.ndarray) -> None:
        """Put the fitted tables in the buffers (they then travel with the weights)."""
        self.rows.copy_(torch.from_numpy(rows))
        self.idf.copy_(torch.from_numpy(idf))
        self.order.copy_(torch.from_numpy(order))

    def row_weights(self, ids: torch.Tensor, counts: torch.Tensor, chars: bool = True
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each n-gram's row of the table and its weight [rows, width] (0 for padding and rare buckets, and
        for the character grams without `chars`)."""
        rows, weights, is_char = self._weighed(ids, counts)
        if is_char is not None and not chars:
            weights = weights * (~is_char).to(weights.dtype)
        return rows, weights

    def split_weights(self, ids: torch.Tensor, counts: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`row_weights` weighed once and given apart: the rows, the word grams' weights, the character grams'."""
        rows, weights, is_char = self._weighed(ids, counts)
        char = is_char.to(weights.dtype) if is_char is not None else torch.zeros_like(weights)
        return rows, weights * (1 - char), weights * char

    def _weighed(self, ids: torch.Tensor, counts: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        rows = self.rows[ids]
        tf = torch.where(counts > 0, 1 + torch.log(counts.clamp_min(1)), torch.zeros_like(counts))
        weights = tf * self.idf[rows]
        order = self.order[rows].clamp(0, self.max_order)
        norms = torch.zeros(weights.shape[0], self.max_order + 1, dtype=weights.dtype, device=weights.device)
        norms = norms.scatter_add(1, order, weights * weights).sqrt().clamp_min(1e-6)
        weights = weights / norms.gather(1, order)
        return rows, weights, (order == self.char_order) if self.char_order is not None else None

    def forward(self, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows, offsets, weights = bag_entries(*self.row_weights(ids, counts, chars=False))
        # through the module, so ZeRO-3 gathers its partitioned table first
        return self.bag(rows, offsets, per_sample_weights=weights.to(self.bag.weight.dtype))


def bag_entries(rows: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A [rows, width] batch's entries of non-zero weight as an embedding bag's flat (rows, offsets,
    weights): padding and the grams a block leaves out are most of the batch, and the bag's backward sorts
    and accumulates every entry it is given. The same sums."""
    keep = weights != 0
    per_row = keep.sum(1)
    return rows[keep], torch.cumsum(per_row, 0) - per_row, weights[keep]


class CategoryLogit(nn.Module):
    """One learned logit per code of each categorical column, summed (a one-hot linear model)."""

    def __init__(self, cardinalities: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, num_classes) for n in cardinalities)
        for table in self.tables:
            nn.init.zeros_(table.weight)

    def forward(self, categorical: torch.Tensor) -> torch.Tensor:
        return sum(table(categorical[:, i]) for i, table in enumerate(self.tables))



# the linear member's inputs, each with its own penalty; the word and character grams share `text_weight`,
# the columns' codes and the two-number bins' codes (fusion_model/pair_bins.py) `categorical_weight`
LINEAR_BLOCKS = ("text", "chars", "categorical", "numerical", "pairs")
_TABLE = {"chars": "text", "pairs": "categorical"}


class LinearMember(nn.Module):
    """The network's linear member: one penalised linear model (a GLM) over the text n-grams (as `TextLogit`
    weighs them), the codes (one-hot) and the numbers (piecewise-linear over their bins, rtdl_num_embeddings),
    fitted to convergence before the deep half trains (fusion_model/wide_fit.py) and kept as fitted. Its
    weights are buffers: no optimizer step moves them, and they travel in the checkpoint and
    model.safetensors. Output: raw logits [rows, width] (class logits, the standardised regression value)
    or, for an ordinal label, cumulative logits `score - threshold_k` [rows, K-1]."""

    def __init__(self, text_rows: int, cardinalities: Sequence[int], numeric_bins: Sequence[Sequence[float]],
                 width: int, ordinal_classes: int = 0) -> None:
        super().__init__()
        self.register_buffer("text_weight", torch.zeros(text_rows, width) if text_rows else None)
        self.register_buffer("categorical_weight",
                             torch.zeros(int(sum(cardinalities)), width) if cardinalities else None)
        offsets = np.concatenate([[0], np.cumsum(cardinalities)[:-1]]) if cardinalities else np.zeros(0)
        self.register_buffer("code_offsets", torch.as_tensor(offsets, dtype=torch.int64), persistent=False)
        self.numeric_encoding: nn.Module | None = None
        if numeric_bins:
            from rtdl_num_embeddings import PiecewiseLinearEncoding

            with torch.device("cpu"):  # the library checks the edges with Python `if`s (see TabularEncoder)
                self.numeric_encoding = PiecewiseLinearEncoding(
                    [torch.tensor(edges, dtype=torch.float32) for edges in numeric_bins])
        self.numeric_inputs = len(numeric_bins)  # the first ones of the batch's numbers
        total_bins = sum(len(e) - 1 for e in numeric_bins)
        self.register_buffer("numerical_weight", torch.zeros(total_bins, width) if numeric_bins else None)
        # the intercept per output, or an ordinal label's increasing thresholds
        self.register_buffer("intercept", torch.zeros(ordinal_classes - 1 if ordinal_classes else width))
        self.ordinal = bool(ordinal_classes)

    def weight(self, block: str) -> torch.Tensor:
        return self.get_buffer(f"{_TABLE.get(block, block)}_weight")

    FIT_BUFFERS = ("text_weight", "categorical_weight", "numerical_weight", "intercept")

    def fit_state(self) -> dict[str, torch.Tensor]:
        """A copy of the fitted weights and intercept (`FusionModel.load_linear_fit_state` puts them back)."""
        return {n: b.detach().clone() for n in self.FIT_BUFFERS if (b := getattr(self, n)) is not None}

    def inputs(self, text: TextLogit | None, batch: dict[str, torch.Tensor], split_chars: bool = False
               ) -> dict[str, object]:
        """Per block: the text's (table rows, weights) (`split_chars`: the word grams', then the character
        grams' apart), the codes' rows of `categorical_weight`, the numbers' encodings [rows, bins]."""
        out: dict[str, object] = {}
        if self.text_weight is not None and text is not None:
            if split_chars and text.char_order is not None:
                rows, words, chars = text.split_weights(batch["text_ids"], batch["text_counts"])
                out["text"], out["chars"] = (rows, words), (rows, chars)
            else:
                out["text"] = text.row_weights(batch["text_ids"], batch["text_counts"])
        if self.categorical_weight is not None:
            out["categorical"] = batch["categorical"] + self.code_offsets
        if self.numeric_encoding is not None:
            out["numerical"] = self.numeric_encoding(batch["numeric"][:, : self.numeric_inputs].float())
        return out

    def forward(self, text: TextLogit | None, batch: dict[str, torch.Tensor], mask: set[str]) -> torch.Tensor:
        parts = []
        for block, value in self.inputs(text, batch).items():
            weight = self.weight(block)
            if block == "text":
                rows, weights = value  # type: ignore[misc]
                flat, offsets, flat_weights = bag_entries(rows, weights)
                out = nn.functional.embedding_bag(flat, weight, offsets, mode="sum",
                                                  per_sample_weights=flat_weights.to(weight.dtype))
            elif block == "categorical":
                out = nn.functional.embedding(value, weight).sum(1)  # type: ignore[arg-type]
            else:
                out = value.to(weight.dtype) @ weight  # type: ignore[union-attr]
            parts.append(out * 0 if ("text" if block == "text" else "tabular") in mask else out)
        rows = batch["categorical"].shape[0]
        score = torch.stack(parts).sum(0) if parts else torch.zeros(rows, 1 if self.ordinal else len(self.intercept))
        return score - self.intercept if self.ordinal else score + self.intercept
