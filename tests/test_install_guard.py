"""scripts/env.sh refuses to start an install that the disk cannot hold, naming the space it needs and has."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_install_refused_on_a_full_disk_before_any_venv_is_written(tmp_path: Path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "env.sh", tmp_path / "scripts" / "env.sh")
    for name in ("pyproject.toml", "requirements.lock"):
        shutil.copy(ROOT / name, tmp_path / name)
    env = {**os.environ, "FUSION_INSTALL_MIN_FREE_GIB": str(10**9)}  # more than any disk has
    done = subprocess.run(["bash", "-c", "source scripts/env.sh"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert f"{tmp_path / '.venv'} needs ~{10**9} GiB" in done.stderr
    assert "GiB free" in done.stderr and "free some space" in done.stderr
    assert not (tmp_path / ".venv").exists()  # nothing half-installed is left to reuse
