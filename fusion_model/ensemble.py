"""The members' mix: Caruana et al.'s greedy ensemble selection (ICML 2004), as AutoGluon's
WeightedEnsemble, on the validation rows. Written here because it selects members inside one network from
their gathered outputs each epoch; no library does that on tensors."""

from __future__ import annotations

from collections.abc import Callable

import torch


def greedy_weights(members: int, loss_of: Callable[[torch.Tensor], float], rounds: int = 25) -> torch.Tensor:
    """Weights [members] summing to 1: `rounds` picks with replacement, each the member whose addition
    lowers `loss_of(weights)` the most (the first on a tie, so a lone best member takes every pick)."""
    counts = torch.zeros(members)
    for _ in range(rounds):
        best, best_loss = 0, float("inf")
        for m in range(members):
            trial = counts.clone()
            trial[m] += 1
            value = loss_of(trial / trial.sum())
            if value < best_loss - 1e-12:
                best, best_loss = m, value
        counts[best] += 1
    return counts / counts.sum()
