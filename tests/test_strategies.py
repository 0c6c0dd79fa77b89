"""Strategy factory, the train stage's launch command, and each documented DeepSpeed option trained for real.

The `slow` tests train 2 ranks on CPU (gloo), convert with the convert stage and predict from its file only.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy
from pydantic import ValidationError
from safetensors.torch import load_file

from fusion_model.config import TrainConfig
from fusion_model.strategies import CPUDeepSpeedStrategy, build_strategy, deepspeed_config
from tasks.train.stage import build_command


def test_deepspeed_config_follows_the_train_section() -> None:
    cfg = TrainConfig(strategy="deepspeed", zero_stage=3, precision="bf16-mixed", batch_size=12,
                      offload_optimizer=True, zero_bucket_size=1_000_000)
    ds = deepspeed_config(cfg)
    assert ds["zero_optimization"]["stage"] == 3 and ds["train_micro_batch_size_per_gpu"] == 12
    assert ds["zero_optimization"]["reduce_bucket_size"] == 1_000_000
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_force_ds_cpu_optimizer"] is False  # else DeepSpeed refuses the client Adam under offload
    assert "offload_param" not in ds["zero_optimization"]
    # bf16 with BatchNorm needs buffers in bf16 too, or DeepSpeed fails with a dtype mismatch
    assert ds["bf16"] == {"enabled": True} and ds["data_types"] == {"buffer_dtype": "bf16"}
    assert ds["zero_allow_untested_optimizer"] is True  # plain AdamW: no CPU-Adam build
    plain = deepspeed_config(TrainConfig(strategy="deepspeed"))
    assert "bf16" not in plain and "data_types" not in plain and "zero_force_ds_cpu_optimizer" not in plain
    fp16 = deepspeed_config(TrainConfig(strategy="deepspeed", precision="16-mixed"))
    assert fp16["data_types"] == {"buffer_dtype": "fp16"} and "bf16" not in fp16  # Lightning adds the fp16 block
    z3 = deepspeed_config(TrainConfig(strategy="deepspeed", zero_stage=3, offload_param=True))
    assert z3["zero_optimization"]["offload_param"]["device"] == "cpu"
    # no side streams on CPU: overlap_comm would only double DeepSpeed's per-step bucket allocation
    assert deepspeed_config(cfg, on_cuda=False)["zero_optimization"]["overlap_comm"] is False
    assert deepspeed_config(cfg, on_cuda=True)["zero_optimization"]["overlap_comm"] is True


def test_cpu_gets_the_cpu_deepspeed_subclass_and_gloo() -> None:
    strategy = build_strategy(TrainConfig(strategy="deepspeed"), on_cuda=False)
    assert isinstance(strategy, CPUDeepSpeedStrategy)
    assert strategy.process_group_backend == "gloo"
    spawn = build_strategy(TrainConfig(strategy="ddp_spawn"), on_cuda=False)
    assert isinstance(spawn, DDPStrategy) and spawn._start_method == "spawn"


def test_launch_commands() -> None:
    cfg = TrainConfig(strategy="ddp", num_nodes=2, node_rank=1, master_port=29555)
    cmd = build_command(cfg, Path("c.json"), nproc=2, port=29555)
    joined = " ".join(cmd)
    assert "-m fusion_model.launch" in joined and "--nproc_per_node 2" in joined  # torchrun, store on loopback
    assert "--nnodes 2 --node_rank 1 --master_addr 127.0.0.1 --master_port 29555" in joined
    assert cmd[-4:] == ["-m", "fusion_model.fit", "--config", "c.json"]
    spawn = build_command(TrainConfig(strategy="ddp_spawn"), Path("c.json"), nproc=2, port=1)
    assert "fusion_model.launch" not in spawn and spawn[1:3] == ["-m", "fusion_model.fit"]


def test_the_train_stage_never_imports_lightning_into_its_caller() -> None:
    import subprocess
    import sys

    code = "import sys, tasks.train; print(sorted(m for m in ('lightning', 'torch') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_offload_param_on_stage_2_and_offload_without_deepspeed_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"train\.offload_param needs ZeRO-3.*zero_stage to 3"):
        TrainConfig(strategy="deepspeed", zero_stage=2, offload_param=True)
    with pytest.raises(ValidationError, match=r"train\.offload_optimizer is a DeepSpeed option.*strategy is ddp"):
        TrainConfig(strategy="ddp", offload_optimizer=True)
    TrainConfig(strategy="deepspeed", zero_stage=2, offload_optimizer=True)  # stage 2 offloads the optimizer


def test_16_mixed_is_refused_before_training_where_deepspeed_has_no_fp16(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepspeed.accelerator import get_accelerator

    cfg = TrainConfig(strategy="deepspeed", precision="16-mixed")
    # what DeepSpeed's CPU accelerator answers on a CPU without AVX512-FP16 / AMX-FP16 (oneDNN has no fp16)
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: False)
    with pytest.raises(ValueError, match=r"train\.precision 16-mixed: DeepSpeed's cpu accelerator has no fp16") as err:
        build_strategy(cfg, on_cuda=False)
    assert "bf16-mixed" in str(err.value) and "32-true" in str(err.value)  # the fix is in the message
    build_strategy(cfg.model_copy(update={"precision": "bf16-mixed"}), on_cuda=False)
    build_strategy(cfg.model_copy(update={"strategy": "ddp"}), on_cuda=False)  # Lightning's own rule for ddp
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)
    assert isinstance(build_strategy(cfg, on_cuda=False), CPUDeepSpeedStrategy)


def _cpu_has_fp16() -> bool:
    return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())  # what DeepSpeed's CPU accelerator asks


# name: (TrainConfig overrides, the ZeRO stage). The ZeRO-3 run is bf16-mixed on test_resnet's BatchNorm, so it
# also fails if DeepSpeed stopped reading data_types.buffer_dtype ("expected scalar type BFloat16 but found Float").
OPTION_RUNS = {
    "z2-offload_optimizer": ({"zero_stage": 2, "offload_optimizer": True}, 2),
    "z3-offload_optimizer-offload_param-bf16": (
        {"zero_stage": 3, "offload_optimizer": True, "offload_param": True, "precision": "bf16-mixed"}, 3),
    # fp16's dynamic loss scale skips its first steps (overflow at 2^16) until it has halved enough, and Adam's
    # moments exist from the first step taken: a few more steps than the others
    "z2-16-mixed": ({"zero_stage": 2, "precision": "16-mixed", "max_epochs": 6, "max_steps": 12}, 2),
}


@pytest.fixture(scope="module")
def option_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.validated_tables import make_validated

    return make_validated(tmp_path_factory.mktemp("options") / "data", n_train=32, n_val=16, n_test=16)


@pytest.mark.slow
@pytest.mark.parametrize("run", list(OPTION_RUNS))
def test_deepspeed_option_trains_converts_to_fp32_and_predicts(option_data: Path, tmp_path: Path, run: str) -> None:
    from fusion_model.predict import Predictor
    from tasks.convert import convert
    from tasks.params import ConvertParams
    from tasks.train import train

    overrides, stage = OPTION_RUNS[run]
    if overrides.get("precision") == "16-mixed" and not _cpu_has_fp16():
        pytest.skip("this CPU has no fp16 (oneDNN): 16-mixed is refused, see the test above")
    ckpt, model_dir = tmp_path / "ckpt", tmp_path / "model"
    summary = train(TrainConfig.model_validate({
        "data_dir": option_data, "out_dir": ckpt, "live_dir": tmp_path / "training",
        "image_model": "test_resnet", "image_size": 32, "text_buckets": 1024, "cat_dim": 4, "adapter_dim": 8,
        "hidden_sizes": [16], "batch_size": 8, "max_epochs": 1, "max_steps": 2, "refit": False,
        "devices": 2, "accelerator": "cpu", "strategy": "deepspeed", **overrides,
    }))
    assert summary.steps == overrides.get("max_steps", 2) and summary.world_size == 2 and summary.zero_stage == stage
    assert summary.precision == overrides.get("precision", "32-true")
    ran_with = json.loads((ckpt / "train_config.json").read_text())
    assert {k: ran_with[k] for k in overrides} == overrides
    # what DeepSpeed's engine parsed, not the dict the project wrote: a key it ignored would read as its default
    parsed = json.loads((ckpt / "train_summary.json").read_text())["deepspeed_parsed"]
    precision = overrides.get("precision", "32-true")
    assert parsed["zero_stage"] == stage
    assert parsed["offload_optimizer"] == ("cpu" if overrides.get("offload_optimizer") else None)
    assert parsed["offload_param"] == ("cpu" if overrides.get("offload_param") else None)
    assert parsed["reduce_bucket_size"] == parsed["allgather_bucket_size"] == TrainConfig().zero_bucket_size
    assert parsed["overlap_comm"] is False  # CPU: no side stream to overlap on
    assert (parsed["bf16"], parsed["fp16"]) == (precision == "bf16-mixed", precision == "16-mixed")

    converted = convert(ConvertParams(checkpoint_dir=ckpt, out_dir=model_dir))  # verified against DeepSpeed's own
    assert converted.converted and converted.kind == "deepspeed_zero" and converted.zero_stage == stage
    weights = load_file(model_dir / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in weights.values() if v.is_floating_point())  # fp32 whatever trained

    predictor = Predictor.load(model_dir)  # the converted folder only, strict load
    # ZeRO keeps each element's fp32 master weight and Adam's two moments once across the ranks (DDP: each rank
    # holds Adam's moments of every element): read from the engine's own buffers at the end of training
    memory = json.loads((ckpt / "train_summary.json").read_text())["memory"]
    model_bytes = sum(p.numel() * 4 for p in predictor.model.parameters())
    assert [m["rank"] for m in memory] == [0, 1] and all(m["peak_rss"] > 0 for m in memory)
    assert 2.9 * model_bytes <= sum(m["optimizer"] for m in memory) <= 3.3 * model_bytes
    test = pd.read_parquet(option_data / "test.parquet")
    meta = json.loads((option_data / "meta.json").read_text())
    proba = predictor.predict_proba(test, (option_data / meta["dataset_root"]).resolve())
    assert proba.shape == (len(test), 2) and np.isfinite(proba).all()
    assert np.allclose(proba.sum(axis=1), 1.0, atol=1e-5)
