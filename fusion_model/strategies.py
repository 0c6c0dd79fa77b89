"""Lightning strategy from the training config: ddp_spawn, ddp, or DeepSpeed ZeRO stage 2/3.

On CUDA the stock ``DeepSpeedStrategy`` is used. On CPU a small subclass lifts its three CUDA-only
assumptions so ZeRO trains with DeepSpeed's CPU accelerator over gloo (CI trains real shards this way).
deepspeed itself is imported only when a DeepSpeed strategy is set up.
"""

from __future__ import annotations

import argparse
from typing import Any

from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, Strategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from torch import nn

from fusion_model.config import TrainConfig
from fusion_model.processes import end_process


class _EndingLauncher(_MultiProcessingLauncher):
    """ddp_spawn's launcher, whose ranks end through `end_process` once their work is handed back (rank 0's
    results are on the pipe: a SimpleQueue writes as it is called): a finished rank's interpreter teardown can
    abort in gloo's C++ destructors (SIGABRT), which failed a finished run, as under torchrun (fit.py)."""

    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        super()._wrapping_function(*args, **kwargs)
        end_process(0)


class SpawnDDPStrategy(DDPStrategy):
    """DDPStrategy(start_method="spawn") whose ranks end without their interpreter's teardown."""

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = _EndingLauncher(self, start_method=self._start_method)


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeedStrategy that runs on CPU processes (DeepSpeed's CPU accelerator + gloo)."""

    strategy_name = "deepspeed_cpu"

    def setup_environment(self) -> None:
        # DeepSpeedStrategy raises for any non-CUDA accelerator here; do what DDPStrategy does instead.
        DDPStrategy.setup_environment(self)

    def setup_distributed(self) -> None:
        # skips _validate_device_index_selection: CPU devices have index None
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        skip_shared_memory_all_reduce()
        self._init_deepspeed_distributed()

    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: Any, lr_scheduler: Any = None,
    ) -> tuple[Any, Any]:
        import deepspeed

        engine, ds_optimizer, _, _ = deepspeed.initialize(
            # root_device.index is None on CPU; DeepSpeed needs a rank to place the process
            args=argparse.Namespace(device_rank=self.local_rank),
            config=self.config,
            model=model,
            model_parameters=filter(lambda p: p.requires_grad, model.parameters()),
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    def _initialize_deepspeed_inference(self, model: nn.Module) -> None:
        import deepspeed
        from lightning.pytorch.strategies.deepspeed import remove_module_hooks

        assert isinstance(self.config, dict)
        config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                config[key] = self.config[key]
        if self.zero_stage_3:
            config["zero_allow_untested_optimizer"] = True
            config["zero_optimization"] = self.config["zero_optimization"]
        remove_module_hooks(model)
        self.model, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self.local_rank), config=config, model=model,
            optimizer=None, lr_scheduler=None, model_parameters=[], dist_init_required=False,
        )


