"""The train stage end to end: real process groups of 2 ranks on CPU (gloo), real ZeRO shards.

Each run trains timm's `test_resnet` at 32 px on the tiny validated folder: 3 steps per epoch.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from fusion_model.config import TrainConfig
from tasks._io.ports import free_port
from tasks.errors import StageError
from tasks.train import TrainSummary, train
from tasks.train.stage import staging_dir

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data_dir(tiny_validated: Path) -> Path:
    """The generated dataset after the real validate stage (192 train / 48 val rows at 32 px)."""
    return tiny_validated


def _config(data_dir: Path, out_dir: Path, **overrides: object) -> TrainConfig:
    base: dict[str, object] = {
        "data_dir": data_dir, "out_dir": out_dir, "live_dir": out_dir.parent / "training",
        "image_model": "test_resnet", "image_size": 32,
        "text_buckets": 1024, "cat_dim": 4, "adapter_dim": 16, "hidden_sizes": [32],
        "batch_size": 32, "max_epochs": 1, "devices": 2, "accelerator": "cpu", "threads_per_rank": 1,
    }
    return TrainConfig.model_validate({**base, **overrides})


def _processes_mentioning(text: str) -> list[psutil.Process]:
    """Live processes whose command line names `text` (ranks orphaned by their launcher included)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in a for a in (p.info["cmdline"] or [])):
            found.append(p)
    return found


def _listening_while(run):
    """Run `run()` in a thread and sample, every 0.1 s, the TCP sockets its process tree listens on."""
    result: dict[str, object] = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", run()))
    thread.start()
    seen: set[tuple[str, int]] = set()
    me = psutil.Process()
    while thread.is_alive():
        for proc in me.children(recursive=True):
            try:
                seen |= {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN}
            except psutil.Error:
                continue
        time.sleep(0.1)
    thread.join()
    return result.get("value"), seen


def _assert_loopback_only(listening: set[tuple[str, int]]) -> None:
    assert listening, "no listening socket was seen: the sampling missed the run"
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::1"}, f"listening beyond loopback: {sorted(listening)}"


def _assert_zero_folder(folder: Path, stage: int, world: int = 2) -> None:
    assert (folder / "latest").read_text().strip() == "checkpoint"
    ckpt = folder / "checkpoint"
    optim = sorted(p.name for p in ckpt.glob("*optim_states.pt"))
    assert optim == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(world)]
    models = sorted(p.name for p in ckpt.glob("*model_states.pt"))
    if stage == 3:
        assert models == [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(world)]
    else:
        assert models == ["mp_rank_00_model_states.pt"]


def _assert_outputs(out: Path, summary: TrainSummary, strategy: str) -> None:
    assert summary.strategy == strategy and summary.world_size == 2 and summary.steps > 0
    on_disk = json.loads((out / "train_summary.json").read_text())
    assert on_disk["world_size"] == 2 and on_disk["steps"] == summary.steps
    assert summary.best_score is not None and summary.metric == "roc_auc" and summary.monitor == "val/roc_auc"
    assert summary.samples_per_s and summary.samples_per_s > 0
    config = json.loads((out / "model_config.json").read_text())
    assert config["model"]["image_model"] == "test_resnet" and config["classes"] == [0, 1]
    assert config["preprocess"]["numeric_mean"] and config["metric"] == "roc_auc"


