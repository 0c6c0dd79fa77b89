"""LightningModule around ``FusionModel``: one shared step for train/val/test, torchmetrics, AdamW.

The ``FusionModel`` is the single attribute ``self.model``, so every key of this module's state dict is
``fusion_model.layout.MODEL_PREFIX + <FusionModel key>``; DeepSpeed's raw output adds
``layout.DEEPSPEED_PREFIX`` in front of that.
The conversion stage strips exactly these two prefixes to get plain ``FusionModel`` keys.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torchmetrics import AUROC, Accuracy, CohenKappa, MetricCollection

from fusion_model.model import FusionModel

# Primary metric per label kind, logged as "val/<name>" and monitored for the best checkpoint.
METRIC_NAME: dict[str, str] = {"binary": "auc", "multiclass": "kappa"}


def metric_name(label_kind: str) -> str:
    return METRIC_NAME[label_kind]


def _metrics(label_kind: str, num_classes: int) -> MetricCollection:
    if label_kind == "binary":
        return MetricCollection({"auc": AUROC(task="binary"), "acc": Accuracy(task="binary")})
    return MetricCollection({
        "kappa": CohenKappa(task="multiclass", num_classes=num_classes, weights="quadratic"),
        "acc": Accuracy(task="multiclass", num_classes=num_classes),
    })


class FusionModule(pl.LightningModule):
    def __init__(
        self, model_kwargs: dict[str, Any], *, label_kind: str, lr: float, weight_decay: float,
        warmup_fraction: float = 0.1, text_lr_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = FusionModel(**model_kwargs)
        self.label_kind = label_kind
        num_classes = model_kwargs["num_classes"]
        self.train_metrics = _metrics(label_kind, num_classes).clone(prefix="train/")
        self.val_metrics = _metrics(label_kind, num_classes).clone(prefix="val/")
        self.test_metrics = _metrics(label_kind, num_classes).clone(prefix="test/")

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch)

    def model_step(self, batch: dict[str, torch.Tensor], stage: str) -> torch.Tensor:
        logits = self.model(batch).float()  # loss and metrics in fp32 whatever the weights' dtype
        labels = batch["label"]
        loss = F.cross_entropy(logits, labels)
        probs = logits.softmax(dim=-1)
        metrics = getattr(self, f"{stage}_metrics")
        metrics.update(probs[:, 1] if self.label_kind == "binary" else probs, labels)
        if stage == "train":  # per step unsynced (an all-reduce per step costs more than it tells), and per epoch
            self.log("train/loss", loss, on_step=True, on_epoch=True, sync_dist=False, batch_size=labels.shape[0])
        else:
            self.log(f"{stage}/loss", loss, on_epoch=True, sync_dist=True, batch_size=labels.shape[0])
        self.log_dict(metrics, on_step=False, on_epoch=True, batch_size=labels.shape[0])
        return loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model_step(batch, "train")

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.model_step(batch, "val")

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.model_step(batch, "test")

    def configure_optimizers(self) -> dict[str, Any]:
        # Plain AdamW: works with ZeRO as a client optimizer (zero_allow_untested_optimizer) and needs no
        # JIT build, unlike DeepSpeed's CPU/Fused Adam (~160 s to compile).
        decay, no_decay, text = [], [], []
        for name, p in self.model.named_parameters():
            if name.startswith("text."):
                text.append(p)  # the linear text logit: its own pace, no decay (idf and tf already scale it)
            elif p.ndim <= 1 or isinstance(self.model.get_submodule(name.rsplit(".", 1)[0]),
                                           torch.nn.Embedding | torch.nn.EmbeddingBag):
                no_decay.append(p)  # biases, norms and embeddings
            else:
                decay.append(p)
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        if text:
            groups.append({"params": text, "weight_decay": 0.0,
                           "lr": self.hparams.lr * self.hparams.text_lr_multiplier})
        # an empty group (e.g. nothing decays in a text-only model) would be dropped by ZeRO, leaving the
        # scheduler one group longer than the optimizer
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.hparams.lr)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warmup = max(1, int(total * self.hparams.warmup_fraction))

        def schedule(step: int) -> float:  # linear warm-up, then cosine to 5% of the peak
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
