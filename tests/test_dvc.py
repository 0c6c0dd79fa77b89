"""dvc.yaml runs the same stages as the flow: `dvc repro` in a throwaway git copy of the project.

The session's `pipeline_project` (one `dvc repro` with tiny parameters, conftest.py) is shared by the
tests below, which run in file order: no-op second repro, metrics, plots, push/pull, a train parameter
change, the version step. Determinism (the flow rebuilding the same bytes) is in test_deployment.py.
"""

from __future__ import annotations

import ast
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import yaml
from filelock import FileLock
from project_copy import ROOT, dvc, run, script_sources, sha256, write_params

STAGES = ("download", "intake", "validate", "train", "convert", "evaluate")
MODEL = Path("data/model/model.safetensors")
# Modules a stage runs by name (every `cmd` is `python -m tasks <stage>`; a subprocess or a lazy import)
# rather than by an import statement at the top.
ENTRY_MODULES = {
    "download": ["tasks.__main__", "tasks.download"],
    "intake": ["tasks.__main__", "tasks.intake"],
    "validate": ["tasks.__main__", "tasks.validate"],
    "train": ["tasks.__main__", "tasks.train", "fusion_model.fit", "fusion_model.launch"],
    "convert": ["tasks.__main__", "tasks.convert"],
    "evaluate": ["tasks.__main__", "tasks.evaluate", "fusion_model.predict"],
}
# Data files a module reads at run time: a stage importing the module depends on them too.
DATA_DIRS = {"fusion_model/presets/petfinder.py": "fusion_model/presets/petfinder_codes",
             "tasks/checks/suite.py": "tasks/checks/suites"}
# Folders of data files (their __init__.py only makes them importable resources), not code.
DATA_PACKAGES = {"fusion_model/presets/petfinder_codes"}
# The params.yaml sections each stage reads: its own, and for the stages that read the table itself the
# dataset's declaration (the later ones read it from the validated folder, a dep).
# The download stage tracks only the keys that make the base dataset (which batch arrived is the intake
# ledger's record, not configuration); the intake stage its own section (the feed, the gate, its folders)
# and the download keys it reads: the folder it builds on and the generator's, never the batch's choice.
STAGE_PARAMS = {
    "download": ["dataset", "download.source", "download.url", "download.sha256", "download.out_dir",
                 "download.synthetic.n_train", "download.synthetic.n_test", "download.synthetic.image_size",
                 "download.synthetic.seed", "download.local"],
    "intake": ["dataset", "intake", "download.out_dir", "download.synthetic.seed", "download.synthetic.image_size"],
    "validate": ["dataset", "validate"],
}
# Another stage's package a stage runs: the intake's folder is built on the download stage's dataset (read
# through its manifest module; the embedded generator's batches). The checks an arriving batch and the whole
# data both go through live in the shared tasks/checks, beside tasks/_io.
SHARED_PACKAGES = {"intake": {"tasks/download"}}
SHARED = {"tasks/_io", "tasks/checks"}


def _ran(output: str) -> set[str]:
    return {s for s in STAGES if f"Running stage '{s}'" in output}


@pytest.fixture
def project(pipeline_project: dict) -> dict:
    return pipeline_project


# --- static checks of dvc.yaml (no pipeline run) ---------------------------------------------------------


