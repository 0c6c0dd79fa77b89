"""Plain-text progress and throughput for a training run whose log is streamed line by line.

Lightning's tqdm bar redraws with carriage returns, which a log stream (Prefect, CI) shows as one
growing line; this prints short lines from global rank 0 instead, flushed at once.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl


class ProgressPrinter(pl.Callback):
    def __init__(self, every_n_steps: int = 20, phase: str = "") -> None:
        self.every_n_steps = every_n_steps
        self.phase = phase  # said before each line ("refit ")
        self.history: list[dict[str, float]] = []

    def _print(self, trainer: pl.Trainer, text: str) -> None:
        if trainer.is_global_zero:
            print(f"[train] {self.phase}{text}", flush=True, file=sys.stdout)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step % self.every_n_steps == 0:
            loss = trainer.callback_metrics.get("train/loss_step")
            loss_text = f" loss {float(loss):.4f}" if loss is not None else ""
            self._print(trainer, f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} step {step}{loss_text}")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # after the epoch's metrics are in callback_metrics (the module logs them in its own epoch-end hook,
        # which Lightning calls after the callbacks' on_validation_epoch_end)
        if trainer.sanity_checking:
            return
        metrics = {k: round(float(v), 5) for k, v in trainer.callback_metrics.items()
                   if k.startswith("val/") or k.endswith("_epoch")}
        self.history.append({"epoch": trainer.current_epoch + 1, "step": trainer.global_step, **metrics})
        shown = " ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items()))
        self._print(trainer, f"epoch {trainer.current_epoch + 1}/{trainer.max_epochs} done: {shown}")


class Throughput(pl.Callback):
    """Training samples per second over all ranks: time between consecutive training batch ends (data
    loading included, validation excluded). The first ``skip`` steps of the run include lazy set-up
    (DeepSpeed buffers, first JPEG decodes) and are left out of the rate.
    """

    def __init__(self, batch_size: int, skip: int = 2) -> None:
        self.batch_size = batch_size
        self.skip = skip
        self.seconds = 0.0
        self.steps = 0
        self._last: float | None = None
        self._seen = 0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None  # the gap since the previous epoch holds validation and checkpointing

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        self._seen += 1
        if self._last is not None and self._seen > self.skip:
            self.seconds += now - self._last
            self.steps += 1
        self._last = now

    def samples_per_s(self, world_size: int) -> float | None:
        if self.steps == 0 or self.seconds <= 0:
            return None
        return self.steps * self.batch_size * world_size / self.seconds

    def steps_per_s(self) -> float | None:
        return self.steps / self.seconds if self.steps and self.seconds > 0 else None


class SameFolderOnEveryHost(pl.Callback):
    """Across machines, Lightning has every rank save into the folder global rank 0 names (it broadcasts the
    path), each host on its own disk: the folder must be at the same path on every host. Checked once, before
    anything is saved, so a mismatch is named rather than surfacing as a write error on another host."""

    def __init__(self, folder: Any) -> None:
        from pathlib import Path

        self.folder = str(Path(folder).resolve())

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        first = trainer.strategy.broadcast(self.folder)
        if trainer.strategy.reduce_boolean_decision(first == self.folder, all=True):
            return
        here = "" if first == self.folder else f", global rank {trainer.global_rank} would write {self.folder}"
        raise RuntimeError(
            f"the training folder must be at the same path on every host: global rank 0 writes {first}{here}. "
            "Give every machine's worker the same RETRAIN_HOME (README, \"Training across machines\")."
        )
