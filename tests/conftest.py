"""Shared test set-up: an isolated environment per session and tiny synthetic data made in fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
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

# scripts/test.sh runs the suite on two xdist workers with `--dist loadfile`: each test file goes to one
# worker whole, and the files that share an expensive session fixture go to the same one, so it is built once.
SHARED_FIXTURE_GROUPS = {
    "test_dvc": "pipeline_project", "test_deployment": "pipeline_project",
    "test_evaluate": "tiny_model_chain", "test_predict": "tiny_model_chain", "test_promote": "tiny_model_chain",
    "test_serve": "tiny_model_chain", "test_score": "tiny_model_chain", "test_wheel": "tiny_model_chain",
}
# The longest groups first (their times: BENCHMARKS.md, "Install and test suite"), so both workers end together.
LONGEST_FIRST = ["pipeline_project", "test_multihost", "test_nightly", "test_real_datasets", "test_convert",
                 "test_train", "tiny_model_chain"]


def _group(path: str | Path) -> str:
    stem = Path(path).stem
    return SHARED_FIXTURE_GROUPS.get(stem, stem)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile`, with the files of one shared fixture as one unit (xdist's `loadgroup` marks do not
    reach the scheduler under this pytest: the node ids it reads carry no group)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep LONGEST_FIRST (xdist would put the files with most tests first)

    class FileGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid.split("::", 1)[0])

    return FileGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # the order the workers are fed in; a plain `pytest` keeps the files' order
        rank = {g: i for i, g in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(_group(item.path), len(rank)))  # stable: each file's order kept


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module's in-process fits (`pytestmark = pytest.mark.usefixtures("one_thread")`):
    on a shared 2-core machine two OpenMP threads spin-wait on each other (a step measured 4.4 s instead of
    0.2 s at load 9)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _isolated_prefect_home(tmp_path_factory: pytest.TempPathFactory) -> None:
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect_home"))


@pytest.fixture(scope="session")
def tiny_raw_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A generated dataset folder (PetFinder preset) (240 train / 80 test rows, 32 px, binary, seed 0).

    Shared by the whole session: treat it as read-only (copy it with shutil.copytree to damage it).
    """
    from tasks.download.synthetic import generate
    from tasks.params import SyntheticParams

    root = tmp_path_factory.mktemp("raw")
    generate(root, SyntheticParams(n_train=240, n_test=80, image_size=32, seed=0), "binary")
    return root / "dataset"


@pytest.fixture(scope="session")
def tiny_validated(tiny_raw_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_raw_dataset` after the validate stage: the out_dir with train/val/test parquet + meta.json
    (reports beside it in `<parent>/reports`). Treat it as read-only; copy it to change it."""
    from tasks.params import ValidateParams
    from tasks.validate import validate

    root = tmp_path_factory.mktemp("validated")
    validate(ValidateParams(dataset_dir=tiny_raw_dataset, out_dir=root / "validated", report_dir=root / "reports"))
    return root / "validated"


@pytest.fixture(scope="session")
def tiny_model_chain(tiny_validated: Path, tmp_path_factory: pytest.TempPathFactory):
    """Two real converted models of `tiny_validated`, each evaluated on its test table (see
    tests/model_chain.py): `trained` (ddp_spawn, test_resnet) and `constant` (zeroed head). Read-only."""
    from tests.model_chain import build_model_chain

    return build_model_chain(tiny_validated, tmp_path_factory.mktemp("model_chain"))


@pytest.fixture(scope="session")
def pipeline_project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A git + DVC copy of the project after one `dvc repro` with tiny params (see tests/project_copy.py).

    Shared by the DVC and deployment tests; each leaves the pipeline up to date (`dvc status` clean).
    """
    from project_copy import reproduced_project

    return reproduced_project(tmp_path_factory.mktemp("pipeline") / "project")
