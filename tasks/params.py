"""params.yaml, parsed into one typed model per stage at the edge.

Every stage function takes its section's model; the CLI and the Prefect flow build them here, so a typo
in params.yaml fails before any work starts, naming the key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, ValidationError, model_validator

from fusion_model.config import TrainConfig
from fusion_model.dataset import DatasetSchema, ProblemType, SchemaError, resolve_schema

# Before `dataset.label.problem_type` existed, three sections named the label kind; still accepted so old
# params files and scripts keep working, and checked against the dataset's problem type.
LegacyLabelKind = Literal["binary", "multiclass"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


DriftKind = Literal["none", "numeric", "codes", "labels", "photos"]
# The keys that choose which arriving data a run takes in, not how the pipeline treats it: a run that sets
# them is not an override (the version step still commits its stages; see tasks/version/stage.py).
FEED_KEYS = {"batch", "drift", "drift_size", "batch_rows"}


class SyntheticParams(_Section):
    n_train: int = Field(3000, ge=10, description="rows in train.csv")
    n_test: int = Field(1000, ge=10, description="rows in test.csv")
    label_kind: LegacyLabelKind | None = Field(None, description="deprecated: dataset.label.problem_type decides")
    image_size: int = Field(64, ge=8, le=1024, description="square JPEG side in pixels")
    seed: int = Field(42, description="same seed -> byte-identical files")
    # Arriving data: batch N > 0 lands N's new labelled rows (seeded by seed and N) and takes them in after
    # validation and the drift gate; 0 is the base dataset alone. The nightly deployment advances it.
    batch: int = Field(0, ge=0, description="the batch to emit and take in (0: the base dataset only)")
    batch_rows: int = Field(600, ge=10, description="labelled rows per arriving batch")
    drift: DriftKind | list[DriftKind] = Field(
        "none", description="how an emitted batch differs: numeric (Age), codes (unseen), labels (rate), photos (broken)")
    drift_size: float = Field(1.0, gt=0, description="how far a drifted batch moves")

    @property
    def drift_kinds(self) -> list[str]:
        kinds = [self.drift] if isinstance(self.drift, str) else list(self.drift)
        return [k for k in kinds if k != "none"]


class DriftGateParams(_Section):
    """The drift gate an arriving batch passes before it joins (tasks/intake/drift.py; the statistics
    and why: tasks/intake/drift_stats.py; measured: BENCHMARKS.md): every column is tested against the
    reference, and a test counts when its p-value after Holm's correction over all the gate's tests is at
    most alpha AND its effect reaches the floor of its kind. A fail stops the run before training; a
    warning lets it go on and says so in the promotion decision."""

    alpha_fail: float = Field(0.01, gt=0, lt=1, description=(
        "the chance that a batch of the reference's own population fails the gate, whatever its size "
        "(familywise: Holm over every test)"))
    alpha_warn: float = Field(0.05, gt=0, lt=1, description="the same chance for a warning")
    min_psi: float = Field(0.1, ge=0, description=(
        "smallest PSI a numeric column, a text length or the shares of known codes must also move by to count"))
    min_share_change: float = Field(0.02, ge=0, le=1, description=(
        "smallest change of a share that counts: a label class, rows without an image, rows with codes the "
        "reference never had (above the share expected by chance)"))
    min_rows: int = Field(50, ge=1, description="a smaller batch is refused: too few rows to judge")

    @model_validator(mode="after")
    def _warn_not_below_fail(self) -> DriftGateParams:
        if self.alpha_warn < self.alpha_fail:
            raise ValueError("alpha_warn must not be below alpha_fail (a warning is the weaker verdict)")
        return self


class LocalParams(_Section):
    """`source: local`: a table already on disk (any dataset schema), rewritten into the layout validation reads.

    `path` is a CSV or Parquet file, or a folder with train.csv (+ a labelled test.csv); PetFinder's Kaggle
    export (no image column, photos at train_images/<PetID>-<n>.jpg) is read too."""

    path: Path | None = Field(None, description="a CSV or Parquet file, or a folder in a PetFinder layout; required")
    images_dir: Path | None = Field(
        None, description="the images root the image cells are relative to; null: the table's folder (Kaggle "
                          "layout: the photos folder, train_images/ beside the CSV)")
    test_path: Path | None = Field(
        None, description="a labelled test table (CSV or Parquet), used as the test set as it is; null: a seeded "
                          "stratified split of the labelled rows")
    layout: Literal["auto", "table", "kaggle"] = Field(
        "auto", description="auto: kaggle for a PetFinder table without its image column (photos found by "
                            "PetID), else table")
    test_fraction: float = Field(0.2, gt=0, lt=1, description="share of labelled rows split off as the test set")
    seed: int = Field(42, description="seed of the stratified train/test split")
    drop_bad_ids: bool = Field(
        False, validation_alias=AliasChoices("drop_bad_ids", "drop_bad_pet_ids"),
        description="rows whose id is empty, repeated or not of the dataset's id pattern (a spreadsheet's "
                    "7.76E+08): false refuses the file naming the rows, true drops them")
    encoding: str = Field("utf-8", description="encoding of CSV files")
    fallback_encoding: str | None = Field(
        "cp1252", description="decodes only the cells that are not valid `encoding`; null refuses them"
    )
    label_kind: LegacyLabelKind | None = Field(None, description="deprecated: dataset.label.problem_type decides")


class FeedParams(_Section):
    """Where arriving batches come from (tasks/intake): each new drop (a table and its images) becomes the
    next batch. A drop's identity is its content's sha256: the same drop again is a no-op, a changed drop
    under a name already taken is refused naming it."""

    kind: Literal["synthetic", "folder", "url"] = Field(
        "synthetic", description="synthetic: the embedded generator's batch download.synthetic.batch; folder: the "
                                 "drops in `path` matching `glob`; url: the drops a listing at `url` names")
    path: Path | None = Field(None, description="kind folder: the folder drops arrive in")
    glob: str = Field("*", description="kind folder: which entries of `path` are drops (a folder with a table and "
                                       "its images, or a CSV / Parquet table), taken in name order")
    url: str | None = Field(None, pattern=r"^(https?|file)://", description=(
        "kind url: a listing, one drop per line (a URL of a CSV, Parquet or zip; `name URL` to name it), or a "
        "JSON list of {name, url}"))
    on_duplicate: Literal["refuse", "update"] = Field(
        "refuse", description="a row whose id the data already holds: refuse the batch naming the ids, or replace "
                              "the older row (recorded in the batch's record)")
    ledger: Path = Field(Path("data/intake/batches.json"), description=(
        "every batch seen: name, sha256, taken in / warned / quarantined / rejected and why"))


# The keys the download section held before the intake stage had a section of its own.
MOVED_TO_INTAKE = ("feed", "drift_gate", "holdout_fraction", "incoming_dir", "quarantine_dir", "report_dir")


class DownloadParams(_Section):
    source: Literal["synthetic", "url", "local"] = Field(
        "synthetic", description="synthetic (embedded, offline), url (the tutorial zip) or local (files on disk)"
    )
    url: str = Field(
        "https://automl-mm-bench.s3.amazonaws.com/petfinder_for_tutorial.zip",
        pattern=r"^https?://",
        description="zip in the tutorial's layout (source: url)",
    )
    sha256: str | None = Field(
        None, pattern=r"^[0-9a-fA-F]{64}$", description="pinned sha256 of the archive; null accepts any"
    )
    out_dir: Path = Field(Path("data/raw"), description="replaced atomically on success")
    timeout_s: float = Field(60, gt=0, description="connect / read timeout per request")
    max_attempts: int = Field(5, ge=1, description="tries on transient failures (5xx, timeout, reset)")
    backoff_s: float = Field(1.0, ge=0, description="first retry wait; doubles each retry, capped at 60 s")
    synthetic: SyntheticParams = SyntheticParams()
    local: LocalParams = LocalParams()

    @model_validator(mode="before")
    @classmethod
    def _intake_keys_moved(cls, data: Any) -> Any:
        """An older params.yaml keeps the arriving batches' keys here: refuse it naming each key and where it
        goes, rather than an `extra inputs` error that leaves the reader to guess."""
        if isinstance(data, dict) and (moved := [k for k in MOVED_TO_INTAKE if k in data]):
            raise ValueError("; ".join(f"download.{k}: moved to the intake: section (intake.{k}); move the key there"
                                       for k in moved))
        return data


class IntakeParams(_Section):
    """Arriving batches (tasks/intake): where they come from, the gate they pass before they join the
    accumulated data (out_dir: the download stage's data, download.out_dir, which the intake only reads,
    plus every batch taken in), the share of each held out (scored beside the frozen test set), where
    they land and where a refused one goes. The embedded feed's batch and generator settings stay
    download.synthetic's: the same generator makes the base."""

    feed: FeedParams = FeedParams()
    drift_gate: DriftGateParams = DriftGateParams()
    holdout_fraction: float = Field(0.2, gt=0, lt=1, description="share of each batch held out for scoring")
    out_dir: Path = Field(Path("data/accumulated"), description="the accumulated data: dataset/ (the download's "
                          "plus every batch taken in) and manifest.json; validate.dataset_dir is its dataset/")
    incoming_dir: Path = Field(Path("data/incoming"), description="landing area: incoming/batch-<N>/")
    quarantine_dir: Path = Field(Path("data/quarantine"), description="refused batches, each with its report")
    report_dir: Path = Field(Path("reports"), description="drift.json, drift.md, drift.png of the latest batch")


