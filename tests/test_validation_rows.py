"""Validation under several ranks counts each row once: what torch's DistributedSampler deals to the ranks,
gathered as Lightning's all_gather stacks it, comes back as the table's rows in order."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from fusion_model.module import in_row_order


def dealt(outputs: torch.Tensor, ranks: int) -> torch.Tensor:
    """The rows the unshuffled sampler deals each rank, stacked as Lightning's all_gather stacks them."""
    rows = len(outputs)
    return torch.stack([outputs[list(DistributedSampler(range(rows), num_replicas=ranks, rank=r, shuffle=False))]
                        for r in range(ranks)])


@pytest.mark.parametrize(("rows", "ranks"), [(7, 2), (1295, 2), (10, 3), (8, 2), (5, 4)])
def test_the_gathered_rows_are_the_table_once_in_order(rows: int, ranks: int) -> None:
    table = torch.arange(rows)
    gathered = dealt(table, ranks)  # [ranks, rows per rank]
    assert gathered.numel() == -(-rows // ranks) * ranks  # an uneven table's first rows are dealt again
    assert torch.equal(in_row_order(gathered, rows), table)


def test_outputs_keep_their_trailing_shape() -> None:
    rows, ranks, width = 5, 2, 3
    outputs = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
    assert torch.equal(in_row_order(dealt(outputs, ranks), rows), outputs)
