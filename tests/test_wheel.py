"""The project as a wheel: built from the checkout, installed into a folder of its own (not editable, the
environment's dependencies beneath it), and run from outside the checkout, its data files included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from project_copy import project_files

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    source = tmp / "source"  # the tracked files only: a build folder in the checkout would hide a missing one
    for rel in project_files():
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, source / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist")], check=True, capture_output=True, text=True)
    (wheel,) = (tmp / "dist").glob("*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp / "site"),
                    str(wheel)], check=True, capture_output=True, text=True)
    return {"wheel": wheel, "site": tmp / "site", "cwd": tmp}


def _run(installed: dict[str, Path], *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(installed["site"])}
    return subprocess.run([sys.executable, *args], cwd=installed["cwd"], env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_wheel_carries_every_data_file_of_the_packages(installed: dict[str, Path]) -> None:
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    data = [p.relative_to(ROOT).as_posix() for package in ("fusion_model", "tasks", "flows")
            for p in (ROOT / package).rglob("*") if p.is_file() and p.suffix in (".csv", ".json")]
    assert data and not sorted(set(data) - names)


def test_the_installed_package_runs_outside_the_checkout(installed: dict[str, Path]) -> None:
    where = _run(installed, "-c", "import fusion_model, tasks; print(fusion_model.__file__, tasks.__file__)")
    assert where.stdout.split() and all(p.startswith(str(installed["site"])) for p in where.stdout.split())
    assert _run(installed, "-m", "tasks", "validate", "--help").returncode == 0
    table = installed["cwd"] / "table.csv"
    table.write_text("colour,size,label\n" + "".join(f"{c},{i},{i % 2}\n" for i, c in enumerate("rgbrgbrgbr")))
    infer = _run(installed, "-m", "tasks", "dataset", "infer", str(table))
    assert infer.returncode == 0, infer.stderr
    assert "label" in infer.stdout and "colour" in infer.stdout
    # the PetFinder preset reads its code tables from the installed package
    codes = _run(installed, "-c", "from fusion_model.dataset import resolve_schema; "
                 "s = resolve_schema({'preset': 'petfinder'}); print(s.checks.codes and len(s.checks.codes))")
    assert codes.returncode == 0 and int(codes.stdout.split()[-1]) > 0, codes.stderr


def test_the_installed_package_predicts_with_a_converted_model(installed: dict[str, Path], tiny_model_chain,
                                                               tmp_path: Path) -> None:
    """`python -m fusion_model.predict` from the wheel, outside the checkout: the same probabilities as the
    evaluation of the checkout's code on the same rows."""
    import pandas as pd

    chain = tiny_model_chain
    rows = tmp_path / "new.csv"
    pd.read_csv(chain.images_root / "test.csv", index_col=0).drop(columns=["AdoptionSpeed"]).to_csv(rows)
    out = tmp_path / "predictions.csv"
    done = _run(installed, "-m", "fusion_model.predict", "--model", str(chain.trained), "--csv", str(rows),
                "--images-root", str(chain.images_root), "--out", str(out))
    assert done.returncode == 0, done.stderr
    got = pd.read_csv(out)
    evaluated = pd.read_csv(chain.trained_eval / "predictions.csv")
    assert len(got) == len(evaluated) > 0
    assert got["proba_1"].to_numpy() == pytest.approx(evaluated["proba_1"].to_numpy(), abs=1e-6)
