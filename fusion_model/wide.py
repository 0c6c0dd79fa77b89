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
    and trigrams each weigh as one block.
    """

    def __init__(self, buckets: int, vocab_size: int, num_classes: int, max_order: int = 3) -> None:
        super().__init__()
        self.max_order = max_order
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

    def forward(self, ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        rows = self.rows[ids]
        tf = torch.where(counts > 0, 1 + torch.log(counts.clamp_min(1)), torch.zeros_like(counts))
        weights = tf * self.idf[rows]
        order = self.order[rows].clamp(0, self.max_order)
        norms = torch.zeros(weights.shape[0], self.max_order + 1, dtype=weights.dtype, device=weights.device)
        norms = norms.scatter_add(1, order, weights * weights).sqrt().clamp_min(1e-6)
        weights = weights / norms.gather(1, order)
        return self.bag(rows, per_sample_weights=weights.to(self.bag.weight.dtype))


class CategoryLogit(nn.Module):
    """One learned logit per code of each categorical column, summed (a one-hot linear model)."""

    def __init__(self, cardinalities: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, num_classes) for n in cardinalities)
        for table in self.tables:
            nn.init.zeros_(table.weight)

    def forward(self, categorical: torch.Tensor) -> torch.Tensor:
        return sum(table(categorical[:, i]) for i, table in enumerate(self.tables))