def skip_shared_memory_all_reduce() -> None:
    """Mark DeepSpeed's shared-memory all-reduce op unavailable before its CPU backend starts. That backend
    compiles the op on first start (~20 s of g++ on 2 cores, in every fresh checkout and on every change of
    TORCH_EXTENSIONS_DIR); only DeepSpeed's tensor-parallel inference calls it, while ZeRO's collectives go
    through torch.distributed (gloo): training's numbers are the same without it."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # probed once per process, kept as a dict


def deepspeed_config(cfg: TrainConfig, on_cuda: bool = True) -> dict[str, Any]:
    """The DeepSpeed JSON config; Lightning adds batch size, clipping and the fp16/bf16 blocks."""
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        "contiguous_gradients": True,
        # DeepSpeed allocates its gradient bucket (reduce_bucket_size elements) at every step, twice with
        # overlap_comm (double buffering for a side stream). The CPU accelerator has no streams, so on CPU
        # the overlap never happens and the second buffer is pure allocation cost.
        "overlap_comm": on_cuda,
        "reduce_scatter": True,
        "allgather_partitions": True,
        # DeepSpeed's default (5e8 elements = 2 GB of fp32 per buffer, allocated every step) is sized for
        # billion-parameter models; a few million elements hold several layers' gradients.
        "reduce_bucket_size": cfg.zero_bucket_size,
        "allgather_bucket_size": cfg.zero_bucket_size,
    }
    if cfg.zero_stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": cfg.zero_bucket_size,
            "stage3_param_persistence_threshold": 100_000,  # small tensors stay whole on every rank
            # a gathered parameter is released after use unless this many elements are live or it is used
            # again within this distance: DeepSpeed's 1e9 defaults keep a whole 300M-parameter model gathered
            # on every rank, which is what stage 3 exists to avoid (bench/zero_memory.py)
            "stage3_max_live_parameters": cfg.zero_bucket_size,
            "stage3_max_reuse_distance": cfg.zero_bucket_size,
        })
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if cfg.offload_param:  # ZeRO-3 only (TrainConfig refuses it on stage 2)
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    config: dict[str, Any] = {
        "zero_allow_untested_optimizer": True,  # plain torch AdamW: no CPU-Adam JIT build
        "zero_optimization": zero,
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "wall_clock_breakdown": False,
    }
    if cfg.offload_optimizer:
        # DeepSpeed refuses a client optimizer with offload unless told: the client Adam then steps the fp32
        # partitions on the CPU, where DeepSpeedCPUAdam would cost a ~160 s JIT build for the same job
        config["zero_force_ds_cpu_optimizer"] = False
    if cfg.multi_host:
        # no disk is shared between hosts: the first rank of each host writes the model states into its own
        # folder (ZeRO shards are per rank anyway), and the shards are gathered before the one conversion
        config["checkpoint"] = {"use_node_local_storage": True}
    if cfg.precision == "bf16-mixed":
        config["bf16"] = {"enabled": True}
    if cfg.precision in ("bf16-mixed", "16-mixed"):  # Lightning adds the fp16 block (loss scaling) itself
        # DeepSpeed casts parameters to bf16/fp16 but keeps buffers fp32: BatchNorm then fails with
        # "expected scalar type BFloat16 (Half) but found Float" unless buffers follow.
        config["data_types"] = {"buffer_dtype": "bf16" if cfg.precision == "bf16-mixed" else "fp16"}
    return config


def check_deepspeed_precision(cfg: TrainConfig) -> None:
    """Refuse 16-mixed where DeepSpeed's accelerator has no fp16: each rank, as its Trainer is built, before training.

    DeepSpeed's CPU accelerator reports fp16 only where oneDNN has it (AVX512-FP16 / AMX-FP16 CPUs); elsewhere
    DeepSpeed itself would fail inside `deepspeed.initialize` with "Type fp16 is not supported on your device".
    """
    if cfg.precision != "16-mixed":
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if not accelerator.is_fp16_supported():
        raise ValueError(
            f"train.precision 16-mixed: DeepSpeed's {accelerator.device_name()} accelerator has no fp16 on this "
            "machine (on CPU it needs AVX512-FP16 or AMX-FP16); set train.precision to bf16-mixed (same memory, "
            "no loss scaling) or 32-true"
        )


def build_strategy(cfg: TrainConfig, on_cuda: bool) -> Strategy | str:
    if cfg.strategy == "ddp_spawn":
        return SpawnDDPStrategy(start_method="spawn", process_group_backend=None if on_cuda else "gloo")
    if cfg.strategy == "ddp":
        return DDPStrategy(process_group_backend=None if on_cuda else "gloo")
    check_deepspeed_precision(cfg)
    cls = DeepSpeedStrategy if on_cuda else CPUDeepSpeedStrategy
    return cls(config=deepspeed_config(cfg, on_cuda), process_group_backend=None if on_cuda else "gloo")
