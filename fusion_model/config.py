"""Typed training configuration: the `train` section of params.yaml, field names = argument names."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# `devices: auto` without a GPU: two processes, so the default run is a real multi-process one.
CPU_PROCESSES_AUTO = 2


def processes_per_node(devices: int | str, cuda_devices: int) -> int:
    """Ranks per node: `devices` as given, or for `auto` every visible GPU, else CPU_PROCESSES_AUTO."""
    if devices != "auto":
        return int(devices)
    return cuda_devices if cuda_devices else CPU_PROCESSES_AUTO


class HostConfig(BaseModel):
    """One machine of a training run across machines (README, "Training across machines")."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    # the host's own address on the training network: torchrun's --local-addr, what its ranks listen on
    # (host 0's is the c10d rendezvous endpoint)
    address: str = Field(min_length=1)
    # the interface holding `address`: GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME of the host's ranks
    interface: str = Field(min_length=1)
    # the Prefect work queue a worker on this host polls: the host's node job is sent there
    work_queue: str = Field(min_length=1)


class LinearPenalties(BaseModel):
    """The linear member's L2 penalty per block of inputs (per training row: logistic regression's
    1 / (2 C)); null: chosen on the validation rows, the lowest validation loss of a small grid."""

    model_config = ConfigDict(extra="forbid")

    text: float | None = Field(None, gt=0)  # the word grams
    chars: float | None = Field(None, gt=0)  # the character grams (train.text_chars)
    categorical: float | None = Field(None, gt=0)
    numerical: float | None = Field(None, gt=0)
    pairs: float | None = Field(None, gt=0)  # the two-number bins (train.pair_bins)


