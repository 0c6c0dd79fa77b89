"""Shared test set-up: an isolated environment per session and tiny synthetic data made in fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Never touch the user's Prefect database, hubs or analytics; build DeepSpeed ops once per machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "60")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".torch_ext"))


@pytest.fixture(scope="session", autouse=True)
def _isolated_prefect_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect_home"))