class ValidateParams(_Section):
    dataset_dir: Path = Path("data/accumulated/dataset")
    out_dir: Path = Path("data/validated")
    report_dir: Path = Path("reports")
    val_fraction: Annotated[float, Field(gt=0, lt=1)] | Literal["auto"] = Field(
        "auto", description="share of the labelled rows held out to validate on; auto: AutoGluon's holdout rule "
                            "for a binary or regression label, a fifth for an ordinal or multiclass one "
                            "(tasks/checks/tables.py, auto_val_fraction)")
    seed: int = 42
    workers: int = Field(2, ge=1)
    seen_codes_mostly: float = Field(
        0.5, ge=0, le=1, description="test table: the share of each categorical column's values that must be "
                                     "codes the training rows hold (fewer: the file does not match the training data)")
    label_kind: LegacyLabelKind | None = Field(None, description="deprecated: dataset.label.problem_type decides")


TrainParams = TrainConfig


class ConvertParams(_Section):
    checkpoint_dir: Path = Field(Path("data/checkpoints"), description="training output: checkpoint + model_config.json")
    checkpoint_name: str = Field("best.ckpt", description="file (ddp) or DeepSpeed folder inside checkpoint_dir")
    out_dir: Path = Field(Path("data/model"), description="model.safetensors, model_config.json, manifest.json")
    # fusion_model.layout.MODEL_PREFIX: the LightningModule attribute holding the FusionModel, plus "."
    model_prefix: str = Field("model.", description="prefix stripped from every key after `_forward_module.`")
    lock_timeout_s: float = Field(600, gt=0, description="wait this long for a concurrent conversion")


