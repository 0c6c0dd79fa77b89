"""LightningModule around ``FusionModel``: the problem type's loss, validation metrics, AdamW.

Training: every head's loss (TabM's independent heads), plus each member's L2 on its wide logits.

The ``FusionModel`` is the single attribute ``self.model``, so every key of this module's state dict is
``fusion_model.layout.MODEL_PREFIX + <FusionModel key>``; DeepSpeed's raw output adds
``layout.DEEPSPEED_PREFIX`` in front of that.
The conversion stage strips exactly these two prefixes to get plain ``FusionModel`` keys.

Validation gathers every rank's outputs at the end of each epoch, fits the decision rule on them when
asked (ordinal cut points: fusion_model/decision.py; kept in the model's buffers,
so the checkpoint of that epoch carries them), after the members' mix (greedy selection on the
validation loss: fusion_model/ensemble.py; logged as ``val/member_<m>/weight`` beside each member's
own ``val/member_<m>/<metric>``) and logs the metrics of fusion_model/metrics.py as
``val/<name>``: the very functions the evaluate stage uses on the test set.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch

from fusion_model import heads
from fusion_model.decision import fit_class_bias, fit_cutpoints
from fusion_model.ensemble import greedy_weights
from fusion_model.metrics import compute_metrics, greater_is_better, primary_metric_name
from fusion_model.model import FusionModel


def metric_name(problem_type: str) -> str:
    """The validation metric monitored for the best checkpoint (logged as ``val/<name>``)."""
    return primary_metric_name(problem_type)


def monitor_mode(problem_type: str) -> str:
    return "max" if greater_is_better(metric_name(problem_type)) else "min"


def in_row_order(gathered: torch.Tensor, rows: int) -> torch.Tensor:
    """Every rank's validation outputs [ranks, rows per rank, ...] as the table's `rows` rows, each once.
    The distributed sampler (unshuffled) deals row i to rank i % ranks and, so that each rank gets as many,
    deals the first rows again after the last: counted twice, they would tilt the mix, the decision rule
    and the epoch's metric towards those rows."""
    return gathered.transpose(0, 1).reshape(-1, *gathered.shape[2:])[:rows]


