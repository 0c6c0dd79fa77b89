"""Sums across the training ranks before Lightning's process group exists.

Every rank fits the linear member before the deep half trains (fusion_model/wide_fit.py). Instead of each
fitting the same model on every row, each takes its share of the rows and the ranks add their losses and
gradients, so every rank runs the same L-BFGS iterations on the whole objective at a share of the work.
Under torchrun the agent serves a store at MASTER_ADDR:MASTER_PORT to its ranks; a gloo group of our own on
that store (under a prefix of its own) leaves the default group to Lightning and DeepSpeed, which create it
later with the backend they choose. Without torchrun's store (one process, or ddp_spawn, whose launching
process fits before it spawns the ranks) the sums are the process's own values.
"""

from __future__ import annotations

import functools
import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

TIMEOUT = timedelta(minutes=30)  # torch's default for a process group: a rank still building its rows waits


class RankSums:
    """One process: every row is its own, a sum is its own value."""

    rank, size = 0, 1

    def sum(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(values, dtype=np.float64)

    def share(self, rows: int) -> slice:
        """This rank's contiguous share of `rows` rows (np.array_split's sizes: they differ by one at most)."""
        base, extra = divmod(rows, self.size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))


class GlooSums(RankSums):
    """Every rank of the torchrun job: a gloo allreduce, whose result is the same bits on every rank (each
    element is summed once and copied), so the ranks' optimisers take the very same steps."""

    def __init__(self, group: dist.ProcessGroupGloo, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    def sum(self, values: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(np.array(values, dtype=np.float64))  # a copy: the caller's array is kept
        self.group.allreduce([tensor]).wait()
        return tensor.numpy()


@functools.cache
def rank_sums() -> RankSums:
    """The ranks of this torchrun job (one group per process, made on first use), or this process alone."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return RankSums()
    rank = int(os.environ["RANK"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=TIMEOUT)
    # a restarted job's ranks meet under a new prefix, never the keys an earlier attempt left in the store
    prefix = f"fusion_model/rank_sums/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    group = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, TIMEOUT)
    return GlooSums(group, rank, size)
