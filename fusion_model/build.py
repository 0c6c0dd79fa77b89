"""The model one configuration makes of one table: the preprocessor fitted on its training rows, the training
module of a model shaped by it (the linear member fitted first), and model_config.json, which rebuilds it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from fusion_model.config import TrainConfig
from fusion_model.data import ValidatedData
from fusion_model.dataset import row_images
from fusion_model.files import write_json
from fusion_model.layout import MODEL_CONFIG
from fusion_model.legacy import CURRENT_FORMAT
from fusion_model.module import FusionModule, balanced_class_weight, metric_name
from fusion_model.preprocess import Preprocessor
from fusion_model.text_encoder import read_tokenizer, text_model_entry
from fusion_model.wide_fit import fit_linear_member, refit_linear_member

FORMAT_VERSION = CURRENT_FORMAT  # the format this version writes (fusion_model/legacy.py reads the older ones)


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
        "text_chars": cfg.text_chars,
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
        "linear_member": cfg.linear_member,
        "linear_multinomial": cfg.linear_multinomial,
        "linear_only_codes": len(pre.frequency_codes) + pre.pair_columns if cfg.linear_member else 0,
        "deep_only_numbers": pre.target_inputs if cfg.linear_member else 0,  # (codes' target encodings)
        "text_model": text_model_entry(cfg.text_model, cfg.text_pooling, cfg.text_lora)
        if cfg.text_model and "text" in modalities else None,
        "text_weights": str(cfg.text_model) if cfg.text_model else None,  # read at training only, as pretrained
        "freeze": list(cfg.freeze),
    }


def build_module(cfg: TrainConfig, data: ValidatedData, modalities: list[str] | None = None,
                 schedule_epochs: int | None = None, linear_start: tuple[Preprocessor, Any] | None = None
                 ) -> tuple[Preprocessor, dict[str, Any], FusionModule]:
    """The preprocessor fitted on `data.train` (on every rank: deterministic, so all ranks agree without
    a broadcast) and the training module of a model shaped by it (its linear member fitted, started from
    `linear_start`: the selection's fit and preprocessor)."""
    schema, problem_type = data.schema, data.problem_type
    train_labels = data.labels(data.train)
    pre = Preprocessor.fit(data.train, schema, text_buckets=cfg.text_buckets, image_size=cfg.image_size,
                           image_index=cfg.image_index, text_ngrams=cfg.text_ngrams, text_min_df=cfg.text_min_df,
                           text_max_features=cfg.text_max_features, numeric_bins=cfg.numeric_bins,
                           numeric_codes_max=cfg.numeric_codes_max, bin_min_rows=cfg.bin_min_rows,
                           frequency_codes=cfg.frequency_codes, text_chars=cfg.text_chars,
                           frequency_targets=cfg.frequency_targets, n_classes=len(data.classes),
                           frequency_crosses=cfg.frequency_crosses,
                           text_tokenizer=read_tokenizer(cfg.text_model) if cfg.text_model else None,
                           text_max_tokens=cfg.text_max_tokens, labels=train_labels if cfg.fusion == "tabm" else None,
                           ordered_labels=problem_type in ("ordinal", "regression"),
                           id_as_number=cfg.id_as_number, codes_as_numbers=cfg.codes_as_numbers,
                           pair_bins=cfg.pair_bins and cfg.linear_member,
                           numeric_output="values" if cfg.fusion == "tabm" else "encodings")
    if modalities is None:
        modalities = used_modalities(cfg, data.train, schema.modalities, schema.columns.image)
        if not modalities:
            raise ValueError(f"train.modalities {cfg.modalities} and the dataset's inputs {schema.modalities} have "
                             "nothing in common; list at least one modality the table feeds")
        if set(modalities) != set(cfg.modalities) and int(os.environ.get("RANK", "0")) == 0:
            print(f"[train] the model uses {modalities} (the table feeds {schema.modalities}; photos in training "
                  "rows decide the image)", flush=True)
    num_classes = len(data.classes) if problem_type != "regression" else 1
    kwargs = model_kwargs(cfg, pre, num_classes, modalities, problem_type, schema.label.transform)
    class_weight = (balanced_class_weight(train_labels, num_classes)
                    if cfg.class_weight == "balanced" and problem_type != "regression" else None)
    module = FusionModule(kwargs, lr=cfg.lr, weight_decay=cfg.weight_decay, class_weight=class_weight,
                          fit_decision=cfg.fit_decision, text_l2=[m.text_l2 for m in cfg.members],
                          category_l2=[m.category_l2 for m in cfg.members], train_rows=len(data.train),
                          schedule_epochs=schedule_epochs)
    if "text" in modalities:  # the fitted text tables, in the model's buffers (so in every checkpoint)
        module.model.text.load_tables(**pre.text_tables)
    if problem_type == "regression":  # the target's scale, in buffers: predictions come out in the label's unit
        target = np.log1p(np.clip(train_labels, 0, None)) if schema.label.transform == "log1p" else train_labels
        module.model.target_mean.fill_(float(np.mean(target)))
        module.model.target_std.fill_(float(np.std(target)) or 1.0)
    if module.model.linear is not None:
        module.linear_report, module.linear_glm = fit_linear_member(module.model, pre, data, train_labels, cfg, linear_start)
        if cfg.refit == "linear" and linear_start is None:
            refit_linear_member(module, pre, data, cfg)
    return pre, kwargs, module


def write_model_config(out_dir: Path, kwargs: dict[str, Any], pre: Preprocessor, data: ValidatedData) -> None:
    write_json(out_dir / MODEL_CONFIG, {
        "format_version": FORMAT_VERSION,
        "model": kwargs,
        "preprocess": pre.to_dict(),
        "label": data.label,
        "problem_type": data.problem_type,
        "classes": data.classes,
        "metric": metric_name(data.problem_type),
        "dataset": data.schema.model_dump(mode="json"),  # the columns a prediction request carries
    })
