"""The convert stage on real DeepSpeed ZeRO-2 / ZeRO-3 shards written by 2 processes on CPU.

The shards come from `tests/zero_shards.py` under torchrun (one launch per session makes every variant);
the reference for every tensor is DeepSpeed's own `get_fp32_state_dict_from_zero_checkpoint` on the same
shards and the weights rank 0 held when training ended.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tasks._io.hashing import sha256_file
from tasks.convert import convert
from tasks.convert.zero_layout import plan_source
from tasks.errors import StageError
from tasks.params import ConvertParams

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))
from zero_shards import TinyNet  # noqa: E402

VARIANTS = ("z2-fp32", "z3-fp32", "z2-bf16", "z3-bf16")
DS_PREFIX = "_forward_module.model."

pytestmark = pytest.mark.slow


def tiny_builder(config: dict) -> torch.nn.Module:
    return TinyNet(width=config["width"], depth=config["depth"])


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant's checkpoint folder, made by one 2-process torchrun launch (DeepSpeed on gloo)."""
    out = tmp_path_factory.mktemp("zero_shards")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(_free_port()),
           str(TESTS / "zero_shards.py"), "--out", str(out), "--variants", ",".join(VARIANTS)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def copy_variant(shards: Path, variant: str, dest: Path) -> Path:
    shutil.copytree(shards / variant, dest)
    return dest


def params(checkpoint_dir: Path, out_dir: Path, **kw) -> ConvertParams:
    return ConvertParams(checkpoint_dir=checkpoint_dir, out_dir=out_dir, **kw)