class FusionModule(pl.LightningModule):
    def __init__(
        self, model_kwargs: dict[str, Any], *, lr: float, weight_decay: float, warmup_fraction: float = 0.1,
        class_weight: list[float] | None = None, fit_decision: bool = True, text_l2: list[float] | None = None,
        category_l2: list[float] | None = None, train_rows: int = 1, schedule_epochs: int | None = None,
    ) -> None:
        """`text_l2`, `category_l2`: each member's L2 penalty on its wide logits (fusion_model/config.py's
        WideMember; its learning-rate multipliers are the model's `member_*_scale`). `schedule_epochs`: the
        learning-rate schedule spans this many epochs though the run may stop sooner (a refit stops at the
        selected epoch with the learning rate that epoch had), None: the run's own length."""
        super().__init__()
        self.save_hyperparameters()
        self.model = FusionModel(**model_kwargs)
        self.problem_type: str = model_kwargs.get("problem_type", "binary")
        self.num_classes: int = model_kwargs["num_classes"]
        self.fit_decision = fit_decision
        self.text_l2 = list(text_l2 or [0.0] * self.model.members)
        self.category_l2 = list(category_l2 or [0.0] * self.model.members)
        self.register_buffer("class_weight", torch.tensor(class_weight, dtype=torch.float32)
                             if class_weight is not None else None, persistent=False)
        self._val_raw: list[torch.Tensor] = []
        self._val_labels: list[torch.Tensor] = []
        # each validated epoch's fitted mix and decision rule (epoch numbered from 1, as the history)
        self.decisions: dict[int, dict[str, list[float]]] = {}
        # refit "linear": the linear member's two fits (keep_linear_fit), else None
        self._linear_fits: dict[str, dict[str, torch.Tensor]] | None = None

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch)

    def _loss(self, raw: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = self.model.loss(raw, labels, self.class_weight)
        # coupled L2 on each member's wide tables, as the logistic regression's penalty (decoupled decay
        # would shrink rare and frequent n-grams alike)
        penalty = self.model.wide_penalty(self.text_l2, self.category_l2)
        return loss if penalty is None else loss + penalty / max(1, self.hparams.train_rows)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        labels = batch["label"]
        loss = self._loss(self.model.head_outputs(batch, linear=False), labels)
        # per step unsynced (an all-reduce per step costs more than it tells), and per epoch
        self.log("train/loss", loss, on_step=True, on_epoch=True, sync_dist=False, batch_size=labels.shape[0])
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        labels = batch["label"]
        raw = self.model.head_outputs(batch)
        loss = self._loss(raw, labels)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True, batch_size=labels.shape[0])
        self._val_raw.append(raw.detach().float())
        self._val_labels.append(labels.detach())

    def keep_linear_fit(self, validated: dict[str, torch.Tensor], kept: dict[str, torch.Tensor]) -> None:
        """Refit "linear": validation weighs the linear member fitted on the training rows (`validated`, a
        `FusionModel.linear_fit_state`); between validations, so in every checkpoint, it holds `kept` (fitted on
        train + val), beside the deep members of that epoch."""
        self._linear_fits = {"validated": validated, "kept": kept}
        self._load_linear_fit("kept")

    def _load_linear_fit(self, which: str) -> None:
        if self._linear_fits is not None:
            self.model.load_linear_fit_state(self._linear_fits[which])

    def on_validation_epoch_start(self) -> None:
        self._val_raw, self._val_labels = [], []
        self._load_linear_fit("validated")

    def on_validation_epoch_end(self) -> None:
        try:
            self._end_validation_epoch()
        finally:  # the checkpoint this validation saves holds the kept fit
            self._load_linear_fit("kept")

    def _gathered(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """This epoch's validation rows of every rank, each row once, in the table's order."""
        local = torch.cat(parts)
        if self.trainer.world_size == 1:
            return local
        return in_row_order(self.all_gather(local), len(self.trainer.val_dataloaders.dataset))

    def _end_validation_epoch(self) -> None:
        if not self._val_raw or self.trainer.sanity_checking:
            return
        raw, labels = self._gathered(self._val_raw), self._gathered(self._val_labels)
        self._val_raw, self._val_labels = [], []
        y = labels.cpu().numpy()
        name = metric_name(self.problem_type)
        members = self.model.member_outputs(raw)  # [rows, members, width]
        if self.model.mixed > 1:
            def mix_loss(weights: torch.Tensor) -> float:
                mixed = self.model.combine(members, weights.to(members.device))
                return float(self.model.loss(mixed, labels))

            self.model.member_weights.copy_(greedy_weights(self.model.mixed, mix_loss).to(members.device))
            for m in range(self.model.mixed):  # each member alone, with its own decision rule
                alone = self._metrics(members[:, m], y, store=False)[name]
                self.log(f"val/member_{m}/{name}", float(alone) if alone is not None else math.nan,
                         on_epoch=True, sync_dist=False, rank_zero_only=False)
                self.log(f"val/member_{m}/weight", float(self.model.member_weights[m]), on_epoch=True,
                         sync_dist=False, rank_zero_only=False)
        metrics = self._metrics(self.model.combine(raw), y, store=True)
        self.decisions[self.current_epoch + 1] = self.model.decision_state()
        # the same value on every rank (the same gathered rows): no further reduction
        for key, value in metrics.items():
            if value is not None:
                self.log(f"val/{key}", float(value), on_epoch=True, sync_dist=False, rank_zero_only=False)
            elif key == name:
                worst = -math.inf if greater_is_better(key) else math.inf
                self.log(f"val/{key}", worst, on_epoch=True, sync_dist=False)

    def _metrics(self, raw: torch.Tensor, y: np.ndarray, store: bool) -> dict[str, Any]:
        """Validation metrics of one raw output [rows, width], its decision rule fitted first when asked
        (kept in the model's buffers when `store`, so the checkpoint of the epoch carries it)."""
        kwargs: dict[str, Any] = {}
        if self.fit_decision and self.problem_type == "ordinal":
            cuts = torch.as_tensor(fit_cutpoints(torch.sigmoid(raw).sum(1).cpu().numpy(), y, self.num_classes),
                                   dtype=torch.float32)
            if store:
                self.model.ordinal.cutpoints.copy_(cuts)
            kwargs["cutpoints"] = cuts
        elif self.fit_decision and self.problem_type == "multiclass":
            bias = torch.as_tensor(fit_class_bias(raw.float().softmax(-1).cpu().numpy()), dtype=torch.float32)
            if store:
                self.model.decision_bias.copy_(bias)
            kwargs["decision_bias"] = bias
        out = self.model.interpret(raw) if store or not kwargs else heads.interpret(
            raw.cpu(), self.problem_type, **kwargs)
        return compute_metrics(y, out.prediction.cpu().numpy(), self.problem_type, self.num_classes,
                               None if out.proba is None else out.proba.cpu().numpy())

    def configure_optimizers(self) -> dict[str, Any]:
        # Plain Adam(W): works with ZeRO as a client optimizer (zero_allow_untested_optimizer) and needs no
        # JIT build, unlike DeepSpeed's CPU/Fused Adam (~160 s to compile).
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            if not p.requires_grad:  # a frozen backbone (train.freeze) or the weights under LoRA adapters
                continue
            if p.ndim <= 1 or name.startswith(("text.", "category_logit.")) or isinstance(
                    self.model.get_submodule(name.rsplit(".", 1)[0]), torch.nn.Embedding | torch.nn.EmbeddingBag):
                # biases, norms, embeddings, the ordinal thresholds, and the wide logits (their members'
                # own L2 is in the loss: _loss)
                no_decay.append(p)
            else:
                decay.append(p)
        groups = [{"params": decay, "weight_decay": self.hparams.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        # an empty group (e.g. nothing decays in a text-only model) would be dropped by ZeRO, leaving the
        # scheduler one group longer than the optimizer; Adam with decoupled decay is AdamW
        optimizer = torch.optim.Adam([g for g in groups if g["params"]], lr=self.hparams.lr,
                                     decoupled_weight_decay=True)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        if self.hparams.schedule_epochs and self.trainer.max_steps == -1:
            total = max(1, total * self.hparams.schedule_epochs // max(1, self.trainer.max_epochs or 1))
        warmup = max(1, int(total * self.hparams.warmup_fraction))

        def schedule(step: int) -> float:  # linear warm-up, then cosine to 5% of the peak
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def balanced_class_weight(labels: np.ndarray, num_classes: int) -> list[float]:
    """scikit-learn's "balanced" weights: rows / (classes * rows of the class), 1 for an absent class."""
    counts = np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes).astype(float)
    return [float(len(labels) / (num_classes * c)) if c else 1.0 for c in counts]
