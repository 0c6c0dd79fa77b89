"""params.yaml, parsed into one typed model per stage at the edge.

Every stage function takes its section's model; the CLI and the Prefect flow build them here, so a typo
in params.yaml fails before any work starts, naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from fusion_model.config import TrainConfig

LabelKind = Literal["binary", "multiclass"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SyntheticParams(_Section):
    n_train: int = Field(3000, ge=10)
    n_test: int = Field(1000, ge=10)
    label_kind: LabelKind = "binary"
    image_size: int = Field(64, ge=8)
    seed: int = 42


class DownloadParams(_Section):
    source: Literal["synthetic", "url"] = "synthetic"
    url: str = "https://automl-mm-bench.s3.amazonaws.com/petfinder_for_tutorial.zip"
    sha256: str | None = None
    out_dir: Path = Path("data/raw")
    timeout_s: float = Field(60, gt=0)
    max_attempts: int = Field(5, ge=1)
    synthetic: SyntheticParams = SyntheticParams()


class ValidateParams(_Section):
    dataset_dir: Path = Path("data/raw/petfinder_for_tutorial")
    out_dir: Path = Path("data/validated")
    report_dir: Path = Path("reports")
    label_kind: LabelKind = "binary"
    val_fraction: float = Field(0.2, gt=0, lt=1)
    seed: int = 42
    workers: int = Field(2, ge=1)


TrainParams = TrainConfig


class ConvertParams(_Section):
    checkpoint_dir: Path = Path("data/checkpoints")
    out_dir: Path = Path("data/model")


class EvaluateParams(_Section):
    model_dir: Path = Path("data/model")
    data_dir: Path = Path("data/validated")
    out_dir: Path = Path("data/eval")
    batch_size: int = Field(256, ge=1)


class PromoteParams(_Section):
    model_dir: Path = Path("data/model")
    eval_dir: Path = Path("data/eval")
    champion_dir: Path = Path("models/champion")
    min_delta: float = Field(0.0, ge=0)


class Params(_Section):
    download: DownloadParams = DownloadParams()
    validate_: ValidateParams = Field(ValidateParams(), alias="validate")
    train: TrainParams = TrainParams()
    convert: ConvertParams = ConvertParams()
    evaluate: EvaluateParams = EvaluateParams()
    promote: PromoteParams = PromoteParams()

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @property
    def validate_params(self) -> ValidateParams:
        return self.validate_


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
        raw.setdefault(section, {}).update(values)
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
        )
        raise ParamsError(f"{path}: invalid parameters: {problems}. Fix these keys in {path}.") from None
