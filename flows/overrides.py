"""Typed flow parameters that override params.yaml, key by key.

`ParamOverrides` mirrors `tasks.params.Params` with every field optional: Prefect validates a run's
`overrides` against it (the UI shows the schema; a typo or a wrong type fails before any work starts),
and only the keys given replace params.yaml's values; nested sections (download.synthetic) merge too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, create_model

from tasks.params import Params, ParamsError, load_params

_STRICT = ConfigDict(extra="forbid", populate_by_name=True)


def partial_model(model: type[BaseModel], name: str) -> type[BaseModel]:
    """`model` with every field optional and defaulting to None (sub-models made partial too)."""
    fields: dict[str, Any] = {}
    for field_name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            annotation = partial_model(annotation, f"{annotation.__name__}Overrides")
        fields[field_name] = (annotation | None, Field(None, alias=field.alias, description=field.description))
    return create_model(name, __config__=_STRICT, **fields)


ParamOverrides: type[BaseModel] = partial_model(Params, "ParamOverrides")
ParamOverrides.__doc__ = "params.yaml keys to replace for one run, e.g. {'train': {'max_epochs': 1}}."


def overrides_dict(overrides: BaseModel | None) -> dict[str, Any]:
    """Only the keys a caller set (an explicit null included), by params.yaml name."""
    if overrides is None:
        return {}
    return overrides.model_dump(mode="json", by_alias=True, exclude_unset=True)


def deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def resolve_params(params_path: Path, overrides: dict[str, Any]) -> Params:
    """params.yaml with `overrides` ({section: {key: value}}) merged in, validated as a whole."""
    load_params(params_path)  # a missing or broken file fails here with its own message
    raw = yaml.safe_load(Path(params_path).read_text()) or {}
    unknown = sorted(set(overrides) - {f.alias or n for n, f in Params.model_fields.items()})
    if unknown:
        raise ParamsError(f"overrides: no params.yaml section named {', '.join(unknown)}")
    merged = {section: deep_merge(raw.get(section) or {}, values) for section, values in overrides.items()}
    try:
        return load_params(params_path, merged)
    except ParamsError as e:
        if not overrides:
            raise
        raise ParamsError(f"{e} This run overrode {', '.join(_dotted(overrides))}: the bad value may be there.") from None


def _dotted(tree: dict[str, Any], prefix: str = "") -> list[str]:
    keys: list[str] = []
    for key, value in tree.items():
        keys += _dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


def parse_set(assignments: list[str]) -> dict[str, Any]:
    """`["train.max_epochs=1", "download.synthetic.n_train=120"]` -> nested dict; values parsed as YAML."""
    result: dict[str, Any] = {}
    for item in assignments:
        key, sep, value = item.partition("=")
        if not sep or not key or "." not in key:
            raise ParamsError(f"--set {item!r}: expected SECTION.KEY=VALUE, e.g. --set train.max_epochs=1")
        *parents, leaf = key.split(".")
        node = result
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return result
