"""Training across machines: two network-namespace hosts, a real Prefect server and workers, torchrun's c10d
rendezvous over a veth link, DeepSpeed ZeRO shards on each host's own disk, a real DVC remote over HTTP.

The first tests need no root: the checks of the hosts list, the node command, the gather plan. The rest
share one lab (tests/netns_hosts.py, root only) and run, in order: ZeRO-2 across both hosts (every
listener sampled; the model against two ranks on one host), a damaged and a missing shard at conversion,
ZeRO-3 across both hosts, a host that never joins, a host killed mid-training. Tiny parameters
(project_copy.TINY: 400 rows, one epoch, test_resnet at 32 px).
"""

from __future__ import annotations

import json
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from netns_hosts import HostLab, can_run, compare, shards_per_host, single_host_reference
from project_copy import sha256

from fusion_model.config import TrainConfig
from tasks._io.hashing import file_hashes
from tasks.errors import StageError
from tasks.train.nodes import NodeUpload, UploadedFile, check_host, node_command, node_environment, rank_of

pytestmark = pytest.mark.slow

HOSTS = [{"name": "h0", "address": "198.19.7.1", "interface": "train0", "work_queue": "h0"},
         {"name": "h1", "address": "198.19.7.2", "interface": "train0", "work_queue": "h1"}]
LAB_SKIP = can_run()
needs_lab = pytest.mark.skipif(LAB_SKIP is not None, reason=f"the namespace hosts cannot run here: {LAB_SKIP}")


def _cfg(**overrides: Any) -> TrainConfig:
    return TrainConfig.model_validate({"hosts": HOSTS, "strategy": "deepspeed", "devices": 1, **overrides})


# ------------------------------------------------------------------------------------------------ no root