def test_ddp_spawn_ranks_end_before_their_interpreters_teardown(data_dir: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished rank's teardown can abort in gloo's C++ destructors (SIGABRT), which failed the finished run:
    here every rank ddp_spawn starts aborts in its teardown (a sitecustomize module, imported by every Python
    started with this PYTHONPATH), and the run still succeeds."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent("""
        import atexit, os, sys
        if "--multiprocessing-fork" in sys.argv:  # a process multiprocessing's spawn started: a rank
            atexit.register(os.abort)
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "ckpt"
    summary = train(_config(data_dir, out, strategy="ddp_spawn"))
    assert summary.epochs == 1 and (out / "best.ckpt").is_file() and (out / "last.ckpt").is_file()


def test_flow_like_caller_runs_once_while_ddp_spawn_trains_two_ranks(data_dir: Path, tmp_path: Path) -> None:
    """Lightning's spawn re-imports the main module in each rank; the caller's body must still run once."""
    counter = tmp_path / "body_runs.txt"
    out = tmp_path / "ckpt"
    cfg = _config(data_dir, out, strategy="ddp_spawn")
    script = tmp_path / "flow_like.py"
    script.write_text(textwrap.dedent(f"""
        import json, logging, sys
        from fusion_model.config import TrainConfig
        from tasks.train import train
        with open({str(counter)!r}, "a") as f:  # the flow body: must run exactly once
            f.write("ran\\n")
        lines = []
        class Collect(logging.Handler):
            def emit(self, record): lines.append(record.getMessage())
        logger = logging.getLogger("flow"); logger.addHandler(Collect()); logger.setLevel(logging.INFO)
        summary = train(TrainConfig.model_validate_json({cfg.model_dump_json()!r}), logger=logger)
        print("SUMMARY", summary.model_dump_json())
        print("STREAMED", json.dumps([l for l in lines if l.startswith("[train]")]))
    """))
    proc, listening = _listening_while(
        lambda: subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=ROOT))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert counter.read_text() == "ran\n"
    _assert_loopback_only(listening)  # rank 0 hosts the store under ddp_spawn: on MASTER_ADDR only
    summary = TrainSummary.model_validate_json(proc.stdout.split("SUMMARY ", 1)[1].splitlines()[0])
    _assert_outputs(out, summary, "ddp_spawn")
    streamed = json.loads(proc.stdout.split("STREAMED ", 1)[1].splitlines()[0])
    assert any("epoch 1/1 done" in line for line in streamed)  # progress reached the caller's logger
    assert (out / "best.ckpt").is_file() and (out / "last.ckpt").is_file()
    state = torch.load(out / "best.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    assert all(k.startswith("model.") for k in state)


@pytest.fixture(scope="module")
def finished_ddp(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, TrainSummary]:
    """One finished ddp run (torchrun, 2 ranks, 1 epoch): its out_dir and summary. Copy it to change it."""
    out = tmp_path_factory.mktemp("finished_ddp") / "ckpt"
    return out, train(_config(data_dir, out, strategy="ddp", max_epochs=2))


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_ddp_torchrun_two_ranks_leaves_a_checkpoint(finished_ddp: tuple[Path, TrainSummary]) -> None:
    out, summary = finished_ddp
    _assert_outputs(out, summary, "ddp")
    assert (out / "best.ckpt").is_file() and (out / "last.ckpt").is_file()
    assert "[train] finished" in (out / "train.log").read_text()  # the ranks' log is kept next to the outputs
    assert not staging_dir(_config(out.parent, out)).exists()  # the staging folder became out_dir
    summary_file = json.loads((out / "train_summary.json").read_text())
    assert (summary_file["best_checkpoint"], summary_file["last_checkpoint"]) == ("best.ckpt", "last.ckpt")


def test_dvclive_logs_one_value_per_epoch_and_the_curves_png(finished_ddp: tuple[Path, TrainSummary]) -> None:
    """DVCLive as the Lightning logger: its series are what DVC reads (dvc.yaml metrics/plots of train)."""
    from tasks.train.curves import per_epoch, read_series

    out, summary = finished_ddp
    live = out.parent / "training"
    assert not (out / "dvclive").exists()  # moved out of the checkpoint folder, into train.live_dir
    history = json.loads((out / "train_summary.json").read_text())["history"]
    val_auc = per_epoch(live, "val/roc_auc")
    assert [epoch for epoch, _ in val_auc] == [1, 2] == [h["epoch"] for h in history]
    assert val_auc[-1][1] == pytest.approx(history[-1]["val/roc_auc"], abs=1e-5)
    assert [e for e, _ in per_epoch(live, "train/loss_epoch")] == [1, 2]
    metrics = json.loads((live / "metrics.json").read_text())
    assert metrics["val"]["roc_auc"] == pytest.approx(history[-1]["val/roc_auc"], abs=1e-5)
    assert read_series(live, "val/loss") and summary.best_epoch in (1, 2)
    assert summary.curves == str(live / "curves.png") and (live / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_writes_one_optimizer_shard_per_rank(data_dir: Path, tmp_path: Path, stage: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "ckpt"
    gathered = tmp_path / "gathered.safetensors"
    extensions = tmp_path / "torch_ext"  # as in a fresh checkout: no op built yet
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(extensions))
    summary, listening = _listening_while(
        lambda: train(_config(data_dir, out, strategy="deepspeed", zero_stage=stage, save_gathered_weights=gathered)))
    _assert_loopback_only(listening)  # torchrun's rendezvous store and gloo: 127.0.0.1 only
    # ZeRO on CPU compiles nothing: DeepSpeed's shared-memory all-reduce (inference only) is not built
    assert not extensions.exists() or not any(extensions.iterdir())
    _assert_outputs(out, summary, "deepspeed")
    assert summary.zero_stage == stage and summary.checkpoint_kind == "deepspeed_zero"
    _assert_zero_folder(out / "best.ckpt", stage)
    _assert_zero_folder(out / "last.ckpt", stage)
    # the gathered weights are the full fp32 FusionModel with plain keys
    from fusion_model.predict import build_model

    expected = build_model(json.loads((out / "model_config.json").read_text())).state_dict()
    weights = load_file(str(gathered))
    assert set(weights) == set(expected)
    assert all(weights[k].shape == v.shape for k, v in expected.items())
    assert all(v.dtype == torch.float32 for k, v in weights.items() if v.is_floating_point())

    if stage == 2:  # resume from the ZeRO folder: the step count continues
        resumed = train(_config(data_dir, out, strategy="deepspeed", zero_stage=2, max_epochs=2, resume=True))
        assert resumed.resumed_from and resumed.resumed_from.endswith("last.ckpt")
        assert resumed.steps == 2 * summary.steps and resumed.epochs == 2
        _assert_zero_folder(out / "last.ckpt", 2)


def test_a_failing_rank_fails_the_stage_fast_and_leaves_no_process(
        data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finished_ddp: tuple[Path, TrainSummary]) -> None:
    # Only rank 1 raises, at its first step, while rank 0 waits in the gradient all-reduce: a sitecustomize module
    # (imported by every Python started with this PYTHONPATH) patches the training step in that rank.
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("RANK") == "1":
            from fusion_model import module
            original = module.FusionModule.training_step
            def training_step(self, batch, batch_idx):
                if batch_idx == 0:
                    raise RuntimeError("injected failure in rank 1")
                return original(self, batch, batch_idx)
            module.FusionModule.training_step = training_step
    """))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "ckpt"
    shutil.copytree(finished_ddp[0], out)
    before = _tree(out)
    failed_at: list[float] = []

    class WhenFailed(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not failed_at and "injected failure in rank 1" in record.getMessage():
                failed_at.append(time.monotonic())

    logger = logging.getLogger("failing_rank")
    logger.addHandler(WhenFailed())
    logger.setLevel(logging.INFO)
    started = time.monotonic()
    with pytest.raises(StageError) as err:
        train(_config(data_dir, out, strategy="ddp", max_epochs=3), logger=logger)
    raised_at = time.monotonic()
    message = str(err.value)
    assert "training failed (exit code" in message and "strategy ddp" in message
    assert "first error: [rank1]: RuntimeError: injected failure in rank 1" in message
    assert "train.log" in message
    # The clock starts when the rank raises: start-up (imports, ~10-55 s on a loaded 2-core machine) is
    # not what is measured; a rank left waiting in its all-reduce would block for gloo's 30-min timeout.
    assert failed_at, "the rank's error never reached the caller's logger"
    assert raised_at - failed_at[0] < 60, f"failed {raised_at - failed_at[0]:.0f} s after the rank raised"
    assert raised_at - started < 240
    staging = staging_dir(_config(data_dir, out))
    assert _processes_mentioning(str(staging)) == []  # launcher and both ranks are gone
    assert _tree(out) == before  # the last good run's checkpoints are untouched
    assert str(staging / "train.log") in message and "injected failure" in (staging / "train.log").read_text()


def _wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_a_killed_run_keeps_the_last_good_checkpoints_and_resumes_where_it_stopped(
        data_dir: Path, tmp_path: Path, finished_ddp: tuple[Path, TrainSummary]) -> None:
    out = tmp_path / "ckpt"
    shutil.copytree(finished_ddp[0], out)
    before = _tree(out)
    cfg = _config(data_dir, out, strategy="ddp", max_epochs=40)
    staging = staging_dir(cfg)
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from fusion_model.config import TrainConfig
        from tasks.train import train
        train(TrainConfig.model_validate_json({cfg.model_dump_json()!r}))
    """))
    caller = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for(lambda: (staging / "last.ckpt").is_file(), 240, "the first epoch's last.ckpt")
        time.sleep(1.0)  # past the save: the kill lands mid-training
        assert len(_processes_mentioning(str(staging))) >= 3  # the launcher and two ranks
        caller.kill()  # SIGKILL: nothing in the caller runs, its launcher and ranks must still end
        caller.wait(timeout=30)
        _wait_for(lambda: not _processes_mentioning(str(staging)), 60, "the launcher and ranks to end")
    finally:
        if caller.poll() is None:
            caller.kill()
    assert _tree(out) == before, "a killed run touched the last good checkpoints"
    assert (staging / "last.ckpt").is_file()
    # the next run resumes the interrupted one (its last.ckpt, checked weights-only first) and then swaps it in
    done = torch.load(staging / "last.ckpt", map_location="cpu", weights_only=True)["epoch"] + 1
    resumed = train(_config(data_dir, out, strategy="ddp", max_epochs=done + 1, resume=True))
    assert resumed.resumed_from and str(staging) in resumed.resumed_from and resumed.epochs == done + 1
    assert not staging.exists() and _tree(out) != before


