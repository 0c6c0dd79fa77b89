"""Make real DeepSpeed ZeRO checkpoints on CPU, laid out as Lightning saves them.

Run once per rank by torchrun:

    python -m torch.distributed.run --nproc_per_node 2 tests/zero_shards.py --out DIR \
        --variants z2-fp32,z3-fp32 [--size tiny|big]

For each variant it trains a small model a few AdamW steps under `deepspeed.initialize` and saves
`DIR/<variant>/best.ckpt/` (`latest` = "checkpoint", `checkpoint/*_model_states.pt`,
`checkpoint/zero_pp_rank_<r>_mp_rank_00_optim_states.pt`), plus `DIR/<variant>/gathered.pt`: the
weights rank 0 sees at the end of training (stage 3: gathered with `GatheredParameters`), keyed like
the inner model's `state_dict()`, and `model_config.json` / `train_summary.json` beside it.

The module is nested as Lightning nests it (`_forward_module.model.<name>`), so the converter meets the
same prefixes it meets on real training output. One torchrun launch makes every variant: DeepSpeed's
start-up dominates the cost.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch import nn


class TinyNet(nn.Module):
    """Odd sizes so ZeRO partitions split parameters across ranks and pad; a BatchNorm for buffers."""

    def __init__(self, width: int = 13, depth: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.inp = nn.Linear(7 + 5, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.inp(torch.cat([x, self.embed(ids).to(x.dtype)], dim=1))
        for block in self.blocks:
            h = torch.relu(block(h))
        return self.head(self.bn(self.norm(h)))


class _Holder(nn.Module):
    """Stands for the LightningModule: the model lives under the attribute `model`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


class _Wrapper(nn.Module):
    """Stands for Lightning's `_LightningModuleWrapperBase`: the module lives under `_forward_module`."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._forward_module = _Holder(model)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self._forward_module.model(x, ids)


SIZES = {"tiny": {"width": 13, "depth": 1}, "big": {"width": 4099, "depth": 5}}


def _ds_config(stage: int, precision: str) -> dict:
    config: dict = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"buffer_dtype": "bf16"}  # BatchNorm buffers must match bf16 inputs
    return config


def make_variant(out: Path, variant: str, size: str, steps: int) -> None:
    import deepspeed

    stage_name, precision = variant.split("-")
    stage = int(stage_name.removeprefix("z"))
    torch.manual_seed(0)
    model = TinyNet(**SIZES[size])
    wrapper = _Wrapper(model)
    optimizer = torch.optim.AdamW(wrapper.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=wrapper, optimizer=optimizer, config=_ds_config(stage, precision))
    rank = torch.distributed.get_rank()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(4, 7, generator=generator).to(dtype)
        ids = torch.randint(0, 11, (4,), generator=generator)
        y = torch.randint(0, 3, (4,), generator=generator)
        loss = nn.functional.cross_entropy(engine(x, ids).float(), y)
        engine.backward(loss)
        engine.step()

    folder = out / variant
    ckpt = folder / "best.ckpt"
    engine.save_checkpoint(str(ckpt), tag="checkpoint", client_state={"epoch": 0, "global_step": steps})

    # The weights as training ends, on rank 0: the reference the converted file must equal.
    if stage == 3:
        params = list(wrapper.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}
    else:
        gathered = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(gathered, folder / "gathered.pt")
        (folder / "model_config.json").write_text(json.dumps({"size": size, **SIZES[size]}, indent=2))
        (folder / "train_summary.json").write_text(
            json.dumps({"strategy": "deepspeed", "zero_stage": stage, "world_size": engine.world_size,
                        "precision": precision, "steps": steps, "best_checkpoint": str(ckpt)}, indent=2)
        )
    torch.distributed.barrier()
    engine.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default="z2-fp32,z3-fp32")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    import deepspeed

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from fusion_model.strategies import skip_shared_memory_all_reduce

    skip_shared_memory_all_reduce()  # as training does: no op compiled for collectives gloo serves
    deepspeed.init_distributed(dist_backend="gloo")
    for variant in args.variants.split(","):
        make_variant(args.out, variant, args.size, args.steps)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # every shard is written: a rank's teardown can still abort in the communication library's destructors
    # ("terminate called without an active exception"), which fails the launch (fusion_model/processes.py)
    from fusion_model.processes import end_process

    end_process(0)
