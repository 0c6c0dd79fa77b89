"""Per-rank training entry point: ``python -m fusion_model.fit --config train_config.json``.

Launched by ``torchrun`` once per rank (ddp, deepspeed) or once in total for ``ddp_spawn`` (Lightning
spawns the ranks). Every rank fits; global rank 0 writes ``model_config.json`` and
``train_summary.json`` into ``out_dir``. Checkpoints: ``best.ckpt`` (monitored ``val/<metric>``) and
``last.ckpt`` -- files for ddp, ZeRO folders that every rank writes its shard into for DeepSpeed.
No checkpoint is converted here: that is a separate stage that runs once all ranks have exited.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch.distributed.elastic.multiprocessing.errors import record

from fusion_model.callbacks import ProgressPrinter, SameFolderOnEveryHost, Throughput
from fusion_model.config import TrainConfig, processes_per_node
from fusion_model.data import FusionDataModule, ValidatedData
from fusion_model.dataset import row_images
from fusion_model.files import write_json
from fusion_model.layout import (
    BEST_CHECKPOINT,
    LAST_CHECKPOINT,
    LIVE_DIR,
    MODEL_CONFIG,
    RANKS_DIR,
    TRAIN_SUMMARY,
)
from fusion_model.legacy import CURRENT_FORMAT
from fusion_model.loopback import bind_stores_to_master_addr
from fusion_model.metrics import greater_is_better
from fusion_model.module import FusionModule, balanced_class_weight, metric_name, monitor_mode
from fusion_model.preprocess import Preprocessor
from fusion_model.processes import die_with_parent
from fusion_model.safe_load import check_checkpoint
from fusion_model.strategies import build_strategy

# Validation metrics are computed on every rank from the same gathered rows, so they need no reduction;
# the per-epoch training loss is each rank's own (an all-reduce per step costs more than it tells).
warnings.filterwarnings("ignore", message=".*when logging on epoch level in distributed setting.*")
FORMAT_VERSION = CURRENT_FORMAT  # the format this version writes (fusion_model/legacy.py reads the older ones)
# At import, so ddp_spawn's ranks (which re-import this module) get it too: under torchrun the agent hosts
# the store (fusion_model.launch), under ddp_spawn rank 0 does, on MASTER_ADDR only.
bind_stores_to_master_addr()
if __name__ == "__mp_main__":  # a rank ddp_spawn started: it ends with the process that spawned it
    die_with_parent(signal.SIGKILL)


def uses_cuda(cfg: TrainConfig) -> bool:
    if cfg.accelerator == "gpu":
        if not torch.cuda.is_available():
            raise RuntimeError("accelerator 'gpu' was asked for but no CUDA device is visible; use 'auto' or 'cpu'")
        return True
    return cfg.accelerator == "auto" and torch.cuda.is_available()


def used_modalities(cfg: TrainConfig, train: Any, available: list[str], image_columns: list[str]) -> list[str]:
    """`cfg.modalities` the table feeds (`available`), without the image when no training row has a photo
    (nothing to learn it from)."""
    columns = [c for c in image_columns if c in train.columns]
    has_photos = bool(columns) and any(row_images(row, columns) for row in train[columns].to_dict("records"))
    return [m for m in cfg.modalities if m in available and (m != "image" or has_photos)]


def model_kwargs(cfg: TrainConfig, pre: Preprocessor, num_classes: int, modalities: list[str], problem_type: str,
                 target_transform: str = "none") -> dict[str, Any]:
    """FusionModel keyword arguments, JSON-serialisable (saved in model_config.json)."""
    return {
        "problem_type": problem_type,
        "target_transform": target_transform,
        "image_model": cfg.image_model,
        # the weights are in the checkpoint: a rebuilt model never needs the pretrained file again
        "pretrained": str(cfg.pretrained) if cfg.pretrained not in (False, True) else cfg.pretrained,
        "image_size": cfg.image_size,
        "cat_cardinalities": pre.cardinalities,
        "n_numeric": pre.n_numeric,
        "num_classes": num_classes,
        "text_buckets": cfg.text_buckets,
        "text_vocab_size": pre.text_vocab_size,
        "text_ngrams": cfg.text_ngrams,
        "cat_dim": cfg.cat_dim,
        "adapter_dim": cfg.adapter_dim,
        "hidden_sizes": list(cfg.hidden_sizes),
        "activation": cfg.activation,
        "dropout": cfg.dropout,
        "layer_norm": cfg.layer_norm,
        "category_logits": cfg.category_logits,
        "aux_loss_weight": cfg.aux_loss_weight,
        "modalities": modalities,
        "fusion": cfg.fusion,
        "ensemble_size": cfg.ensemble_size,
        "numeric_bins": pre.numeric_bins if pre.numeric_output == "values" else None,
        "numeric_embedding_dim": cfg.numeric_embedding_dim,
        "member_text_scale": [m.text_lr_multiplier for m in cfg.members],
        "member_category_scale": [m.category_lr_multiplier for m in cfg.members],
    }


def epochs_for(cfg: TrainConfig, train_rows: int, world_size: int) -> int:
    """max_epochs, raised on a small table until the run makes `min_steps` optimizer steps (at most
    max_epochs_cap epochs): a few thousand rows give few steps per epoch."""
    steps_per_epoch = max(1, train_rows // max(1, cfg.batch_size * world_size))
    needed = -(-cfg.min_steps // steps_per_epoch)
    return max(cfg.max_epochs, min(cfg.max_epochs_cap, needed))


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


def _best_epoch(history: list[dict[str, float]], monitor: str) -> int | None:
    """The (first) epoch of the best monitored value: the one best.ckpt holds."""
    scored = [h for h in history if monitor in h]
    if not scored:
        return None
    pick = max if greater_is_better(monitor.removeprefix("val/")) else min
    return pick(scored, key=lambda h: h[monitor])["epoch"]


class FinishRun(pl.Callback):
    """At the end of fit, inside every rank (ddp_spawn's workers too): gather the final weights if asked
    and write ``train_summary.json`` from global rank 0, then wait so no rank exits before it exists."""

    def __init__(self, cfg: TrainConfig, metric: str, checkpoint: ModelCheckpoint, progress: ProgressPrinter,
                 throughput: Throughput, resume_from: str | None) -> None:
        self.cfg, self.metric, self.checkpoint = cfg, metric, checkpoint
        self.progress, self.throughput, self.resume_from = progress, throughput, resume_from
        self.summary: dict[str, Any] = {}
        self._started = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.perf_counter()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        cfg, out_dir = self.cfg, Path(self.cfg.out_dir)
        if cfg.save_gathered_weights:
            state = gathered_fp32_state(trainer, pl_module)
            if state is not None:
                from safetensors.torch import save_file

                path = Path(cfg.save_gathered_weights)
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file({k: v.contiguous() for k, v in state.items()}, str(path))
        best = self.checkpoint.best_model_score
        best_epoch = _best_epoch(self.progress.history, f"val/{self.metric}")
        self.summary = {
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
            "best_score": float(best) if best is not None else None,
            # names inside the run's folder, not paths: the folder is renamed into place, and the same run
            # must write the same bytes in any clone
            "best_checkpoint": Path(self.checkpoint.best_model_path).name if self.checkpoint.best_model_path else None,
            "last_checkpoint": LAST_CHECKPOINT,
            "checkpoint_kind": "deepspeed_zero" if cfg.strategy == "deepspeed" else "lightning",
            "resumed_from": self.resume_from,
            "fit_wall_s": round(time.perf_counter() - self._started, 2),
            "history": self.progress.history,
            "best_epoch": best_epoch,
            # the members of the kept epoch: settings, validation score alone, weight in the mix
            "portfolio": portfolio(self.progress.history, best_epoch, self.metric,
                                   [m.model_dump() for m in cfg.members]),
            "stopped_early": bool(getattr(trainer.early_stopping_callback, "stopped_epoch", 0)),
        }
        if trainer.is_global_zero:
            write_json(out_dir / TRAIN_SUMMARY, self.summary)
            brief = {k: v for k, v in self.summary.items() if k != "history"}
            print(f"[train] finished: {json.dumps(brief)}", flush=True)
        trainer.strategy.barrier("train_summary_written")


def live_logger(out_dir: Path, resume: bool) -> Any:
    """DVCLive as the Lightning logger (it logs from global rank 0 only, on every strategy): per-step loss
    and learning rate, per-epoch train/val metrics, into `out_dir/dvclive`. No DVC experiment, dvc.yaml or
    report of its own (dvc.yaml declares the files), no Studio (the train stage sets DVC_STUDIO_OFFLINE)."""
    from dvclive.lightning import DVCLiveLogger

    return DVCLiveLogger(dir=str(out_dir / LIVE_DIR), resume=resume, save_dvc_exp=False, dvcyaml=False,
                         report=None, monitor_system=False)


def run(cfg: TrainConfig) -> dict[str, Any]:
    torch.set_num_threads(cfg.threads_per_rank)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.multi_host:  # which global ranks ran on this host: its node job reports them with its files
        rank = {k.lower(): int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")}
        write_json(out_dir / RANKS_DIR / f"rank-{rank['rank']}.json", rank)
    data = ValidatedData.read(cfg.data_dir)
    schema, problem_type = data.schema, data.problem_type
    train_labels = data.labels(data.train)
    # Fitted from the train split on every rank: deterministic, so all ranks agree without a broadcast.
    pre = Preprocessor.fit(data.train, schema, text_buckets=cfg.text_buckets, image_size=cfg.image_size,
                           image_index=cfg.image_index, text_ngrams=cfg.text_ngrams, text_min_df=cfg.text_min_df,
                           text_max_features=cfg.text_max_features, numeric_bins=cfg.numeric_bins,
                           numeric_codes_max=cfg.numeric_codes_max, bin_min_rows=cfg.bin_min_rows,
                           labels=train_labels if cfg.fusion == "tabm" else None,
                           ordered_labels=problem_type in ("ordinal", "regression"),
                           id_as_number=cfg.id_as_number,
                           numeric_output="values" if cfg.fusion == "tabm" else "encodings")
    modalities = used_modalities(cfg, data.train, schema.modalities, schema.columns.image)
    if not modalities:
        raise ValueError(f"train.modalities {cfg.modalities} and the dataset's inputs {schema.modalities} have "
                         "nothing in common; list at least one modality the table feeds")
    if set(modalities) != set(cfg.modalities) and int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] the model uses {modalities} (the table feeds {schema.modalities}; photos in training "
              "rows decide the image)", flush=True)
    num_classes = len(data.classes) if problem_type != "regression" else 1
    kwargs = model_kwargs(cfg, pre, num_classes, modalities, problem_type, schema.label.transform)
    metric = metric_name(problem_type)
    class_weight = (balanced_class_weight(train_labels, num_classes)
                    if cfg.class_weight == "balanced" and problem_type != "regression" else None)
    module = FusionModule(kwargs, lr=cfg.lr, weight_decay=cfg.weight_decay, class_weight=class_weight,
                          fit_decision=cfg.fit_decision, text_l2=[m.text_l2 for m in cfg.members],
                          category_l2=[m.category_l2 for m in cfg.members], train_rows=len(data.train))
    if "text" in modalities:  # the fitted text tables, in the model's buffers (so in every checkpoint)
        module.model.text.load_tables(**pre.text_tables)
    if problem_type == "regression":  # the target's scale, in buffers: predictions come out in the label's unit
        target = np.log1p(np.clip(train_labels, 0, None)) if schema.label.transform == "log1p" else train_labels
        module.model.target_mean.fill_(float(np.mean(target)))
        module.model.target_std.fill_(float(np.std(target)) or 1.0)
    datamodule = FusionDataModule(data, pre, batch_size=cfg.batch_size, num_workers=cfg.num_workers)

    on_cuda = uses_cuda(cfg)
    devices = (int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ
               else processes_per_node(cfg.devices, torch.cuda.device_count() if on_cuda else 0))
    checkpoint = ModelCheckpoint(
        dirpath=out_dir, filename=Path(BEST_CHECKPOINT).stem, monitor=f"val/{metric}", mode=monitor_mode(problem_type),
        save_top_k=1, save_last=True,
        enable_version_counter=False,  # overwrite best.ckpt instead of writing best-v1.ckpt
        auto_insert_metric_name=False,
    )
    progress = ProgressPrinter()
    throughput = Throughput(cfg.batch_size)
    callbacks: list[pl.Callback] = [checkpoint, progress, throughput, LearningRateMonitor(logging_interval="step")]
    if cfg.multi_host:
        callbacks.append(SameFolderOnEveryHost(out_dir))
    if cfg.early_stopping_patience:
        callbacks.append(EarlyStopping(monitor=f"val/{metric}", mode=monitor_mode(problem_type),
                                       patience=cfg.early_stopping_patience))
    trainer = pl.Trainer(
        accelerator="gpu" if on_cuda else "cpu",
        devices=devices,
        num_nodes=cfg.num_nodes,
        strategy=build_strategy(cfg, on_cuda),
        precision=cfg.precision,
        max_epochs=epochs_for(cfg, len(data.train), devices * cfg.num_nodes),
        max_steps=cfg.max_steps,
        callbacks=callbacks,
        logger=live_logger(out_dir, cfg.resume),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        deterministic=False,
    )
    if trainer.is_global_zero:
        write_json(out_dir / MODEL_CONFIG, {
            "format_version": FORMAT_VERSION,
            "model": kwargs,
            "preprocess": pre.to_dict(),
            "label": data.label,
            "problem_type": problem_type,
            "classes": data.classes,
            "metric": metric,
            "dataset": schema.model_dump(mode="json"),  # the columns a prediction request carries
        })
    resume_from = None
    if cfg.resume:
        last = out_dir / LAST_CHECKPOINT
        if not last.exists():
            raise FileNotFoundError(f"--resume: {last} does not exist; train once without --resume first")
        # Lightning and DeepSpeed unpickle a checkpoint in full (code may run): first prove that every file
        # of it holds only tensors and plain data
        check_checkpoint(last)
        resume_from = str(last)
    finish = FinishRun(cfg, metric, checkpoint, progress, throughput, resume_from)
    trainer.callbacks.append(finish)
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
    return finish.summary


@record  # torchrun then prints the failing rank's traceback in its error summary
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusion_model.fit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, required=True, help="TrainConfig as JSON (written by tasks.train)")
    parser.add_argument("--resume", action="store_true", help="continue from out_dir/last.ckpt")
    parser.add_argument("--save-gathered-weights", type=Path, default=None, metavar="PATH",
                        help="after fit, save the final fp32 weights (gathered across ranks) as safetensors")
    args = parser.parse_args(argv)
    # a rank whose launcher died (killed with the caller) must not train on alone
    die_with_parent(signal.SIGKILL)
    cfg = TrainConfig.model_validate_json(args.config.read_text())
    updates: dict[str, Any] = {}
    if args.resume:
        updates["resume"] = True
    if args.save_gathered_weights:
        updates["save_gathered_weights"] = args.save_gathered_weights
    cfg = cfg.model_copy(update=updates)
    run(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
