"""The fusion model: deep encoders -> adapters to a common width -> concat -> MLP -> head, plus wide logits.

A plain composition (as AutoGluon's ``fusion_mlp``), widened: the image and tabular encoders go through
per-modality adapters, the concatenation and an MLP to the head; the text, whose signal on real rows is
lexical, and the categorical codes also add linear logits straight to the head (fusion_model/wide.py).
``forward`` takes a dict of tensors (``image``, ``image_mask``, ``categorical``, ``numeric``,
``text_ids``, ``text_counts``) and an optional set of modalities to mask: everything a masked modality
contributes is zeroed, which evaluation uses for its ablation. Every input is cast to the dtype of the
weights that consume it, so fp16/bf16 weights accept fp32 batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from torch import nn

from fusion_model.schema import MODALITIES
from fusion_model.wide import CategoryLogit, TextLogit

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "leaky_relu": nn.LeakyReLU, "tanh": nn.Tanh,
}


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


class ImageEncoder(nn.Module):
    """A timm backbone without its classifier; ``out_dim`` is measured, not read from an attribute."""

    def __init__(self, name: str, pretrained: bool | str | Path = False, image_size: int = 64) -> None:
        super().__init__()
        import timm  # imported here: timm pulls torchvision, which only the image path needs

        try:
            # Never download: a hub fetch retries ~47 s offline and then fails.
            self.backbone = timm.create_model(name, pretrained=False, num_classes=0)
        except RuntimeError as e:
            raise ValueError(
                f"image_model {name!r} is not a timm model ({e}); pick one from timm.list_models(), "
                "e.g. 'resnet18' or 'test_resnet' for a quick run"
            ) from None
        if pretrained not in (False, None, "", "false"):
            if pretrained is True:
                raise ValueError(
                    "pretrained=true would download from a hub; pass the path of a local weights file instead "
                    "(saved with torch.save(model.state_dict()) or safetensors)"
                )
            self._load_local_weights(Path(pretrained))
        # Some models' pooled width is head_hidden_size, not num_features (mobilenetv3: 1024 vs 576):
        # a dummy forward is the only reliable answer. eval(): BatchNorm cannot train on such a batch.
        was_training = self.backbone.training
        self.backbone.eval()
        with torch.no_grad():
            self.out_dim = int(self.backbone(torch.zeros(2, 3, image_size, image_size)).shape[-1])
        self.backbone.train(was_training)

    def _load_local_weights(self, path: Path) -> None:
        if not path.is_file():
            raise ValueError(f"pretrained weights file {path} does not exist; pass an existing local file or false")
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        # A classifier head trained for other classes does not belong to a num_classes=0 backbone.
        own = self.backbone.state_dict()
        state = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
        if not state:
            raise ValueError(f"{path} holds no weights matching this backbone; was it saved from the same model?")
        self.backbone.load_state_dict(state, strict=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.backbone(images.to(_dtype_of(self.backbone)))


class TabularEncoder(nn.Module):
    """One embedding per categorical column, concatenated with the standardised numeric columns."""

    def __init__(self, cardinalities: Sequence[int], n_numeric: int, cat_dim: int) -> None:
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(n, cat_dim) for n in cardinalities)
        self.out_dim = len(cardinalities) * cat_dim + n_numeric

    def forward(self, categorical: torch.Tensor, numeric: torch.Tensor) -> torch.Tensor:
        parts = [emb(categorical[:, i]) for i, emb in enumerate(self.embeddings)]
        dtype = parts[0].dtype if parts else numeric.dtype
        return torch.cat([*parts, numeric.to(dtype)], dim=1)


class FusionModel(nn.Module):
    def __init__(
        self,
        *,
        image_model: str,
        cat_cardinalities: Sequence[int],
        n_numeric: int,
        num_classes: int,
        pretrained: bool | str = False,
        image_size: int = 64,
        text_buckets: int = 262144,
        text_vocab_size: int = 1,
        text_ngrams: int = 3,
        cat_dim: int = 4,
        adapter_dim: int = 64,
        hidden_sizes: Sequence[int] = (128,),
        activation: str = "gelu",
        dropout: float = 0.3,
        layer_norm: bool = True,
        category_logits: bool = True,
        modalities: Sequence[str] = MODALITIES,
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(_ACTIVATIONS)}")
        unknown = set(modalities) - set(MODALITIES)
        if unknown or not modalities:
            raise ValueError(f"modalities {list(modalities)} must be a non-empty subset of {list(MODALITIES)}")
        # Only the modalities the model uses get an encoder: a dataset without photos trains on tabular +
        # text without running a backbone on blank images, and a single-modality baseline is that
        # modality's part alone.
        self.modalities = tuple(m for m in MODALITIES if m in modalities)
        encoders: dict[str, nn.Module] = {}
        if "image" in self.modalities:
            encoders["image"] = self.image = ImageEncoder(image_model, pretrained, image_size)
        if "tabular" in self.modalities:
            encoders["tabular"] = self.tabular = TabularEncoder(cat_cardinalities, n_numeric, cat_dim)
            self.category_logit = CategoryLogit(cat_cardinalities, num_classes) if category_logits else None
        if "text" in self.modalities:
            self.text = TextLogit(text_buckets, text_vocab_size, num_classes, max_order=text_ngrams)
        self.adapters = nn.ModuleDict({name: nn.Linear(enc.out_dim, adapter_dim) for name, enc in encoders.items()})
        self.mlp: nn.Module | None = None
        self.head: nn.Module | None = None
        if self.adapters:
            layers: list[nn.Module] = []
            width = adapter_dim * len(self.adapters)
            for hidden in hidden_sizes:
                layers.append(nn.Linear(width, hidden))
                if layer_norm:
                    layers.append(nn.LayerNorm(hidden))
                layers += [_ACTIVATIONS[activation](), nn.Dropout(dropout)]
                width = hidden
            self.mlp = nn.Sequential(*layers)
            self.head = nn.Linear(width, num_classes)

    def encode(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The deep modalities' features (the encoders' outputs, before the adapters)."""
        inputs = {"image": lambda: self.image(batch["image"]),
                  "tabular": lambda: self.tabular(batch["categorical"], batch["numeric"])}
        return {name: inputs[name]() for name in self.adapters}

    def forward(self, batch: dict[str, torch.Tensor], mask: Iterable[str] = ()) -> torch.Tensor:
        """Logits [batch, num_classes]; modalities named in ``mask`` contribute zeros, and so does the image
        of a row whose ``image_mask`` is 0 (a row without photos)."""
        mask = set(mask)
        unknown = mask - set(MODALITIES)
        if unknown:
            raise ValueError(f"cannot mask {sorted(unknown)}: modalities are {list(MODALITIES)}")
        # times zero rather than zeros_like: a masked branch stays in the graph with zero gradients, so
        # ddp/ZeRO never meet a parameter without a gradient
        wide: list[torch.Tensor] = []
        if "text" in self.modalities:
            text = self.text(batch["text_ids"], batch["text_counts"])
            wide.append(text * 0 if "text" in mask else text)
        if "tabular" in self.modalities and self.category_logit is not None:
            codes = self.category_logit(batch["categorical"])
            wide.append(codes * 0 if "tabular" in mask else codes)
        logits = None
        if self.head is not None:
            features = self.encode(batch)
            fused = []
            for name, adapter in self.adapters.items():
                # the seed's fix: an encoder may return fp32 while the adapter holds fp16/bf16 weights
                out = adapter(features[name].to(adapter.weight.dtype))
                if name == "image" and "image_mask" in batch:
                    out = out * batch["image_mask"].to(out.dtype).unsqueeze(1)
                fused.append(out * 0 if name in mask else out)
            logits = self.head(self.mlp(torch.cat(fused, dim=1)))
        for part in wide:
            logits = part if logits is None else logits + part.to(logits.dtype)
        assert logits is not None  # modalities is non-empty
        return logits
