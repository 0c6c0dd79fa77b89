"""The fusion model: deep encoders -> adapters to a common width -> concat -> MLP -> head, plus wide logits.

A plain composition (as AutoGluon's ``fusion_mlp``), widened: the image and tabular encoders go through
per-modality adapters, the concatenation and an MLP to the head; the text, whose signal on real rows is
lexical, and the categorical codes also add linear logits straight to the head (fusion_model/wide.py).
The head's meaning follows the problem type (fusion_model/heads.py): class logits, an ordinal score
through a cumulative link, or a standardised regression value.
A Hugging Face text transformer (fusion_model/text_encoder.py), when configured, is one more deep encoder
with its adapter, beside the n-gram logit.
``forward`` takes a dict of tensors (``image``, ``image_mask``, ``categorical``, ``numeric``,
``text_ids``, ``text_counts``; ``text_tokens``, ``text_attention`` with a transformer) and an optional set of modalities to mask: everything a masked modality
contributes is zeroed, which evaluation uses for its ablation. Every input is cast to the dtype of the
weights that consume it, so fp16/bf16 weights accept fp32 batches.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from fusion_model import heads
from fusion_model.dataset import MODALITIES
from fusion_model.image_encoder import ImageEncoder, dtype_of
from fusion_model.tabular import TabularEncoder
from fusion_model.wide import CategoryLogit, LinearMember, TextLogit

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU, "gelu": nn.GELU, "leaky_relu": nn.LeakyReLU, "tanh": nn.Tanh,
}


class FusionModel(nn.Module):
    """See the module docstring. `fusion`: "tabm" fuses with a TabM ensemble (`tabm`: `ensemble_size`
    MLPs sharing one body, each with its own scaling and head, trained as independent heads), "mlp" with
    one MLP (format 2). Heads are split among `len(member_text_scale)` members: each member adds its own
    wide text and code logits (a learning-rate multiplier each, `member_*_scale`, and an L2 penalty set by
    the training module), so one network holds several regularisations of its linear part; `member_weights`
    (fitted on validation) mix the members' probabilities into the prediction."""

    def __init__(
        self,
        *,
        image_model: str,
        cat_cardinalities: Sequence[int],
        n_numeric: int,
        num_classes: int,
        problem_type: str = "binary",
        target_transform: str = "none",
        pretrained: bool | str = False,
        image_size: int = 64,
        text_buckets: int = 262144,
        text_vocab_size: int = 1,
        text_ngrams: int = 3,
        text_chars: int = 0,
        cat_dim: int = 4,
        adapter_dim: int = 64,
        hidden_sizes: Sequence[int] = (128,),
        activation: str = "gelu",
        dropout: float = 0.3,
        layer_norm: bool = True,
        category_logits: bool = True,
        aux_loss_weight: float = 0.0,
        modalities: Sequence[str] = MODALITIES,
        fusion: str = "mlp",
        ensemble_size: int = 1,
        numeric_bins: Sequence[Sequence[float]] | None = None,
        numeric_embedding_dim: int = 16,
        member_text_scale: Sequence[float] = (1.0,),
        member_category_scale: Sequence[float] = (1.0,),
        linear_member: bool = False,
        linear_multinomial: bool = False,
        linear_only_codes: int = 0,
        deep_only_numbers: int = 0,
        text_model: dict[str, Any] | None = None,
        text_weights: str | None = None,
        freeze: Sequence[str] = (),
    ) -> None:
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation {activation!r} is not one of {sorted(_ACTIVATIONS)}")
        unknown = set(modalities) - set(MODALITIES)
        if unknown or not modalities:
            raise ValueError(f"modalities {list(modalities)} must be a non-empty subset of {list(MODALITIES)}")
        if fusion not in ("mlp", "tabm"):
            raise ValueError(f"fusion {fusion!r} is not 'mlp' or 'tabm'")
        members = len(member_text_scale)
        if members != len(member_category_scale) or members < 1:
            raise ValueError("member_text_scale and member_category_scale need one entry per member")
        k = ensemble_size if fusion == "tabm" else 1
        if k < members:
            raise ValueError(f"ensemble_size {ensemble_size} is smaller than the {members} members; every member "
                             "needs at least one head (fusion: tabm)")
        # Only the modalities the model uses get an encoder: a dataset without photos trains on tabular +
        # text without running a backbone on blank images, and a single-modality baseline is that
        # modality's part alone.
        self.modalities = tuple(m for m in MODALITIES if m in modalities)
        self.problem_type, self.target_transform = problem_type, target_transform
        self.fusion, self.k, self.members = fusion, k, members
        width = heads.output_width(problem_type, num_classes)
        self.width = width
        self.ordinal = heads.OrdinalLink(num_classes) if problem_type == "ordinal" else None
        if problem_type == "multiclass":  # added to the log probabilities before the argmax (fusion_model/decision.py)
            self.register_buffer("decision_bias", torch.zeros(num_classes))
        if problem_type == "regression":  # the training labels' scale (after the transform)
            self.register_buffer("target_mean", torch.zeros(()))
            self.register_buffer("target_std", torch.ones(()))
        # the linear member (fusion_model/wide.py), where the model has text or code logits: one more head and
        # one more member of the mix, after the deep members
        tabular = "tabular" in self.modalities
        self.linear: LinearMember | None = None
        # an ordinal label's second linear member: the same inputs as a multinomial GLM (a logit per class),
        # its softmax read as cumulative logits; it holds where the proportional odds of one score do not
        self.linear_classes: LinearMember | None = None
        if linear_member and ("text" in self.modalities or tabular):
            inputs = (text_vocab_size if "text" in self.modalities else 0, list(cat_cardinalities) if tabular else [],
                      # the last `deep_only_numbers` numbers (codes' target encodings) are the deep half's alone:
                      # the linear member reads those codes one-hot, the GLM's own shrunk effect per value
                      list(numeric_bins or [])[: len(numeric_bins or []) - deep_only_numbers]
                      if tabular and fusion == "tabm" else [])
            self.linear = LinearMember(*inputs, width, num_classes if problem_type == "ordinal" else 0)
            if linear_multinomial and problem_type == "ordinal" and num_classes > 2:  # two: the same logistic model
                self.linear_classes = LinearMember(*inputs, num_classes)
        self.linear_heads = (self.linear is not None) + (self.linear_classes is not None)
        self.mixed = members + self.linear_heads  # members the validation mix weighs
        # the members' mix, fitted on validation (uniform until then); head h belongs to member h % members,
        # the linear members' heads (last) to the last members
        self.register_buffer("member_weights", torch.full((self.mixed,), 1.0 / self.mixed))
        head_member = torch.tensor([h % members for h in range(k)])  # (arange % on meta costs a dynamo import)
        if self.linear is not None:
            head_member = torch.cat([head_member, members + torch.arange(self.linear_heads)])
        self.register_buffer("head_member", head_member, persistent=False)
        # a member's learning-rate multiplier as a constant scale of its wide logits: under Adam a weight
        # moves ~lr per step whatever its gradient's size, so the scaled logit moves `scale` times as fast
        self.register_buffer("text_scale", torch.tensor(list(member_text_scale), dtype=torch.float32),
                             persistent=False)
        self.register_buffer("category_scale", torch.tensor(list(member_category_scale), dtype=torch.float32),
                             persistent=False)
        encoders: dict[str, nn.Module] = {}
        # the last `linear_only_codes` codes (keys of thousands of values: a rescuer) reach the linear member
        # alone, whose penalised one-hot shrinks each value's effect; an embedding per value overfits them
        deep_codes = list(cat_cardinalities)[: len(cat_cardinalities) - linear_only_codes]
        if "image" in self.modalities:
            encoders["image"] = self.image = ImageEncoder(image_model, pretrained, image_size,
                                                          frozen="image" in freeze)
        self.category_logit: CategoryLogit | None = None
        if "tabular" in self.modalities:
            encoders["tabular"] = self.tabular = TabularEncoder(
                deep_codes, n_numeric, cat_dim, numeric_bins if fusion == "tabm" else None,
                numeric_embedding_dim)
            self.category_logit = CategoryLogit(deep_codes, width * members) if category_logits else None
        if "text" in self.modalities:
            # word grams weigh as one block per length, character grams as one more
            self.text = TextLogit(text_buckets, text_vocab_size, width * members,
                                  max_order=text_ngrams + (1 if text_chars else 0), chars=bool(text_chars))
            if text_model is not None:  # a transformer beside the n-gram logit, fused as the image is
                from fusion_model.text_encoder import TextEncoder

                encoders["text"] = self.text_encoder = TextEncoder(
                    text_model["config"], text_model.get("pooling", "cls"), text_weights, text_model.get("lora"),
                    frozen="text" in freeze)
        # the image goes through an adapter to a common width; under tabm the tabular features enter the
        # ensemble as they are (its first layer is their adapter)
        self.adapters = nn.ModuleDict({
            name: nn.Identity() if fusion == "tabm" and name == "tabular" else nn.Linear(enc.out_dim, adapter_dim)
            for name, enc in encoders.items()})
        adapted = {name: enc.out_dim if isinstance(self.adapters[name], nn.Identity) else adapter_dim
                   for name, enc in encoders.items()}
        self.mlp: nn.Module | None = None
        self.head: nn.Module | None = None
        self.view: nn.Module | None = None
        if self.adapters and fusion == "mlp":
            layers: list[nn.Module] = []
            fused = sum(adapted.values())
            for hidden in hidden_sizes:
                layers.append(nn.Linear(fused, hidden))
                if layer_norm:
                    layers.append(nn.LayerNorm(hidden))
                layers += [_ACTIVATIONS[activation](), nn.Dropout(dropout)]
                fused = hidden
            self.mlp = nn.Sequential(*layers)
            self.head = nn.Linear(fused, width)
        elif self.adapters:
            import tabm

            if len(set(hidden_sizes)) != 1:
                raise ValueError(f"fusion tabm needs blocks of one width; hidden_sizes {list(hidden_sizes)} differ")
            d_in = sum(adapted.values())
            self.view = tabm.EnsembleView(k=k)
            self.mlp = tabm.make_tabm_backbone(
                d_in=d_in, n_blocks=len(hidden_sizes), d_block=hidden_sizes[0], dropout=dropout, k=k,
                arch_type="tabm", start_scaling_init="normal", start_scaling_init_chunks=[d_in])
            self.head = tabm.LinearEnsemble(hidden_sizes[0], width, k=k)
        # one auxiliary head per deep modality, on its adapter's output, trained beside the fused head so
        # each encoder learns features of its own (a slow learner such as an image encoder from scratch is
        # otherwise left behind by the modalities that fit fast); unused when predicting
        self.aux_loss_weight = aux_loss_weight
        self.aux_heads = nn.ModuleDict(
            {name: nn.Linear(adapted[name], width) for name in self.adapters}
        ) if aux_loss_weight > 0 and len(self.adapters) + len(self.modalities) > 2 else None
        self._aux: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def encode(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The deep modalities' features (the encoders' outputs, before the adapters)."""
        inputs = {"image": lambda: self.image(batch["image"]),
                  "tabular": lambda: self.tabular(batch["categorical"], batch["numeric"]),
                  "text": lambda: self.text_encoder(batch["text_tokens"], batch["text_attention"])}
        return {name: inputs[name]() for name in self.adapters}

    def head_outputs(self, batch: dict[str, torch.Tensor], mask: Iterable[str] = (), linear: bool = True
                     ) -> torch.Tensor:
        """Every head's raw output [batch, heads, width] (fusion_model/heads.py: class logits, ordinal
        cumulative logits, or the standardised regression value); modalities named in ``mask`` contribute
        zeros, and so does the image of a row whose ``image_mask`` is 0 (a row without photos). Without
        ``linear`` the linear members' heads (the last `linear_heads`) are zeros: a training step's loss leaves
        them out (they are fitted before training), so computing them there is wasted."""
        mask = set(mask)
        unknown = mask - set(MODALITIES)
        if unknown:
            raise ValueError(f"cannot mask {sorted(unknown)}: modalities are {list(MODALITIES)}")
        # times zero rather than zeros_like: a masked branch stays in the graph with zero gradients, so
        # ddp/ZeRO never meet a parameter without a gradient
        wide: list[torch.Tensor] = []
        if "text" in self.modalities:
            text = self.member_view(self.text(batch["text_ids"], batch["text_counts"]), self.text_scale)
            wide.append(text * 0 if "text" in mask else text)
        if "tabular" in self.modalities and self.category_logit is not None:
            codes = self.member_view(self.category_logit(batch["categorical"]), self.category_scale)
            wide.append(codes * 0 if "tabular" in mask else codes)
        keep_image = batch.get("image_mask")  # 0 for a row without a photo
        logits = None
        if self.head is not None:
            features = self.encode(batch)
            fused = []
            self._aux = []
            for name, adapter in self.adapters.items():
                # the seed's fix: an encoder may return fp32 while the adapter holds fp16/bf16 weights
                dtype = adapter.weight.dtype if isinstance(adapter, nn.Linear) else dtype_of(self.head)
                out = adapter(features[name].to(dtype))
                if self.training and self.aux_heads is not None:
                    keep = keep_image.bool() if name == "image" and keep_image is not None else None
                    aux = self.aux_heads[name](out)
                    self._aux.append((self.ordinal(aux) if self.ordinal is not None else aux, keep))
                if name == "image" and keep_image is not None:
                    out = out * keep_image.to(out.dtype).unsqueeze(1)
                fused.append(out * 0 if name in mask else out)
            x = torch.cat(fused, dim=1)
            if self.view is None:
                logits = self.head(self.mlp(x)).unsqueeze(1)
            else:
                logits = self.head(self.mlp(self.view(x)))
        for part in wide:  # [batch, members, width] -> each head gets its member's
            part = part[:, self.head_member[: self.k]]
            logits = part if logits is None else logits + part.to(logits.dtype)
        assert logits is not None  # modalities is non-empty
        logits = self.ordinal(logits) if self.ordinal is not None else logits
        if self.linear is None:
            return logits
        if not linear:
            return torch.cat([logits, logits.new_zeros(logits.shape[0], self.linear_heads, logits.shape[2])], dim=1)
        outs = [self.linear(getattr(self, "text", None), batch, mask).to(logits.dtype).expand(logits.shape[0], -1)]
        if self.linear_classes is not None:
            outs.append(heads.cumulative_logits(self.linear_classes(getattr(self, "text", None), batch, mask))
                        .to(logits.dtype))
        return torch.cat([logits, torch.stack(outs, dim=1)], dim=1)

    def linear_members(self) -> dict[str, LinearMember]:
        """The linear members by attribute name: fitted before training, never by an optimizer step."""
        return {n: m for n in ("linear", "linear_classes") if (m := getattr(self, n)) is not None}

    def linear_fit_state(self) -> dict[str, torch.Tensor]:
        """A copy of every linear member's fitted buffers, by name in this model."""
        return {f"{n}.{k}": v for n, m in self.linear_members().items() for k, v in m.fit_state().items()}

    def load_linear_fit_state(self, state: dict[str, torch.Tensor]) -> None:
        """Put back buffers as `linear_fit_state` names them (any subset)."""
        with torch.no_grad():
            for name, value in state.items():
                self.get_buffer(name).copy_(value)

    def member_view(self, wide: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """A wide logit [batch, members * width] as [batch, members, width], times each member's scale."""
        return wide.view(wide.shape[0], self.members, self.width) * scale.to(wide.dtype).view(1, -1, 1)

    def combine(self, raw: torch.Tensor, head_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Heads' raw outputs [batch, heads, width] -> one raw output [batch, width] in the same space: the
        weighted mean of the heads' probabilities as logits (ordinal: of each P(y > k)), or of the values
        (regression). Default weights: each member's `member_weights`, shared by its heads."""
        if raw.shape[1] == 1:
            return raw[:, 0]
        if head_weights is None:
            head_weights = self.head_weights()
        w = head_weights.to(torch.float32).view(1, -1, 1)
        raw = raw.float()
        if self.problem_type == "regression":
            return (raw * w).sum(1)
        if self.problem_type == "ordinal":
            p = (torch.sigmoid(raw) * w).sum(1).clamp(1e-7, 1 - 1e-7)
            return torch.log(p) - torch.log1p(-p)
        return torch.log((raw.softmax(-1) * w).sum(1).clamp_min(1e-12))

    # what validation fits into the buffers: the members' mix and the decision rule
    DECISION_BUFFERS = ("member_weights", "decision_bias", "ordinal.cutpoints")

    def decision_state(self) -> dict[str, list[float]]:
        """The validation-fitted buffers as plain lists (a refit on every labelled row carries them over)."""
        names = [n for n, _ in self.named_buffers()]
        return {n: self.get_buffer(n).detach().float().cpu().flatten().tolist()
                for n in self.DECISION_BUFFERS if n in names}

    def load_decision_state(self, state: dict[str, list[float]]) -> None:
        for name, values in state.items():
            buffer = self.get_buffer(name)
            buffer.copy_(torch.tensor(values, dtype=buffer.dtype).reshape(buffer.shape))

    def head_weights(self, member_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Per head: its member's weight shared equally by the member's heads."""
        mw = self.member_weights if member_weights is None else member_weights
        per_member = torch.bincount(self.head_member, minlength=self.mixed).to(mw.dtype)
        return mw[self.head_member] / per_member[self.head_member]

    def member_outputs(self, raw: torch.Tensor) -> torch.Tensor:
        """Heads' raw outputs [batch, heads, width] -> each member's [batch, members, width] (its heads mixed)."""
        alone = torch.eye(self.mixed, device=self.member_weights.device)  # member m's weights: all on m
        return torch.stack([self.combine(raw, self.head_weights(alone[m])) for m in range(self.mixed)], dim=1)

    def forward(self, batch: dict[str, torch.Tensor], mask: Iterable[str] = ()) -> torch.Tensor:
        """The raw output [batch, width] (the heads combined): see ``head_outputs`` and ``combine``."""
        return self.combine(self.head_outputs(batch, mask))

    def wide_penalty(self, text_l2: Sequence[float], category_l2: Sequence[float]) -> torch.Tensor | None:
        """sum over members of l2 * |scaled weights|^2 of its wide logits (the caller divides by the rows):
        logistic regression's penalty on each member's own tables (None when all are 0)."""
        terms = []
        for module, scale, l2 in ((getattr(self, "text", None), self.text_scale, text_l2),
                                  (self.category_logit, self.category_scale, category_l2)):
            if module is None or not any(l2):
                continue
            weights = [module.bag.weight] if isinstance(module, TextLogit) else [t.weight for t in module.tables]
            coef = (torch.tensor(list(l2), dtype=torch.float32, device=scale.device) * scale.float() ** 2)
            coef = coef.repeat_interleave(self.width)  # per output column (member-major)
            terms += [(w.float().pow(2).sum(0) * coef.to(w.device)).sum() for w in weights]
        return torch.stack(terms).sum() if terms else None

    def interpret(self, raw: torch.Tensor) -> heads.Outputs:
        """Predictions from this model's raw output (its fitted cut points, biases and target scale)."""
        kwargs: dict = {}
        if self.problem_type == "multiclass":
            kwargs["decision_bias"] = self.decision_bias
        elif self.problem_type == "ordinal":
            assert self.ordinal is not None
            kwargs["cutpoints"] = self.ordinal.cutpoints
        elif self.problem_type == "regression":
            kwargs.update(target_mean=float(self.target_mean), target_std=float(self.target_std),
                          target_transform=self.target_transform)
        return heads.interpret(raw, self.problem_type, **kwargs)

    def loss(self, raw: torch.Tensor, labels: torch.Tensor, class_weight: torch.Tensor | None = None) -> torch.Tensor:
        """The mean loss of every head ([batch, heads, width], as TabM trains its heads independently), or
        of one raw output [batch, width]; plus the auxiliary heads' of the same forward pass."""
        scale: dict = {}
        if self.problem_type == "regression":
            scale = {"target_mean": float(self.target_mean), "target_std": float(self.target_std),
                     "target_transform": self.target_transform}
        aux_labels = labels  # the auxiliary heads see each row once
        if raw.dim() == 3 and self.linear is not None:
            raw = raw[:, :-self.linear_heads]  # the linear members are fitted before training (fusion_model/wide_fit.py)
        if raw.dim() == 3:
            raw, labels = raw.reshape(-1, raw.shape[2]), labels.repeat_interleave(raw.shape[1])
        main = heads.loss(raw, labels, self.problem_type, class_weight=class_weight, **scale)
        aux, self._aux = self._aux, []  # the auxiliary heads' outputs of the forward pass that made `raw`
        parts = [heads.loss(out if rows is None else out[rows], aux_labels if rows is None else aux_labels[rows],
                            self.problem_type, class_weight=class_weight, **scale)
                 for out, rows in aux if rows is None or bool(rows.any())]
        if not parts:
            return main
        return main + self.aux_loss_weight * torch.stack(parts).mean()