@pytest.mark.parametrize(("change", "message"), [
    ({"hosts": [HOSTS[0], {**HOSTS[1], "name": "h0"}]}, "every host needs its own name; h0 repeats"),
    ({"hosts": [HOSTS[0], {**HOSTS[1], "address": HOSTS[0]["address"]}]}, "own address"),
    ({"hosts": [HOSTS[0], {**HOSTS[1], "work_queue": "h0"}]}, "own work_queue"),
    ({"strategy": "ddp_spawn"}, "set train.strategy to ddp or deepspeed"),
    ({"resume": True}, "train afresh across the hosts"),
    ({"num_nodes": 3}, "keep num_nodes 1 with a hosts list"),
])
def test_a_hosts_list_that_cannot_work_is_refused_before_anything_runs(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _cfg(**change)


def test_one_host_or_none_is_this_machine_and_the_train_stage_refuses_several(tmp_path: Path) -> None:
    from tasks.train import train

    assert not TrainConfig().multi_host and not TrainConfig(hosts=HOSTS[:1]).multi_host
    with pytest.raises(StageError, match=r"lists 2 hosts \(h0, h1\): the retrain flow starts one node job per host"):
        train(_cfg(data_dir=tmp_path, out_dir=tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="no host named 'h9' .it lists: h0, h1."):
        _cfg().host("h9")


def test_each_node_runs_torchrun_c10d_on_its_own_address_and_interface(tmp_path: Path) -> None:
    p = _cfg(rendezvous_port=29500, join_timeout_s=45)
    cmd = node_command(p, p.host("h1"), "run-1", 1, tmp_path / "c.json")
    args = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert cmd[1:3] == ["-m", "fusion_model.launch"]
    assert args["--rdzv-backend"] == "c10d" and args["--rdzv-endpoint"] == "198.19.7.1:29500"
    assert args["--rdzv-id"] == "run-1" and args["--local-addr"] == "198.19.7.2" and args["--nnodes"] == "2"
    assert args["--rdzv-conf"] == "join_timeout=45,is_host=0" and args["--max-restarts"] == "0"
    first = node_command(p, p.host("h0"), "run-1", 1, tmp_path / "c.json")
    assert first[first.index("--rdzv-conf") + 1] == "join_timeout=45,is_host=1"  # host 0 hosts the rendezvous
    env = node_environment(p, p.host("h1"))
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "train0" and env["NCCL_HOSTID"] == "h1"


def test_deepspeed_keeps_each_hosts_checkpoint_on_that_host_only_across_hosts() -> None:
    from fusion_model.strategies import deepspeed_config

    assert deepspeed_config(_cfg(), on_cuda=False)["checkpoint"] == {"use_node_local_storage": True}
    assert "checkpoint" not in deepspeed_config(TrainConfig(strategy="deepspeed"), on_cuda=False)  # one host: as before


def test_the_c10d_rendezvous_stores_listen_on_the_given_address_only() -> None:
    """torch's c10d backend and the store node rank 0 shares with its ranks bind the wildcard address by
    themselves; fusion_model.loopback hands them a socket bound to the address they serve."""
    import psutil
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    from fusion_model.loopback import bind_stores_to_master_addr

    bind_stores_to_master_addr()
    shared = dynamic_rendezvous.DynamicRendezvousHandler._create_tcp_store_server(None, "127.0.0.1", 0)
    rendezvous = c10d_rendezvous_backend.TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True)
    ports = {shared.port, rendezvous.port}
    bound = {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN and c.laddr.port in ports}
    assert bound == {"127.0.0.1"}


def test_a_node_on_the_wrong_machine_is_refused_naming_the_host_and_the_fix() -> None:
    p = _cfg(hosts=[{**HOSTS[0], "interface": "nosuch0"}, {**HOSTS[1], "interface": "lo"}])
    with pytest.raises(StageError, match=r"host h0: this machine .* has no interface 'nosuch0'.*work queue 'h0'"):
        check_host(p.host("h0"))
    with pytest.raises(StageError, match=r"host h1: interface lo holds .*127\.0\.0\.1.*not 198\.19\.7\.2"):
        check_host(p.host("h1"))
    check_host(_cfg(hosts=[{**HOSTS[0], "interface": "lo", "address": "127.0.0.1"}, HOSTS[1]]).host("h0"))


def test_inputs_outside_the_project_are_refused(tmp_path: Path) -> None:
    from tasks.train.nodes import publish_inputs

    with pytest.raises(StageError, match="train.data_dir = /elsewhere: with several hosts it must be a folder inside"):
        publish_inputs(_cfg(data_dir="/elsewhere"), Path("data/raw/x"), None, root=tmp_path)


def _upload(host: str, ranks: list[int], files: list[str], world: int = 2) -> NodeUpload:
    return NodeUpload(run_id="r", host=host, address=host, world_size=world, global_ranks=ranks,
                      strategy="deepspeed", zero_stage=2,
                      files=[UploadedFile(path=f, bytes=1, sha256="0" * 64, rank=rank_of(f)) for f in files])


SHARD = "best.ckpt/checkpoint/zero_pp_rank_{}_mp_rank_00_optim_states.pt"


def test_the_gather_plan_takes_each_rank_from_its_host_and_names_what_is_missing() -> None:
    from tasks.convert.gather import plan

    common = ["best.ckpt/latest", "best.ckpt/checkpoint/mp_rank_00_model_states.pt", "train.log"]
    world, owner, chosen = plan({"h0": _upload("h0", [0], [*common, SHARD.format(0), "model_config.json",
                                                            "dvclive/metrics.json"]),
                                 "h1": _upload("h1", [1], [*common, SHARD.format(1)])})
    assert world == 2 and owner == {0: "h0", 1: "h1"}
    assert {d: h for d, (h, _) in chosen.items()} == {
        "best.ckpt/latest": "h0", "best.ckpt/checkpoint/mp_rank_00_model_states.pt": "h0", "train.log": "h0",
        "train.h1.log": "h1", SHARD.format(0): "h0", SHARD.format(1): "h1", "model_config.json": "h0"}
    with pytest.raises(StageError, match=r"host h1, rank 1: best.ckpt/checkpoint/zero_pp_rank_1_.* is missing from "
                                         r"its upload \(manifest runs/r/h1/manifest.json\)"):
        plan({"h0": _upload("h0", [0], [SHARD.format(0)]), "h1": _upload("h1", [1], ["train.log"])})
    with pytest.raises(StageError, match="global rank 0 is claimed by hosts h0 and h1"):
        plan({"h0": _upload("h0", [0], []), "h1": _upload("h1", [0, 1], [])})
    with pytest.raises(StageError, match=r"no host uploaded global rank\(s\) \[1\]"):
        plan({"h0": _upload("h0", [0], []), "h1": _upload("h1", [], [])})
    with pytest.raises(StageError, match="disagree on the world size"):
        plan({"h0": _upload("h0", [0], []), "h1": _upload("h1", [1], [], world=3)})
    with pytest.raises(StageError, match="host h0: uploaded .*zero_pp_rank_1_.* of rank 1, which ran on host h1"):
        plan({"h0": _upload("h0", [0], [SHARD.format(1)]), "h1": _upload("h1", [1], [])})


# ------------------------------------------------------------------------------------------------ the lab


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory):
    if LAB_SKIP:
        pytest.skip(f"the namespace hosts cannot run here: {LAB_SKIP}")
    lab = HostLab(tmp_path_factory.mktemp("multihost"), hosts=2, params={"train": {"devices": 1}})
    try:
        lab.up()
        yield lab
    finally:
        lab.down()


