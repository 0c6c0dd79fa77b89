"""Plan a consolidated fp32 state dict from a training checkpoint without loading its tensors.

Every shard is opened with ``torch.load(map_location="meta", weights_only=True)``: the pickled structure
is read, tensors come back as shape-only meta tensors, and torch records where each storage's bytes start
in the file (``_checkpoint_offset``). From the ZeRO layout (flat fp32 partitions per rank) each output
tensor becomes a list of byte ranges in the shard files, so the writer can stream them one at a time and
memory stays flat whatever the model size. The layout rules are DeepSpeed's own (`zero_to_fp32.py`):

- stage 1/2: per parameter group, the ranks' partitions concatenated form one flat vector; parameters
  follow each other in it, each followed by its alignment padding;
- stage 3: every parameter is split into `ceil(numel / world_size)` elements per rank, at the same offset
  in every rank's flat vector; the last rank's piece is padded.

Buffers come from rank 0's model states (floating buffers cast to fp32, as DeepSpeed does); frozen
parameters from the model states' fragments; tied parameters repeat their source's bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fusion_model import safe_load
from tasks.errors import StageError

_OPTIM_RE = re.compile(r"^(?P<prefix>(?:bf16_|fp16_)?)zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^zero_pp_rank_(?P<rank>\d+)_mp_rank_(?P<mp>\d+)_model_states\.pt$")


@dataclass(frozen=True)
class Piece:
    """`numel` elements of `dtype` at byte `offset` of `file`."""

    file: Path
    offset: int
    numel: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class TensorPlan:
    """One output tensor: its name, shape and output dtype, and where its bytes are, in order."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    is_parameter: bool

    @property
    def nbytes(self) -> int:
        """Bytes of the output tensor (its pieces may hold another dtype, cast on writing)."""
        return math.prod(self.shape) * _itemsize(self.dtype)


@dataclass(frozen=True)
class SourcePlan:
    checkpoint: Path
    kind: str  # "deepspeed_zero" | "lightning"
    tag: str | None
    zero_stage: int | None
    world_size: int
    files: tuple[Path, ...]  # every file read, to hash and to leave untouched
    tensors: tuple[TensorPlan, ...]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def load_meta(path: Path) -> Any:
    """`fusion_model.safe_load.load_meta`, its refusal as a StageError."""
    try:
        return safe_load.load_meta(path)
    except safe_load.UnsafeCheckpoint as e:
        raise StageError(str(e)) from None


def piece_of(tensor: torch.Tensor, file: Path, what: str) -> Piece:
    """Where a meta tensor loaded by `load_meta` keeps its bytes."""
    storage = tensor.untyped_storage()
    offset = getattr(storage, "_checkpoint_offset", None)
    if offset is None:
        raise StageError(f"{file}: {what} has no recorded file offset; the file was not written by torch.save.")
    if not tensor.is_contiguous():
        raise StageError(
            f"{file}: {what} is stored non-contiguously (strides {tuple(tensor.stride())}); save the state "
            "dict of contiguous tensors (`.contiguous()`) and convert again."
        )
    return Piece(file, offset + tensor.storage_offset() * tensor.element_size(), tensor.numel(), tensor.dtype)


def take(parts: list[Piece], start: int, numel: int) -> list[Piece]:
    """Elements [start, start + numel) of the virtual concatenation of `parts` (one dtype), as pieces."""
    out: list[Piece] = []
    pos = 0
    for part in parts:
        lo, hi = max(start, pos), min(start + numel, pos + part.numel)
        if lo < hi:
            item = _itemsize(part.dtype)
            out.append(Piece(part.file, part.offset + (lo - pos) * item, hi - lo, part.dtype))
        pos += part.numel
    if sum(p.numel for p in out) != numel:
        raise StageError(
            f"{parts[0].file.parent if parts else '?'}: the flat fp32 partitions hold fewer elements than the "
            f"parameter shapes need (wanted [{start}, {start + numel}) of {pos}); the shards do not belong "
            "to one checkpoint. Re-run training."
        )
    return out


