"""What each rank holds at the end of training, and its peak resident memory: the numbers that show what
ZeRO's partitioning saves (train_summary.json "memory"; bench/zero_memory.py compares strategies).

Bytes are counted per distinct storage, so a parameter that is a view into a flat buffer (DDP's gradient
buckets, ZeRO's flat groups) counts once, and so does a buffer several views share.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterable
from typing import Any

import torch

# DeepSpeed ZeRO optimizers keep their fp32 master weights (and their gradients) in these flat lists
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        if t is None or not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def held_bytes(module: torch.nn.Module, optimizer: Any, engine: Any = None) -> dict[str, int]:
    """Bytes this rank holds in the model's parameters (ZeRO-3: its partitions), their gradients, and the
    optimizer (fp32 master weights of ZeRO, Adam's moments); `engine`: DeepSpeed's, when training with it."""
    seen: set[int] = set()
    params = list(module.parameters())
    # ZeRO-3 leaves each parameter an empty placeholder and keeps this rank's piece in ds_tensor
    held = [getattr(p, "ds_tensor", None) if hasattr(p, "ds_tensor") else p for p in params]
    out = {"params": _bytes(held, seen)}
    inner = optimizer
    masters: list[torch.Tensor] = []
    if engine is not None and getattr(engine, "optimizer", None) is not None:
        zero = engine.optimizer
        inner = getattr(zero, "optimizer", zero)
        for attr in _MASTER_ATTRS:
            masters += list(getattr(zero, attr, None) or [])
    grads = [p.grad for p in params] + [m.grad for m in masters]
    out["grads"] = _bytes(grads, seen)
    states = [v for state in getattr(inner, "state", {}).values() for v in state.values()]
    out["optimizer"] = _bytes([*masters, *states], seen)
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def rank_memory(trainer: Any, module: torch.nn.Module) -> list[dict[str, int]]:
    """Every rank's held bytes and peak RSS, in global rank order (a collective: call it on every rank)."""
    optimizer = trainer.optimizers[0] if trainer.optimizers else None
    mine = {"rank": int(trainer.global_rank), **held_bytes(module, optimizer,
                                                           getattr(trainer.strategy, "deepspeed_engine", None)),
            "peak_rss": peak_rss_bytes()}
    if trainer.world_size == 1 or not torch.distributed.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * trainer.world_size
    torch.distributed.all_gather_object(everyone, mine)
    return sorted(everyone, key=lambda r: r["rank"])
