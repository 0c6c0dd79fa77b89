"""Check a written model file against the model it must load into, without reading its data."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tasks.errors import StageError

ModelBuilder = Callable[[dict[str, Any]], torch.nn.Module]


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


def build_meta(config: dict[str, Any], build_model: ModelBuilder, config_path: Path) -> torch.nn.Module:
    """The model of `config` on the meta device: its keys, shapes and dtypes, no data, no memory. Thread-safe
    (the device and init modes are the calling thread's), so it can be built while the file is written."""
    with torch.device("meta"), _SkipInit():
        try:
            return build_model(config)
        except Exception as e:
            raise StageError(f"{config_path}: the model cannot be built from this config ({e}); re-run training.") from None


def verify_strict(model_file: Path, model: torch.nn.Module, config_path: Path) -> dict[str, Any]:
    """Load the written file's keys, shapes and dtypes into `model` (`build_meta`'s) with strict=True,
    without its data: the file's header becomes meta tensors, so this costs no memory; a missing,
    unexpected or mis-shaped key raises with the key's name.
    """
    from safetensors import safe_open

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
