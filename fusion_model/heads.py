"""Heads per problem type: what the network's output means, its loss, and how it becomes a prediction.

The fusion network ends in `output_width` numbers per row:
- binary: two logits (softmax; the positive class is index 1);
- multiclass: one logit per class (softmax; the prediction is the argmax after `decision_bias`, fitted on validation for macro F1);
- ordinal: one score turned into K-1 cumulative logits `score - t_k` by `OrdinalLink` (a cumulative-link,
  proportional-odds head: P(y > k) = sigmoid(score - t_k), thresholds kept increasing); the prediction cuts
  the expected class (sum of P(y > k)) at `cutpoints`, fitted on validation for quadratic weighted kappa;
- regression: one value, the standardised (and optionally log1p'd) target; the prediction is in the
  label's unit.
Everything a prediction needs (thresholds, cut points, target scale) is a parameter or a
buffer of the model, so it travels in model.safetensors. Modules take tensors and return tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def output_width(problem_type: str, num_classes: int) -> int:
    """Numbers the network's last layer (and each wide logit) emits per row."""
    if problem_type in ("ordinal", "regression"):
        return 1
    return num_classes


class OrdinalLink(nn.Module):
    """score [B, 1] -> cumulative logits [B, K-1]: score - t_k, with t_1 < t_2 < ... (softplus gaps)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"an ordinal head needs at least two classes, got {num_classes}")
        gaps = num_classes - 2
        # thresholds start one unit apart and centred on 0 (softplus(log(e - 1)) = 1)
        self.first = nn.Parameter(torch.tensor([-gaps / 2.0]))
        # (no zero-sized parameter for two classes: ZeRO partitions every parameter)
        self.gaps = nn.Parameter(torch.full((gaps,), math.log(math.e - 1.0))) if gaps else None
        # decision cut points on the expected class (0 .. K-1); rounding until fitted on validation
        self.register_buffer("cutpoints", torch.arange(num_classes - 1, dtype=torch.float32) + 0.5)

    def thresholds(self) -> torch.Tensor:
        if self.gaps is None:
            return self.first
        return torch.cat([self.first, self.first + torch.cumsum(F.softplus(self.gaps), 0)])

    def forward(self, score: torch.Tensor) -> torch.Tensor:
        return score - self.thresholds().to(score.dtype)


def cumulative_logits(class_logits: torch.Tensor) -> torch.Tensor:
    """Class logits [B, K] (a softmax over the ordered classes) -> the cumulative logits [B, K-1] that
    `OrdinalLink` emits: log P(y > k) - log P(y <= k), in log space (no probability rounds to 0 or 1)."""
    z = class_logits.float()
    below = torch.logcumsumexp(z, dim=1)[:, :-1]  # log P(y <= k) + log-normaliser
    above = torch.logcumsumexp(z.flip(1), dim=1).flip(1)[:, 1:]  # log P(y > k) + the same
    return above - below


@dataclass
class Outputs:
    """What a batch of rows becomes: the class (index) or value predicted, class probabilities
    (classification), and a score (binary: P(positive); ordinal: the expected class index)."""

    prediction: torch.Tensor
    proba: torch.Tensor | None
    score: torch.Tensor | None


def interpret(raw: torch.Tensor, problem_type: str, *, decision_bias: torch.Tensor | None = None,
              cutpoints: torch.Tensor | None = None, target_mean: float = 0.0, target_std: float = 1.0,
              target_transform: str = "none") -> Outputs:
    """The network's raw output [B, width] -> predictions (fp32, no gradient needed)."""
    raw = raw.float()
    if problem_type == "regression":
        value = raw[:, 0] * target_std + target_mean
        if target_transform == "log1p":
            value = torch.expm1(value)
        return Outputs(prediction=value, proba=None, score=value)
    if problem_type == "ordinal":
        above = torch.sigmoid(raw)  # P(y > k), k = 0 .. K-2
        ones = torch.ones_like(above[:, :1])
        zeros = torch.zeros_like(above[:, :1])
        # P(y = k) = P(y > k-1) - P(y > k); increasing thresholds keep these non-negative
        proba = (torch.cat([ones, above], 1) - torch.cat([above, zeros], 1)).clamp_min(0)
        proba = proba / proba.sum(1, keepdim=True).clamp_min(1e-12)
        expected = above.sum(1)
        cuts = cutpoints if cutpoints is not None else torch.arange(raw.shape[1], dtype=raw.dtype) + 0.5
        return Outputs(prediction=torch.bucketize(expected, cuts.to(expected), right=True), proba=proba,
                       score=expected)
    proba = raw.softmax(-1)
    logits = raw if decision_bias is None else raw + decision_bias.to(raw)
    return Outputs(prediction=logits.argmax(-1), proba=proba, score=proba[:, 1] if problem_type == "binary" else None)


def loss(raw: torch.Tensor, labels: torch.Tensor, problem_type: str, *, target_mean: float = 0.0,
         target_std: float = 1.0, target_transform: str = "none",
         class_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Training loss of a batch: cross-entropy (binary, multiclass), the cumulative-link likelihood as one
    binary cross-entropy per threshold (ordinal), mean squared error of the standardised target
    (regression). `labels`: class indices, or values in the label's unit (regression)."""
    raw = raw.float()
    if problem_type == "regression":
        target = labels.float()
        if target_transform == "log1p":
            target = torch.log1p(target.clamp_min(0))
        return F.mse_loss(raw[:, 0], (target - target_mean) / target_std)
    if problem_type == "ordinal":
        k = torch.arange(raw.shape[1], device=raw.device)
        above = (labels.unsqueeze(1) > k).float()
        per_row = F.binary_cross_entropy_with_logits(raw, above, reduction="none").sum(1)
        if class_weight is not None:
            per_row = per_row * class_weight.to(raw)[labels]
            return per_row.sum() / class_weight.to(raw)[labels].sum()
        return per_row.mean()
    return F.cross_entropy(raw, labels, weight=None if class_weight is None else class_weight.to(raw))