def tree_hashes(folder: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def deepspeed_reference(checkpoint: Path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="checkpoint")
    return {k.removeprefix(DS_PREFIX): v for k, v in state.items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_output_is_bit_equal_to_deepspeed_and_to_the_trained_weights(shards: Path, tmp_path: Path, variant: str) -> None:
    src = shards / variant
    before = tree_hashes(src)
    summary = convert(params(src, tmp_path / "model"), build_model=tiny_builder)
    assert summary.converted and summary.world_size == 2
    assert summary.zero_stage == int(variant[1])
    got = load_file(tmp_path / "model" / "model.safetensors")

    reference = deepspeed_reference(src / "best.ckpt")
    assert list(got) and set(got) == set(reference)
    for key, ref in reference.items():
        assert got[key].dtype == ref.dtype and torch.equal(got[key], ref), key
    # fp32 master weights even when training ran in bf16; the bf16 weights training used are their rounding.
    gathered = torch.load(src / "gathered.pt", weights_only=True)
    assert set(gathered) == set(got)
    for key, trained in gathered.items():
        assert got[key].dtype == (torch.float32 if trained.is_floating_point() else trained.dtype), key
        assert torch.equal(got[key].to(trained.dtype), trained), key
    if variant.endswith("bf16"):
        assert any(not torch.equal(got[k], gathered[k].float()) for k in got if got[k].is_floating_point())

    model = tiny_builder(json.loads((tmp_path / "model" / "model_config.json").read_text()))
    model.load_state_dict(got, strict=True)

    assert sorted(os.listdir(tmp_path / "model")) == ["manifest.json", "model.safetensors", "model_config.json"]
    manifest = json.loads((tmp_path / "model" / "manifest.json").read_text())
    assert manifest["source"]["zero_stage"] == int(variant[1]) and manifest["source"]["world_size"] == 2
    assert manifest["source"]["tag"] == "checkpoint"
    for entry in manifest["identity"]["files"]:
        assert entry["bytes"] == (src / entry["path"]).stat().st_size
    assert len(manifest["identity"]["files"]) == (3 if variant.startswith("z2") else 4)
    assert len(manifest["identity"]["layout_sha256"]) == 64
    assert manifest["output"]["sha256"] == sha256_file(tmp_path / "model" / "model.safetensors") == summary.sha256
    assert manifest["output"]["parameters"] == sum(p.numel() for p in model.parameters())
    assert manifest["verification"]["strict_load"] is True
    assert manifest["code_version"].startswith(("git:", "fusion-retrain=="))
    # the shards are read, never written, renamed or deleted
    assert tree_hashes(src) == before


@pytest.mark.parametrize(("variant", "missing"), [
    ("z2-fp32", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    ("z3-fp32", "zero_pp_rank_1_mp_rank_00_model_states.pt"),
    ("z3-bf16", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"),
])
def test_missing_shard_is_named(shards: Path, tmp_path: Path, variant: str, missing: str) -> None:
    src = copy_variant(shards, variant, tmp_path / "ckpt")
    (src / "best.ckpt" / "checkpoint" / missing).unlink()
    with pytest.raises(StageError) as err:
        convert(params(src, tmp_path / "model"), build_model=tiny_builder)
    message = str(err.value)
    assert str(src / "best.ckpt" / "checkpoint" / missing) in message
    assert "world size of 2" in message and "re-run training" in message
    assert not (tmp_path / "model" / "model.safetensors").exists()


def test_shard_of_a_third_rank_is_refused(shards: Path, tmp_path: Path) -> None:
    src = copy_variant(shards, "z2-fp32", tmp_path / "ckpt")
    tag = src / "best.ckpt" / "checkpoint"
    shutil.copy(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt", tag / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    with pytest.raises(StageError, match=r"ranks \[2\] exceed the recorded world size 2"):
        convert(params(src, tmp_path / "model"), build_model=tiny_builder)


def test_second_run_on_the_same_source_does_nothing(shards: Path, tmp_path: Path) -> None:
    src, out = shards / "z3-fp32", tmp_path / "model"
    first = convert(params(src, out), build_model=tiny_builder)
    stat = (out / "model.safetensors").stat()
    manifest = (out / "manifest.json").read_text()

    second = convert(params(src, out), build_model=tiny_builder)
    assert first.converted and not second.converted
    assert "up to date" in second.message and "source layout" in second.message
    assert second.sha256 == first.sha256
    assert (out / "model.safetensors").stat().st_ino == stat.st_ino
    assert (out / "model.safetensors").stat().st_mtime_ns == stat.st_mtime_ns
    assert (out / "manifest.json").read_text() == manifest

    # a damaged output no longer matches its manifest: converted again, not trusted
    with open(out / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\0\0\0\1")
    third = convert(params(src, out), build_model=tiny_builder)
    assert third.converted and sha256_file(out / "model.safetensors") == first.sha256

    # another source into the same folder is a new conversion
    fourth = convert(params(shards / "z2-fp32", out), build_model=tiny_builder)
    assert fourth.converted and fourth.zero_stage == 2


def _first_optimizer_tensor(shard: Path, key: str) -> tuple[int, int]:
    """(byte offset, bytes) in `shard` of the first tensor named `key` in its optimizer state."""
    from fusion_model.safe_load import load_meta

    zero = load_meta(shard)["optimizer_state_dict"]
    state = (zero.get("optimizer_state_dict") or zero["base_optimizer_state"])["state"]  # stage 3, stage 1/2
    tensor = next(v[key] for v in (state.values() if isinstance(state, dict) else state) if key in v)
    return tensor.untyped_storage()._checkpoint_offset + tensor.storage_offset() * 4, tensor.numel() * 4


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("variant", ["z2-fp32", "z3-fp32"])
def test_only_the_bytes_that_reach_the_model_decide_a_reconversion(shards: Path, tmp_path: Path, variant: str) -> None:
    """Adam's moments never reach the model file: changing them leaves the output up to date. A changed
    master weight of the same size (same layout) is read, found, and converted again."""
    src, out = copy_variant(shards, variant, tmp_path / "src"), tmp_path / "model"
    first = convert(params(src, out), build_model=tiny_builder)
    shard = next((src / "best.ckpt" / "checkpoint").glob("*optim_states.pt"))
    offset, size = _first_optimizer_tensor(shard, "exp_avg")
    _overwrite(shard, offset, bytes(range(8)) * (min(size, 64) // 8))
    moments = convert(params(src, out), build_model=tiny_builder)
    assert first.converted and not moments.converted and moments.sha256 == first.sha256

    plan = plan_source(src / "best.ckpt").tensors
    piece = next(p for t in plan if t.is_parameter for p in t.pieces if p.numel >= 4)
    _overwrite(piece.file, piece.offset, torch.tensor([0.25, -0.5, 1.5, 2.0]).numpy().tobytes())
    weights = convert(params(src, out), build_model=tiny_builder)
    assert weights.converted and weights.sha256 != first.sha256
    got = load_file(out / "model.safetensors")
    assert any(torch.equal(v.flatten()[:4], torch.tensor([0.25, -0.5, 1.5, 2.0])) for v in got.values())


def _worker(src: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(TESTS / "convert_worker.py"), str(src), str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.glob(f".{out.name}.*") if p.is_dir())


def test_kill_mid_write_leaves_no_output_and_the_next_run_succeeds(shards: Path, tmp_path: Path) -> None:
    src, out = shards / "z3-fp32", tmp_path / "model"
    proc = _worker(src, out, "--pause-after", "5")
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("PAUSED .model.incoming-"), line + proc.stderr.read()  # type: ignore[union-attr]
        staged = out.parent / line.split()[1]
        assert (staged / "model.safetensors").stat().st_size > 0
        assert not (out / "model.safetensors").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "model.safetensors").exists()
    assert not (out / "manifest.json").exists()

    summary = convert(params(src, out), build_model=tiny_builder)
    assert summary.converted
    assert _leftovers(out) == [], "the killed run's half-written folder is cleaned up"
    reference = deepspeed_reference(src / "best.ckpt")
    got = load_file(out / "model.safetensors")
    assert all(torch.equal(got[k], v) for k, v in reference.items())


def test_kill_while_replacing_keeps_the_previous_output(shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    convert(params(shards / "z2-fp32", out), build_model=tiny_builder)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    proc = _worker(shards / "z3-fp32", out, "--pause-after", "3")
    try:
        assert proc.stdout.readline().startswith("PAUSED")  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # all three files, as they were


def test_kill_right_after_the_swap_leaves_the_whole_new_output(shards: Path, tmp_path: Path) -> None:
    """The folder exchange is the one point where old becomes new: killed just after it, the new weights,
    config and manifest are all there together; the old folder's leftovers go with the next run."""
    out = tmp_path / "model"
    convert(params(shards / "z2-fp32", out), build_model=tiny_builder)
    proc = _worker(shards / "z3-fp32", out, "--pause-after-swap")
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("SWAPPED"), line + proc.stderr.read()  # type: ignore[union-attr]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["zero_stage"] == 3
    assert manifest["output"]["sha256"] == sha256_file(out / "model.safetensors")
    assert manifest["output"]["model_config_sha256"] == sha256_file(out / "model_config.json")
    assert _leftovers(out) == [line.split()[1]]  # the old folder, under its temporary name
    again = convert(params(shards / "z3-fp32", out), build_model=tiny_builder)
    assert not again.converted and _leftovers(out) == []


def test_two_concurrent_runs_convert_once_and_skip_once(shards: Path, tmp_path: Path) -> None:
    src, out = shards / "z2-fp32", tmp_path / "model"
    # ~0.3 s per tensor keeps the first run inside its lock while the second one arrives
    first = _worker(src, out, "--sleep-per-tensor", "0.3")
    second = _worker(src, out, "--sleep-per-tensor", "0.3")
    results = []
    for proc in (first, second):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    # both were inside convert() at the same time: the lock, not luck, made one of them skip
    assert max(r["entered"] for r in results) < min(r["left"] for r in results)
    assert sorted(r["converted"] for r in results) == [False, True]
    skipped = next(r for r in results if not r["converted"])
    assert "up to date" in skipped["message"]
    assert results[0]["sha256"] == results[1]["sha256"] == sha256_file(out / "model.safetensors")
    reference = deepspeed_reference(src / "best.ckpt")
    got = load_file(out / "model.safetensors")
    assert set(got) == set(reference) and all(torch.equal(got[k], v) for k, v in reference.items())


def test_lock_held_too_long_is_explained(shards: Path, tmp_path: Path) -> None:
    from filelock import FileLock

    out = tmp_path / "model"
    with FileLock(str(tmp_path / ".model.convert.lock")):
        with pytest.raises(StageError, match=r"\.model\.convert\.lock: another conversion has held this lock"):
            convert(params(shards / "z2-fp32", out, lock_timeout_s=0.2), build_model=tiny_builder)
    assert not (out / "model.safetensors").exists()


def test_model_that_does_not_match_the_checkpoint_is_refused(shards: Path, tmp_path: Path) -> None:
    out = tmp_path / "model"
    with pytest.raises(StageError) as err:
        convert(params(shards / "z2-fp32", out), build_model=lambda c: TinyNet(width=c["width"], depth=2))
    assert "strict=True" in str(err.value) and "blocks.1.weight" in str(err.value)
    assert not (out / "model.safetensors").exists() and _leftovers(out) == []


def test_keys_outside_the_model_prefix_are_named(shards: Path, tmp_path: Path) -> None:
    with pytest.raises(StageError, match=r"not under the model attribute `net\.`: _forward_module\.model\."):
        convert(params(shards / "z2-fp32", tmp_path / "model", model_prefix="net."), build_model=tiny_builder)


def test_missing_inputs_are_named(shards: Path, tmp_path: Path) -> None:
    src = copy_variant(shards, "z2-fp32", tmp_path / "ckpt")
    (src / "best.ckpt" / "latest").unlink()
    with pytest.raises(StageError, match=r"latest: missing; a DeepSpeed checkpoint folder names its tag"):
        convert(params(src, tmp_path / "model"), build_model=tiny_builder)
    (src / "model_config.json").unlink()
    with pytest.raises(StageError, match=r"model_config.json: missing. The train stage writes it beside the checkpoint"):
        convert(params(src, tmp_path / "model"), build_model=tiny_builder)
    with pytest.raises(StageError, match=r"nowhere/best.ckpt: no such checkpoint"):
        shutil.copy(shards / "z2-fp32" / "model_config.json", tmp_path / "model_config.json")
        shutil.copy(shards / "z2-fp32" / "train_summary.json", tmp_path / "train_summary.json")
        convert(params(tmp_path, tmp_path / "model", checkpoint_name="nowhere/best.ckpt"), build_model=tiny_builder)


def test_truncated_shard_is_refused_with_its_name(shards: Path, tmp_path: Path) -> None:
    src = copy_variant(shards, "z3-fp32", tmp_path / "ckpt")
    shard = src / "best.ckpt" / "checkpoint" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(StageError, match=rf"{shard}: cannot be read as a torch checkpoint with weights_only=True"):
        convert(params(src, tmp_path / "model"), build_model=tiny_builder)


def test_diverged_weights_are_refused(shards: Path, tmp_path: Path) -> None:
    src = copy_variant(shards, "z2-fp32", tmp_path / "ckpt")
    shard = src / "best.ckpt" / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    state = torch.load(shard, weights_only=False)  # our own test file: rewrite one master weight as NaN
    with torch.no_grad():
        state["optimizer_state_dict"]["single_partition_of_fp32_groups"][0][0] = float("nan")
    torch.save(state, shard)
    with pytest.raises(StageError, match=r"1 tensor\(s\) hold NaN or inf \(embed.weight\): training diverged"):
        convert(params(src, tmp_path / "model"), build_model=tiny_builder)
    assert not (tmp_path / "model" / "model.safetensors").exists()


def test_plain_lightning_checkpoint_passes_through(tmp_path: Path) -> None:
    """ddp / ddp_spawn save one file; bf16 tensors in it still come out fp32."""
    torch.manual_seed(0)
    model = TinyNet()
    state = {"model." + k: (v.bfloat16() if k == "head.bias" else v) for k, v in model.state_dict().items()}
    torch.save({"state_dict": state, "epoch": 1, "global_step": 7, "pytorch-lightning_version": "2.6.6"},
               tmp_path / "best.ckpt")
    (tmp_path / "model_config.json").write_text(json.dumps({"width": 13, "depth": 1}))
    (tmp_path / "train_summary.json").write_text(json.dumps({"strategy": "ddp", "world_size": 2}))
    summary = convert(params(tmp_path, tmp_path / "model"), build_model=tiny_builder)
    assert summary.converted and summary.kind == "lightning" and summary.zero_stage is None
    got = load_file(tmp_path / "model" / "model.safetensors")
    for key, value in model.state_dict().items():
        expected = value.bfloat16().float() if key == "head.bias" else value
        assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), key


# ---------------------------------------------------------------- checkpoints written by the train stage


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The train stage's own output (timm `test_resnet`, 32 px, 2 ranks, 2 steps) for ZeRO-2, ZeRO-3 and
    ddp; the ZeRO runs also save the fp32 weights gathered across ranks when fit ended."""
    from fusion_model.config import TrainConfig
    from tasks.train import train
    from tests.validated_tables import make_validated

    root = tmp_path_factory.mktemp("trained")
    data_dir = make_validated(root / "data", n_train=32, n_val=16, n_test=16)
    runs = {"z2": {"strategy": "deepspeed", "zero_stage": 2}, "z3": {"strategy": "deepspeed", "zero_stage": 3},
            "ddp": {"strategy": "ddp"}}
    out = {}
    for name, overrides in runs.items():
        ckpt = root / name
        if name != "ddp":  # a ddp rank holds the full weights already: its checkpoint is the reference
            # beside the run's folder, not in it: the folder is replaced whole when the run succeeds
            overrides = {**overrides, "save_gathered_weights": root / f"{name}.gathered.safetensors"}
        train(TrainConfig.model_validate({
            "data_dir": data_dir, "out_dir": ckpt, "live_dir": root / f"{name}.training",
            "image_model": "test_resnet", "image_size": 32,
            "text_buckets": 1024, "cat_dim": 4, "adapter_dim": 8, "hidden_sizes": [16],
            "batch_size": 8, "max_epochs": 1, "max_steps": 2, "devices": 2, "accelerator": "cpu",
            **overrides,
        }))
        out[name] = ckpt
    return out


def _fusion_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from fusion_model.layout import DEEPSPEED_PREFIX, MODEL_PREFIX

    return {k.removeprefix(DEEPSPEED_PREFIX).removeprefix(MODEL_PREFIX): v for k, v in state.items()}


def test_model_prefix_default_is_the_lightning_modules_attribute() -> None:
    from fusion_model.layout import MODEL_PREFIX
    from fusion_model.module import FusionModule

    module = FusionModule({"image_model": "test_resnet", "cat_cardinalities": [3], "n_numeric": 1, "num_classes": 2,
                           "image_size": 32, "text_buckets": 64, "cat_dim": 2, "adapter_dim": 4,
                           "hidden_sizes": [4]}, lr=1e-3, weight_decay=0.0)
    keys = list(module.state_dict())
    assert keys and all(k.startswith(ConvertParams().model_prefix) for k in keys), keys[:5]
    assert ConvertParams().model_prefix == MODEL_PREFIX


@pytest.mark.parametrize("run", ["z2", "z3", "ddp"])
def test_train_stage_checkpoint_converts_to_a_loadable_fusion_model(trained: dict[str, Path], tmp_path: Path,
                                                                   run: str) -> None:
    from fusion_model.predict import Predictor, build_model

    src, out = trained[run], tmp_path / "model"
    before = tree_hashes(src)
    summary = convert(params(src, out))  # the default model builder: fusion_model.predict.build_model
    assert summary.converted and summary.kind == ("lightning" if run == "ddp" else "deepspeed_zero")
    got = load_file(out / "model.safetensors")

    model = build_model(json.loads((out / "model_config.json").read_text()))
    assert set(got) == set(model.state_dict())
    model.load_state_dict(got, strict=True)
    if run != "ddp":
        gathered = load_file(src.parent / f"{run}.gathered.safetensors")
        assert set(gathered) == set(got)
        for key, value in gathered.items():
            assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
        reference = _fusion_keys(deepspeed_reference(src / "best.ckpt"))
        assert set(reference) == set(got)
        for key, value in reference.items():
            assert torch.equal(got[key], value), key
    else:
        lightning = torch.load(src / "best.ckpt", map_location="cpu", weights_only=True)["state_dict"]
        assert all(torch.equal(got[k], v.float() if v.is_floating_point() else v) for k, v in _fusion_keys(lightning).items())
    Predictor.load(out)  # what evaluation and prediction do: strict load of this folder only
    assert tree_hashes(src) == before


def test_cli_converts_once_then_skips_and_reports_errors(trained: dict[str, Path], shards: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from tasks.__main__ import main

    out = tmp_path / "model"
    argv = ["convert", "--checkpoint-dir", str(trained["z3"]), "--out-dir", str(out)]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["converted"] is True
    assert main(argv) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["converted"] is False and "up to date" in second["message"]

    broken = copy_variant(shards, "z2-fp32", tmp_path / "broken")
    missing = broken / "best.ckpt" / "checkpoint" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    missing.unlink()
    assert main(["convert", "--checkpoint-dir", str(broken), "--out-dir", str(tmp_path / "m2")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: convert: ") and str(missing) in err and "Traceback" not in err
