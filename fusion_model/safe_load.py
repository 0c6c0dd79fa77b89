"""Read torch checkpoint files with ``weights_only=True``: tensors and plain data, never code.

A full unpickle runs whatever the file names, so a checkpoint from elsewhere (a shared DVC remote) is
code. Everything here loads with ``weights_only=True``; DeepSpeed's shards carry a few small objects of
its own, allowed by name. Tensors come back on the meta device: structure and file offsets, no memory.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

# DeepSpeed pickles these small objects beside the tensors; everything else must be weights_only-safe.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class UnsafeCheckpoint(ValueError):
    """A checkpoint file is missing, damaged, or holds more than tensors and known metadata."""


def _deepspeed_globals() -> list[Any]:
    found = []
    for dotted in DEEPSPEED_GLOBALS:
        module, _, name = dotted.rpartition(".")
        found.append(getattr(importlib.import_module(module), name))
    return found


def load_meta(path: Path) -> Any:
    """The pickled structure of a torch file, tensors as meta tensors that remember their file offset."""
    try:
        with torch.serialization.safe_globals(_deepspeed_globals()):
            return torch.load(path, map_location="meta", weights_only=True)
    except FileNotFoundError:
        raise UnsafeCheckpoint(f"{path}: missing. Re-run training to write a complete checkpoint.") from None
    except Exception as e:  # UnpicklingError for unknown globals, RuntimeError for a truncated zip
        reason = str(e).strip().splitlines()
        detail = next((line.strip() for line in reason if "Unsupported global" in line), reason[-1] if reason else "")
        raise UnsafeCheckpoint(
            f"{path}: cannot be read as a torch checkpoint with weights_only=True ({detail}). The file is "
            "truncated, corrupt, or holds objects other than tensors and DeepSpeed's known metadata; "
            "re-run training to rewrite it."
        ) from None


def check_checkpoint(checkpoint: Path) -> list[Path]:
    """Load every torch file of a checkpoint (a Lightning file, or each `*.pt` of a DeepSpeed folder) with
    weights_only=True; returns the files. Raises UnsafeCheckpoint naming the first file that fails."""
    files = sorted(checkpoint.rglob("*.pt")) if checkpoint.is_dir() else [checkpoint]
    if not files:
        raise UnsafeCheckpoint(f"{checkpoint}: no checkpoint files inside; re-run training to write one.")
    for file in files:
        load_meta(file)
    return files


def checkpoint_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """Each model tensor's name and shape in a Lightning checkpoint file (its `state_dict`) or a DeepSpeed
    folder (its model states file: the buffers there, the parameters' shapes from `param_shapes`, which
    ZeRO-3 keeps apart from its placeholders)."""
    if not checkpoint.is_dir():
        return {k: tuple(v.shape) for k, v in load_meta(checkpoint)["state_dict"].items()}
    found = sorted(checkpoint.rglob("*mp_rank_00_model_states.pt"), key=lambda p: p.name)
    if not found:
        raise UnsafeCheckpoint(f"{checkpoint}: no model states file inside; re-run training to write one.")
    states = load_meta(found[0])
    shapes = {k: tuple(v.shape) for k, v in states["module"].items()}
    for group in [*(states.get("param_shapes") or []), states.get("frozen_param_shapes") or {}]:
        shapes.update({k: tuple(v) for k, v in group.items()})
    return shapes


def key_mismatch(missing: list[str], unexpected: list[str], shapes: list[str]) -> str:
    """"missing keys: ...; unexpected keys: ...; shape mismatches: ..." (the first six of each), or "" when
    a weights file fits its model: how a strict load's refusal names the keys."""
    def few(keys: list[str]) -> str:
        return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")

    parts = [f"missing keys: {few(missing)}" if missing else "",
             f"unexpected keys: {few(unexpected)}" if unexpected else "",
             f"shape mismatches: {few(shapes)}" if shapes else ""]
    return "; ".join(p for p in parts if p)
