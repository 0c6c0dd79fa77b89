"""Training throughput on CPU: each strategy (2 processes) against a plain PyTorch loop, in one run.

    python bench/train_throughput.py [--steps 30] [--precision 32-true] [--image-model resnet18]

The plain loop is one process with one rank's resources (threads_per_rank threads, the per-device batch)
on the same model, data and optimizer; each strategy is printed as a ratio to 2 x that rate, the ideal for
2 processes, so a ratio below 1 is the cost of the distribution machinery. (One process with 2 threads is
no fair baseline on a shared 2-core machine: its OpenMP threads spin-wait on each other, measured 20x
slower per step at load 9.) Rates exclude start-up, validation and the first steps (warm-up).
Prints one line per run and a JSON list at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fusion_model.config import TrainConfig  # noqa: E402
from tasks.train import train  # noqa: E402
from tests.validated_tables import make_validated  # noqa: E402


def plain_loop(cfg: TrainConfig, steps: int, warmup: int) -> float:
    """samples/s of a hand-written loop in one process: same model, data pipeline and optimizer."""
    from torch.utils.data import DataLoader

    from fusion_model.build import model_kwargs
    from fusion_model.data import FusionDataset, ValidatedData
    from fusion_model.module import FusionModule
    from fusion_model.preprocess import Preprocessor

    torch.set_num_threads(cfg.threads_per_rank)
    torch.manual_seed(cfg.seed)
    data = ValidatedData.read(cfg.data_dir)
    pre = Preprocessor.fit(data.train, data.schema, text_buckets=cfg.text_buckets, image_size=cfg.image_size,
                           image_index=cfg.image_index)
    kwargs = model_kwargs(cfg, pre, len(data.classes), list(cfg.modalities), data.problem_type)
    model = FusionModule(kwargs, lr=cfg.lr, weight_decay=cfg.weight_decay).model.train()
    loader = DataLoader(FusionDataset(data.train, pre, data.dataset_root, train=True, labels=data.labels(data.train)),
                        batch_size=cfg.batch_size, shuffle=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    autocast = cfg.precision == "bf16-mixed"
    done, started = 0, 0.0
    while done < steps + warmup:
        for batch in loader:
            if done == warmup:
                started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model.loss(model(batch), batch["label"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            done += 1
            if done == steps + warmup:
                break
    return steps * cfg.batch_size / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run (after 2 warm-up steps)")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    parser.add_argument("--image-model", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8, help="per device")
    parser.add_argument("--runs", default="plain,ddp_spawn,ddp,zero2,zero3",
                        help="comma list of plain, ddp_spawn, ddp, zero2, zero3, zero2_default_buckets")
    args = parser.parse_args()
    world = 2
    rows = (args.steps + 4) * args.batch_size * world
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = make_validated(Path(tmp), n_train=rows, n_val=16, n_test=16)
        base = TrainConfig(
            data_dir=data_dir, out_dir=Path(tmp) / "ckpt", live_dir=Path(tmp) / "training", image_model=args.image_model,
            image_size=args.image_size, batch_size=args.batch_size, max_epochs=1, max_steps=args.steps + 2,
            devices=world, accelerator="cpu", precision=args.precision, threads_per_rank=1,
        )
        variants = {
            "ddp_spawn": {"strategy": "ddp_spawn"},
            "ddp": {"strategy": "ddp"},
            "zero2": {"strategy": "deepspeed", "zero_stage": 2},
            "zero3": {"strategy": "deepspeed", "zero_stage": 3},
            # DeepSpeed's own bucket default, to show what the smaller bucket buys
            "zero2_default_buckets": {"strategy": "deepspeed", "zero_stage": 2, "zero_bucket_size": 500_000_000},
        }
        results: list[dict[str, object]] = []
        plain_rates: list[float] = []
        runs = args.runs.split(",")
        if "plain" in runs:  # once first and once last: on a shared machine the spread shows the noise
            runs = ["plain", *[r for r in runs if r != "plain"], "plain"]
        for run in runs:
            started = time.perf_counter()
            if run == "plain":
                rate = plain_loop(base, args.steps, warmup=2)
                plain_rates.append(rate)
            else:
                summary = train(base.model_copy(update=variants[run]))
                rate = summary.samples_per_s or 0.0
            row = {"run": run, "samples_per_s": round(rate, 2), "wall_s": round(time.perf_counter() - started, 1),
                   "precision": args.precision, "model": args.image_model, "batch_per_device": args.batch_size}
            results.append(row)
            steps_per_s = rate / args.batch_size / (1 if run == "plain" else world)
            print(f"{run:>22}: {rate:8.2f} samples/s ({steps_per_s:5.2f} it/s)", flush=True)
        plain = world * sum(plain_rates) / len(plain_rates) if plain_rates else None
        if plain:
            print(f"\nplain loop (1 process): {', '.join(f'{r:.2f}' for r in plain_rates)} samples/s (first, last);"
                  f" ratio to {world} x their mean = {plain:.2f}:")
            for row in results:
                row["ratio_to_ideal"] = round(float(row["samples_per_s"]) / plain, 3)
                print(f"{row['run']:>22}: {row['ratio_to_ideal']:.2f}")
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
