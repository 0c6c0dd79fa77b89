"""What a training run reports: the summary of each phase, the kept epoch's portfolio, the gathered weights.

``FinishRun`` runs inside every rank (ddp_spawn's workers too), so what it computes is there without a
round trip through the launching process.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from fusion_model.callbacks import ProgressPrinter, Throughput
from fusion_model.config import TrainConfig
from fusion_model.files import write_json
from fusion_model.layout import LAST_CHECKPOINT, TRAIN_SUMMARY
from fusion_model.memory import rank_memory
from fusion_model.metrics import greater_is_better


def portfolio(history: list[dict[str, float]], epoch: int | None, metric: str, members: list[dict[str, Any]]
              ) -> dict[str, Any] | None:
    """The members at the kept epoch: each one's settings, own validation score and weight in the mix."""
    row = next((h for h in history if h.get("epoch") == epoch), None)
    if row is None or len(members) < 2:
        return None
    entries = [{"member": m, **config, f"val_{metric}": row.get(f"val/member_{m}/{metric}"),
                "weight": row.get(f"val/member_{m}/weight")} for m, config in enumerate(members)]
    chosen = max(entries, key=lambda e: e["weight"] if e["weight"] is not None else -1.0)
    return {"epoch": epoch, "chosen": chosen["member"], "ensemble_val": row.get(f"val/{metric}"),
            "members": entries}


