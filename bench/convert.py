"""Peak memory and wall time of ZeRO -> fp32 conversion: the convert stage vs DeepSpeed's and Lightning's.

    python bench/convert.py [--work DIR] [--size big] [--variants z2-fp32,z3-fp32] [--repeats 1]
    python bench/convert.py --checkpoint DIR [--checkpoint-name last.ckpt]   # a train stage's own ZeRO run

With --checkpoint, the shards are a training run's (e.g. bench/zero_memory.py's 335M-parameter ZeRO-3 run,
`--checkpoint /tmp/zero_memory/runs/z3/ckpt`), `ours` builds the fusion model of its model_config.json for
the strict check, and the outputs of `ours` and DeepSpeed's safetensors converter are compared tensor by
tensor (bit-equal, keys without the training module's prefixes).

Makes (once, reused from --work) 2-rank ZeRO-2 and ZeRO-3 checkpoints of a ~336 MB fp32 model on CPU with
`tests/zero_shards.py` under torchrun, then runs every converter in its own fresh subprocess on the same
warm shards:

- `ours`: `tasks.convert.convert` (checks, shard hashing, streaming write, fsync, verification, manifest);
- `ds_state_dict+save`: `get_fp32_state_dict_from_zero_checkpoint` + `torch.save`;
- `ds_convert_safetensors`: `convert_zero_checkpoint_to_fp32_state_dict(..., safe_serialization=True)`;
- `lightning`: `lightning.pytorch.utilities.deepspeed.convert_zero_checkpoint_to_fp32_state_dict`;
- `sha256_of_shards`: only hashing every shard file (what the manifest and the skip check need), for scale.

Memory figure = (peak RSS of the converter's process during the call - RSS of a process that only imports
torch and deepspeed) / fp32 model bytes; the peak mark is reset after the imports, whose own transient peak
is larger than some conversions'. Wall time is the conversion call alone (imports excluded). Prints a table
and the ratios against the goals (memory <= 1.25x, time <= DeepSpeed's fastest).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("ours", "ds_state_dict+save", "ds_convert_safetensors", "lightning", "sha256_of_shards")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    """Set the peak-RSS mark (VmHWM) to the current RSS, so the peak measured is the conversion's own and
    not the transient peak of importing torch and deepspeed (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def child(method: str, src: Path, out: Path, name: str = "best.ckpt", fusion: bool = False) -> None:
    """Runs in the measured subprocess; prints one JSON line."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: F401  (the baseline imports both)
    import torch

    torch.set_num_threads(1)
    if method == "lightning":
        from lightning.pytorch.utilities.deepspeed import (
            convert_zero_checkpoint_to_fp32_state_dict as lightning_convert,
        )
    tag = None if fusion else "checkpoint"  # a training run's: the shards' own `latest` file names it
    if fusion and method in ("baseline", "ours"):
        # the libraries the strict check builds the fusion model with (its text transformer's too): imports,
        # measured in the baseline as well, not memory the conversion holds
        sys.path.insert(0, str(ROOT))
        import rtdl_num_embeddings  # noqa: F401
        import tabm  # noqa: F401
        import timm  # noqa: F401
        import transformers  # noqa: F401
        from transformers import AutoModel  # noqa: F401

        text = (json.loads((src / "model_config.json").read_text())["model"].get("text_model") or {}).get("config")
        if text:  # the transformer's own module (transformers imports each architecture on first use)
            kind = text["model_type"].replace("-", "_")
            __import__(f"transformers.models.{kind}.modeling_{kind}")

        import fusion_model.predict  # noqa: F401
        import tasks.convert  # noqa: F401
    if method == "ours":
        sys.path.insert(0, str(ROOT))
        sys.path.insert(0, str(ROOT / "tests"))
        from zero_shards import TinyNet

        from tasks.convert import convert
        from tasks.params import ConvertParams

        builder = None if fusion else (lambda c: TinyNet(width=c["width"], depth=c["depth"]))
    out.mkdir(parents=True, exist_ok=True)
    after_imports = _status_kib("VmRSS")
    _reset_peak()
    start = time.perf_counter()
    if method == "baseline":
        pass
    elif method == "sha256_of_shards":
        from concurrent.futures import ThreadPoolExecutor

        sys.path.insert(0, str(ROOT))
        from tasks._io.hashing import sha256_file

        files = sorted((src / name).rglob("*.pt"))
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(sha256_file, files))
    elif method == "ours":
        summary = convert(ConvertParams(checkpoint_dir=src, checkpoint_name=name, out_dir=out), build_model=builder)
        assert summary.converted, summary.message
    elif method == "ds_state_dict+save":
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(src / name), tag=tag)
        torch.save(state, out / "pytorch_model.bin")
    elif method == "ds_convert_safetensors":
        from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

        convert_zero_checkpoint_to_fp32_state_dict(str(src / name), str(out), safe_serialization=True, tag=tag)
    elif method == "lightning":
        lightning_convert(str(src / name), str(out / "lightning.ckpt"), tag=tag)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM")  # includes mapped file pages (DeepSpeed mmaps the shards)
    print(json.dumps({"method": method, "seconds": seconds, "peak_kib": peak, "after_imports_kib": after_imports}))


def _run_child(method: str, src: Path, out: Path, name: str = "best.ckpt", fusion: bool = False,
               keep: bool = False) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    extra = ["--checkpoint-name", name] + (["--fusion"] if fusion else [])
    done = subprocess.run([sys.executable, __file__, "--child", method, "--src", str(src), "--out", str(out), *extra],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not keep:
        shutil.rmtree(out, ignore_errors=True)
    return result


def _bit_equal(ours: Path, deepspeed: Path) -> tuple[int, list[str]]:
    """Tensors compared, and the keys that differ (or are missing on either side), one tensor at a time."""
    import torch
    from safetensors import safe_open

    prefixes = ("_forward_module.model.", "model.")
    theirs_files = sorted(deepspeed.glob("*.safetensors"))
    theirs: dict[str, Path] = {}
    for f in theirs_files:
        with safe_open(str(f), "pt") as h:
            for key in h.keys():
                plain = next((key[len(p):] for p in prefixes if key.startswith(p)), key)
                theirs[plain] = f
    differ: list[str] = []
    with safe_open(str(ours / "model.safetensors"), "pt") as mine:
        keys = list(mine.keys())
        for key in keys:
            if key not in theirs:
                differ.append(f"{key} (not in DeepSpeed's)")
                continue
            with safe_open(str(theirs[key]), "pt") as h:
                other = next(k for k in h.keys() if next((k[len(p):] for p in prefixes if k.startswith(p)), k) == key)
                if not torch.equal(mine.get_tensor(key), h.get_tensor(other)):
                    differ.append(key)
    floating = {k for k in theirs if k not in keys}
    return len(keys), differ + [f"{k} (not in ours)" for k in sorted(floating)]


def _make_shards(work: Path, size: str, variants: list[str]) -> None:
    missing = [v for v in variants if not (work / v / "best.ckpt" / "latest").is_file()]
    if not missing:
        return
    print(f"making {', '.join(missing)} shards in {work} (2 ranks on CPU) ...", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29655",
           str(ROOT / "tests" / "zero_shards.py"), "--out", str(work), "--variants", ",".join(missing),
           "--size", size, "--steps", "1"]
    subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"},
                   stdout=subprocess.DEVNULL)


def _warm(folder: Path) -> None:
    """Read every shard once so every converter starts from the same page cache."""
    for path in folder.rglob("*.pt"):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def _model_bytes(src: Path, name: str = "best.ckpt", fusion: bool = False) -> int:
    import torch

    if fusion:  # the shards' own plan: every output tensor's bytes
        sys.path.insert(0, str(ROOT))
        from tasks.convert.zero_layout import plan_source

        return sum(t.nbytes for t in plan_source(src / name).tensors)

    sys.path.insert(0, str(ROOT / "tests"))
    from zero_shards import TinyNet

    config = json.loads((src / "model_config.json").read_text())
    with torch.device("meta"):
        model = TinyNet(width=config["width"], depth=config["depth"])
    return sum(t.numel() * 4 for t in model.state_dict().values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/convert_bench"))
    parser.add_argument("--size", default="big")
    parser.add_argument("--variants", default="z2-fp32,z3-fp32")
    parser.add_argument("--repeats", type=int, default=1, help="runs per method; the best time and lowest peak")
    parser.add_argument("--child", choices=("baseline", *METHODS))
    parser.add_argument("--src", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--checkpoint", type=Path, help="a train stage's out_dir holding a ZeRO checkpoint")
    parser.add_argument("--checkpoint-name", default="best.ckpt")
    parser.add_argument("--fusion", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.src, args.out, args.checkpoint_name, args.fusion)
        return

    fusion = args.checkpoint is not None
    name = args.checkpoint_name if fusion else "best.ckpt"
    variants = [str(args.checkpoint)] if fusion else args.variants.split(",")
    if not fusion:
        _make_shards(args.work, args.size, variants)
    load = os.getloadavg()
    print(f"load average before: {load[0]:.2f} (2 cores); other work on the machine inflates times")
    rows = []
    for variant in variants:
        src = Path(variant) if fusion else args.work / variant
        model_bytes = _model_bytes(src, name, fusion)
        _warm(src / name)
        base = min(_run_child("baseline", src, args.work / "out", name, fusion)["after_imports_kib"]
                   for _ in range(args.repeats))
        for method in METHODS:
            runs = [_run_child(method, src, args.work / "out", name, fusion) for _ in range(args.repeats)]
            peak = min(r["peak_kib"] for r in runs)
            seconds = min(r["seconds"] for r in runs)
            rows.append({"variant": variant, "method": method, "seconds": round(seconds, 2),
                         "memory_x": round((peak - base) * 1024 / model_bytes, 2),
                         "peak_mib": round(peak / 1024), "baseline_mib": round(base / 1024),
                         "model_mib": round(model_bytes / 2**20)})
    print(f"\n{'variant':9} {'method':24} {'time s':>7} {'memory x':>9} {'peak MiB':>9} {'base MiB':>9} {'model MiB':>9}")
    for r in rows:
        print(f"{r['variant']:9} {r['method']:24} {r['seconds']:7.2f} {r['memory_x']:9.2f} {r['peak_mib']:9} "
              f"{r['baseline_mib']:9} {r['model_mib']:9}")
    print()
    for variant in variants:
        ours = next(r for r in rows if r["variant"] == variant and r["method"] == "ours")
        ds_fastest = min(r["seconds"] for r in rows if r["variant"] == variant and r["method"].startswith("ds_"))
        ds_safetensors = next(r["seconds"] for r in rows
                              if r["variant"] == variant and r["method"] == "ds_convert_safetensors")
        hashing = next(r for r in rows if r["variant"] == variant and r["method"] == "sha256_of_shards")
        print(f"{variant}: ours memory {ours['memory_x']:.2f}x (goal <= 1.25x: "
              f"{'met' if ours['memory_x'] <= 1.25 else 'NOT met'}); time {ours['seconds']:.2f} s vs DeepSpeed's "
              f"fastest {ds_fastest:.2f} s = {ours['seconds'] / ds_fastest:.2f}x (goal <= 1.0x: "
              f"{'met' if ours['seconds'] <= ds_fastest else 'NOT met'}); hashing the shards alone (for the "
              f"manifest and the skip check) takes {hashing['seconds']:.2f} s; against DeepSpeed's "
              f"zero_to_fp32 --safe_serialization (the same output format): "
              f"{ours['seconds'] / ds_safetensors:.2f}x")
    if fusion:  # bit-equal to DeepSpeed's own conversion of the same shards
        src = Path(variants[0])
        _run_child("ours", src, args.work / "ours", name, fusion, keep=True)
        _run_child("ds_convert_safetensors", src, args.work / "deepspeed", name, fusion, keep=True)
        compared, differ = _bit_equal(args.work / "ours", args.work / "deepspeed")
        print(f"bit-equal to DeepSpeed's safetensors: {compared} tensors compared, {len(differ)} differ"
              + (f": {differ[:5]}" if differ else ""))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
