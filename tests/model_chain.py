"""Real converted models for evaluation, prediction and promotion tests: train -> convert -> evaluate.

One short ddp_spawn run of timm's `test_resnet` at 32 px on a validated folder gives the `trained`
model. A second model comes from the same checkpoint with every logit part zeroed, converted by the
same convert stage: it predicts 0.5 for every row (ROC AUC exactly 0.5), a challenger that is worse for
certain without a second training run. Both are evaluated by the evaluate stage on the test table.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from fusion_model.config import TrainConfig
from tasks.convert import convert
from tasks.evaluate import evaluate
from tasks.params import ConvertParams, EvaluateParams
from tasks.train import train


@dataclass(frozen=True)
class ModelChain:
    data_dir: Path  # the validated folder (test.parquet, meta.json)
    validation_report: Path  # its reports/validation.json (success)
    images_root: Path
    trained: Path  # converted model folder of the real run
    trained_eval: Path  # its evaluation folder
    constant: Path  # converted model folder with a zeroed head
    constant_eval: Path


def tiny_train_config(data_dir: Path, out_dir: Path) -> TrainConfig:
    return TrainConfig(
        data_dir=data_dir, out_dir=out_dir, live_dir=out_dir.parent / "training", image_model="test_resnet", image_size=32, text_buckets=256,
        cat_dim=4, adapter_dim=16, hidden_sizes=[32], batch_size=16, max_epochs=3, lr=0.01,
        strategy="ddp_spawn", devices=2, accelerator="cpu", threads_per_rank=1,
    )


def _zero_head_checkpoint(src_dir: Path, dest_dir: Path) -> None:
    """The training checkpoint with every part that adds to the logits set to zero (the deep head, the
    wide text and per-code logits, the linear member's weights and intercept), beside its config and summary."""
    dest_dir.mkdir(parents=True)
    for name in ("model_config.json", "train_summary.json"):
        shutil.copy2(src_dir / name, dest_dir / name)
    checkpoint = torch.load(src_dir / "best.ckpt", map_location="cpu", weights_only=True)
    state = checkpoint["state_dict"]
    logit_parts = [k for k in state if k.startswith(("model.head.", "model.text.bag.", "model.category_logit."))
                   or (k.startswith("model.linear.") and k.endswith(("_weight", "intercept")))]
    assert {"model.head.weight", "model.text.bag.weight", "model.linear.text_weight"} <= set(logit_parts), sorted(state)
    for key in logit_parts:
        state[key] = torch.zeros_like(state[key])
    torch.save(checkpoint, dest_dir / "best.ckpt")


def build_model_chain(data_dir: Path, root: Path) -> ModelChain:
    meta = json.loads((data_dir / "meta.json").read_text())
    train(tiny_train_config(data_dir, root / "checkpoints"))
    convert(ConvertParams(checkpoint_dir=root / "checkpoints", out_dir=root / "trained" / "model"))
    _zero_head_checkpoint(root / "checkpoints", root / "constant_checkpoints")
    convert(ConvertParams(checkpoint_dir=root / "constant_checkpoints", out_dir=root / "constant" / "model"))
    for name in ("trained", "constant"):
        evaluate(EvaluateParams(model_dir=root / name / "model", data_dir=data_dir, out_dir=root / name / "eval"))
    return ModelChain(
        data_dir=data_dir,
        validation_report=data_dir.parent / "reports" / "validation.json",
        images_root=(data_dir / meta["dataset_root"]).resolve(),
        trained=root / "trained" / "model",
        trained_eval=root / "trained" / "eval",
        constant=root / "constant" / "model",
        constant_eval=root / "constant" / "eval",
    )
