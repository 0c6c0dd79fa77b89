"""What ZeRO saves per rank on a fusion model of 300M+ parameters: ddp, ZeRO-2, ZeRO-3, ZeRO-3 + offload.

    python bench/zero_memory.py [--work DIR] [--layers 24] [--hidden 1024] [--steps 3] [--runs ddp,z2,z3,z3-offload]

The model: timm's test_resnet for the photos and a BERT-large-sized text transformer (24 layers, hidden
1024, 30522-token embedding: ~335M parameters), randomly initialised from a local config and saved with
`save_pretrained` (nothing downloaded), fused as train.text_model. Each run trains 2 CPU ranks for a few
steps through the train stage, batch 2 per rank, 32 tokens per row, fp32; train_summary.json's `memory`
gives each rank's parameter, gradient and optimizer bytes at the end and its peak resident memory. Prints a
table and the ratios the goal is about (ZeRO-3's largest per-rank peak over DDP's and over ZeRO-2's), and
writes bench/results/zero_memory.json. Needs ~20 GB of free memory (DDP holds 16 bytes per parameter on
each rank).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {
    "ddp": {"strategy": "ddp"},
    "z2": {"strategy": "deepspeed", "zero_stage": 2},
    "z3": {"strategy": "deepspeed", "zero_stage": 3},
    "z3-offload": {"strategy": "deepspeed", "zero_stage": 3, "offload_optimizer": True, "offload_param": True},
}
GB = 1e9


def make_inputs(work: Path, layers: int, hidden: int) -> tuple[Path, Path]:
    """The validated table and the text model folder (made once, reused from `work`)."""
    import pandas as pd

    from tests.tiny_text_model import make_text_model
    from tests.validated_tables import make_validated

    data = work / "data" / "validated"
    if not (data / "meta.json").is_file():
        data = make_validated(work / "data", n_train=48, n_val=8, n_test=8)
    folder = work / f"bert-{layers}x{hidden}"
    if not (folder / "config.json").is_file():
        texts = pd.read_parquet(data / "train.parquet")["Description"].tolist()
        make_text_model(folder, texts, hidden=hidden, layers=layers, heads=max(2, hidden // 64),
                        intermediate=4 * hidden, vocab_size=30522, max_positions=512)
    return data, folder


def run(name: str, data: Path, folder: Path, work: Path, steps: int) -> dict:
    from fusion_model.config import TrainConfig
    from tasks.train import train

    out = work / "runs" / name
    started = time.perf_counter()
    train(TrainConfig.model_validate({
        "data_dir": data, "out_dir": out / "ckpt", "live_dir": out / "training", "image_model": "test_resnet",
        "image_size": 32, "text_model": str(folder), "text_max_tokens": 32, "batch_size": 2, "max_epochs": 1,
        "max_steps": steps, "refit": False, "linear_member": False, "devices": 2, "accelerator": "cpu",
        "precision": "32-true", **RUNS[name]}))
    summary = json.loads((out / "ckpt" / "train_summary.json").read_text())
    return {"run": name, "wall_s": round(time.perf_counter() - started, 1), "ranks": summary["memory"],
            "checkpoint": str(out / "ckpt" / summary["last_checkpoint"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/zero_memory"))
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", default=",".join(RUNS))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    data, folder = make_inputs(args.work, args.layers, args.hidden)
    from transformers import AutoConfig, AutoModel

    with __import__("torch").device("meta"):
        params = sum(p.numel() for p in AutoModel.from_config(AutoConfig.from_pretrained(folder)).parameters())
    results = []
    for name in args.runs.split(","):
        print(f"== {name}", flush=True)
        results.append(run(name, data, folder, args.work, args.steps))
    print(f"\ntext transformer: {params / 1e6:.0f}M parameters ({params * 4 / GB:.2f} GB fp32); 2 CPU ranks")
    print(f"{'run':>11} | {'rank':>4} | {'peak RSS GB':>11} | {'params GB':>9} | {'grads GB':>8} | "
          f"{'optimizer GB':>12} | {'held GB':>7}")
    for r in results:
        for m in r["ranks"]:
            print(f"{r['run']:>11} | {m['rank']:>4} | {m['peak_rss'] / GB:>11.2f} | {m['params'] / GB:>9.2f} | "
                  f"{m['grads'] / GB:>8.2f} | {m['optimizer'] / GB:>12.2f} | {m['total'] / GB:>7.2f}")
    peak = {r["run"]: max(m["peak_rss"] for m in r["ranks"]) for r in results}
    if {"ddp", "z3"} <= set(peak):
        print(f"\nZeRO-3 largest peak / DDP's: {peak['z3'] / peak['ddp']:.2f} (goal <= 0.6)")
    if {"z2", "z3"} <= set(peak):
        print(f"ZeRO-3 largest peak / ZeRO-2's: {peak['z3'] / peak['z2']:.2f} (goal < 1)")
    out = ROOT / "bench" / "results" / "zero_memory.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"text_params": params, "runs": results}, indent=2))
    print("->", out)


if __name__ == "__main__":
    main()
