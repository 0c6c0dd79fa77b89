"""The image encoder: a timm backbone without its classifier, built offline, with local weights loaded strictly."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from fusion_model.safe_load import key_mismatch


def dtype_of(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype


class ImageEncoder(nn.Module):
    """A timm backbone without its classifier; ``out_dim`` is measured, not read from an attribute.
    `frozen`: no gradients, and eval mode throughout (its batch-norm statistics stay those it was given)."""

    def __init__(self, name: str, pretrained: bool | str | Path = False, image_size: int = 64,
                 frozen: bool = False) -> None:
        super().__init__()
        self.frozen = frozen
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
        if frozen:
            self.backbone.requires_grad_(False)
            self.backbone.eval()

    def _load_local_weights(self, path: Path) -> None:
        """Load a local weights file strictly: every key of the backbone present with its shape, none more.
        Only the model's own classifier (timm's `pretrained_cfg["classifier"]`, trained for other classes)
        is left out, since a num_classes=0 backbone has none."""
        if not path.is_file():
            raise ValueError(f"pretrained weights file {path} does not exist; pass an existing local file or false")
        try:
            if path.suffix == ".safetensors":
                from safetensors.torch import load_file

                state = load_file(str(path))
            else:
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # pickle refusals, a damaged file, another format
            raise ValueError(f"pretrained weights file {path} cannot be read as a state dict of tensors "
                             f"({type(e).__name__}: {e}); save it with torch.save(model.state_dict()) or "
                             "safetensors") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"pretrained weights file {path} is not a flat state dict of tensors (a training "
                             "checkpoint?); save model.state_dict() of the timm model")
        classifier = (getattr(self.backbone, "pretrained_cfg", None) or {}).get("classifier")
        heads_ = tuple(f"{c}." for c in ([classifier] if isinstance(classifier, str) else classifier or []))
        state = {k: v for k, v in state.items() if not k.startswith(heads_)}
        own = self.backbone.state_dict()
        missing = sorted(set(own) - set(state))
        unexpected = sorted(set(state) - set(own))
        shapes = sorted(f"{k} {tuple(state[k].shape)} (the model has {tuple(own[k].shape)})"
                        for k in set(own) & set(state) if own[k].shape != state[k].shape)
        if missing or unexpected or shapes:
            raise ValueError(f"pretrained weights file {path} does not match train.image_model "
                             f"{type(self.backbone).__name__} ({key_mismatch(missing, unexpected, shapes)}); save "
                             "the weights of the same timm model (timm.create_model(name).state_dict())")
        self.backbone.load_state_dict(state, strict=True)

    def train(self, mode: bool = True) -> ImageEncoder:
        super().train(mode)
        if self.frozen:
            self.backbone.eval()
        return self

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # channels-last input: oneDNN's convolutions, pooling and batch norm then run in NHWC, ~20 % less
        # time per training step on CPU (BENCHMARKS.md); the weights keep their layout (ZeRO flattens them)
        images = images.to(dtype_of(self.backbone))
        if images.dim() == 4:
            images = images.contiguous(memory_format=torch.channels_last)
        return self.backbone(images)