def _module_file(name: str) -> Path | None:
    base = ROOT / Path(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def project_imports(modules: list[str]) -> set[str]:
    """Files of this project a module imports, directly or not (function-level imports included)."""
    seen: set[Path] = set()
    todo = list(modules)
    while todo:
        path = _module_file(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                todo += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
    return {str(p.relative_to(ROOT)) for p in seen if p.name != "__init__.py"}


def _stage(name: str) -> dict:
    return yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"][name]


@pytest.mark.parametrize("stage", STAGES)
def test_stage_deps_list_every_module_the_stage_runs(stage: str) -> None:
    missing_modules = [m for m in ENTRY_MODULES[stage] if _module_file(m) is None]
    if missing_modules:
        pytest.fail(f"{stage}: {missing_modules} not written yet, so its deps cannot be checked")
    deps = set(_stage(stage)["deps"])
    # code: a module file, or a folder (a stage package, the shared tasks/_io and tasks/checks) that holds modules
    code_deps = {d for d in deps if "${" not in d and d not in DATA_PACKAGES
                 and (d.endswith(".py") or any((ROOT / d).rglob("*.py")))}
    needed = project_imports(ENTRY_MODULES[stage])

    def covered_by(module: str, dep: str) -> bool:
        return module == dep or module.startswith(dep.rstrip("/") + "/")

    uncovered = sorted(m for m in needed if not any(covered_by(m, d) for d in code_deps))
    assert not uncovered, f"dvc.yaml `{stage}` deps lack {uncovered}"
    unused = sorted(d for d in code_deps if not any(covered_by(m, d) for m in needed))
    assert not unused, f"dvc.yaml `{stage}` lists code it does not import: {unused}"
    # a folder dep stands for a whole package: only stage packages and the shared one, never a catch-all
    folders = {d for d in code_deps if not d.endswith(".py")}
    allowed = {*SHARED, f"tasks/{stage}", *SHARED_PACKAGES.get(stage, ())}
    assert folders <= allowed, f"dvc.yaml `{stage}` folder deps {sorted(folders)}"
    data_dirs = {DATA_DIRS[m] for m in needed if m in DATA_DIRS}
    missing_data = sorted(d for d in data_dirs if not any(covered_by(d, dep) for dep in deps))
    assert not missing_data, f"dvc.yaml `{stage}` deps lack data files {missing_data}"
    for dep in deps:
        if "${" not in dep:
            assert (ROOT / dep).exists(), f"dvc.yaml `{stage}` dep {dep} does not exist"


def test_each_stage_tracks_only_the_params_sections_it_reads() -> None:
    for stage in STAGES:
        assert _stage(stage)["params"] == STAGE_PARAMS.get(stage, [stage]), stage
        assert _stage(stage)["cmd"] == f"python -m tasks {stage}", stage


def test_evaluate_declares_every_file_it_writes() -> None:
    from tasks.evaluate import OUTPUT_FILES

    stage = _stage("evaluate")
    declared = [*stage["outs"], *(next(iter(m)) for m in stage["metrics"]), *(next(iter(p)) for p in stage["plots"])]
    names = sorted(Path(d if isinstance(d, str) else next(iter(d))).name for d in declared)
    assert names == sorted(OUTPUT_FILES)


def test_default_remote_is_a_local_folder_inside_the_project() -> None:
    config = (ROOT / ".dvc" / "config").read_text()
    assert "remote = storage" in config and "url = ../.dvc-remote" in config
    assert "/.dvc-remote/" in (ROOT / ".gitignore").read_text()


# --- the pipeline, in a git copy ------------------------------------------------------------------------


@pytest.mark.slow
def test_repro_runs_every_stage_and_writes_metrics(project: dict) -> None:
    root = project["root"]
    assert _ran(project["first_repro"]) == set(STAGES), project["first_repro"][-2000:]
    metrics = json.loads((root / "data/eval/metrics.json").read_text())
    assert metrics["primary_metric"]["name"] == "roc_auc"
    assert 0.0 <= metrics["primary_metric"]["value"] <= 1.0
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert set(lock["stages"]) == set(STAGES)
    # data stays out of git: only dvc.lock and the small uncached metrics, plot data and reports are new
    status = run(root, "git", "status", "--porcelain", "--untracked-files=all").stdout.splitlines()
    new = sorted(line.removeprefix("?? ") for line in status)
    assert all(line.startswith("?? ") for line in status), status
    assert all(p == "dvc.lock" or p in {"data/eval/metrics.json", "data/eval/plots/roc.csv", "data/eval/plots/confusion.csv",
                                        "data/eval/plots/residuals.csv", "data/intake/batches.json"}
               or p.startswith("reports/") for p in new), new
    for path in ("dvc.lock", "reports/validation.json", "reports/training/metrics.json", "reports/training/curves.png",
                 "reports/training/plots/metrics/val/roc_auc.tsv"):
        assert path in new, path
    print(f"dvc repro, all stages, tiny params: {project['repro_s']:.0f} s")


@pytest.mark.slow
def test_second_repro_is_a_no_op(project: dict) -> None:
    out = dvc(project["root"], "repro").stdout
    assert _ran(out) == set(), out
    assert "Data and pipelines are up to date." in out
    assert dvc(project["root"], "status").stdout.strip() == "Data and pipelines are up to date."


@pytest.mark.slow
def test_metrics_show_lists_the_metrics(project: dict) -> None:
    out = dvc(project["root"], "metrics", "show").stdout
    assert "data/eval/metrics.json" in out and "roc_auc" in out, out
    shown = json.loads(dvc(project["root"], "metrics", "show", "--json").stdout)
    assert "data/eval/metrics.json" in json.dumps(shown)


@pytest.mark.slow
def test_plots_point_at_the_evaluation_files(project: dict, tmp_path: Path) -> None:
    shown = dvc(project["root"], "plots", "show", "--out", str(tmp_path / "page"))
    assert "DVC failed to load some plots" not in shown.stdout + shown.stderr, shown.stderr  # every file there
    page = (tmp_path / "page/index.html").read_text()
    assert script_sources(page) and set(script_sources(page)) == {"inline"}  # Vega from vendor/vega/, no CDN
    out = dvc(project["root"], "plots", "show", "--json", "--out", str(tmp_path / "plots")).stdout
    assert '"errors"' not in out
    for name in ("roc.csv", "confusion.csv", "roc.png", "confusion_matrix.png"):
        assert f"data/eval/plots/{name}" in out, name
    assert "ROC curve (test set)" in out and "Confusion matrix (test set)" in out  # dvc.yaml's top-level plots
    # the training curves DVCLive logged, and the PNG drawn from them
    for name in ("plots/metrics/val/roc_auc.tsv", "plots/metrics/train/loss_epoch.tsv", "curves.png"):
        assert f"reports/training/{name}" in out, name


@pytest.mark.slow
def test_exp_show_lists_the_training_metrics_dvclive_logged(project: dict) -> None:
    shown = json.loads(dvc(project["root"], "exp", "show", "--json").stdout)
    workspace = next(row for row in shown if row["rev"] == "workspace")
    metrics = workspace["data"]["metrics"]
    live = metrics["reports/training/metrics.json"]["data"]
    assert {"val", "train", "epoch", "step"} <= set(live) and "roc_auc" in live["val"] and "loss_epoch" in live["train"]
    assert "data/eval/metrics.json" in metrics


@pytest.mark.slow
def test_push_then_pull_restores_the_model_byte_identical(project: dict) -> None:
    root = project["root"]
    shutil.rmtree(root / ".dvc-remote", ignore_errors=True)  # a flow run may have pushed already
    assert "pushed" in dvc(root, "push").stdout
    assert any((root / ".dvc-remote").rglob("*")), "nothing reached the default remote"
    for out in ("data/raw", "data/accumulated", "data/validated", "data/checkpoints", "data/model", ".dvc/cache"):
        shutil.rmtree(root / out)  # the local cache too: the files must come from the remote
    dvc(root, "pull")
    assert sha256(root / MODEL) == project["model_sha"]
    assert dvc(root, "status").stdout.strip() == "Data and pipelines are up to date."


@pytest.mark.slow
def test_changing_a_train_param_reruns_train_convert_and_evaluate_only(project: dict) -> None:
    root = project["root"]
    lr = yaml.safe_load((root / "params.yaml").read_text())["train"]["lr"]
    write_params(root, {"train": {"lr": lr * 5}})
    out = dvc(root, "repro").stdout
    assert _ran(out) == {"train", "convert", "evaluate"}, out
    assert "Stage 'download' didn't change" in out and "Stage 'validate' didn't change" in out
    assert sha256(root / MODEL) != project["model_sha"]
    project["model_sha"] = sha256(root / MODEL)


# --- the version step (`python -m tasks version`, the flow's last DVC step) -------------------------------


def _version(root: Path, *args: str, check: bool = True):
    return run(root, "python", "-m", "tasks", "version", *args, check=check)


@pytest.mark.slow
def test_version_commits_pushes_and_writes_a_run_manifest(project: dict) -> None:
    root = project["root"]
    shutil.rmtree(root / ".dvc-remote", ignore_errors=True)
    summary = json.loads(_version(root).stdout)
    manifest = json.loads((root / summary["manifest"]).read_text())
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert manifest["git"]["rev"] == run(root, "git", "rev-parse", "HEAD").stdout.strip()
    assert manifest["dvc"]["outs"]["convert"]["data/model"] == lock["stages"]["convert"]["outs"][0]["md5"]
    assert manifest["dvc"]["pushed"] and any((root / ".dvc-remote").rglob("*"))
    from tasks.params import load_params

    # the parameters the run used, every key typed: params.yaml as it is (no overrides here)
    assert manifest["params"] == load_params(root / "params.yaml").model_dump(mode="json", by_alias=True)
    assert manifest["overridden"] == [] and manifest["dvc"]["uncommitted_stages"] == []
    assert manifest["metrics"]["data/eval/metrics.json"]["primary_metric"]["name"] == "roc_auc"
    # data, model and metrics reached the remote; the optimizer shards did not (version.push_checkpoints)
    assert manifest["dvc"]["pushed_stages"] == ["download", "intake", "validate", "convert", "evaluate"]
    pushed = dvc(root, "status", "--cloud", "download", "intake", "validate", "convert", "evaluate").stdout.strip()
    assert pushed == "Cache and remote 'storage' are in sync."
    assert "data/checkpoints/best.ckpt" in dvc(root, "status", "--cloud", "train").stdout


@pytest.mark.slow
def test_version_waits_for_a_concurrent_version_step(project: dict) -> None:
    root = project["root"]
    lock = FileLock(str(root / ".dvc/tmp/version.lock"), thread_local=False)  # released by the timer thread
    lock.acquire()
    threading.Timer(4.0, lock.release).start()
    started = time.monotonic()
    _version(root, "--push", "false")
    assert time.monotonic() - started >= 4.0


@pytest.mark.slow
def test_version_gives_up_on_a_held_lock_with_the_fix(project: dict) -> None:
    root = project["root"]
    with FileLock(str(root / ".dvc/tmp/version.lock")):
        done = _version(root, "--lock-timeout-s", "1", check=False)
    assert done.returncode == 1
    assert "another version step has held this lock" in done.stderr and "lock_timeout_s" in done.stderr


@pytest.mark.slow
def test_version_names_an_unknown_stage(project: dict) -> None:
    done = _version(project["root"], "--stages", "[download, trian]", check=False)
    assert done.returncode == 1
    assert "dvc.yaml: no stage named trian" in done.stderr and "version.stages" in done.stderr


def test_version_outside_a_dvc_repo_says_how_to_set_one_up(tmp_path: Path) -> None:
    (tmp_path / "params.yaml").write_text("{}\n")
    done = _version(tmp_path, check=False)
    assert done.returncode == 1
    assert "not a DVC repository" in done.stderr and "dvc init" in done.stderr


def test_an_overridden_stage_and_those_after_it_are_not_committed(tmp_path: Path) -> None:
    from tasks.params import load_params
    from tasks.version.stage import committable_stages, overridden_keys

    path = tmp_path / "params.yaml"
    shutil.copy(ROOT / "params.yaml", path)
    stages = ["download", "validate", "train", "convert", "evaluate"]
    assert committable_stages(stages, path, load_params(path)) == (stages, [])
    effective = load_params(path, {"train": {"max_epochs": 3}})
    assert committable_stages(stages, path, effective) == (["download", "validate"], ["train", "convert", "evaluate"])
    assert overridden_keys(path, effective) == ["train.max_epochs"]
    assert path.read_bytes() == (ROOT / "params.yaml").read_bytes()  # nothing is written back


@pytest.fixture
def fresh_project(tmp_path: Path) -> Path:
    """A git + DVC copy with no pipeline outputs yet."""
    from project_copy import make_project

    return make_project(tmp_path / "project")


def test_version_before_any_run_names_the_missing_output_and_the_fix(fresh_project: Path) -> None:
    done = _version(fresh_project, "--push", "false", check=False)
    assert done.returncode == 1
    assert "`dvc commit --force download" in done.stderr and "data/raw" in done.stderr
    assert "run the missing stage (`python -m tasks <stage>`) or `dvc repro`" in done.stderr
    assert not (fresh_project / "dvc.lock").exists()


def test_version_without_a_remote_says_how_to_add_one(fresh_project: Path) -> None:
    config = fresh_project / ".dvc/config"
    config.write_text(config.read_text().replace("    remote = storage\n", ""))
    done = _version(fresh_project, check=False)
    assert done.returncode == 1
    assert "no DVC remote to push to" in done.stderr and "dvc remote add -d storage" in done.stderr


@pytest.mark.slow
def test_two_experiments_are_compared_by_exp_show_and_plots_diff(project: dict, tmp_path: Path) -> None:
    """`dvc exp run -S train.lr=...` twice: both experiments listed with their own lr and metrics, and
    `dvc plots diff` compares their training curves."""
    root = project["root"]
    names = {}
    for lr in (0.001, 0.02):
        out = dvc(root, "exp", "run", "-S", f"train.lr={lr}", timeout=900).stdout
        assert "Ran experiment(s)" in out, out[-2000:]
        names[lr] = out.split("Ran experiment(s): ")[1].split()[0]
    shown = json.loads(dvc(root, "exp", "show", "--json").stdout)
    experiments = {e["name"]: e for row in shown for e in (row.get("experiments") or [])
                   for e in (e.get("revs") or [e]) if e.get("name")}
    found = {}
    for lr, name in names.items():
        data = experiments[name]["data"]
        found[lr] = (data["params"]["params.yaml"]["data"]["train"]["lr"],
                     data["metrics"]["reports/training/metrics.json"]["data"]["val"]["roc_auc"])
    assert [found[lr][0] for lr in names] == list(names)  # each experiment records its own lr
    assert found[0.001][1] != found[0.02][1]  # and its own validation metric
    diff = dvc(root, "plots", "diff", *names.values(), "--json", "--out", str(tmp_path / "diff")).stdout
    assert "reports/training/plots/metrics/val/roc_auc.tsv" in diff and all(n in diff for n in names.values())