def test_resume_refuses_a_checkpoint_that_is_more_than_tensors(data_dir: Path, tmp_path: Path,
                                                              finished_ddp: tuple[Path, TrainSummary]) -> None:
    """A checkpoint pulled from elsewhere is code to Lightning's full unpickle: refused before that."""
    out = tmp_path / "ckpt"
    shutil.copytree(finished_ddp[0], out)
    before = _tree(out)
    staging = staging_dir(_config(data_dir, out))
    staging.mkdir()
    torch.save({"state_dict": {}, "payload": logging.getLogger("x")}, staging / "last.ckpt")  # a pickled object
    with pytest.raises(StageError) as err:
        train(_config(data_dir, out, strategy="ddp", max_epochs=2, resume=True))
    assert "weights_only=True" in str(err.value) and "last.ckpt" in str(err.value)
    assert _tree(out) == before


def test_missing_inputs_and_resume_without_checkpoint_are_refused(tmp_path: Path, data_dir: Path) -> None:
    with pytest.raises(StageError, match="train.parquet is missing; run `python -m tasks validate` first"):
        train(_config(tmp_path / "nothing", tmp_path / "ckpt"))
    with pytest.raises(StageError, match="last.ckpt .a finished one. exists; train once with resume false first"):
        train(_config(data_dir, tmp_path / "ckpt", resume=True))
    with pytest.raises(StageError, match="num_nodes > 1 needs train.master_port"):
        train(_config(data_dir, tmp_path / "ckpt", num_nodes=2))