def linear_entries(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The linear members' portfolio entries, in the mix's order: the fit report without the penalties tried
    (an ordinal label's multinomial member second, from its part of the report)."""
    def own(part: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in part.items() if k not in ("tried", "classes", "refit")}

    refit = report.get("refit")
    entries = [{"linear": {**own(report), **({"refit": own(refit)} if refit else {})}}]
    if (classes := report.get("classes")) is not None:
        again = (refit or {}).get("classes")
        entries.append({"linear_classes": {**own(classes), **({"refit": own(again)} if again else {})}})
    return entries


def gathered_fp32_state(trainer: Any, module: Any) -> dict[str, torch.Tensor] | None:
    """Full fp32 FusionModel weights on global rank 0 (None elsewhere). Collective: call on every rank.

    Under DeepSpeed the fp32 master weights live in the (sharded) optimizer; ``safe_get_full_fp32_param``
    assembles each one across ranks for ZeRO 1/2/3.
    """
    model = module.model
    state: dict[str, torch.Tensor] = {}
    if trainer.strategy.strategy_name.startswith("deepspeed"):
        import deepspeed
        from deepspeed.utils import safe_get_full_fp32_param

        for name, param in model.named_parameters():
            full = safe_get_full_fp32_param(param)
            if full is None:  # a frozen parameter has no master copy: gather the module's own
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    full = param.detach().clone()
            state[name] = full.detach().float().cpu().clone()
        persistent = set(model.state_dict())  # a non-persistent buffer (a constant rebuilt by __init__) stays out
        for name, buf in model.named_buffers():
            if name not in persistent:
                continue
            state[name] = buf.detach().cpu().clone() if not buf.is_floating_point() else buf.detach().float().cpu()
    else:
        state = {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().clone()
                 for k, v in model.state_dict().items()}
    return state if trainer.is_global_zero else None


def parsed_deepspeed(trainer: Any) -> dict[str, Any] | None:
    """What DeepSpeed itself read from the config the project wrote (its engine's accessors, not our dict):
    a key DeepSpeed ignored or renamed shows here as its default. None for the other strategies."""
    engine = getattr(trainer.strategy, "deepspeed_engine", None)
    if engine is None:
        return None

    def device(offload: Any) -> str | None:  # an offload block's device ("cpu", "nvme"), None when absent
        value = getattr(offload, "device", None) if offload is not None else None
        return str(getattr(value, "value", value)) if value not in (None, "none") else None

    return {
        "zero_stage": int(engine.zero_optimization_stage()),
        "offload_optimizer": device(engine.zero_offload_optimizer()),
        "offload_param": device(engine.zero_offload_param()),
        "reduce_bucket_size": int(engine.zero_reduce_bucket_size()),
        "allgather_bucket_size": int(engine.zero_allgather_bucket_size()),
        "overlap_comm": bool(engine.zero_overlap_comm()),
        "bf16": bool(engine.bfloat16_enabled()),
        "fp16": bool(engine.fp16_enabled()),
        "optimizer": type(engine.optimizer).__name__,
    }


def _best_epoch(history: list[dict[str, float]], monitor: str) -> int | None:
    """The (first) epoch of the best monitored value: the one best.ckpt holds."""
    scored = [h for h in history if monitor in h]
    if not scored:
        return None
    pick = max if greater_is_better(monitor.removeprefix("val/")) else min
    return pick(scored, key=lambda h: h[monitor])["epoch"]


class FinishRun(pl.Callback):
    """At the end of fit, inside every rank: gather the final weights if asked and write
    ``train_summary.json`` from global rank 0, then wait so no rank exits before it exists.

    The selection phase (validation picks the epoch, the members' mix and the decision rule) reports them;
    a refit (every labelled row, that many epochs, no validation) reports `selection`'s fields with its own
    checkpoint and steps under ``refit``.
    """

    def __init__(self, cfg: TrainConfig, metric: str, checkpoint: ModelCheckpoint, progress: ProgressPrinter,
                 throughput: Throughput, resume_from: str | None, selection: dict[str, Any] | None = None,
                 rows: int = 0) -> None:
        self.cfg, self.metric, self.checkpoint = cfg, metric, checkpoint
        self.progress, self.throughput, self.resume_from = progress, throughput, resume_from
        self.selection, self.rows = selection, rows
        self.summary: dict[str, Any] = {}
        self._started = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()

    def _save_gathered(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        state = gathered_fp32_state(trainer, pl_module)
        if state is not None:
            from safetensors.torch import save_file

            path = Path(self.cfg.save_gathered_weights)  # type: ignore[arg-type]
            path.parent.mkdir(parents=True, exist_ok=True)
            save_file({k: v.contiguous() for k, v in state.items()}, str(path))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cfg, out_dir = self.cfg, Path(self.cfg.out_dir)
        final = self.selection is not None or not cfg.retrains
        if cfg.save_gathered_weights and final:
            self._save_gathered(trainer, pl_module)
        wall = round(time.perf_counter() - self._started, 2)
        memory = rank_memory(trainer, pl_module.model)  # collective: every rank answers
        if self.selection is not None:
            self.summary = {**self.selection, "fit_wall_s": round(self.selection["fit_wall_s"] + wall, 2),
                            "best_checkpoint": Path(self.checkpoint.best_model_path).name or None,
                            "refit": {"rows": self.rows, "epochs": trainer.current_epoch,
                                      "steps": trainer.global_step, "fit_wall_s": wall,
                                      "decision_from_epoch": self.selection["best_epoch"]}}
        else:
            self.summary = self._selection_summary(trainer, pl_module, wall)
        # each rank's parameter, gradient and optimizer bytes at the end, and its peak resident memory
        self.summary["memory"] = memory
        if trainer.is_global_zero:
            write_json(out_dir / TRAIN_SUMMARY, self.summary)
            if final:
                brief = {k: v for k, v in self.summary.items() if k not in ("history", "decision", "memory")}
                print(f"[train] finished: {json.dumps(brief)}", flush=True)
        trainer.strategy.barrier("train_summary_written")

    def _selection_summary(self, trainer: pl.Trainer, pl_module: Any, wall: float) -> dict[str, Any]:
        cfg, history = self.cfg, self.progress.history
        best = self.checkpoint.best_model_score
        best_epoch = _best_epoch(history, f"val/{self.metric}")
        scores = [h[f"val/{self.metric}"] for h in history if h.get("epoch") == best_epoch]
        decisions = getattr(pl_module, "decisions", {})
        return {
            "strategy": cfg.strategy,
            "zero_stage": cfg.zero_stage if cfg.strategy == "deepspeed" else None,
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            "accelerator": trainer.strategy.root_device.type,
            "precision": cfg.precision,
            "epochs": trainer.current_epoch,
            "steps": trainer.global_step,
            "samples_per_s": self.throughput.samples_per_s(trainer.world_size),
            "steps_per_s": self.throughput.steps_per_s(),
            "batch_size_per_device": cfg.batch_size,
            "metric": self.metric,
            "monitor": f"val/{self.metric}",
            "best_score": float(best) if best is not None else (float(scores[0]) if scores else None),
            # names inside the run's folder, not paths: the folder is renamed into place, and the same run
            # must write the same bytes in any clone
            "best_checkpoint": Path(self.checkpoint.best_model_path).name if self.checkpoint.best_model_path else None,
            "last_checkpoint": LAST_CHECKPOINT,
            "checkpoint_kind": "deepspeed_zero" if cfg.strategy == "deepspeed" else "lightning",
            "deepspeed_parsed": parsed_deepspeed(trainer),
            "resumed_from": self.resume_from,
            "fit_wall_s": wall,
            "history": history,
            "best_epoch": best_epoch,
            # the members of the kept epoch: settings, validation score alone, weight in the mix
            "portfolio": portfolio(history, best_epoch, self.metric, [m.model_dump() for m in cfg.members] + (
                linear_entries(linear) if (linear := getattr(pl_module, "linear_report", None)) else [])),
            "linear_member": getattr(pl_module, "linear_report", None),
            # the kept epoch's mix and decision rule (the model's buffers), which a refit carries over
            "decision": decisions.get(best_epoch) if best_epoch is not None else None,
            "stopped_early": bool(getattr(trainer.early_stopping_callback, "stopped_epoch", 0)),
        }
