"""Convert the best training checkpoint into one verified fp32 `model.safetensors`, exactly once.

Runs after the training process group has exited, in one process: the ZeRO shards of every rank are
complete and nothing else writes them. The stage
- checks the shard count against the world size the checkpoint records (a missing shard is named);
- streams the consolidated fp32 master weights tensor by tensor into a temporary file beside the output,
  fsyncs it and `os.replace`s it, so a kill leaves either the old file or the new one;
- never writes to the checkpoint folder;
- skips the work when the manifest already records the same source files (by sha256) and the output still
  matches its recorded hash;
- holds a file lock in the output folder, so a second run started at the same time waits, then skips;
- verifies the result: the file's keys, shapes and dtypes load with `strict=True` into the model built
  from `model_config.json`, and every weight is finite; the output's sha256 is taken from the bytes as
  they are written.

Tensors are located in the shards without loading them (see `tasks.zero_checkpoint`) and copied through
one small buffer, so memory stays flat whatever the model size.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock, Timeout
from pydantic import BaseModel

from tasks.errors import StageError
from tasks.params import ConvertParams
from tasks.safetensors_stream import write_safetensors
from tasks.zero_checkpoint import SourcePlan, TensorPlan, plan_source

MODEL_FILE = "model.safetensors"
CONFIG_FILE = "model_config.json"
SUMMARY_FILE = "train_summary.json"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = ".convert.lock"
# DeepSpeed's engine wraps Lightning's module wrapper, whose attribute `_forward_module` is the
# LightningModule (fusion_model.module.DEEPSPEED_PREFIX).
DEEPSPEED_PREFIX = "_forward_module."
ModelBuilder = Callable[[dict[str, Any]], torch.nn.Module]


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


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def code_version() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if rev.returncode == 0 and rev.stdout.strip():
            return "git:" + rev.stdout.strip()
    except (FileNotFoundError, subprocess.TimeoutExpired):
        pass  # not a git checkout (installed package): the package version below
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "petfinder-retrain==" + version("petfinder-retrain")
    except PackageNotFoundError:
        return "unknown"


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=2, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _copy_atomic(src: Path, dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp")
    shutil.copyfile(src, tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, dest)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise StageError(f"{path}: missing; the train stage writes {what} beside the checkpoint. Run training first.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StageError(f"{path}: not valid JSON ({e}); re-run training to rewrite it.") from None
    if not isinstance(data, dict):
        raise StageError(f"{path}: expected a JSON object, found {type(data).__name__}; re-run training.")
    return data


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


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Skip weight initialisation while building on the meta device: there is no data to fill, and random
    fills on meta tensors go through Python decompositions that import torch._dynamo (seconds)."""

    _RANDOM_FILLS = frozenset({"normal_", "uniform_", "erfinv_", "exponential_", "log_normal_", "cauchy_",
                               "geometric_", "bernoulli_", "random_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        target = args[0] if args else kwargs.get("tensor")
        skip = getattr(func, "__module__", None) == "torch.nn.init" or getattr(func, "__name__", "") in self._RANDOM_FILLS
        if skip and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def verify_strict(model_file: Path, config: dict[str, Any], build_model: ModelBuilder, config_path: Path) -> dict[str, Any]:
    """Load the written file's keys, shapes and dtypes into the model with strict=True, without its data.

    The model is built on the meta device and the file's header becomes meta tensors, so this costs no
    memory; a missing, unexpected or mis-shaped key raises with the key's name.
    """
    from safetensors import safe_open

    with torch.device("meta"), _SkipInit():
        try:
            model = build_model(config)
        except Exception as e:
            raise StageError(f"{config_path}: the model cannot be built from this config ({e}); re-run training.") from None
    expected = model.state_dict()
    tensors = {}
    with safe_open(str(model_file), framework="pt") as f:
        for key in f.keys():
            sl = f.get_slice(key)
            dtype = getattr(torch, {"F32": "float32", "I64": "int64", "BF16": "bfloat16", "F16": "float16",
                                    "I32": "int32", "U8": "uint8", "BOOL": "bool", "F64": "float64",
                                    "I8": "int8", "I16": "int16"}[sl.get_dtype()])
            tensors[key] = torch.empty(sl.get_shape(), dtype=dtype, device="meta")
    wrong_dtype = [
        f"{k} ({tensors[k].dtype}, model {v.dtype})"
        for k, v in expected.items()
        if k in tensors and tensors[k].dtype != (torch.float32 if v.dtype.is_floating_point else v.dtype)
    ]
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as e:
        raise StageError(
            f"{model_file}: does not load into {type(model).__name__} with strict=True: {e}. The checkpoint "
            f"and {config_path} describe different models; re-run training so both come from one run."
        ) from None
    if wrong_dtype:
        raise StageError(f"{model_file}: unexpected dtypes {', '.join(wrong_dtype[:5])}; expected fp32 weights.")
    return {
        "strict_load": True,
        "model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "parameters": sum(p.numel() for p in model.parameters()),
        "keys": len(tensors),
    }


def _up_to_date(out_dir: Path, identity: dict[str, Any]) -> dict[str, Any] | None:
    """The existing manifest, when it records this very source and the output still matches it."""
    manifest_path, model_file = out_dir / MANIFEST_FILE, out_dir / MODEL_FILE
    if not (manifest_path.is_file() and model_file.is_file() and (out_dir / CONFIG_FILE).is_file()):
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except json.JSONDecodeError:
        return None  # an unreadable manifest: convert again and rewrite it
    if manifest.get("identity") != identity:
        return None
    if sha256_file(model_file) != manifest.get("output", {}).get("sha256"):
        return None
    if sha256_file(out_dir / CONFIG_FILE) != identity["model_config_sha256"]:
        return None
    return manifest


def _same_sizes(manifest_path: Path, files: tuple[Path, ...], root: Path) -> bool:
    """Whether the manifest records exactly these files with these sizes (a cheap hint, not a proof)."""
    try:
        recorded = json.loads(manifest_path.read_text())["identity"]["files"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError):
        return False
    current = [(str(f.relative_to(root)), f.stat().st_size) for f in files]
    return [(r.get("path"), r.get("bytes")) for r in recorded] == current


def _remove_stale_temps(out_dir: Path) -> list[str]:
    """Temporary files of runs that were killed; safe to delete while we hold the lock."""
    stale = [*out_dir.glob(f".{MODEL_FILE}.*.tmp"), *out_dir.glob(f".{MANIFEST_FILE}.*.tmp"),
             *out_dir.glob(f".{CONFIG_FILE}.*.tmp")]
    for path in stale:
        path.unlink(missing_ok=True)
    return [p.name for p in stale]


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
    config_path, summary_path = p.checkpoint_dir / CONFIG_FILE, p.checkpoint_dir / SUMMARY_FILE
    config = _read_json(config_path, "the model config")
    train_summary = _read_json(summary_path, "the training summary")
    if not checkpoint.exists():
        raise StageError(
            f"{checkpoint}: no such checkpoint (a file for ddp/ddp_spawn, a folder for DeepSpeed). Run the "
            "train stage first, or set `convert.checkpoint_dir` to the folder holding it."
        )
    p.out_dir.mkdir(parents=True, exist_ok=True)
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
    _remove_stale_temps(out_dir)
    source = plan_source(checkpoint)  # checks the shard set before anything is hashed or written
    hashed = [*source.files, config_path]
    model_file, manifest_path = out_dir / MODEL_FILE, out_dir / MANIFEST_FILE
    # Hashing the shards costs about as much as converting them: hash in background threads while the
    # output is written, unless the manifest already names files of these sizes (then the hashes decide
    # first whether there is anything to do).
    with ThreadPoolExecutor(max_workers=max(1, min(len(hashed), os.cpu_count() or 1))) as pool:
        pending = [pool.submit(sha256_file, f) for f in hashed]

        def identity() -> dict[str, Any]:
            hashes = [f.result() for f in pending]
            files = [{"path": str(f.relative_to(p.checkpoint_dir)), "bytes": f.stat().st_size, "sha256": h}
                     for f, h in zip(source.files, hashes, strict=False)]
            return {"files": files, "model_config_sha256": hashes[-1], "model_prefix": p.model_prefix}

        if _same_sizes(manifest_path, source.files, p.checkpoint_dir):
            existing = _up_to_date(out_dir, identity())
            if existing is not None:
                return _summary(False, f"up to date: {manifest_path} already records these {len(source.files)} "
                                "source files with the same sha256; nothing converted", p, source,
                                existing["output"], started)

        plans = rename_for_model(source.tensors, p.model_prefix, checkpoint)
        metadata = {"format": "pt", "source": str(checkpoint.resolve())}
        tmp = out_dir / f".{MODEL_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
        try:
            written = write_safetensors(tmp, plans, metadata, on_tensor)
            if written.non_finite:
                raise StageError(
                    f"{checkpoint}: {len(written.non_finite)} tensor(s) hold NaN or inf "
                    f"({', '.join(written.non_finite[:5])}): training diverged. Lower the learning rate or use "
                    "fp32/bf16 precision and re-run training; nothing was written."
                )
            verification = verify_strict(tmp, config, build_model, config_path)
            source_identity = identity()
            os.replace(tmp, model_file)
        finally:
            tmp.unlink(missing_ok=True)
    _fsync_dir(out_dir)
    _copy_atomic(config_path, out_dir / CONFIG_FILE)
    output = {
        "file": MODEL_FILE,
        "sha256": written.sha256,
        "bytes": written.file_bytes,
        "data_bytes": written.data_bytes,
        "tensors": len(plans),
        "parameters": verification["parameters"],
        "dtype": "float32",
    }
    manifest = {
        "created_at": datetime.now(UTC).isoformat(),
        "code_version": code_version(),
        "identity": source_identity,
        "source": {
            "checkpoint": str(checkpoint.resolve()),
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
    _write_json_atomic(manifest_path, manifest)
    _fsync_dir(out_dir)
    kind = f"ZeRO stage {source.zero_stage}, {source.world_size} ranks" if source.zero_stage else source.kind
    return _summary(True, f"converted {checkpoint} ({kind}) into {model_file}", p, source, output, started)


def _summary(converted: bool, message: str, p: ConvertParams, source: SourcePlan, output: dict[str, Any],
             started: float) -> ConvertSummary:
    return ConvertSummary(
        converted=converted, message=message, model_file=p.out_dir / MODEL_FILE,
        manifest=p.out_dir / MANIFEST_FILE, source=source.checkpoint, kind=source.kind,
        zero_stage=source.zero_stage, world_size=source.world_size, tensors=output["tensors"],
        parameters=output["parameters"], bytes=output["bytes"], sha256=output["sha256"],
        seconds=round(time.perf_counter() - started, 3),
    )

