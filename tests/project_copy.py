"""A throwaway copy of the project as its own git + DVC repository, with tiny parameters.

`git clone` would miss files not committed yet, so the copy takes the working tree's files that git
tracks or would track (`git ls-files --cached --others --exclude-standard`): code, dvc.yaml, .dvc/config,
prefect.yaml, params.yaml; never .venv, data or models.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]

# ~400/200 rows, 32 px, a timm test model, one epoch on 2 ranks: every stage, in seconds. 200 test rows, so
# that the soak's better challenger (four epochs) wins by more than the test set's noise (40 rows did not).
TINY: dict[str, Any] = {
    "download": {"synthetic": {"n_train": 400, "n_test": 200, "image_size": 32, "seed": 7}},
    "validate": {"workers": 1},
    "train": {
        "image_model": "test_resnet", "image_size": 32, "text_buckets": 1024, "cat_dim": 4,
        "adapter_dim": 16, "hidden_sizes": [16], "max_epochs": 1, "batch_size": 16, "strategy": "deepspeed",
        "zero_stage": 2, "devices": 2, "accelerator": "cpu", "num_workers": 0,
        # one configuration: the runs here compare one-key changes (lr, epochs), which a candidate's own
        # keys would override; the candidates are tested in test_refit.py
        "candidates": [{}],
        # the runs compare one-key changes of the deep half (lr, epochs); the linear member, fitted to
        # convergence before it, sees none of them and, on 400 rows, wins the mix alone: every run would
        # score the same. It is tested in test_linear_member.py, test_convert.py and test_strategies.py
        "linear_member": False,
    },
    "evaluate": {"batch_size": 64},
    # one epoch on 400 rows is not meant to beat the classical baseline; the gate has tests of its own
    # (test_promote.py), here promotion is about the champion
    "promote": {"require_beat_baseline": False},
}

GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@127.0.0.1", "-c", "init.defaultBranch=main"]


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def project_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split("\0")
    # dvc.lock and the pipeline's own outputs (metrics git may track) describe a run the copy has not made
    outputs = ("data/", "models/", "reports/")
    return [f for f in listed if f and f != "dvc.lock" and not f.startswith(outputs) and (ROOT / f).is_file()]


def make_project(dest: Path, params: dict[str, Any] | None = None) -> Path:
    """Copy the project into `dest`, write params.yaml = project's merged with TINY and `params`, commit."""
    for rel in project_files():
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    write_params(dest, merge(TINY, params or {}))
    git(dest, "init", "-q")
    git(dest, "add", "-A")
    git(dest, "commit", "-q", "-m", "project copy for a test")
    return dest


def write_params(project: Path, changes: dict[str, Any]) -> None:
    current = yaml.safe_load((project / "params.yaml").read_text())
    (project / "params.yaml").write_text(yaml.safe_dump(merge(current, changes), sort_keys=False))


def git(project: Path, *args: str) -> str:
    return subprocess.run([*GIT, *args], cwd=project, capture_output=True, text=True, check=True).stdout


def env() -> dict[str, str]:
    """The environment every command in the copy runs with: this venv first, no analytics, offline."""
    e = dict(os.environ)
    e["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}"
    e.update(DVC_NO_ANALYTICS="1", HF_HUB_OFFLINE="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    e.pop("PYTHONPATH", None)
    return e


def run(project: Path, *cmd: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, cwd=project, env=env(), capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return done


def dvc(project: Path, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(project, sys.executable, "-m", "dvc", *args, timeout=timeout, check=check)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def lock_hashes(project: Path) -> dict[str, str]:
    """Output path -> md5 from dvc.lock."""
    lock = yaml.safe_load((project / "dvc.lock").read_text())
    return {o["path"]: o["md5"] for stage in lock["stages"].values() for o in stage.get("outs", [])}


def reproduced_project(dest: Path) -> dict[str, Any]:
    """`make_project` + one `dvc repro` of every stage: its output, duration and the model's sha256."""
    root = make_project(dest)
    started = time.monotonic()
    first = dvc(root, "repro")
    model_sha = sha256(root / "data/model/model.safetensors")
    # model_sha follows later changes of the tests; first_model_sha stays that of the committed params
    return {
        "root": root, "first_repro": first.stdout, "repro_s": time.monotonic() - started,
        "model_sha": model_sha, "first_model_sha": model_sha,
    }


def script_sources(page: str) -> list[str]:
    """What each <script> of the page loads: its src, or "inline"."""
    return [m.group(1) or "inline" for m in re.finditer(r"<script\b[^>]*?(?:\bsrc\s*=\s*[\"']([^\"']*)[\"'])?[^>]*>",
                                                         page, flags=re.IGNORECASE)]
