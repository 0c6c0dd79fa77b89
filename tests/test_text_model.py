"""train.text_model: a Hugging Face text transformer from a local folder, strict loading, tokenization kept
with the model, and full fine-tuning, LoRA adapters and freezing trained on 2 ranks, converted and predicted.

The transformer is a tiny BERT built offline (tests/tiny_text_model.py); nothing is downloaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from fusion_model.config import TrainConfig
from fusion_model.text_encoder import TextEncoder, TextModelError, read_config, read_tokenizer
from tests.tiny_text_model import make_text_model

TEXTS = [f"{'friendly playful' if i % 2 else 'shy quiet'} pet number {i}" for i in range(40)]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_text_model(tmp_path_factory.mktemp("text") / "bert", TEXTS)


def _copy_with_weights(src: Path, dest: Path, edit) -> Path:
    shutil.copytree(src, dest)
    state = load_file(dest / "model.safetensors")
    save_file(edit(dict(state)), dest / "model.safetensors")
    return dest


def test_weights_that_do_not_fit_the_config_are_refused_naming_the_keys(text_model: Path, tmp_path: Path) -> None:
    def edit(state: dict) -> dict:
        state.pop("embeddings.LayerNorm.bias")
        state["encoder.extra.weight"] = torch.zeros(2)
        return state

    broken = _copy_with_weights(text_model, tmp_path / "broken", edit)
    with pytest.raises(TextModelError, match=r"missing keys: embeddings\.LayerNorm\.bias.*unexpected keys: "
                                             r"encoder\.extra\.weight.*save_pretrained"):
        TextEncoder(read_config(broken), weights=broken)
    # the base model's own weights load; its pooler, which the encoder never uses, is dropped
    encoder = TextEncoder(read_config(text_model), weights=text_model)
    assert encoder.backbone.pooler is None and encoder.out_dim == 32


def test_a_folder_without_config_or_tokenizer_is_refused(text_model: Path, tmp_path: Path) -> None:
    with pytest.raises(TextModelError, match=r"has no config\.json.*save_pretrained"):
        read_config(tmp_path)
    shutil.copytree(text_model, tmp_path / "no_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "no_tokenizer" / name).unlink()
    with pytest.raises(TextModelError, match=r"tokenizer.*tokenizer\.save_pretrained"):
        read_tokenizer(tmp_path / "no_tokenizer")


def test_the_tokenizer_travels_in_the_preprocessing(text_model: Path) -> None:
    from fusion_model.dataset import resolve_schema
    from fusion_model.preprocess import Preprocessor

    schema = resolve_schema({"preset": None, "label": {"column": "y"}, "columns": {"text": ["t"]}})
    train = pd.DataFrame({"t": TEXTS, "y": [i % 2 for i in range(len(TEXTS))]})
    pre = Preprocessor.fit(train, schema, text_buckets=64, image_size=32, image_index=0,
                           text_tokenizer=read_tokenizer(text_model), text_max_tokens=8)
    again = Preprocessor.from_dict(json.loads(json.dumps(pre.to_dict())))  # as model_config.json holds it
    rows = pd.DataFrame({"t": ["friendly playful pet number 3 and a much longer tail of words", "shy"]})
    ids, mask = again.tokens(rows)
    assert ids.shape == mask.shape == (2, 8)  # cut and padded to text_max_tokens
    assert mask[0].tolist() == [1] * 8 and mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]  # [CLS] shy [SEP]
    assert ids[1, 3:].tolist() == [pre.text_pad_id] * 5
    assert pre.tokens(rows)[0].equal(ids)


def test_text_options_without_a_text_model_or_in_conflict_are_refused(text_model: Path) -> None:
    with pytest.raises(ValidationError, match=r"train\.text_lora needs a text transformer.*text_model"):
        TrainConfig(text_lora={"r": 4})
    with pytest.raises(ValidationError, match=r"train\.freeze: \[text\] needs a text transformer"):
        TrainConfig(freeze=["text"])
    with pytest.raises(ValidationError, match=r"text_lora already freezes.*remove text from train\.freeze"):
        TrainConfig(text_model=text_model, text_lora={"r": 4}, freeze=["text"])
    with pytest.raises(ValidationError, match=r"randomly initialised image backbone.*train\.pretrained"):
        TrainConfig(freeze=["image"])


# name: train keys over the tiny run. Each trains 2 ranks, converts, and predicts from the converted folder with
# the text model's folder gone; then the converted transformer weights are compared with the folder's.
# Every strategy in bf16-mixed (the fusion MLP's dtype casts under each), converted to fp32.
RUNS = {
    "zero2-bf16-finetune": {"strategy": "deepspeed", "zero_stage": 2, "precision": "bf16-mixed"},
    "zero3-bf16-lora": {"strategy": "deepspeed", "zero_stage": 3, "precision": "bf16-mixed",
                        "text_lora": {"r": 4, "lora_alpha": 8}},
    "ddp_spawn-bf16-frozen": {"strategy": "ddp_spawn", "precision": "bf16-mixed", "freeze": ["text"]},
}


@pytest.fixture(scope="module")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.validated_tables import make_validated

    return make_validated(tmp_path_factory.mktemp("text_data") / "data", n_train=32, n_val=16, n_test=16)


@pytest.mark.slow
@pytest.mark.parametrize("run", list(RUNS))
def test_text_transformer_trains_converts_and_predicts_from_the_converted_folder(
        text_data: Path, text_model: Path, tmp_path: Path, run: str) -> None:
    from fusion_model.predict import Predictor
    from tasks.convert import convert
    from tasks.params import ConvertParams
    from tasks.train import train

    folder = shutil.copytree(text_model, tmp_path / "bert")
    original = {k: v for k, v in load_file(folder / "model.safetensors").items() if not k.startswith("pooler.")}
    ckpt, model_dir = tmp_path / "ckpt", tmp_path / "model"
    summary = train(TrainConfig.model_validate({
        "data_dir": text_data, "out_dir": ckpt, "live_dir": tmp_path / "training", "image_model": "test_resnet",
        "image_size": 32, "text_buckets": 1024, "cat_dim": 4, "adapter_dim": 8, "hidden_sizes": [16],
        "batch_size": 8, "max_epochs": 1, "max_steps": 2, "refit": False, "devices": 2, "accelerator": "cpu",
        "text_model": str(folder), "text_max_tokens": 16, **RUNS[run]}))
    assert summary.steps == 2 and summary.world_size == 2
    config = json.loads((ckpt / "model_config.json").read_text())
    assert config["model"]["text_model"]["config"]["hidden_size"] == 32
    assert config["preprocess"]["text_max_tokens"] == 16 and config["preprocess"]["text_tokenizer"]

    convert(ConvertParams(checkpoint_dir=ckpt, out_dir=model_dir))
    shutil.rmtree(folder)  # prediction needs the converted folder alone
    predictor = Predictor.load(model_dir)
    test = pd.read_parquet(text_data / "test.parquet")
    meta = json.loads((text_data / "meta.json").read_text())
    proba = predictor.predict_proba(test, (text_data / meta["dataset_root"]).resolve())
    assert proba.shape == (len(test), 2) and np.isfinite(proba).all()

    weights = load_file(model_dir / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point())
    prefix = "text_encoder.backbone." + ("base_model.model." if "text_lora" in RUNS[run] else "")
    backbone = {k[len(prefix):].replace(".base_layer", ""): v for k, v in weights.items()
                if k.startswith(prefix) and ".lora_" not in k}
    assert set(backbone) == set(original)
    # DeepSpeed in bf16 keeps a frozen weight as the module holds it, in bf16 (so does its own converter);
    # Lightning's bf16-mixed under ddp keeps fp32 weights and autocasts
    rounded = RUNS[run]["strategy"] == "deepspeed" and RUNS[run].get("precision") == "bf16-mixed"
    loaded = {k: v.bfloat16().float() if rounded else v for k, v in original.items()}
    unchanged = sorted(k for k in original if torch.equal(backbone[k], loaded[k]))
    lora = {k: v for k, v in weights.items() if ".lora_" in k}
    if run == "zero2-bf16-finetune":
        assert len(unchanged) < len(original) and not lora  # every rank fine-tuned the transformer
    else:  # frozen, or under its adapters: the loaded weights, and (LoRA) adapters that trained
        assert unchanged == sorted(original)
        assert bool(lora) == ("text_lora" in RUNS[run])
        assert all(v.abs().sum() > 0 for k, v in lora.items() if ".lora_B." in k)
