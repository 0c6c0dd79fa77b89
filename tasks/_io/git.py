"""What git says about a checkout: its HEAD commit and whether tracked files changed."""

from __future__ import annotations

import subprocess
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[2]


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess[str] | None:
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=30, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired):  # no git on this machine
        return None


def head_rev(cwd: Path = Path(".")) -> str | None:
    """The HEAD commit of the checkout at `cwd`; None outside git or before the first commit."""
    done = _git(cwd, "rev-parse", "HEAD")
    return done.stdout.strip() if done is not None and done.returncode == 0 and done.stdout.strip() else None


def has_tracked_changes(cwd: Path = Path(".")) -> bool:
    done = _git(cwd, "status", "--porcelain", "--untracked-files=no")
    return bool(done is not None and done.returncode == 0 and done.stdout.strip())


def code_version() -> str:
    """The project's own code: `git:<rev>` in a checkout, else the installed package's version."""
    rev = head_rev(PROJECT_ROOT)
    if rev:
        return "git:" + rev
    from importlib.metadata import PackageNotFoundError, version

    try:
        return "fusion-retrain==" + version("fusion-retrain")
    except PackageNotFoundError:
        return "unknown"
