"""Models of an older model_config.json format, read by this version: a champion promoted months ago must
still load, predict and be compared, whatever changed since.

Format 1 (before dataset schemas): the PetFinder columns written into the code, `label_kind` binary (two
logits) or multiclass (five logits, argmax), two count features named `rescuer_listings` and
`breed1_frequency`, integer code vocabularies. Format 2 says all of that through the dataset schema.
Format 3 adds the TabM fusion and members (fusion_model/model.py); a format-2 model is its one-member case.
"""

from __future__ import annotations

import copy
from typing import Any

from fusion_model.presets import petfinder as pf

CURRENT_FORMAT = 3
_V1_COUNTS = {"rescuer_listings": pf.RESCUER_ID, "breed1_frequency": pf.BREED1}


def upgrade_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` as the current format reads it (a copy; the current format is returned as is). A format-1
    model gets the PetFinder preset's schema and `missing_buffers`: buffers its weights file lacks, with
    the values that reproduce its old predictions."""
    version = config.get("format_version", 1)
    if version == CURRENT_FORMAT:
        return config
    if version == 2:  # one MLP and one member: the model's defaults; only the members' mix is new
        return {**copy.deepcopy(config), "format_version": CURRENT_FORMAT, "upgraded_from": 2,
                "missing_buffers": {"member_weights": [1.0]}}
    if version != 1:
        raise ValueError(f"model_config.json format_version {version!r} is newer than this version reads "
                         f"({CURRENT_FORMAT}); update the project, or retrain the model")
    from fusion_model.dataset import resolve_schema

    old = copy.deepcopy(config)
    kind = old.get("label_kind", "binary")
    problem_type = "binary" if kind == "binary" else "multiclass"
    model = dict(old["model"], problem_type=problem_type, target_transform="none")
    pre = dict(old["preprocess"])
    numeric = list(pre.pop("numeric_columns"))
    counts = {"rescuer_listings": pre.pop("rescuer_counts", {}), "breed1_frequency": pre.pop("breed1_counts", {})}
    frequency = [_V1_COUNTS[c] for c in numeric if c in _V1_COUNTS]
    pre.update(
        numeric_columns=[c if c not in _V1_COUNTS else _V1_COUNTS[c] + " frequency" for c in numeric],
        numeric_log=[True] * len(numeric),  # format 1 took log1p of every numeric input
        frequency_columns=frequency,
        frequency_counts={_V1_COUNTS[name]: table for name, table in counts.items() if _V1_COUNTS[name] in frequency},
        vocabularies={c: [str(v) for v in values] for c, values in pre["vocabularies"].items()},
        image_columns=[pf.IMAGES],
    )
    schema = resolve_schema({"preset": "petfinder", "label": {"problem_type": problem_type}})
    upgraded = {
        **{k: v for k, v in old.items() if k != "label_kind"},
        "format_version": CURRENT_FORMAT, "upgraded_from": 1, "model": model, "preprocess": pre,
        "problem_type": problem_type, "dataset": schema.model_dump(mode="json"),
        "missing_buffers": {"member_weights": [1.0]},
    }
    if problem_type == "multiclass":  # the argmax of format 1: no class bias
        upgraded["missing_buffers"]["decision_bias"] = [0.0] * len(old["classes"])
    return upgraded
