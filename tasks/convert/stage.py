"""Convert the best training checkpoint into one verified fp32 `model.safetensors`, exactly once.

Runs after the training process group has exited, in one process: the ZeRO shards of every rank are
complete and nothing else writes them. The stage
- checks the shard count against the world size the checkpoint records (a missing shard is named);
- streams the consolidated fp32 master weights tensor by tensor into a temporary folder beside the output,
  with the model config and the manifest, and swaps that folder in whole (one atomic exchange), so a kill
  leaves the old folder or the new one, never new weights beside an old config;
- never writes to the checkpoint folder;
- skips the work when the manifest already records the same source layout (files, sizes, where each
  tensor's bytes lie) and the bytes those ranges hold now give the very output the folder holds (read and
  hashed, not written): the parts of a shard that never reach the model (Adam's moments) are never read;
- holds a file lock beside the output folder, so a second run started at the same time waits, then skips;
- verifies the result: the file's keys, shapes and dtypes load with `strict=True` into the model built
  from `model_config.json`, and every weight is finite; the output's sha256 is taken from the bytes as
  they are written.

Tensors are located in the shards without loading them (see `tasks.convert.zero_layout`) and copied through
one small buffer, so memory stays flat whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from pydantic import BaseModel

from fusion_model.layout import (
    CONVERSION_MANIFEST,
    DEEPSPEED_PREFIX,
    MODEL_CONFIG,
    TRAIN_SUMMARY,
    WEIGHTS,
)
from tasks._io.files import fsync_dir, read_json, write_json
from tasks._io.folders import recover_dir, swap_dir, temp_dir_beside
from tasks._io.git import code_version
from tasks._io.hashing import sha256_file
from tasks.convert.safetensors_writer import output_sha256, write_safetensors
from tasks.convert.verify import ModelBuilder, build_meta, verify_strict
from tasks.convert.zero_layout import SourcePlan, TensorPlan, plan_source
from tasks.errors import StageError
from tasks.params import ConvertParams

LOCK_FILE = ".convert.lock"


class ConvertSummary(BaseModel):
    converted: bool
    message: str
    model_file: Path
    manifest: Path
    source: Path
    kind: str
    zero_stage: int | None
    world_size: int
    tensors: int
    parameters: int
    bytes: int
    sha256: str
    seconds: float


def _default_builder(config: dict[str, Any]) -> torch.nn.Module:
    from fusion_model.predict import build_model

    return build_model(config)


def rename_for_model(plans: tuple[TensorPlan, ...], model_prefix: str, source: Path) -> list[TensorPlan]:
    """Strip DeepSpeed's and the LightningModule's prefixes so keys equal the model's own state_dict."""
    renamed, outside = [], []
    for plan in plans:
        name = plan.name.removeprefix(DEEPSPEED_PREFIX)
        if not name.startswith(model_prefix):
            outside.append(plan.name)
            continue
        renamed.append(replace(plan, name=name.removeprefix(model_prefix)))
    if outside:
        raise StageError(
            f"{source}: {len(outside)} tensor(s) are not under the model attribute `{model_prefix}`: "
            f"{', '.join(outside[:5])}{' ...' if len(outside) > 5 else ''}. Keep every weight inside the "
            "model the LightningModule holds, or set `convert.model_prefix` to that attribute plus '.'."
        )
    return renamed


def _identity(p: ConvertParams, files: tuple[Path, ...], plans: list[TensorPlan], config_path: Path) -> dict[str, Any]:
    """What the output is made of, short of its bytes: the source files and sizes, where each output tensor's
    bytes lie in them (its layout), the model config and the prefix stripped."""
    root = p.checkpoint_dir
    layout = [[t.name, list(t.shape), str(t.dtype), [[x.file.relative_to(root).as_posix(), x.offset, x.numel,
                                                      str(x.dtype)] for x in t.pieces]] for t in plans]
    return {"files": [{"path": f.relative_to(root).as_posix(), "bytes": f.stat().st_size} for f in files],
            "layout_sha256": hashlib.sha256(json.dumps(layout, separators=(",", ":")).encode()).hexdigest(),
            "model_config_sha256": sha256_file(config_path), "model_prefix": p.model_prefix}


def _up_to_date(out_dir: Path, identity: dict[str, Any], would_write: Callable[[], str]) -> dict[str, Any] | None:
    """The existing manifest, when it records this source layout, the output in the folder is the one it
    records, and `would_write()` (the sha256 this source gives now) is that output's."""
    manifest_path, model_file = out_dir / CONVERSION_MANIFEST, out_dir / WEIGHTS
    if not (manifest_path.is_file() and model_file.is_file() and (out_dir / MODEL_CONFIG).is_file()):
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return None  # an unreadable manifest: convert again and rewrite it
    if manifest.get("identity") != identity:
        return None
    recorded = manifest.get("output", {}).get("sha256")
    if sha256_file(out_dir / MODEL_CONFIG) != identity["model_config_sha256"] or sha256_file(model_file) != recorded:
        return None
    return manifest if would_write() == recorded else None