class LoraSettings(BaseModel):
    """LoRA adapters on the text transformer (peft's LoraConfig keys); its own weights stay frozen."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(8, ge=1)
    lora_alpha: float = Field(16, gt=0)
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # the layers adapted, by name (null: peft's default for the model type, e.g. BERT's query and value)
    target_modules: list[str] | None = None


class WideMember(BaseModel):
    """One member of the network's portfolio: how its wide text and code logits learn. Every member shares
    the encoders and the TabM body; each has its own heads and wide tables, and validation mixes them."""

    model_config = ConfigDict(extra="forbid")

    # the text table's learning rate, times lr; 0: this member's heads read no text logits (the body alone)
    text_lr_multiplier: float = Field(1.5, ge=0)
    # the text table's L2 penalty as in logistic regression (1 / (2 C)): text_l2 * |w|^2 / training rows
    # added to the mean loss, so rare n-grams cannot fit the rows they occur in (0: none)
    text_l2: float = Field(0.0, ge=0)
    category_lr_multiplier: float = Field(1.0, ge=0)  # the per-code logits' learning rate, times lr; 0: none
    category_l2: float = Field(0.0, ge=0)  # the per-code logits' L2 penalty, as text_l2


# one member whose heads add loosely held word and code logits to the body's, one whose heads read the body
# alone: the linear member already is the converged logistic regression, so the second deep member's worth is
# an error of its own for the mix (BENCHMARKS.md)
DEFAULT_MEMBERS = [WideMember(),
                   WideMember(text_lr_multiplier=0, text_l2=0.0, category_lr_multiplier=0, category_l2=0.0)]

# where and how a run trains (data, distribution, run control): one value for the whole run
_SAME_FOR_EVERY_CANDIDATE = frozenset({
    "data_dir", "out_dir", "live_dir", "seed", "modalities", "refit", "candidates", "strategy", "zero_stage",
    "offload_optimizer", "offload_param", "zero_bucket_size", "precision", "accelerator", "devices", "num_nodes",
    "node_rank", "master_addr", "master_port", "hosts", "rendezvous_port", "join_timeout_s", "threads_per_rank",
    "resume", "max_steps", "num_workers", "save_gathered_weights", "batch_size", "candidate_tolerance",
})


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    data_dir: Path = Path("data/validated")
    out_dir: Path = Path("data/checkpoints")
    # the run's DVCLive log (per-step loss, per-epoch metrics, learning rate) and its curves PNG: read by
    # `dvc exp show`, `dvc metrics diff` and `dvc plots` (dvc.yaml), replaced whole when a run succeeds
    live_dir: Path = Path("reports/training")
    seed: int = 42
    # model
    image_model: str = "test_resnet"
    pretrained: bool | Path = False
    image_size: int = Field(64, ge=16)
    image_index: int = Field(0, ge=0)
    # text: word 1..text_ngrams-grams hashed into text_buckets; those in >= text_min_df training rows get a
    # row of the linear text logit (fusion_model/wide.py), weighted tf-idf
    text_buckets: int = Field(262144, ge=16)
    text_ngrams: int = Field(3, ge=1, le=5)
    text_min_df: int = Field(2, ge=1)
    text_chars: int = Field(4, ge=0, le=6)  # and character 1..text_chars-grams within each word (0: none)
    text_max_features: int = Field(2048, ge=1)  # distinct n-grams kept per row
    # a Hugging Face text transformer from a local folder (config.json, weights, tokenizer files), read
    # offline and strictly, its pooled output fused as the image's is (null: the n-gram logit alone)
    text_model: Path | None = None
    text_max_tokens: int = Field(128, ge=4)  # tokens per row (the text columns joined), cut and padded
    text_pooling: Literal["cls", "mean"] = "cls"
    text_lora: LoraSettings | None = None  # LoRA adapters trained on the frozen transformer (peft)
    freeze: list[Literal["image", "text"]] = []  # backbones kept as loaded: no gradients, eval mode
    # tabular: an embedding per code and each number's piecewise-linear embedding over bins a decision tree
    # fitted to the training labels finds (at most numeric_bins, each >= bin_min_rows rows), and a linear
    # logit per code beside the deep path
    cat_dim: int = Field(8, ge=1)
    numeric_bins: int = Field(255, ge=2)
    bin_min_rows: int = Field(2, ge=1)
    numeric_embedding_dim: int = Field(16, ge=1)
    # a numerical column with at most this many distinct training values also enters as a code (0: never)
    numeric_codes_max: int = Field(0, ge=0)
    # each `dataset.frequency` key (a rescuer, an item) also enters as a code: of the linear member alone (a
    # penalised one-hot, a shrunk effect per value), or of the deep half when there is no linear member
    frequency_codes: bool = True
    # ... and as its label mean, a number of the deep half alone (a target encoding, cross-fitted on the training
    # rows: fusion_model/target_encoding.py)
    frequency_targets: bool = True
    # ... and the key of most values crossed with each code (a rescuer's label mean among its cats), as CatBoost's
    # combinations of categorical features
    frequency_crosses: bool = True
    # the row key enters as a number too when every training value is an integer (a catalogue number)
    id_as_number: bool = True
    # so does each code whose training values are all whole numbers, of more than two (an item number)
    codes_as_numbers: bool = True
    # each pair of numbers also gets a label-fitted tree over both, its leaf a code of the linear member alone
    pair_bins: bool = True
    category_logits: bool = True
    # the linear member: a penalised linear model over the text n-grams, codes and numbers, fitted to
    # convergence before the deep half trains and weighed in the validation mix (fusion_model/wide_fit.py)
    linear_member: bool = True
    gram_ratios: bool = True  # the linear member weighs each n-gram by its naive Bayes log-count ratio (NBSVM)
    linear_l2: LinearPenalties = Field(default_factory=lambda: LinearPenalties())
    # an ordinal label's second linear member: the same inputs as a multinomial GLM, its class probabilities
    # read as the head's P(y > k); its penalties (null: the grams' chosen on validation, walked from the first
    # member's choice; the other blocks' taken as the first member chose them)
    linear_multinomial: bool = True
    linear_classes_l2: LinearPenalties = Field(default_factory=lambda: LinearPenalties())
    # the portfolio: members of one network, mixed by weights fitted on validation (fusion tabm)
    members: list[WideMember] = Field(default_factory=lambda: [m.model_copy() for m in DEFAULT_MEMBERS],
                                      min_length=1)
    # weight of the auxiliary loss of each deep modality's own head (0: none)
    aux_loss_weight: float = Field(0.0, ge=0.0)
    adapter_dim: int = Field(64, ge=1)
    # tabm: a TabM ensemble of ensemble_size MLPs sharing one body (blocks of hidden_sizes, one width);
    # mlp: one MLP (layer_norm and activation apply to it)
    fusion: Literal["tabm", "mlp"] = "tabm"
    ensemble_size: int = Field(16, ge=1)
    hidden_sizes: list[int] = [256, 256]
    activation: Literal["relu", "gelu", "leaky_relu", "tanh"] = "gelu"
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    layer_norm: bool = True
    # inputs the model sees; a subset trains a single-modality baseline of the same architecture
    modalities: list[Literal["image", "tabular", "text"]] = ["image", "tabular", "text"]
    # the loss and the decision rule
    class_weight: Literal["none", "balanced"] = "none"  # balanced: rare classes weigh more in the loss
    # fit the decision rule on the validation rows each epoch: ordinal cut points (quadratic weighted kappa),
    # multiclass class biases maximising the macro F1 the rows' own probabilities expect (label-free:
    # fusion_model/decision.py); false: the expected class rounded, the argmax
    fit_decision: bool = True
    # after validation has picked the epoch count, the members' mix and the decision rule, fit the kept
    # model again on train + val with them (true: AutoGluon's refit_full); "linear": keep the best epoch's
    # deep members and fit only the linear member again on train + val (its penalties as validation chose
    # them; no second training); false: the best epoch's model as it is
    refit: bool | Literal["linear"] = "linear"
    # configurations the stage tries (AutoGluon's presets): each a few train keys over this section's; the one
    # with the best validation score is kept (and refitted). [{}]: this section alone
    candidates: list[dict[str, Any]] = Field(default_factory=lambda: [{}], min_length=1)
    candidate_tolerance: float = Field(0.002, ge=0.0)  # a later candidate must win by more than this share
    # optimisation
    max_epochs: int = Field(8, ge=1)
    # a small table trains for more epochs: at least this many optimizer steps (within max_epochs_cap)
    min_steps: int = Field(0, ge=0)
    max_epochs_cap: int = Field(40, ge=1)
    # stop when the validation metric has not improved for this many epochs (None: train max_epochs);
    # the checkpoint kept is the best epoch's either way
    early_stopping_patience: int | None = Field(None, ge=1)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(2e-3, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    num_workers: int = Field(0, ge=0)
    # distribution
    strategy: Literal["ddp_spawn", "ddp", "deepspeed"] = "deepspeed"
    zero_stage: Literal[2, 3] = 2
    offload_optimizer: bool = False  # DeepSpeed: optimizer states and step on the CPU
    offload_param: bool = False  # DeepSpeed ZeRO-3: parameters on the CPU too
    # ZeRO reduce/all-gather bucket (elements); DeepSpeed's 5e8 default is sized for billion-parameter models
    zero_bucket_size: int = Field(2_000_000, ge=10_000)
    precision: Literal["32-true", "bf16-mixed", "16-mixed"] = "32-true"
    accelerator: Literal["auto", "cpu", "gpu"] = "auto"
    devices: int | Literal["auto"] = "auto"
    num_nodes: int = Field(1, ge=1)
    threads_per_rank: int = Field(1, ge=1)
    # multi-node (torchrun static rendezvous): every node runs the stage with its own node_rank and the
    # same master address/port; on one node the port is chosen free on 127.0.0.1.
    node_rank: int = Field(0, ge=0)
    master_addr: str = "127.0.0.1"
    master_port: int | None = Field(None, ge=1, le=65535)
    # several machines, each started by the retrain flow (one node job per host, torchrun's c10d rendezvous
    # at host 0's address): empty or one entry trains on this machine alone, as without the list
    hosts: list[HostConfig] = []
    rendezvous_port: int = Field(29400, ge=1, le=65535)  # on host 0
    join_timeout_s: float = Field(300, gt=0)  # every host must have joined by then, or the run fails
    # run control
    resume: bool = False  # continue from out_dir/last.ckpt (a file, or a ZeRO folder)
    max_steps: int = Field(-1, ge=-1)  # -1: as many as max_epochs gives; a cap for quick runs
    save_gathered_weights: Path | None = None  # after fit: the final fp32 weights as safetensors

    def with_linear_l2(self, report: dict[str, Any]) -> TrainConfig:
        """This config with the linear members' penalties set as a fit `report` gives them (those validation
        chose, for a refit)."""
        classes = report.get("classes", {}).get("l2", {})
        return self.model_copy(update={"linear_l2": self.linear_l2.model_copy(update=report["l2"]),
                                       "linear_classes_l2": self.linear_classes_l2.model_copy(update=classes)})

    @property
    def retrains(self) -> bool:
        """The kept model is trained again on train + val (`refit: true`), not the selection's best epoch."""
        return self.refit is True

    @property
    def multi_host(self) -> bool:
        return len(self.hosts) > 1

    def host(self, name: str) -> HostConfig:
        for entry in self.hosts:
            if entry.name == name:
                return entry
        known = ", ".join(h.name for h in self.hosts) or "none"
        raise ValueError(f"train.hosts has no host named {name!r} (it lists: {known}); fix the node job's `host`")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: object) -> object:
        moved = sorted(set(data) & set(WideMember.model_fields)) if isinstance(data, dict) else []
        if moved:
            raise ValueError(f"train.{', train.'.join(moved)} moved into train.members (one entry per member of "
                             "the portfolio, e.g. members: [{text_lr_multiplier: 15, text_l2: 1.0}]); delete the "
                             "key to use the default portfolio, which validation weighs on each table")
        return data

    def candidate(self, index: int) -> TrainConfig:
        """This section with candidate `index`'s keys over it (a config of one candidate)."""
        return TrainConfig.model_validate({**self.model_dump(exclude={"candidates"}), **self.candidates[index],
                                           "candidates": [{}]})

    @model_validator(mode="after")
    def _candidates_are_model_keys(self) -> TrainConfig:
        for index, keys in enumerate(self.candidates):
            wrong = sorted(set(keys) - set(TrainConfig.model_fields))
            fixed = sorted(set(keys) & _SAME_FOR_EVERY_CANDIDATE)
            if wrong or fixed:
                what = (f"{wrong} are not train keys" if wrong else
                        f"{fixed} set where and how the run trains, the same for every candidate")
                raise ValueError(f"train.candidates[{index}]: {what}; a candidate sets model and optimisation "
                                 "keys only (e.g. {lr: 0.005}); set the others in the train section itself")
            if keys:
                try:
                    self.candidate(index)
                except ValueError as error:
                    raise ValueError(f"train.candidates[{index}] {keys} does not make a valid train section: "
                                     f"{error}") from None
        return self

    @model_validator(mode="after")
    def _members_fit(self) -> TrainConfig:
        if self.fusion == "mlp" and len(self.members) > 1:
            raise ValueError("train.members lists several members but fusion mlp has one head; set fusion: tabm "
                             "or keep one member")
        if self.fusion == "tabm" and self.ensemble_size < len(self.members):
            raise ValueError(f"train.ensemble_size {self.ensemble_size} is smaller than the {len(self.members)} "
                             "members; each member needs a head")
        return self

    @model_validator(mode="after")
    def _offload_fits_the_strategy(self) -> TrainConfig:
        if self.strategy != "deepspeed" and (self.offload_optimizer or self.offload_param):
            key = "offload_optimizer" if self.offload_optimizer else "offload_param"
            raise ValueError(f"train.{key} is a DeepSpeed option but train.strategy is {self.strategy}; set strategy "
                             f"to deepspeed or {key} to false")
        if self.offload_param and self.zero_stage != 3:
            raise ValueError("train.offload_param needs ZeRO-3: stage 2 keeps every parameter whole on each rank, so "
                             "there is nothing to offload; set train.zero_stage to 3 or offload_param to false "
                             "(offload_optimizer works on both stages)")
        return self

    @model_validator(mode="after")
    def _text_model_options(self) -> TrainConfig:
        if self.text_model is None and (self.text_lora is not None or "text" in self.freeze):
            key = "text_lora" if self.text_lora is not None else "freeze: [text]"
            raise ValueError(f"train.{key} needs a text transformer; set train.text_model to a local Hugging Face "
                             "folder or remove the key")
        if self.text_lora is not None and "text" in self.freeze:
            raise ValueError("train.text_lora already freezes the text transformer's own weights and trains its "
                             "adapters; remove text from train.freeze (or text_lora to freeze it whole)")
        if "image" in self.freeze and self.pretrained in (False, None):
            raise ValueError("train.freeze: [image] would keep a randomly initialised image backbone; set "
                             "train.pretrained to a local weights file, or remove image from train.freeze")
        return self

    @model_validator(mode="after")
    def _hosts_are_usable(self) -> TrainConfig:
        if not self.multi_host:
            return self
        for key in ("name", "address", "work_queue"):
            values = [getattr(h, key) for h in self.hosts]
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"train.hosts: every host needs its own {key}; {', '.join(repeated)} repeats")
        if self.strategy == "ddp_spawn":
            raise ValueError("train.hosts lists several hosts but ddp_spawn starts every rank on one machine; "
                             "set train.strategy to ddp or deepspeed")
        if self.num_nodes not in (1, len(self.hosts)):  # a node's own config carries one node per host
            raise ValueError("train.hosts and train.num_nodes > 1 both describe several machines; keep num_nodes 1 "
                             "with a hosts list (the flow starts one node per host)")
        if self.resume:
            raise ValueError("train.resume works on one machine only: each host keeps only its own shards; "
                             "train afresh across the hosts (resume false)")
        return self