def test_two_nodes_on_loopback_train_together(data_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    out = tmp_path / "ckpt"
    common = {"strategy": "ddp", "devices": 1, "num_nodes": 2, "master_port": port}
    results: dict[int, object] = {}

    def node(rank: int) -> None:
        try:
            results[rank] = train(_config(data_dir, out, node_rank=rank, **common),
                                  logger=logging.getLogger(f"node{rank}"))
        except BaseException as e:  # reported below, in the test's thread
            results[rank] = e

    threads = [threading.Thread(target=node, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert all(isinstance(results.get(r), TrainSummary) for r in (0, 1)), results
    summary = results[0]
    assert isinstance(summary, TrainSummary)
    assert summary.world_size == 2 and summary.num_nodes == 2 and summary.steps > 0
    assert (out / "best.ckpt").is_file()


def test_a_cancelled_caller_takes_its_ranks_down(data_dir: Path, tmp_path: Path) -> None:
    """SIGTERM to the caller (how a flow run is cancelled) ends the launcher and both ranks."""
    out = tmp_path / "ckpt"
    cfg = _config(data_dir, out, strategy="ddp", max_epochs=50)
    script = tmp_path / "caller.py"
    script.write_text(textwrap.dedent(f"""
        from fusion_model.config import TrainConfig
        from tasks.train import train
        train(TrainConfig.model_validate_json({cfg.model_dump_json()!r}))
    """))
    caller = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        staging = staging_dir(cfg)
        while time.monotonic() < deadline:  # wait until both ranks run
            ranks = [p for p in _processes_mentioning(str(staging)) if "fusion_model.fit" in p.info["cmdline"]]
            if len(ranks) >= 3:  # the launcher and two ranks
                break
            time.sleep(0.5)
        else:
            pytest.fail("the ranks never started")
        caller.terminate()
        stderr = caller.communicate(timeout=60)[1]
    finally:
        if caller.poll() is None:
            caller.kill()
    assert caller.returncode != 0
    assert "stopping the training processes" in stderr
    assert _processes_mentioning(str(staging)) == []


def test_one_node_keeps_gloo_and_nccl_sockets_on_loopback_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    """On one machine the ranks' own sockets (gloo's, and NCCL's bootstrap on CUDA) bind to loopback; an
    interface the user exported is kept, and a real master address leaves the choice to them."""
    from tasks.train.stage import _environment

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    env = _environment(TrainConfig(), port=29500)
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert _environment(TrainConfig(), port=29500)["NCCL_SOCKET_IFNAME"] == "ib0"
    monkeypatch.delenv("NCCL_SOCKET_IFNAME")
    assert "NCCL_SOCKET_IFNAME" not in _environment(TrainConfig(master_addr="198.18.0.2", num_nodes=2), port=29500)


def test_zero3_ranks_return_released_memory_to_the_os(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO-3's ranks get a fixed glibc mmap threshold (a released gathered parameter goes back to the OS);
    the other strategies keep glibc's default, and a value the user exported wins."""
    from tasks.train.stage import _environment

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    zero3 = TrainConfig(strategy="deepspeed", zero_stage=3)
    assert _environment(zero3, port=29500)["MALLOC_MMAP_THRESHOLD_"] == str(1 << 20)
    for other in (TrainConfig(strategy="deepspeed", zero_stage=2), TrainConfig(strategy="ddp")):
        assert "MALLOC_MMAP_THRESHOLD_" not in _environment(other, port=29500)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert _environment(zero3, port=29500)["MALLOC_MMAP_THRESHOLD_"] == "65536"


def test_resume_refuses_a_checkpoint_of_another_model_naming_what_differs(
        data_dir: Path, tmp_path: Path, finished_ddp: tuple[Path, TrainSummary]) -> None:
    """A checkpoint of other settings (or another version's model): refused before loading, the tensors that
    differ named, the finished run left as it was."""
    out = tmp_path / "ckpt"
    shutil.copytree(finished_ddp[0], out)
    before = _tree(out)
    with pytest.raises(StageError) as err:
        train(_config(data_dir, out, strategy="ddp", max_epochs=3, resume=True, hidden_sizes=[16]))
    message = str(err.value)
    assert "holds another model than these train settings build" in message and "last.ckpt" in message
    assert "shape mismatches: model." in message and "train with resume false" in message
    assert _tree(out) == before