def convert(
    p: ConvertParams,
    build_model: ModelBuilder | None = None,
    on_tensor: Callable[[int, TensorPlan], None] | None = None,
) -> ConvertSummary:
    """Convert `p.checkpoint_dir/p.checkpoint_name` into `p.out_dir` (see the module docstring).

    `build_model(config)` makes the model whose `state_dict()` the output must match; the default is
    `fusion_model.predict.build_model`. `on_tensor(i, plan)` runs after each tensor is written.
    """
    started = time.perf_counter()
    checkpoint = p.checkpoint_dir / p.checkpoint_name
    config_path, summary_path = p.checkpoint_dir / MODEL_CONFIG, p.checkpoint_dir / TRAIN_SUMMARY
    fix = "The train stage writes it beside the checkpoint: run training first (or re-run it to rewrite the file)."
    config = read_json(config_path, fix)
    train_summary = read_json(summary_path, fix)
    if not checkpoint.exists():
        raise StageError(
            f"{checkpoint}: no such checkpoint (a file for ddp/ddp_spawn, a folder for DeepSpeed). Run the "
            "train stage first, or set `convert.checkpoint_dir` to the folder holding it."
        )
    p.out_dir.parent.mkdir(parents=True, exist_ok=True)
    # beside the output folder, not in it: the folder is a versioned output and holds only the model
    lock_path = p.out_dir.parent / f".{p.out_dir.name}{LOCK_FILE}"
    try:
        with FileLock(str(lock_path), timeout=p.lock_timeout_s):
            return _convert_locked(p, checkpoint, config, config_path, train_summary, build_model or _default_builder,
                                   on_tensor, started)
    except Timeout:
        raise StageError(
            f"{lock_path}: another conversion has held this lock for over {p.lock_timeout_s:.0f} s. Wait for it "
            "to finish or raise `convert.lock_timeout_s`; delete the lock file only if no conversion runs."
        ) from None


def _convert_locked(
    p: ConvertParams,
    checkpoint: Path,
    config: dict[str, Any],
    config_path: Path,
    train_summary: dict[str, Any],
    build_model: ModelBuilder,
    on_tensor: Callable[[int, TensorPlan], None] | None,
    started: float,
) -> ConvertSummary:
    out_dir = p.out_dir
    recover_dir(out_dir)  # leftovers of a killed conversion (a half-written folder beside this one)
    source = plan_source(checkpoint)  # checks the shard set before anything is read or written
    model_file, manifest_path = out_dir / WEIGHTS, out_dir / CONVERSION_MANIFEST
    plans = rename_for_model(source.tensors, p.model_prefix, checkpoint)
    # the checkpoint's name, not its path: the same weights give the same bytes in any clone
    metadata = {"format": "pt", "source": p.checkpoint_name}
    source_identity = _identity(p, source.files, plans, config_path)
    # Only the bytes the output is made of decide whether there is anything to do (Adam's moments, most of a
    # ZeRO shard, never reach the model file): read them without writing when the layout is the recorded one
    existing = _up_to_date(out_dir, source_identity, lambda: output_sha256(plans, metadata))
    if existing is not None:
        return _summary(False, f"up to date: {manifest_path} already records this source layout and the output "
                        "its bytes give; nothing converted", p, source, existing["output"], started)
    staged = temp_dir_beside(out_dir)
    try:
        # the model the file must load into is built (its libraries imported) while the bytes stream: the
        # writer waits on reads, writes and hashing, which release the interpreter
        with ThreadPoolExecutor(max_workers=1) as pool:
            model = pool.submit(build_meta, config, build_model, config_path)
            written = write_safetensors(staged / WEIGHTS, plans, metadata, on_tensor)
            if written.non_finite:
                raise StageError(
                    f"{checkpoint}: {len(written.non_finite)} tensor(s) hold NaN or inf "
                    f"({', '.join(written.non_finite[:5])}): training diverged. Lower the learning rate or use "
                    "fp32/bf16 precision and re-run training; nothing was written."
                )
            verification = verify_strict(staged / WEIGHTS, model.result(), config_path)
        shutil.copyfile(config_path, staged / MODEL_CONFIG)
        output = {
            "file": WEIGHTS,
            "sha256": written.sha256,
            "bytes": written.file_bytes,
            "data_bytes": written.data_bytes,
            "tensors": len(plans),
            "parameters": verification["parameters"],
            "dtype": "float32",
            # what evaluate and promote check before they trust the folder: these two files belong together
            "model_config_sha256": source_identity["model_config_sha256"],
        }
        manifest = {
            "created_at": datetime.now(UTC).isoformat(),
            "code_version": code_version(),
            "identity": source_identity,
            "source": {
                "checkpoint": str(checkpoint),
                "kind": source.kind,
                "tag": source.tag,
                "zero_stage": source.zero_stage,
                "world_size": source.world_size,
                "train_summary": {k: v for k, v in train_summary.items() if k != "history"},
            },
            "output": output,
            "verification": {**verification, "all_finite": True},
            "seconds": round(time.perf_counter() - started, 3),
        }
        write_json(staged / CONVERSION_MANIFEST, manifest)
        # the three files replace the folder together: new weights never meet an old config
        with open(staged / MODEL_CONFIG, "rb") as copied:  # the weights and the manifest are fsynced already
            os.fsync(copied.fileno())
        fsync_dir(staged)
        swap_dir(staged, out_dir, flushed=True)  # three files of our own: no machine-wide sync
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    kind = f"ZeRO stage {source.zero_stage}, {source.world_size} ranks" if source.zero_stage else source.kind
    return _summary(True, f"converted {checkpoint} ({kind}) into {model_file}", p, source, output, started)


def _summary(converted: bool, message: str, p: ConvertParams, source: SourcePlan, output: dict[str, Any],
             started: float) -> ConvertSummary:
    return ConvertSummary(
        converted=converted, message=message, model_file=p.out_dir / WEIGHTS,
        manifest=p.out_dir / CONVERSION_MANIFEST, source=source.checkpoint, kind=source.kind,
        zero_stage=source.zero_stage, world_size=source.world_size, tensors=output["tensors"],
        parameters=output["parameters"], bytes=output["bytes"], sha256=output["sha256"],
        seconds=round(time.perf_counter() - started, 3),
    )