class Listeners:
    """Samples every listening TCP socket of each host while a run is in flight."""

    def __init__(self, lab: HostLab) -> None:
        self.lab, self.seen = lab, {h.name: set() for h in lab.hosts}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            for h in self.lab.hosts:
                self.seen[h.name] |= self.lab.listeners(h)
            time.sleep(0.3)

    def __enter__(self) -> Listeners:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _task_runs(lab: HostLab, flow_run_id: str) -> list[dict[str, Any]]:
    return lab.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})


def _task(lab: HostLab, flow_run_id: str, name: str) -> dict[str, Any]:
    return next(t for t in _task_runs(lab, flow_run_id) if t["name"].rsplit("-", 1)[0] == name)


def _state_of_checkpoints(lab: HostLab) -> dict[str, Any]:
    ws = lab.workspace
    champion = ws / "models" / "champion"
    return {"checkpoints": file_hashes(ws / "data/checkpoints"),
            "model": sha256(ws / "data/model/model.safetensors"),
            "champion": str(champion.resolve()) if champion.is_symlink() else None}


@pytest.fixture(scope="module")
def zero2(lab: HostLab, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One retrain across both hosts (ZeRO-2, one rank each), its listeners sampled while it ran."""
    started = time.monotonic()
    with Listeners(lab) as listeners:
        flow_run = lab.retrain(timeout_s=900)
    assert flow_run["state"]["type"] == "COMPLETED", (flow_run["state"], lab.log("worker"), lab.log("worker-h0"),
                                                      lab.log("worker-h1"))
    return {"flow_run": flow_run, "run_id": lab.run_id_of(flow_run), "listeners": listeners.seen,
            "seconds": time.monotonic() - started, "reference": tmp_path_factory.mktemp("single_host")}


@needs_lab
def test_two_hosts_train_one_model_with_zero2_bit_equal_to_two_ranks_on_one_host(lab: HostLab,
                                                                                  zero2: dict[str, Any]) -> None:
    run_id, flow_run = zero2["run_id"], zero2["flow_run"]
    names = [t["name"].rsplit("-", 1)[0] for t in _task_runs(lab, flow_run["id"])]
    assert names.count("train") == 1 and names.count("convert") == 1, names  # one conversion, once
    nodes = lab.node_runs(flow_run["id"])
    assert sorted((r["parameters"]["host"], r["state"]["type"]) for r in nodes) == [("h0", "COMPLETED"),
                                                                                   ("h1", "COMPLETED")]
    assert {r["parameters"]["run_id"] for r in nodes} == {run_id}  # the rendezvous id
    manifests = {h.name: lab.manifest(run_id, h.name) for h in lab.hosts}
    assert {h: m["global_ranks"] for h, m in manifests.items()} == {"h0": [0], "h1": [1]}
    assert shards_per_host(lab, run_id) == [1, 1]
    # each host wrote only its own rank's shard, on its own disk; the gathered folder has both
    for h in lab.hosts:
        ckpt = lab.node_workspace(h) / "data/.checkpoints.staging/best.ckpt/checkpoint"
        assert sorted(p.name for p in ckpt.glob("*optim_states.pt")) == [
            f"zero_pp_rank_{h.index}_mp_rank_00_optim_states.pt"]
        assert (lab.node_workspace(h) / "data/validated/train.parquet").is_file()  # fetched from the remote
    gathered = lab.workspace / "data/checkpoints/best.ckpt/checkpoint"
    assert sorted(p.name for p in gathered.glob("*optim_states.pt")) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)]
    assert (lab.workspace / "data/checkpoints/train.h1.log").is_file()
    summary = json.loads((lab.workspace / "data/checkpoints/train_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_nodes"] == 2 and summary["zero_stage"] == 2
    manifest = json.loads((lab.workspace / "data/model/manifest.json").read_text())
    assert manifest["source"]["world_size"] == 2 and manifest["verification"]["all_finite"]
    assert (lab.workspace / "reports/training/curves.png").is_file()
    assert (lab.workspace / "models/champion").is_symlink()  # evaluated, versioned, promoted
    # the same seed and parameters, two ranks on one host: the same weights, bit for bit
    reference, ref_summary = single_host_reference(lab.workspace, zero2["reference"])
    bit_equal, diff = compare(lab.workspace / "data/model/model.safetensors", reference)
    assert bit_equal and diff == 0.0
    assert ref_summary["world_size"] == 2 and ref_summary["num_nodes"] == 1


@needs_lab
def test_each_host_listens_only_on_its_training_address_and_loopback(lab: HostLab, zero2: dict[str, Any]) -> None:
    seen = zero2["listeners"]
    port = TrainConfig().rendezvous_port
    h0, h1 = lab.hosts
    assert (h0.train_address, port) in seen["h0"], seen  # the c10d store: the sampling saw the run
    for h in lab.hosts:
        addresses = {a for a, _ in seen[h.name]}
        assert addresses <= {h.train_address, "127.0.0.1", "::1"}, (h.name, sorted(seen[h.name]))
        assert h.control_address not in addresses and not addresses & {"0.0.0.0", "*", "::"}


@needs_lab
def test_a_damaged_or_missing_shard_refuses_the_conversion_naming_host_and_rank(lab: HostLab,
                                                                               zero2: dict[str, Any]) -> None:
    from tasks.convert.gather import gather

    run_id, ws = zero2["run_id"], lab.workspace
    before = _state_of_checkpoints(lab)
    shard = lab.control / "remote" / "dvc" / "runs" / run_id / "h1" / SHARD.format(1)
    good = shard.read_bytes()
    hosts = [h.name for h in lab.hosts]
    try:
        shard.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
        with pytest.raises(StageError) as err:
            gather(ws / "data/checkpoints", hosts, run_id, None, root=ws)
        assert "host h1, rank 1: best.ckpt/checkpoint/zero_pp_rank_1_mp_rank_00_optim_states.pt is damaged" in str(
            err.value) and "re-run training" in str(err.value)
        shard.unlink()
        with pytest.raises(StageError, match=r"host h1, rank 1: http://.*zero_pp_rank_1_.* is listed in its manifest "
                                             r"but missing from the remote"):
            gather(ws / "data/checkpoints", hosts, run_id, None, root=ws)
    finally:
        shard.write_bytes(good)
    with pytest.raises(StageError, match="host h1: no upload manifest at http://.*/runs/no-such-run/h1/manifest.json"):
        gather(ws / "data/checkpoints", ["h1"], "no-such-run", None, root=ws)
    assert _state_of_checkpoints(lab) == before  # nothing of the last good run was touched
    assert not [p for p in (ws / "data").iterdir() if p.name.startswith(".checkpoints.incoming")]


@needs_lab
def test_two_hosts_train_with_zero3(lab: HostLab, zero2: dict[str, Any]) -> None:
    flow_run = lab.retrain(timeout_s=900, overrides={"train": {"zero_stage": 3}}, promote_model=False,
                           version_outputs=False)
    assert flow_run["state"]["type"] == "COMPLETED", (flow_run["state"], lab.log("worker"))
    run_id = lab.run_id_of(flow_run)
    assert shards_per_host(lab, run_id) == [2, 2]  # optimizer and model states of its own rank, per host
    manifest = json.loads((lab.workspace / "data/model/manifest.json").read_text())
    assert manifest["source"]["zero_stage"] == 3 and manifest["source"]["world_size"] == 2


def _wait_until(condition, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(0.3)
    return time.monotonic() - started


@needs_lab
def test_a_host_that_never_joins_fails_the_run_within_the_join_timeout_naming_it(lab: HostLab,
                                                                                  zero2: dict[str, Any]) -> None:
    h0, h1 = lab.hosts
    before = _state_of_checkpoints(lab)
    lab.stop_host_worker(h1)  # its machine is up, but nothing takes its node job
    try:
        flow_run = lab.retrain(timeout_s=600, overrides={"train": {"join_timeout_s": 40}})
    finally:
        lab.start_host_worker(h1)
    assert flow_run["state"]["type"] == "FAILED"
    train = _task(lab, flow_run["id"], "train")
    message = train["state"]["message"]
    assert "host(s) h1 never joined the rendezvous" in message, message
    assert "host h1 (198.19." in message and "train.join_timeout_s=40 s" in message
    assert re.search(r"is (Scheduled|Late|Pending); no worker took it", message), message
    assert "prefect worker start --pool retrain-pool --work-queue h1" in message
    took = (_time(train["end_time"]) - _time(train["start_time"]))
    assert took < 40 + 45, f"the train step took {took:.0f} s"  # the join timeout, the other node's stop
    _wait_until(lambda: not lab.ranks(h0), 60, "host h0's ranks to end")
    assert _state_of_checkpoints(lab) == before


def _time(stamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@needs_lab
def test_a_host_killed_mid_training_ends_every_rank_and_changes_nothing(lab: HostLab, zero2: dict[str, Any]) -> None:
    h0, h1 = lab.hosts
    before = _state_of_checkpoints(lab)
    staging = lab.node_workspace(h0) / "data/.checkpoints.staging"
    shutil.rmtree(staging, ignore_errors=True)  # an earlier run's last.ckpt must not be taken for this one's
    flow_run_id = lab.submit("retrain/on-demand",
                             overrides={"train": {"max_epochs": 200, "early_stopping_patience": None}})
    saved = staging / "last.ckpt"
    _wait_until(lambda: saved.is_dir() and lab.ranks(h0) and lab.ranks(h1), 600,
                "both hosts training past their first epoch")
    killed = lab.kill_host(h1)  # the machine is lost: its worker, node job, torchrun and rank, at once
    assert killed >= 3
    took = _wait_until(lambda: not lab.ranks(h0) and not lab.ranks(h1), 60, "every rank on every host to end")
    flow_run = lab.wait(flow_run_id, timeout_s=300)
    assert flow_run["state"]["type"] == "FAILED"
    train = _task(lab, flow_run_id, "train")
    message = train["state"]["message"]
    assert "host h0: Failed" in message and f"{h1.train_address} is host h1" in message, message
    assert "Nothing was gathered or converted" in message
    assert _state_of_checkpoints(lab) == before  # no checkpoint, model or champion of the failed run
    print(f"every rank ended {took:.1f} s after host h1 was killed")


@needs_lab
def test_the_lab_leaves_nothing_behind(lab: HostLab) -> None:
    lab.down()
    assert lab.remaining() == []
