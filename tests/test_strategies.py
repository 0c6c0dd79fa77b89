"""Strategy factory and the train stage's launch command (no process is started here)."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch.strategies import DDPStrategy

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
    # bf16 with BatchNorm needs buffers in bf16 too, or DeepSpeed fails with a dtype mismatch
    assert ds["bf16"] == {"enabled": True} and ds["data_types"] == {"buffer_dtype": "bf16"}
    assert ds["zero_allow_untested_optimizer"] is True  # plain AdamW: no CPU-Adam build
    assert "bf16" not in deepspeed_config(TrainConfig(strategy="deepspeed"))
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