class EvaluateParams(_Section):
    model_dir: Path = Path("data/model")
    data_dir: Path = Path("data/validated")
    out_dir: Path = Path("data/eval")
    batch_size: int = Field(256, ge=1)
    baseline: bool = Field(True, description="fit the classical baseline on the same training rows and report it beside the model")
    seed: int = Field(42, description="the baseline's folds and trees")
    primary_metric: str | None = Field(
        None, description="the metric promotion compares; null: the problem type's (roc_auc, macro_f1, qwk, rmse)")


class PromoteParams(_Section):
    """Champion/challenger: the challenger (model_dir + eval_dir/metrics.json) replaces champion_dir only if
    it passed validation and beats the champion's primary metric on the same test set by >= min_delta."""

    model_dir: Path = Path("data/model")
    eval_dir: Path = Path("data/eval")
    champion_dir: Path = Path("models/champion")
    min_delta: float = Field(0.0, ge=0)
    require_beat_baseline: bool = Field(
        True, description="refuse a challenger whose primary metric is below the classical baseline's (metrics.json)")
    # The current test set: the champion is re-scored on it when its metrics came from another one.
    data_dir: Path = Path("data/validated")
    validation_report: Path = Path("reports/validation.json")
    drift_report: Path = Path("reports/drift.json")  # a warning there is said in the decision
    batch_size: int = Field(256, ge=1)
    lock_timeout_s: float = Field(600, gt=0)


class VersionParams(_Section):
    """What the `version` step records: DVC-commits these stages, pushes them and writes a run manifest."""

    stages: list[str] = ["download", "intake", "validate", "train", "convert", "evaluate"]
    remote: str | None = None  # None: the default remote of .dvc/config
    push: bool = True
    # data, model and metrics are always pushed; the training checkpoints (optimizer shards: ~3x the
    # weights) only when asked
    push_checkpoints: bool = False
    manifest_dir: Path = Path("models/runs")
    params_file: Path = Path("params.yaml")
    lock_timeout_s: float = Field(1800, gt=0)


class ScoreParams(_Section):
    """New rows scored with the champion (tasks/score; `python -m tasks score`, the `score/...` deployments):
    each drop of `source` (as intake.feed's folder / url kinds) checked row by row with the validation
    rules, its good rows predicted, written to `out_dir/<drop>/` whole (predictions.csv, rejects.jsonl,
    manifest.json naming the model's version and sha256). A drop already scored is skipped."""

    source: str = Field("data/to_score", min_length=1, description=(
        "a folder of drops (each a folder with a table and its photos, or a CSV / Parquet table whose photos "
        "are relative to the folder), or the http(s):// or file:// URL of a listing of drops"))
    glob: str = Field("*", description="a folder source: which of its entries are drops, taken in name order")
    champion_dir: Path = Field(Path("models/champion"), description=(
        "the model to score with: the registry's champion link (promote.champion_dir) or a converted model folder"))
    out_dir: Path = Field(Path("data/scores"), description="one folder per drop: predictions, rejects, manifest")
    batch_size: int = Field(256, ge=1, description="rows per forward pass")
    workers: int = Field(2, ge=1, description="image checks in parallel")
    rescore: bool = Field(False, description="score drops already scored again (their folders replaced whole)")
    timeout_s: float = Field(60, gt=0, description="a URL source: connect / read timeout per request")
    max_attempts: int = Field(5, ge=1, description="a URL source: tries on transient failures")

    @property
    def kind(self) -> Literal["folder", "url"]:
        """url when `source` is a URL, else folder (intake.feed's kinds)."""
        return "url" if re.match(r"^(https?|file)://", self.source) else "folder"


