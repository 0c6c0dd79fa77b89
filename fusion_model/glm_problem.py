"""The linear member's fitting problem: its logits' loss under the network's own head, on one rank's rows.

torch computes the problem type's loss (fusion_model/heads.py) and its derivatives on the [rows, width]
logits; scipy's sparse products turn them into the weights' (fusion_model/wide_fit.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from fusion_model import heads
from fusion_model.model import FusionModel
from fusion_model.rank_sums import RankSums

Design = dict[str, sp.csr_matrix]  # block name (LINEAR_BLOCKS) -> [rows, block inputs]


@dataclass
class Glm:
    weights: dict[str, np.ndarray]  # block -> [block inputs, width]
    intercept: np.ndarray  # [width], or the ordinal thresholds' parameters (first, gaps...)
    loss: float  # the mean training loss, penalty excluded


class GlmProblem:
    """The loss of a GLM's logits under the network's head (torch autograd on the [rows, width] logits), on
    this rank's share of the rows: `sums` adds the ranks' parts into the mean over every rank's rows."""

    def __init__(self, model: FusionModel, labels: torch.Tensor, loss_kwargs: dict, sums: RankSums | None = None,
                 member: str = "linear") -> None:
        linear = model.linear_members()[member]
        # "linear_classes": an ordinal label's multinomial member, a softmax over its classes
        classes = member == "linear_classes"
        self.problem_type = "multiclass" if classes else model.problem_type
        self.labels, self.kwargs = labels, loss_kwargs
        self.sums = sums or RankSums()
        self.rows = int(self.sums.sum(np.array([len(labels)]))[0])  # every rank's
        self.share = len(labels) / self.rows
        # binary's two softmax logits, both penalised, have their optimum at w1 = -w0: fitted as one logit u
        # (the logits -u, u; the penalty l2 |w0|^2 + l2 |w1|^2 = 2 l2 |u|^2), half the unknowns, the same model
        width = linear.intercept.numel() if classes else model.width
        self.symmetric = self.problem_type == "binary" and width == 2
        self.width = 1 if self.symmetric else width  # the fitted weights' columns
        self.penalty_scale = 2.0 if self.symmetric else 1.0
        self.ordinal = model.ordinal is not None and not classes
        self.link = model.ordinal if self.ordinal else None
        self.n_intercept = 1 if self.symmetric else linear.intercept.numel()

    def initial_intercept(self) -> np.ndarray:
        if self.link is None:
            return np.zeros(self.n_intercept)
        return torch.cat([p.detach().flatten() for p in self.link.parameters()]).double().numpy()

    def thresholds(self, intercept: np.ndarray) -> np.ndarray:
        """The intercept as stored in the model: as fitted, or an ordinal label's increasing thresholds."""
        if self.ordinal:
            return self._thresholds(torch.as_tensor(intercept)).numpy()
        return self.model_weights(intercept[None])[0]

    def model_weights(self, w: np.ndarray) -> np.ndarray:
        """Fitted weights [inputs, width] as the model's columns."""
        return np.hstack([-w, w]) if self.symmetric else w

    @staticmethod
    def _thresholds(b: torch.Tensor) -> torch.Tensor:  # OrdinalLink's parametrisation: increasing by softplus gaps
        first, gaps = b[:1], b[1:]
        return torch.cat([first, first + torch.cumsum(torch.nn.functional.softplus(gaps), 0)])

    def _loss(self, z: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """This rank's part of the mean loss (its rows' mean times their share) of logits `z`, intercept `b`."""
        raw = z - self._thresholds(b) if self.ordinal else z + b
        if self.symmetric:
            raw = torch.cat([-raw, raw], dim=1)
        return heads.loss(raw, self.labels, self.problem_type, **self.kwargs) * self.share

    def loss_and_grads(self, logits: np.ndarray, intercept: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """This rank's part of the mean loss and its gradients."""
        z = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(intercept, dtype=torch.float64, requires_grad=True)
        loss = self._loss(z, b)
        loss.backward()
        assert z.grad is not None and b.grad is not None
        return float(loss.detach()), z.grad.numpy(), b.grad.numpy()

    def curvature(self, logits: np.ndarray, intercept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The second derivatives of this rank's part of the mean loss at `logits`: [rows, width] in each row's
        each logit (the rows' losses are independent: the derivative of a column's gradients' sum), and
        [intercept] in each intercept parameter (the Hessian's diagonal)."""
        z = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(intercept, dtype=torch.float64, requires_grad=True)
        dz, db = torch.autograd.grad(self._loss(z, b), (z, b), create_graph=True)
        rows = [torch.autograd.grad(dz[:, k].sum(), z, retain_graph=True)[0][:, k] for k in range(self.width)]
        own = [torch.autograd.grad(db[j], b, retain_graph=True)[0][j] for j in range(b.numel())]
        return torch.stack(rows, dim=1).numpy(), torch.stack(own).numpy()

    def loss(self, glm: Glm, x: Design) -> float:
        """The mean loss over every rank's rows (`x`: this rank's)."""
        part = self.loss_and_grads(logits(glm.weights, x, self.width), glm.intercept)[0]
        return float(self.sums.sum(np.array([part]))[0])


def logits(weights: dict[str, np.ndarray], x: Design, width: int) -> np.ndarray:
    out = np.zeros((next(iter(x.values())).shape[0], width))
    for name, w in weights.items():
        out += x[name] @ w
    return out
