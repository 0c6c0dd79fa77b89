"""Several hosts on one Linux machine: network namespaces, each with its own disk, its own Prefect worker.

The lab the multi-host tests and `scripts/multihost_demo.sh` run in (root only):

- a control side in the machine's own namespace: a bridge with the first address of 198.18.<k>.0/24, on
  which the Prefect server, the DVC remote (scripts/http_remote.py) and the project's git repository
  (`git daemon`) listen, and a worker for the retrain flow (work queue `default`);
- hosts h0, h1, ...: one network namespace each, reaching the control side over the bridge (198.18.<k>.x)
  and each other over a separate training link (198.19.<k>.x, interface `train0`: a veth pair for two
  hosts, a second bridge for more). Each host's worker (work queue h<i>) runs in a mount namespace of its
  own where the host's own folder is mounted at the path every machine uses as RETRAIN_HOME
  (`<root>/machine`; Lightning has every rank save where global rank 0 says, so the path must be the same
  on all hosts), the control side's and the other hosts' folders are covered by empty read-only tmpfs,
  and /var/tmp (DVC's site cache) is private: nothing reaches a host by disk except the code and the venv.
  The code comes from the control side's `git daemon`, the data from the DVC remote; `prefect deploy` runs
  without RETRAIN_HOME/RETRAIN_REPOSITORY, so each worker fills in its own;
- everything torn down by `down()`, whatever state the lab is in; if the process that made the lab is
  killed first, a reaper ends its processes and the next lab removes its namespaces (`sweep_stale`).

The training link is not the control link: a node that listened on every interface, or on the wrong one,
shows up on `ctl0` in `listeners()`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import yaml
from prefect_stack import POOL, PrefectStack
from project_copy import ROOT, git, make_project, write_params
from project_copy import env as project_env

from tasks._io.processes import REAPER_TOKEN, start_reaper

TRAIN_IFACE = "train0"
CONTROL_IFACE = "ctl0"
NAME_RE = re.compile(r"^mh(\d+)-h\d+$")


def can_run() -> str | None:
    """Why the lab cannot run here (None when it can)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces and mounts needs root"
    for tool in ("ip", "ss", "unshare", "git"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    return None


def sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def sweep_stale() -> list[str]:
    """Namespaces a killed lab left (their creator's pid is gone): removed, with their links."""
    removed = []
    for line in sh("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = NAME_RE.match(name)
        if m and not psutil.pid_exists(int(m[1])):
            for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", name, check=False)
            for link in (f"mh{m[1]}br", f"mh{m[1]}tb"):
                sh("ip", "link", "del", link, check=False)
            removed.append(name)
    return removed


@dataclass
class Host:
    index: int
    name: str  # also its work queue
    netns: str
    control_address: str
    train_address: str
    home: Path  # RETRAIN_HOME: this host's own disk

    def entry(self) -> dict[str, str]:
        return {"name": self.name, "address": self.train_address, "interface": TRAIN_IFACE, "work_queue": self.name}


class HostLab(PrefectStack):
    """Control side + namespace hosts (see the module docstring); a PrefectStack whose API is on the bridge."""

    def __init__(self, root: Path, hosts: int = 2, params: dict[str, Any] | None = None, tiny: bool = True) -> None:
        if REAPER_TOKEN not in os.environ:  # a SIGKILLed caller must not leave the lab's processes running
            start_reaper()
        self.tag = f"mh{os.getpid()}"
        k = os.getpid() % 250 + 1
        self.root = root
        control = root / "control"
        for sub in ("prefect", "git", "remote"):
            (control / sub).mkdir(parents=True, exist_ok=True)
        self.control = control
        self.bridge_address = f"198.18.{k}.1"
        self.hosts = [Host(i, f"h{i}", f"{self.tag}-h{i}", f"198.18.{k}.{i + 2}", f"198.19.{k}.{i + 1}",
                           root / "hosts" / f"h{i}") for i in range(hosts)]
        self.params = params or {}
        self.tiny = tiny  # project_copy.TINY's parameters; else params.yaml's own defaults
        self.host_procs: dict[str, subprocess.Popen] = {}
        self.aux: dict[str, subprocess.Popen] = {}
        self.network_up = False
        project = control / "git" / "project"
        self.machine = root / "machine"  # RETRAIN_HOME on every machine (the control side's own folder here)
        self.machine.mkdir(parents=True, exist_ok=True)
        super().__init__(project, control / "prefect", self.machine)
        self.api = f"http://{self.bridge_address}:{self.port}/api"
        self.env["PREFECT_API_URL"] = self.api
        # deployments are made without these, so every worker fills in its own when a run starts
        for key in ("RETRAIN_HOME", "RETRAIN_REPOSITORY"):
            self.env.pop(key, None)

    # ---------------------------------------------------------------------------------------- network
    def up_network(self) -> None:
        sweep_stale()
        br, tb = f"{self.tag}br", f"{self.tag}tb"
        sh("ip", "link", "add", br, "type", "bridge")
        self.network_up = True
        sh("ip", "addr", "add", f"{self.bridge_address}/24", "dev", br)
        sh("ip", "link", "set", br, "up")
        for h in self.hosts:
            h.home.mkdir(parents=True, exist_ok=True)
            sh("ip", "netns", "add", h.netns)
            sh("ip", "-n", h.netns, "link", "set", "lo", "up")
            sh("ip", "link", "add", f"{self.tag}c{h.index}", "type", "veth", "peer", "name", CONTROL_IFACE,
               "netns", h.netns)
            sh("ip", "link", "set", f"{self.tag}c{h.index}", "master", br, "up")
            sh("ip", "-n", h.netns, "addr", "add", f"{h.control_address}/24", "dev", CONTROL_IFACE)
            sh("ip", "-n", h.netns, "link", "set", CONTROL_IFACE, "up")
        if len(self.hosts) == 2:  # the training link: one veth pair between the two hosts
            a, b = self.hosts
            sh("ip", "link", "add", TRAIN_IFACE, "netns", a.netns, "type", "veth", "peer", "name", TRAIN_IFACE,
               "netns", b.netns)
        else:  # more hosts: a second bridge, with no address of the control side on it
            sh("ip", "link", "add", tb, "type", "bridge")
            sh("ip", "link", "set", tb, "up")
            for h in self.hosts:
                sh("ip", "link", "add", f"{self.tag}t{h.index}", "type", "veth", "peer", "name", TRAIN_IFACE,
                   "netns", h.netns)
                sh("ip", "link", "set", f"{self.tag}t{h.index}", "master", tb, "up")
        for h in self.hosts:
            sh("ip", "-n", h.netns, "addr", "add", f"{h.train_address}/24", "dev", TRAIN_IFACE)
            sh("ip", "-n", h.netns, "link", "set", TRAIN_IFACE, "up")

    def in_host(self, h: Host, cmd: list[str]) -> list[str]:
        """`cmd` inside host `h`: its network namespace, a mount namespace where only its own folders exist
        (the control side's and the other hosts' are covered), its own /var/tmp and host name."""
        hide = [str(self.control)] + [str(o.home) for o in self.hosts if o is not h]
        script = (
            'set -e; mount --make-rprivate /; hostname "$1"; mount --bind "$2" "$3"; shift 3; '
            'mount -t tmpfs -o size=256m tmpfs /var/tmp; '
            'while [ "$1" != "--" ]; do mount -t tmpfs -o ro,size=1m tmpfs "$1"; shift; done; shift; exec "$@"'
        )
        return ["ip", "netns", "exec", h.netns, "unshare", "--mount", "--uts", "sh", "-c", script, "sh", h.name,
                str(h.home), str(self.machine), *hide, "--", *cmd]

    def listeners(self, h: Host) -> set[tuple[str, int]]:
        """(address, port) of every TCP socket listening in host `h`'s network namespace."""
        out = sh("ip", "netns", "exec", h.netns, "ss", "-ltnH", check=False).stdout
        found = set()
        for line in out.splitlines():
            fields = line.split()
            if len(fields) >= 4:
                addr, _, port = fields[3].rpartition(":")
                found.add((addr.strip("[]"), int(port)))
        return found

    def pids(self, h: Host) -> list[int]:
        return [int(p) for p in sh("ip", "netns", "pids", h.netns, check=False).stdout.split()]

    def ranks(self, h: Host) -> list[int]:
        """Training processes (launcher and ranks) alive in host `h`."""
        alive = []
        for pid in self.pids(h):
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE and "fusion_model" in " ".join(p.cmdline()):
                    alive.append(pid)
        return alive

    def kill_host(self, h: Host) -> int:
        """SIGKILL everything running in host `h` (its worker, node job, torchrun, ranks): a machine lost."""
        pids = self.pids(h)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.host_procs.pop(h.name, None)
        return len(pids)

    # ---------------------------------------------------------------------------------------- services
    def _free_port(self) -> int:
        with socket.socket() as s:
            s.bind((self.bridge_address, 0))
            return s.getsockname()[1]

    def start_aux(self, name: str, cmd: list[str], cwd: Path | None = None) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(cmd, cwd=cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        self.aux[name] = proc
        return proc

    def make_project(self) -> None:
        """The project copy every machine clones, with `train.hosts` and the DVC remote on the bridge."""
        port_file = self.control / "remote.port"
        self.start_aux("remote", [sys.executable, str(Path(__file__).resolve().parents[1] / "scripts/http_remote.py"),
                                  "--root", str(self.control / "remote"), "--host", self.bridge_address,
                                  "--port-file", str(port_file)])
        _wait_for(port_file.is_file, 30, "the DVC remote to serve", self.log, "remote")
        self.remote_url = f"http://{self.bridge_address}:{port_file.read_text().strip()}/dvc"
        params = _merge({"train": {"hosts": [h.entry() for h in self.hosts]}}, self.params)
        make_project(self.project, params)
        if not self.tiny:
            (self.project / "params.yaml").write_bytes((ROOT / "params.yaml").read_bytes())
            write_params(self.project, params)
        config = self.project / ".dvc" / "config"
        config.write_text(re.sub(r"url = .*", f"url = {self.remote_url}", config.read_text()))
        git(self.project, "commit", "-qam", "the lab's DVC remote")
        git_port = self._free_port()
        self.start_aux("git", ["git", "daemon", f"--listen={self.bridge_address}", f"--port={git_port}",
                               "--export-all", "--reuseaddr", f"--base-path={self.control / 'git'}",
                               str(self.control / "git")])
        self.repository = f"git://{self.bridge_address}:{git_port}/project"
        _wait_for(lambda: sh("git", "ls-remote", self.repository, check=False).returncode == 0, 30,
                  "git daemon", self.log, "git")

    def worker_env(self, name: str) -> dict[str, str]:
        """A worker's environment: its machine's RETRAIN_HOME and PREFECT_HOME (made here: Prefect does not
        make missing parents), the repository every machine clones."""
        home = next((h.home for h in self.hosts if h.name == name), self.machine)  # seen at self.machine
        (home / ".prefect").mkdir(parents=True, exist_ok=True)
        return self.env | {"RETRAIN_HOME": str(self.machine), "RETRAIN_REPOSITORY": self.repository,
                           "PREFECT_HOME": str(self.machine / ".prefect")}

    def start_host_worker(self, h: Host) -> None:
        log = open(self.logs / f"worker-{h.name}.log", "a")  # noqa: SIM115 (closed with the process)
        cmd = self.in_host(h, [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL,
                               "--work-queue", h.name, "--name", f"worker-{h.name}"])
        self.host_procs[h.name] = subprocess.Popen(cmd, cwd=h.home, env=self.worker_env(h.name), stdout=log,
                                                   stderr=subprocess.STDOUT, start_new_session=True)

    def stop_host_worker(self, h: Host) -> None:
        proc = self.host_procs.pop(h.name, None)
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def up(self) -> None:
        """Network, DVC remote, git daemon, Prefect server, pool and queues, deployments, every worker."""
        self.up_network()
        self.make_project()
        self.start("server", "server", "start", "--host", self.bridge_address, "--port", str(self.port))
        self.wait_healthy()
        self.prefect("work-pool", "create", POOL, "--type", "process", "--overwrite")
        # the retrain run and every host's node job at once; retrains themselves stay one at a time
        self.prefect("work-pool", "set-concurrency-limit", POOL, str(len(self.hosts) + 1))
        for queue in ["default", *(h.name for h in self.hosts)]:
            self.prefect("work-queue", "create", queue, "--pool", POOL, check=False)
        self.prefect("work-queue", "set-concurrency-limit", "default", "1", "--pool", POOL)
        self.deploy_out = self.prefect("--no-prompt", "deploy", "--all").stdout
        control_env = self.worker_env("control")
        log = open(self.logs / "worker.log", "w")  # noqa: SIM115 (closed with the process)
        self.procs["worker"] = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--work-queue", "default",
             "--name", "worker-control"], cwd=self.project, env=control_env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        for h in self.hosts:
            self.start_host_worker(h)

    def node_workspace(self, h: Host) -> Path:
        return h.home / "node-workspace"

    def down(self) -> list[str]:
        """Stop every process and remove every namespace and link of the lab; returns what it had to kill."""
        killed = []
        for h in self.hosts:
            self.stop_host_worker(h)
        with contextlib.suppress(Exception):
            self.stop()  # the control worker, then the server
        for name, proc in list(self.aux.items()):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
            self.aux.pop(name)
        for h in self.hosts:
            for pid in self.pids(h):
                with contextlib.suppress(ProcessLookupError, psutil.Error):
                    killed.append(" ".join(psutil.Process(pid).cmdline())[:120])
                    os.kill(pid, signal.SIGKILL)
            # the root-side veth ends go with their namespace, but asynchronously: delete them here
            for link in (f"{self.tag}c{h.index}", f"{self.tag}t{h.index}"):
                sh("ip", "link", "del", link, check=False)
            sh("ip", "netns", "del", h.netns, check=False)
        if self.network_up:
            for link in (f"{self.tag}br", f"{self.tag}tb"):
                sh("ip", "link", "del", link, check=False)
            self.network_up = False
        return killed

    def remaining(self, settle_s: float = 10.0) -> list[str]:
        """What of the lab still exists: namespaces, links, processes under its folders (the kernel tears a
        deleted namespace's links down asynchronously, so this waits up to settle_s for them to go)."""
        deadline = time.monotonic() + settle_s
        while (left := self._remaining()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left

    def _remaining(self) -> list[str]:
        left = [n for n in (h.netns for h in self.hosts) if n in sh("ip", "netns", "list", check=False).stdout]
        links = sh("ip", "-br", "link", check=False).stdout
        left += [f"link {w.split()[0]}" for w in links.splitlines() if w.startswith(self.tag)]
        for p in psutil.process_iter(["pid", "cmdline", "cwd"]):
            with contextlib.suppress(psutil.Error):
                text = " ".join(p.info["cmdline"] or []) + " " + (p.info["cwd"] or "")
                if str(self.root) in text and p.pid != os.getpid():
                    left.append(f"{p.pid}: {text[:150]}")
        return left

    # ---------------------------------------------------------------------------------------- runs
    def retrain(self, timeout_s: float = 900, **parameters: Any) -> dict[str, Any]:
        """Run `retrain/on-demand` with these flow parameters; the finished flow run."""
        return self.wait(self.submit("retrain/on-demand", **parameters), timeout_s)

    def node_runs(self, parent_id: str) -> list[dict[str, Any]]:
        runs = self.post("/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [parent_id]}}})
        if not runs:  # subflows are linked through the parent's task run
            tasks = self.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [parent_id]}}})
            ids = [t["id"] for t in tasks]
            runs = self.post("/flow_runs/filter", {"flow_runs": {"parent_task_run_id": {"any_": ids}}}) if ids else []
        return runs

    def run_id_of(self, flow_run: dict[str, Any]) -> str:
        """The retrain run's id (rendezvous id, remote prefix), from the workspace's log of runs."""
        lines = (self.workspace / "models/runs/flow_runs.jsonl").read_text().splitlines()
        return next(json.loads(x)["run_id"] for x in lines if json.loads(x).get("flow_run_id") == flow_run["id"])

    def manifest(self, run_id: str, host: str) -> dict[str, Any]:
        return json.loads(httpx.get(f"{self.remote_url}/runs/{run_id}/{host}/manifest.json", timeout=30).text)