class DatasetLabelParams(_Section):
    column: str | None = None
    problem_type: ProblemType | None = None
    classes: list[int | str] | None = None
    positive: list[int | str] | None = None
    negative: list[int | str] | None = None
    transform: Literal["none", "log1p"] | None = None
    min_class_rows: int | None = None
    rare_classes: Literal["merge", "refuse", "drop"] | None = None
    other_class: str | None = None


class DatasetColumnsParams(_Section):
    image: list[str] | None = None
    text: list[str] | None = None
    categorical: list[str] | None = None
    numerical: list[str] | None = None


class DatasetParams(_Section):
    """params.yaml `dataset:` as written: a preset and/or explicit keys (fusion_model/dataset.py). Every
    stage reads the resolved schema (`.schema`); a null key keeps the preset's value."""

    preset: str | None = Field("petfinder", description="a preset fills every key not given; null: all given here. "
                               "Unset beside columns of the section's own: null (a preset applies only when named)")
    id: str | None = Field(None, description="unique row key; null: the file's index column, else the row number")
    label: DatasetLabelParams | None = None
    columns: DatasetColumnsParams | None = None
    frequency: list[str] | None = Field(None, description="columns whose count among the training rows is an input")
    checks: dict[str, Any] | None = Field(None, description="plausibility rules (fusion_model.dataset.Checks)")

    @model_validator(mode="after")
    def _resolves(self) -> DatasetParams:
        try:
            self.schema  # noqa: B018 -- fail at load time, naming the key
        except SchemaError as e:
            raise ValueError(str(e)) from None
        return self

    @property
    def schema(self) -> DatasetSchema:
        declared = self.model_dump(mode="json", exclude_unset=True)
        # a section with columns of its own describes another table: a preset applies only when named
        declared.setdefault("preset", None if declared.get("columns") else self.preset)
        return resolve_schema(declared)


class Params(_Section):
    dataset: DatasetParams = DatasetParams()
    download: DownloadParams = DownloadParams()
    intake: IntakeParams = IntakeParams()
    validate_: ValidateParams = Field(ValidateParams(), alias="validate")
    train: TrainParams = TrainParams()
    convert: ConvertParams = ConvertParams()
    evaluate: EvaluateParams = EvaluateParams()
    promote: PromoteParams = PromoteParams()
    version: VersionParams = VersionParams()
    score: ScoreParams = ScoreParams()

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @property
    def validate_params(self) -> ValidateParams:
        return self.validate_

    @property
    def schema(self) -> DatasetSchema:
        return self.dataset.schema

    @model_validator(mode="after")
    def _label_kinds_agree(self) -> Params:
        problem_type = self.dataset.schema.label.problem_type
        for key, kind in (("download.synthetic.label_kind", self.download.synthetic.label_kind),
                          ("download.local.label_kind", self.download.local.label_kind),
                          ("validate.label_kind", self.validate_.label_kind)):
            if kind is not None and not (kind == problem_type or (kind == "multiclass" and problem_type != "binary")):
                raise ValueError(f"{key}: {kind} disagrees with dataset.label.problem_type {problem_type}; the dataset "
                                 "section decides the label now: set dataset.label.problem_type and drop this key")
        return self


class ParamsError(ValueError):
    """params.yaml is missing, unreadable or has a bad value."""


def load_params(path: str | Path = "params.yaml", overrides: dict[str, Any] | None = None) -> Params:
    """Read params.yaml; `overrides` maps section -> {key: value} and replaces those keys."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise ParamsError(f"{path}: no such params file; run from the project root or pass --params PATH") from None
    except yaml.YAMLError as e:
        raise ParamsError(f"{path}: not valid YAML ({e}); fix the syntax at the line shown") from None
    for section, values in (overrides or {}).items():
        if section == "dataset" and values.get("columns") and "preset" not in values:
            values = {"preset": None, **values}  # another table's columns: the file's preset does not apply
        raw.setdefault(section, {}).update(values)
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ParamsError(f"{path}: invalid parameters: {problems}. Fix these keys in {path}.") from None
