"""The training loader's batches, indexed a batch at a time (BatchedFusionDataset), are the very tensors the
rows one by one and collated give, random flips included, so a fit is the same either way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from fusion_model.build import build_module
from fusion_model.config import TrainConfig
from fusion_model.data import BatchedFusionDataset, FusionDataset, ValidatedData, whole_batch
from tests.validated_tables import make_validated


@pytest.mark.parametrize("train", [True, False])
def test_batches_equal_the_rows_collated(tmp_path: Path, train: bool) -> None:
    validated = make_validated(tmp_path, n_train=70, n_val=20, n_test=10)
    data = ValidatedData.read(validated)
    cfg = TrainConfig.model_validate({"data_dir": validated, "image_size": 16, "hidden_sizes": [8],
                                      "ensemble_size": 2, "text_buckets": 1024, "linear_member": False})
    pre, _, _ = build_module(cfg, data)
    table = data.train.copy()
    table.loc[table.index[::5], pre.image_columns[0]] = ""  # every fifth row without a photo
    labels = data.labels(table)
    rows = FusionDataset(table, pre, data.dataset_root, train=train, labels=labels)
    batched = BatchedFusionDataset(table, pre, data.dataset_root, train=train, labels=labels)
    assert 0 < rows.rows_with_images < len(rows)  # photos, and rows without: both kinds of image
    torch.manual_seed(3)
    one_by_one = list(DataLoader(rows, batch_size=16, shuffle=True, drop_last=train))
    after_rows = torch.rand(())
    torch.manual_seed(3)
    at_once = list(DataLoader(batched, batch_size=16, shuffle=True, drop_last=train, collate_fn=whole_batch))
    assert torch.rand(()) == after_rows  # the same random draws were made
    assert len(one_by_one) == len(at_once) == (4 if train else 5)
    for a, b in zip(one_by_one, at_once, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