def output_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every floating tensor (the master weights' precision); integer buffers keep their type."""
    return torch.float32 if dtype.is_floating_point else dtype


# ---------------------------------------------------------------- DeepSpeed ZeRO folders


def read_tag(folder: Path) -> str:
    latest = folder / "latest"
    if not latest.is_file():
        raise StageError(
            f"{latest}: missing; a DeepSpeed checkpoint folder names its tag in `latest`. The checkpoint was "
            "not completely saved: re-run training."
        )
    tag = latest.read_text().strip()
    if not tag or not (folder / tag).is_dir():
        raise StageError(f"{latest}: names tag {tag!r} but {folder / tag} is not a folder; re-run training.")
    return tag


def _rank_files(tag_dir: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for path in sorted(tag_dir.iterdir()):
        m = pattern.match(path.name)
        if not m:
            continue
        if int(m["mp"]) != 0:
            raise StageError(
                f"{path}: model-parallel rank {m['mp']}; only data-parallel ZeRO checkpoints (mp_rank_00) "
                "can be converted."
            )
        found[int(m["rank"])] = path
    return found


def _check_ranks(tag_dir: Path, found: dict[int, Path], world_size: int, example: str, what: str) -> None:
    missing = [r for r in range(world_size) if r not in found]
    if missing:
        names = ", ".join(str(tag_dir / example.format(rank=r)) for r in missing)
        raise StageError(
            f"{tag_dir}: the checkpoint records a world size of {world_size} but {len(missing)} {what} "
            f"file(s) are missing: {names}. A rank did not finish saving; re-run training (or restore the "
            "missing file) and convert again."
        )
    extra = sorted(r for r in found if r >= world_size)
    if extra:
        raise StageError(
            f"{tag_dir}: {what} files for ranks {extra} exceed the recorded world size {world_size} "
            f"({', '.join(found[r].name for r in extra)}): files from another run are mixed in. Remove them "
            "or re-run training into an empty folder."
        )


def plan_zero(folder: Path) -> SourcePlan:
    tag = read_tag(folder)
    tag_dir = folder / tag
    stage3_models = _rank_files(tag_dir, _MODEL_RE)
    model0 = tag_dir / "mp_rank_00_model_states.pt"
    if not model0.is_file():
        model0 = stage3_models.get(0, tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if not model0.is_file():
        raise StageError(
            f"{tag_dir}: no model states file (mp_rank_00_model_states.pt for ZeRO 1/2, "
            "zero_pp_rank_0_mp_rank_00_model_states.pt for ZeRO 3); re-run training."
        )
    states0 = load_meta(model0)
    for key in ("param_shapes", "buffer_names", "module", "dp_world_size"):
        if key not in states0:
            raise StageError(f"{model0}: no `{key}` entry; it is not a DeepSpeed model states file.")
    world_size = int(states0["dp_world_size"])

    optim = _rank_files(tag_dir, _OPTIM_RE)
    prefixes = {_OPTIM_RE.match(p.name)["prefix"] for p in optim.values()}  # type: ignore[index]
    prefix = prefixes.pop() if len(prefixes) == 1 else ""
    _check_ranks(tag_dir, optim, world_size, prefix + "zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", "optimizer")
    optim_states = [load_meta(optim[r])["optimizer_state_dict"] for r in range(world_size)]
    zero_stage = int(optim_states[0]["zero_stage"])
    counts = optim_states[0]["partition_count"]
    recorded = max(counts) if isinstance(counts, list) else int(counts)
    if recorded != world_size:
        raise StageError(
            f"{optim[0]}: partitioned over {recorded} ranks but {model0.name} records world size {world_size}; "
            "the files come from different runs. Re-run training into an empty folder."
        )

    files = [model0, *(optim[r] for r in range(world_size))]
    model_states = [states0]
    if zero_stage == 3:
        _check_ranks(tag_dir, stage3_models, world_size, "zero_pp_rank_{rank}_mp_rank_00_model_states.pt", "model states")
        for r in range(1, world_size):
            model_states.append(load_meta(stage3_models[r]))
            files.append(stage3_models[r])
        model_files = [stage3_models[r] for r in range(world_size)]
    else:
        model_files = [model0]

    tensors = _buffers(states0, model0)
    tensors += _frozen(model_states, model_files, world_size, zero_stage)
    if zero_stage <= 2:
        tensors += _zero2_params(states0, optim_states, [optim[r] for r in range(world_size)])
    elif zero_stage == 3:
        tensors += _zero3_params(states0, optim_states, [optim[r] for r in range(world_size)])
    else:
        raise StageError(f"{optim[0]}: unknown ZeRO stage {zero_stage}; only stages 1, 2 and 3 are supported.")
    tensors += _shared(states0, tensors)
    return SourcePlan(folder, "deepspeed_zero", tag, zero_stage, world_size, tuple(files), tuple(tensors))


def _buffers(states0: dict[str, Any], file: Path) -> list[TensorPlan]:
    module = states0["module"]
    out = []
    for name in states0["buffer_names"]:
        if name not in module:
            continue  # non-persistent buffers are listed but not saved, as DeepSpeed's converter skips them
        t = module[name]
        out.append(TensorPlan(name, tuple(t.shape), output_dtype(t.dtype), (piece_of(t, file, name),), False))
    return out


def _frozen(model_states: list[dict[str, Any]], files: list[Path], world_size: int, stage: int) -> list[TensorPlan]:
    shapes = model_states[0].get("frozen_param_shapes") or {}
    out = []
    for name, shape in shapes.items():
        numel = math.prod(shape)
        if stage <= 2:
            frag = model_states[0]["frozen_param_fragments"][name]
            pieces = [piece_of(frag, files[0], name)]
        else:
            parts = [piece_of(s["frozen_param_fragments"][name], f, name) for s, f in zip(model_states, files, strict=True)]
            pieces = take(parts, 0, numel)
        out.append(TensorPlan(name, tuple(shape), output_dtype(pieces[0].dtype), tuple(pieces), True))
    return out


def _zero2_params(states0: dict[str, Any], optim_states: list[dict[str, Any]], files: list[Path]) -> list[TensorPlan]:
    groups_per_rank = [o["single_partition_of_fp32_groups"] for o in optim_states]
    paddings = optim_states[0].get("param_alignment_paddings")
    world_size = len(files)
    out = []
    for g, shapes in enumerate(states0["param_shapes"]):
        flat = [piece_of(groups[g], f, f"fp32 partition of group {g}") for groups, f in zip(groups_per_rank, files, strict=True)]
        avail = sum(p.numel for p in flat)
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            out.append(TensorPlan(name, tuple(shape), torch.float32, tuple(take(flat, offset, numel)), True))
            offset += numel + (paddings[g][i] if paddings is not None else 0)
        # DeepSpeed pads each group to a multiple of 2 * world_size: compare the padded totals, as it does.
        align = 2 * world_size
        if align * math.ceil(offset / align) != align * math.ceil(avail / align):
            raise StageError(
                f"{files[0]}: group {g} holds {avail} fp32 elements but its parameter shapes use {offset}; "
                "the model states and optimizer shards do not match. Re-run training into an empty folder."
            )
    return out


def _zero3_params(states0: dict[str, Any], optim_states: list[dict[str, Any]], files: list[Path]) -> list[TensorPlan]:
    world_size = len(files)
    per_rank = [
        [piece_of(t, f, f"fp32 flat group {j}") for j, t in enumerate(o["fp32_flat_groups"])]
        for o, f in zip(optim_states, files, strict=True)
    ]
    shapes = {k: v for group in states0["param_shapes"] for k, v in group.items()}
    out = []
    offset = 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        part = math.ceil(numel / world_size)
        pieces: list[Piece] = []
        for r in range(world_size):
            n = min(part, numel - r * part)
            if n > 0:
                pieces += take(per_rank[r], offset, n)
        out.append(TensorPlan(name, tuple(shape), torch.float32, tuple(pieces), True))
        offset += part
    avail = sum(p.numel for p in per_rank[0])
    if offset != avail:
        raise StageError(
            f"{files[0]}: rank 0 holds {avail} fp32 elements but the parameter shapes use {offset}; the model "
            "states and optimizer shards do not match. Re-run training into an empty folder."
        )
    return out


def _shared(states0: dict[str, Any], tensors: list[TensorPlan]) -> list[TensorPlan]:
    by_name = {t.name: t for t in tensors}
    out = []
    for alias, source in (states0.get("shared_params") or {}).items():
        if source in by_name and alias not in by_name:
            src = by_name[source]
            out.append(TensorPlan(alias, src.shape, src.dtype, src.pieces, src.is_parameter))
    return out


# ---------------------------------------------------------------- plain Lightning checkpoint files


def plan_lightning(path: Path) -> SourcePlan:
    ckpt = load_meta(path)
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None
    if not isinstance(state, dict):
        raise StageError(f"{path}: no `state_dict` entry; it is not a Lightning checkpoint. Re-run training.")
    tensors = []
    for name, t in state.items():
        if not isinstance(t, torch.Tensor):
            continue
        tensors.append(TensorPlan(name, tuple(t.shape), output_dtype(t.dtype), (piece_of(t, path, name),), True))
    return SourcePlan(path, "lightning", None, None, 1, (path,), tuple(tensors))


def plan_source(checkpoint: Path) -> SourcePlan:
    if checkpoint.is_dir():
        return plan_zero(checkpoint)
    if checkpoint.is_file():
        return plan_lightning(checkpoint)
    raise StageError(
        f"{checkpoint}: no such checkpoint (file for ddp/ddp_spawn, folder for DeepSpeed). Run the train stage "
        "first, or point `convert.checkpoint_dir` at the folder holding it."
    )