def compare(a: Path, b: Path) -> tuple[bool, float]:
    """(bit-equal, largest absolute difference) of two safetensors files with the same keys."""
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    if set(x) != set(y):
        raise SystemExit(f"{a} and {b} hold different tensors: {sorted(set(x) ^ set(y))[:5]}")
    diff = max(((x[k].double() - y[k].double()).abs().max().item() if x[k].numel() else 0.0) for k in x)
    return all(x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and bool((x[k] == y[k]).all()) for k in x), diff


def single_host_reference(workspace: Path, out: Path) -> tuple[Path, dict[str, Any]]:
    """The same params with train.hosts [] and both ranks here: the train and convert stages' CLI, in the
    workspace the flow ran in (its validated data), into `out`."""
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    params["train"]["devices"] = len(params["train"]["hosts"]) * int(params["train"].get("devices") or 1)
    params["train"]["hosts"] = []
    out.mkdir(parents=True, exist_ok=True)
    ref = out / "params.yaml"
    ref.write_text(yaml.safe_dump(params, sort_keys=False))
    for stage, paths in (("train", ["--out-dir", str(out / "checkpoints"), "--live-dir", str(out / "training")]),
                         ("convert", ["--checkpoint-dir", str(out / "checkpoints"), "--out-dir", str(out / "model")])):
        done = subprocess.run([sys.executable, "-m", "tasks", stage, "--params", str(ref), *paths], cwd=workspace,
                              env=project_env(), capture_output=True, text=True, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"single-host {stage} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return out / "model" / "model.safetensors", json.loads((out / "checkpoints" / "train_summary.json").read_text())


def shards_per_host(lab: HostLab, run_id: str) -> list[int]:
    """Per-rank ZeRO files of best.ckpt each host uploaded (optimizer states; model states too under ZeRO-3)."""
    return [sum(1 for f in lab.manifest(run_id, h.name)["files"]
                if f["rank"] is not None and f["path"].startswith("best.ckpt/")) for h in lab.hosts]


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _wait_for(condition: Any, timeout_s: float, what: str, log: Any, name: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log(name)}")
        time.sleep(0.3)

