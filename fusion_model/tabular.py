"""The tabular encoder: code embeddings beside the numeric inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


class TabularEncoder(nn.Module):
    """One embedding per categorical column, concatenated with the numeric inputs: as they come
    (standardised values and their bin encodings), or, given `numeric_bins`, each standardised value
    embedded piecewise-linearly over its bins (rtdl_num_embeddings, version B: a linear term plus a
    zero-initialised piecewise one)."""

    def __init__(self, cardinalities: Sequence[int], n_numeric: int, cat_dim: int,
                 numeric_bins: Sequence[Sequence[float]] | None = None, numeric_embedding_dim: int = 16) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(n, cat_dim) for n in cardinalities)
        self.numeric_embedding: nn.Module | None = None
        width = n_numeric
        if numeric_bins is not None and n_numeric:
            from rtdl_num_embeddings import PiecewiseLinearEmbeddings

            # Built on the CPU whatever the surrounding device: the library checks the edges with Python
            # `if`s, which a meta tensor (the convert stage's shape-only build) cannot answer.
            with torch.device("cpu"):
                self.numeric_embedding = PiecewiseLinearEmbeddings(
                    [torch.tensor(edges, dtype=torch.float32) for edges in numeric_bins], numeric_embedding_dim,
                    activation=False, version="B")
            width = n_numeric * numeric_embedding_dim
        self.out_dim = len(cardinalities) * cat_dim + width

    def forward(self, categorical: torch.Tensor, numeric: torch.Tensor) -> torch.Tensor:
        parts = [emb(categorical[:, i]) for i, emb in enumerate(self.embeddings)]
        dtype = parts[0].dtype if parts else numeric.dtype
        if self.numeric_embedding is not None:
            dtype = next(self.numeric_embedding.parameters()).dtype
            numeric = self.numeric_embedding(numeric.to(dtype)).flatten(1)
        return torch.cat([*(p.to(dtype) for p in parts), numeric.to(dtype)], dim=1)
