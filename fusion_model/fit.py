"""Per-rank training entry point: ``python -m fusion_model.fit --config train_config.json``.

Launched by ``torchrun`` once per rank (ddp, deepspeed) or once in total for ``ddp_spawn`` (Lightning
spawns the ranks). Every rank fits; global rank 0 writes ``model_config.json`` and
``train_summary.json`` into ``out_dir``. Checkpoints: ``best.ckpt`` (the refit's model with ``refit: true``,
else the best monitored ``val/<metric>``) and ``last.ckpt`` (the selection's, to resume) -- files for ddp,
ZeRO folders that every rank writes its shard into for DeepSpeed.
No checkpoint is converted here: that is a separate stage that runs once all ranks have exited.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from torch.distributed.elastic.multiprocessing.errors import record

from fusion_model import quiet
from fusion_model.build import build_module, write_model_config
from fusion_model.callbacks import ProgressPrinter, SameFolderOnEveryHost, Throughput
from fusion_model.config import TrainConfig, processes_per_node
from fusion_model.data import FusionDataModule, ValidatedData
from fusion_model.files import write_json
from fusion_model.layout import (
    BEST_CHECKPOINT,
    CANDIDATES_DIR,
    LAST_CHECKPOINT,
    LIVE_DIR,
    RANKS_DIR,
    TRAIN_SUMMARY,
)
from fusion_model.loopback import bind_stores_to_master_addr
from fusion_model.metrics import greater_is_better
from fusion_model.module import metric_name, monitor_mode
from fusion_model.preprocess import Preprocessor
from fusion_model.processes import die_with_parent, end_process
from fusion_model.safe_load import check_checkpoint, checkpoint_shapes, key_mismatch
from fusion_model.strategies import build_strategy
from fusion_model.summary import FinishRun

quiet.install()  # at import, so every rank (ddp_spawn's re-import it) drops the known third-party noise
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


def epochs_for(cfg: TrainConfig, train_rows: int, world_size: int) -> int:
    """max_epochs, raised on a small table until the run makes `min_steps` optimizer steps (at most
    max_epochs_cap epochs): a few thousand rows give few steps per epoch."""
    steps_per_epoch = max(1, train_rows // max(1, cfg.batch_size * world_size))
    needed = -(-cfg.min_steps // steps_per_epoch)  # epochs, rounded up
    return max(cfg.max_epochs, min(cfg.max_epochs_cap, needed))


def live_logger(out_dir: Path, resume: bool) -> Any:
    """DVCLive as the Lightning logger (it logs from global rank 0 only, on every strategy): per-step loss
    and learning rate, per-epoch train/val metrics, into `out_dir/dvclive`. No DVC experiment, dvc.yaml or
    report of its own (dvc.yaml declares the files), no Studio (the train stage sets DVC_STUDIO_OFFLINE)."""
    from fusion_model.live_logger import LiveLogger

    return LiveLogger(dir=str(out_dir / LIVE_DIR), resume=resume, save_dvc_exp=False, dvcyaml=False,
                         report=None, monitor_system=False)


def _trainer(cfg: TrainConfig, devices: int, on_cuda: bool, max_epochs: int, callbacks: list[pl.Callback],
             logger: Any, validate: bool) -> pl.Trainer:
    if cfg.multi_host:
        callbacks = [*callbacks, SameFolderOnEveryHost(Path(cfg.out_dir))]
    return pl.Trainer(
        accelerator="gpu" if on_cuda else "cpu", devices=devices, num_nodes=cfg.num_nodes,
        strategy=build_strategy(cfg, on_cuda), precision=cfg.precision, max_epochs=max_epochs,
        max_steps=cfg.max_steps, callbacks=callbacks, logger=logger, limit_val_batches=None if validate else 0,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=10,
        deterministic=False,
    )


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Selection: fit on the train split, validation picking the epoch, the members' mix and the decision
    rule, for each of `candidates` (the best validation score wins). With `refit: true` (AutoGluon's
    refit_full), a second model is then fitted on train + val for that many epochs with that mix and rule;
    `refit: linear` refits only the linear member, inside the selection (build_module)."""
    torch.set_num_threads(cfg.threads_per_rank)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if cfg.multi_host:  # which global ranks ran on this host: its node job reports them with its files
        rank = {k.lower(): int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")}
        write_json(out_dir / RANKS_DIR / f"rank-{rank['rank']}.json", rank)
    data = ValidatedData.read(cfg.data_dir)
    on_cuda = uses_cuda(cfg)
    devices = (int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ
               else processes_per_node(cfg.devices, torch.cuda.device_count() if on_cuda else 0))
    if len(cfg.candidates) == 1:
        selection = select(cfg.candidate(0), data, devices, on_cuda, out_dir)
    else:
        selection = select_candidate(cfg, data, devices, on_cuda)
    index = selection["summary"].get("chosen_candidate") or 0
    chosen = cfg.candidate(index)
    if not cfg.retrains:
        if index == 0:
            return selection["summary"]
        # the kept model is the chosen selection's best epoch: fitted again, seeded, where the stage reads it
        again = select(chosen, data, devices, on_cuda, out_dir, phase="kept ")["summary"]
        summary = {**again, **{k: selection["summary"][k] for k in ("chosen_candidate", "candidates")}}
        if int(os.environ.get("RANK", "0")) == 0:
            write_json(out_dir / TRAIN_SUMMARY, summary)
        return summary
    if selection.get("linear"):  # the refit's linear member keeps the penalties validation chose
        chosen = chosen.with_linear_l2(selection["linear"])
    return refit(chosen, data, selection["summary"], selection["modalities"], selection["decision"], devices,
                 on_cuda, selection["max_epochs"], selection.get("linear_start"))


def select_candidate(cfg: TrainConfig, data: ValidatedData, devices: int, on_cuda: bool) -> dict[str, Any]:
    """Each candidate's selection (the first in out_dir, candidate i in out_dir/candidates/i, each with its
    own checkpoints and DVCLive log), the best validation score kept. A resumed run skips the candidates
    that finished (their selection.json) and continues the one that did not."""
    out_dir = Path(cfg.out_dir)
    metric = metric_name(data.problem_type)
    done: list[dict[str, Any]] = []
    for index in range(len(cfg.candidates)):
        folder = out_dir if index == 0 else out_dir / CANDIDATES_DIR / str(index)
        record = out_dir / CANDIDATES_DIR / f"{index}.json"
        if cfg.resume and record.exists():
            done.append(json.loads(record.read_text()))
            continue
        candidate = cfg.candidate(index).model_copy(
            update={"out_dir": folder, "resume": cfg.resume and (folder / LAST_CHECKPOINT).exists()})
        got = select(candidate, data, devices, on_cuda, folder, phase=f"candidate {index} ")
        got["summary"] = got["summary"] or json.loads((folder / TRAIN_SUMMARY).read_text())
        done.append({**got, "index": index})
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # each host's own copy: a resumed run reads it there
            write_json(record, {k: v for k, v in done[-1].items() if k != "linear_start"})
    best = _best_candidate(done, greater_is_better(metric), cfg.candidate_tolerance)
    table = [{"candidate": d["index"], **cfg.candidates[d["index"]], f"val_{metric}": d["summary"].get("best_score"),
              "best_epoch": d["summary"].get("best_epoch"), "fit_wall_s": d["summary"].get("fit_wall_s")}
             for d in done]
    summary = {**best["summary"], "chosen_candidate": best["index"], "candidates": table,
               "fit_wall_s": round(sum(d["summary"].get("fit_wall_s") or 0.0 for d in done), 2)}
    if int(os.environ.get("RANK", "0")) == 0:
        if best["index"] != 0:  # the kept candidate's curves are the run's
            shutil.rmtree(out_dir / LIVE_DIR, ignore_errors=True)
            shutil.copytree(out_dir / CANDIDATES_DIR / str(best["index"]) / LIVE_DIR, out_dir / LIVE_DIR)
        record_candidates(out_dir / LIVE_DIR, best["index"], table, metric)
        write_json(out_dir / TRAIN_SUMMARY, summary)
        print(f"[train] candidates: {json.dumps(table)}; kept candidate {best['index']}", flush=True)
    return {**best, "summary": summary}


def _best_candidate(done: list[dict[str, Any]], higher: bool, tolerance: float) -> dict[str, Any]:
    """The best validation score; a later candidate must beat the one kept by more than `tolerance` of its
    score (a difference that small is the validation rows' noise, and the first candidate is the default)."""
    best = done[0]
    for entry in done[1:]:
        score, kept = entry["summary"].get("best_score"), best["summary"].get("best_score")
        if score is not None and (kept is None or
                                  (score - kept if higher else kept - score) > tolerance * abs(kept)):
            best = entry
    return best


def record_candidates(live_dir: Path, chosen: int, table: list[dict[str, Any]], metric: str) -> None:
    """Every candidate's validation score and the choice, in DVCLive's metrics.json (`dvc metrics show`, the run
    manifest). Written into the file as it is: reopening the log with DVCLive would advance its step."""
    path = live_dir / "metrics.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    summary["candidates"] = {str(c["candidate"]): {f"val_{metric}": c[f"val_{metric}"]} for c in table}
    summary["chosen_candidate"] = chosen
    write_json(path, summary)


def select(cfg: TrainConfig, data: ValidatedData, devices: int, on_cuda: bool, out_dir: Path, phase: str = ""
           ) -> dict[str, Any]:
    """One configuration's selection fit in `out_dir`: its summary, modalities, last decision rule and epochs."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir.mkdir(parents=True, exist_ok=True)
    pre, kwargs, module = build_module(cfg, data)
    metric, mode = metric_name(data.problem_type), monitor_mode(data.problem_type)
    checkpoint = ModelCheckpoint(
        dirpath=out_dir, filename=Path(BEST_CHECKPOINT).stem, monitor=f"val/{metric}", mode=mode,
        save_top_k=0 if cfg.retrains else 1,  # a refit's model is the one kept: selection keeps only last.ckpt
        save_last=True,
        enable_version_counter=False,  # overwrite best.ckpt instead of writing best-v1.ckpt
        auto_insert_metric_name=False,
    )
    progress, throughput = ProgressPrinter(phase=phase), Throughput(cfg.batch_size)
    callbacks: list[pl.Callback] = [checkpoint, progress, throughput, LearningRateMonitor(logging_interval="step")]
    if cfg.early_stopping_patience:
        callbacks.append(EarlyStopping(monitor=f"val/{metric}", mode=mode, patience=cfg.early_stopping_patience))
    max_epochs = epochs_for(cfg, len(data.train), devices * cfg.num_nodes)
    trainer = _trainer(cfg, devices, on_cuda, max_epochs, callbacks, live_logger(out_dir, cfg.resume), validate=True)
    if trainer.is_global_zero:
        write_model_config(out_dir, kwargs, pre, data)
    resume_from = None
    if cfg.resume:
        last = out_dir / LAST_CHECKPOINT
        if not last.exists():
            raise FileNotFoundError(f"--resume: {last} does not exist; train once without --resume first")
        # Lightning and DeepSpeed unpickle a checkpoint in full (code may run): first prove that every file
        # of it holds only tensors and plain data
        check_checkpoint(last)
        refuse_another_model(last, module)
        resume_from = str(last)
    finish = FinishRun(cfg.model_copy(update={"out_dir": out_dir}), metric, checkpoint, progress, throughput,
                       resume_from)
    trainer.callbacks.append(finish)
    trainer.fit(module, datamodule=FusionDataModule(data, pre, batch_size=cfg.batch_size,
                                                    num_workers=cfg.num_workers), ckpt_path=resume_from)
    # ddp_spawn fitted in its workers: their summary reached this process through the file only
    summary = finish.summary or json.loads((out_dir / TRAIN_SUMMARY).read_text())
    return {"summary": summary, "modalities": kwargs["modalities"], "decision": module.model.decision_state(),
            "max_epochs": max_epochs, "linear": getattr(module, "linear_report", None),
            "linear_start": (pre, module.linear_glm) if hasattr(module, "linear_glm") else None}


def refuse_another_model(checkpoint: Path, module: pl.LightningModule) -> None:
    """Refuse to resume a checkpoint whose tensors are not those these settings build, naming them: Lightning's
    strict load would refuse it too, without saying what differs or what to do."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    found = checkpoint_shapes(checkpoint)
    mismatch = key_mismatch([k for k in expected if k not in found], [k for k in found if k not in expected],
                            [f"{k} {list(found[k])} in the checkpoint vs {list(expected[k])} now" for k in expected
                             if k in found and found[k] != expected[k]])
    if mismatch:
        raise ValueError(f"resume: {checkpoint} holds another model than these train settings build ({mismatch}); it "
                         "was trained with other settings or another version: resume with the settings it was "
                         "trained with, or train with resume false")


def refit(cfg: TrainConfig, data: ValidatedData, selection: dict[str, Any], modalities: list[str],
          fallback_decision: dict[str, list[float]], devices: int, on_cuda: bool, schedule_epochs: int,
          linear_start: tuple[Preprocessor, Any] | None = None) -> dict[str, Any]:
    """The kept model: every labelled row, the selected epoch count, the selected mix and decision rule."""
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    out_dir = Path(cfg.out_dir)
    every = data.every_labelled()
    # the selection's schedule, stopped at its best epoch: the refit trains as the kept epoch did
    pre, kwargs, module = build_module(cfg, every, modalities, schedule_epochs=schedule_epochs, linear_start=linear_start)
    # a selection that validated nothing new (a resumed run already at its last epoch) keeps the last rule
    module.model.load_decision_state(selection.get("decision") or fallback_decision)
    epochs = max(1, selection.get("best_epoch") or selection["epochs"])
    checkpoint = ModelCheckpoint(dirpath=out_dir, filename=Path(BEST_CHECKPOINT).stem, monitor=None,
                                 every_n_epochs=epochs, save_top_k=1, save_last=False,
                                 enable_version_counter=False, auto_insert_metric_name=False)
    progress, throughput = ProgressPrinter(phase="refit "), Throughput(cfg.batch_size)
    finish = FinishRun(cfg, selection["metric"], checkpoint, progress, throughput, None, selection=selection,
                       rows=len(every.train))
    trainer = _trainer(cfg, devices, on_cuda, epochs, [checkpoint, progress, throughput, finish], False,
                       validate=False)
    if trainer.is_global_zero:
        write_model_config(out_dir, kwargs, pre, every)
    trainer.fit(module, datamodule=FusionDataModule(every, pre, batch_size=cfg.batch_size,
                                                    num_workers=cfg.num_workers))
    return finish.summary or json.loads((out_dir / TRAIN_SUMMARY).read_text())


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
    end_process(main())  # a rank whose work is written is not failed by its interpreter's teardown
