"""The text encoder: a Hugging Face transformer from a local folder, its pooled output fused as a modality.

`train.text_model` names a folder in the Hugging Face layout (config.json, model.safetensors or
pytorch_model.bin, tokenizer files), read with `transformers` offline and strictly. Training builds the
encoder from that folder; a converted model rebuilds it from the config saved in model_config.json and the
trained weights, and tokenizes with the tokenizer saved in the preprocessing (so prediction never needs the
folder). LoRA adapters come from `peft`; freezing keeps a backbone's weights and normalisation statistics.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from fusion_model.safe_load import key_mismatch

POOLINGS = ("cls", "mean")
# weights a backbone file may hold that the encoder never uses: BERT's pooler (the encoder pools itself)
_UNUSED_PREFIXES = ("pooler.",)


class TextModelError(ValueError):
    """The local text model folder cannot be used; the message names the folder, the keys and the fix."""


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # its load reports and deprecation notes; refusals are raised below
    hf_logging.disable_progress_bar()


def _folder(path: str | Path) -> Path:
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise TextModelError(f"train.text_model {folder} has no config.json; point it at a local folder in the "
                             "Hugging Face layout (model.save_pretrained(DIR) and tokenizer.save_pretrained(DIR))")
    return folder


def read_tokenizer(path: str | Path) -> tuple[str, int]:
    """The folder's fast tokenizer as JSON (kept in the preprocessing) and its padding id."""
    from transformers import AutoTokenizer

    folder = _folder(path)
    _quiet_transformers()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # no tokenizer files, an unknown tokenizer class
        raise TextModelError(f"train.text_model {folder}: its tokenizer cannot be read ({type(e).__name__}: {e}); "
                             "save one there with tokenizer.save_pretrained(DIR)") from None
    # without tokenizer files transformers builds an empty tokenizer of the model type: special tokens only
    if len(tokenizer) <= len(set(tokenizer.all_special_tokens)):
        raise TextModelError(f"train.text_model {folder}: no tokenizer vocabulary there (tokenizer.json, vocab.txt, "
                             "...); save the model's tokenizer with tokenizer.save_pretrained(DIR)")
    rows = read_config(folder).get("vocab_size")
    if rows is not None and len(tokenizer) > rows:
        raise TextModelError(f"train.text_model {folder}: the tokenizer has {len(tokenizer)} tokens but the model's "
                             f"embedding only {rows} rows; save the tokenizer the model was trained with")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise TextModelError(f"train.text_model {folder}: {type(tokenizer).__name__} is not a fast tokenizer; save "
                             "a tokenizer.json (a `tokenizers` tokenizer) in the folder")
    pad = tokenizer.pad_token_id
    return backend.to_str(), int(pad if pad is not None else 0)


@lru_cache(maxsize=4)
def _tokenizer(spec: str, max_tokens: int, pad_id: int) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(spec)
    tokenizer.enable_truncation(max_length=max_tokens)
    tokenizer.enable_padding(length=max_tokens, pad_id=pad_id)
    return tokenizer


def tokenize(texts: list[str], spec: str, max_tokens: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask [rows, max_tokens] (cut at max_tokens, padded to it)."""
    encoded = _tokenizer(spec, max_tokens, pad_id).encode_batch(texts)
    ids = np.array([e.ids for e in encoded], dtype=np.int64).reshape(len(texts), max_tokens)
    mask = np.array([e.attention_mask for e in encoded], dtype=np.int64).reshape(len(texts), max_tokens)
    return torch.from_numpy(ids), torch.from_numpy(mask)


def read_config(path: str | Path) -> dict[str, Any]:
    """The folder's model config as a plain dict (saved in model_config.json to rebuild the encoder)."""
    from transformers import AutoConfig

    folder = _folder(path)
    _quiet_transformers()
    try:
        return AutoConfig.from_pretrained(str(folder), local_files_only=True).to_dict()
    except Exception as e:
        raise TextModelError(f"train.text_model {folder}/config.json cannot be read ({type(e).__name__}: {e}); "
                             "write it with config.save_pretrained(DIR)") from None


def text_model_entry(path: str | Path, pooling: str, lora: Any = None) -> dict[str, Any]:
    """The model config's `text_model` entry: what rebuilds the encoder without the folder (its config,
    the pooling, the LoRA settings: a pydantic model or a dict, or None)."""
    if lora is not None and hasattr(lora, "model_dump"):
        lora = lora.model_dump()
    return {"config": read_config(path), "pooling": pooling, "lora": lora}


class TextEncoder(nn.Module):
    """A transformer's pooled output ([CLS] or the mean over real tokens), `out_dim` = its hidden size.
    `weights`: the local folder to load trained weights from, strictly (None: initialised from `config`, as
    when a converted model is rebuilt). `lora`: peft's LoraConfig keys (r, lora_alpha, lora_dropout,
    target_modules) to train adapters on a frozen backbone. `frozen`: no gradients, eval mode throughout."""

    def __init__(self, config: dict[str, Any], pooling: str = "cls", weights: str | Path | None = None,
                 lora: dict[str, Any] | None = None, frozen: bool = False) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModel

        if pooling not in POOLINGS:
            raise TextModelError(f"text pooling {pooling!r} is not one of {list(POOLINGS)}")
        _quiet_transformers()
        self.pooling, self.frozen = pooling, frozen
        if weights:
            backbone = self._load(_folder(weights))
        else:
            kwargs = dict(config)
            model_type = kwargs.pop("model_type", None)
            if not model_type:
                raise TextModelError("the text model config has no model_type; rebuild it from the folder's "
                                     "config.json (transformers' AutoConfig.to_dict())")
            backbone = AutoModel.from_config(AutoConfig.for_model(model_type, **kwargs), dtype=torch.float32)
        if getattr(backbone, "pooler", None) is not None:
            backbone.pooler = None  # unused: a parameter without gradients would stop ddp
        self.out_dim = int(backbone.config.hidden_size)
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            backbone = get_peft_model(backbone, LoraConfig(**lora))
        self.backbone = backbone
        if frozen:
            self.backbone.requires_grad_(False)
            self.backbone.eval()

    @staticmethod
    def _load(folder: Path) -> nn.Module:
        from transformers import AutoModel

        try:
            backbone, info = AutoModel.from_pretrained(str(folder), local_files_only=True, output_loading_info=True,
                                                       dtype=torch.float32)
        except Exception as e:  # no weights file, shapes that do not fit the config
            raise TextModelError(f"train.text_model {folder}: its weights cannot be loaded ({type(e).__name__}: "
                                 f"{e}); save the model there with model.save_pretrained(DIR)") from None
        missing = sorted(k for k in info.get("missing_keys", ()) if not k.startswith(_UNUSED_PREFIXES))
        unexpected = sorted(k for k in info.get("unexpected_keys", ()) if not k.startswith(_UNUSED_PREFIXES))
        shapes = sorted(str(k) for k in info.get("mismatched_keys", ()))
        if missing or unexpected or shapes:
            raise TextModelError(f"train.text_model {folder}: the weights do not match its config.json "
                                 f"({key_mismatch(missing, unexpected, shapes)}); save the base model's own weights "
                                 "(AutoModel.from_pretrained(...).save_pretrained(DIR)) beside its config")
        return backbone

    def train(self, mode: bool = True) -> TextEncoder:
        super().train(mode)
        if self.frozen:  # dropout off, as the frozen weights were trained to be used
            self.backbone.eval()
        return self

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        if self.pooling == "cls":
            return hidden[:, 0]
        weights = mask.to(hidden.dtype).unsqueeze(-1)
        return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
