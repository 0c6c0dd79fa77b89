"""The stages on local real datasets, the fusion model vs the classical baseline of the same evaluation.

    python bench/real_data.py                                  # every dataset of ../shared
    python bench/real_data.py --dataset fashion-season         # one of DATASETS (repeatable)
    python bench/real_data.py --csv FILE_OR_FOLDER --label-kind binary   # your own PetFinder file
    python bench/real_data.py --peer                           # ... beside AutoGluon-Tabular on the same split
    python bench/real_data.py --split 1 --split 2 --split 3    # other splits (download.local's seed), and the means

Runs download (source: local) -> validate -> train -> convert -> evaluate with params.yaml's defaults and
only the `dataset:` section (and download.local's paths) changed, every path inside --work, and prints
the test metrics of the fusion model and of the baseline fitted in the same evaluation, the per-modality
ablation and the stage times; `--modalities` also trains each single-modality model of the same
architecture. `--through dvc` / `--through flow` instead runs the whole pipeline as a user would: a git
clone of the project (its last commit) under --work, params.yaml's `dataset:` and `download.local`
edited there, then `dvc repro` / `python -m flows.retrain` in it; the same seeds give the same numbers
as the stages run here. Results go to bench/results/real_data.json. Never copies the real files into the project.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from statistics import fmean
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.__main__ import run_stage  # noqa: E402
from tasks._io.files import write_json  # noqa: E402
from tasks.params import load_params  # noqa: E402


def shared_dir() -> Path:
    """Where the real datasets are: $SHARED_DATA, else ../shared beside the project."""
    return Path(os.environ.get("SHARED_DATA", ROOT.parent / "shared"))


def datasets(shared: Path) -> dict[str, dict[str, Any]]:
    """name -> {"dataset": params.yaml dataset section, "local": download.local keys}: what a user writes
    (README, "Real datasets"); no table sets a train key."""
    reviews_inputs = {"text": ["Title", "Review Text"],
                      "categorical": ["Clothing ID", "Division Name", "Department Name", "Class Name"],
                      "numerical": ["Age", "Positive Feedback Count"]}
    return {
        "petfinder-binary": {
            "dataset": {"preset": "petfinder", "label": {"problem_type": "binary"}},
            "local": {"path": str(shared / "petfinder/real/dogs_train.csv"), "drop_bad_ids": True}},
        "petfinder-ordinal": {
            "dataset": {"preset": "petfinder", "label": {"problem_type": "ordinal"}},
            "local": {"path": str(shared / "petfinder/real/dogs_train.csv"), "drop_bad_ids": True}},
        "fashion-season": {
            "dataset": {"preset": None, "id": "id",
                        "label": {"column": "season", "problem_type": "multiclass"},
                        "columns": {"image": ["image"], "text": ["productDisplayName"],
                                    "categorical": ["gender", "masterCategory", "subCategory", "articleType",
                                                    "baseColour", "usage"],
                                    "numerical": ["year"]}},
            "local": {"path": str(shared / "fashion/styles.csv"), "images_dir": str(shared / "fashion")}},
        "reviews-recommended": {
            "dataset": {"preset": None, "id": None,
                        "label": {"column": "Recommended IND", "problem_type": "binary"},
                        "columns": reviews_inputs, "frequency": ["Clothing ID"]},
            "local": {"path": str(shared / "womens_clothing/reviews.csv")}},
        "reviews-rating": {
            "dataset": {"preset": None, "id": None,
                        "label": {"column": "Rating", "problem_type": "ordinal"},
                        "columns": reviews_inputs, "frequency": ["Clothing ID"]},
            "local": {"path": str(shared / "womens_clothing/reviews.csv")}},
    }


def overrides(work: Path, spec: dict[str, Any], train: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "dataset": spec["dataset"],
        "download": {"source": "local", "out_dir": str(work / "raw"), "local": spec["local"]},
        "intake": {"report_dir": str(work / "reports"), "feed": {"ledger": str(work / "intake/batches.json")}},
        "validate": {"dataset_dir": str(work / "raw/dataset"), "out_dir": str(work / "validated"),
                     "report_dir": str(work / "reports")},
        "train": {"data_dir": str(work / "validated"), "out_dir": str(work / "checkpoints"),
                  "live_dir": str(work / "training"), **spec.get("train", {}), **(train or {})},
        "convert": {"checkpoint_dir": str(work / "checkpoints"), "out_dir": str(work / "model")},
        "evaluate": {"model_dir": str(work / "model"), "data_dir": str(work / "validated"),
                     "out_dir": str(work / "eval")},
    }


def run(name: str, spec: dict[str, Any], work: Path, train: dict[str, Any] | None = None,
        stages: tuple[str, ...] = ("download", "validate", "train", "convert", "evaluate")) -> dict[str, Any]:
    params = load_params(ROOT / "params.yaml", overrides(work, spec, train))
    seconds: dict[str, float | None] = {}
    for stage in stages:
        started = time.perf_counter()
        result = run_stage(stage, params)
        seconds[stage] = round(time.perf_counter() - started, 1)
        if stage == "evaluate":
            seconds["baseline (inside evaluate)"] = result.baseline_seconds
    return {**outcome(name, work / "eval", work / "validated"), "seconds": seconds}


def outcome(name: str, eval_dir: Path, validated_dir: Path) -> dict[str, Any]:
    """What one run of a table measured: its test metrics beside the baseline's, and the ablation."""
    metrics = json.loads((eval_dir / "metrics.json").read_text())
    ablation = json.loads((eval_dir / "ablation.json").read_text())
    return {
        "dataset": name, "problem_type": metrics["problem_type"],
        "rows": json.loads((validated_dir / "meta.json").read_text())["rows"],
        "metric": metrics["primary_metric"]["name"], "fusion": metrics["primary_metric"]["value"],
        "baseline": metrics["baseline"]["primary_metric"]["value"], "improvement": metrics["vs_baseline"]["improvement"],
        "fusion_metrics": metrics["metrics"], "baseline_metrics": metrics["baseline"]["metrics"],
        "ablation": {m: {"score": e["score"], "drop": e["drop"]} for m, e in ablation["modalities"].items()},
    }


def run_project(name: str, spec: dict[str, Any], work: Path, through: str) -> dict[str, Any]:
    """`dvc repro` or the retrain flow in a clone of the project with only params.yaml changed."""
    project = work / "project"
    if not project.exists():
        subprocess.run(["git", "clone", "-q", str(ROOT), str(project)], check=True)
    params = yaml.safe_load((project / "params.yaml").read_text())
    params["dataset"] = spec["dataset"]
    params["download"]["source"] = "local"
    params["download"]["local"].update(spec["local"])
    params["train"].update(spec.get("train", {}))
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    command = [sys.executable, "-m", "dvc", "repro"] if through == "dvc" else [sys.executable, "-m", "flows.retrain"]
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": os.environ.get(
               "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")}
    env.pop("PYTHONPATH", None)
    started = time.perf_counter()
    with open(work / f"{through}.log", "w") as log:
        done = subprocess.run(command, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{name}: {' '.join(command[1:])} failed ({done.returncode}); see {work / f'{through}.log'}")
    seconds = round(time.perf_counter() - started, 1)
    paths = load_params(project / "params.yaml")  # where the clone's params.yaml puts the outputs
    return {**outcome(name, project / paths.evaluate.out_dir, project / paths.validate_.out_dir),
            "through": through, "seconds": {through: seconds}}


def peer_side(result: dict[str, Any], validated: Path) -> dict[str, Any]:
    """AutoGluon-Tabular on the very split of this run (bench/peer/runner.py; cached by the split's sha256)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from peer.runner import fit

    got = fit(validated, ROOT / "bench" / "results" / "peer")
    if got.metric != result["metric"]:
        raise SystemExit(f"the peer scored {got.metric}, the network {result['metric']}: bench/peer/runner.py is stale")
    ratio = result["fusion"] / got.score if got.score else float("nan")
    return {"score": got.score, "ratio": round(ratio, 4), "fit_wall_s": got.fit_wall_s, "cached": got.cached,
            "best_model": got.best_model, "metrics": got.metrics}


def single_modalities(spec: dict[str, Any], work: Path, result: dict[str, Any]) -> dict[str, float]:
    """The best validation score of each single-modality model of the same architecture and settings,
    beside the fusion model's (the train stage with `modalities` set; the same validated rows)."""
    from tasks.train import train

    params = load_params(ROOT / "params.yaml", overrides(work, spec))
    scores = {}
    summary = json.loads((work / "checkpoints/train_summary.json").read_text())
    scores["fusion"] = summary["best_score"]
    for modality in result["ablation"]:
        out = work / f"single-{modality}"
        got = train(params.train.model_copy(update={"modalities": [modality], "out_dir": out / "checkpoints",
                                                     "live_dir": out / "training"}))
        scores[modality] = got.best_score
    return scores


def split_of(spec: dict[str, Any], split: int | None) -> dict[str, Any]:
    """The table's spec with download.local's seed set to `split` (None: params.yaml's)."""
    return spec if split is None else {**spec, "local": {**spec["local"], "seed": split}}


def print_means(results: list[dict[str, Any]]) -> None:
    """Each table's mean over its splits: one split's score turns on a few rows, the mean less so."""
    for name in dict.fromkeys(r["dataset"] for r in results):
        runs = [r for r in results if r["dataset"] == name]
        line = (f"{name}, mean over splits {[r['split'] for r in runs]}: network {fmean(r['fusion'] for r in runs):.4f}, "
                f"baseline {fmean(r['baseline'] for r in runs):.4f}")
        if all("peer" in r for r in runs):
            line += f", AutoGluon-Tabular {fmean(r['peer']['score'] for r in runs):.4f}"
        print(line, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", action="append", default=[], help="a name of DATASETS (default: all)")
    parser.add_argument("--csv", type=Path, help="your own PetFinder CSV or folder (with --label-kind)")
    parser.add_argument("--label-kind", choices=["binary", "multiclass", "ordinal", "both"], default="both",
                        help="with --csv: binary AUC, 0-4 QWK (multiclass is read as ordinal), or both")
    parser.add_argument("--work", type=Path, default=Path("/tmp/real_data_bench"))
    parser.add_argument("--modalities", action="store_true", help="also train each single-modality model")
    parser.add_argument("--peer", action="store_true",
                        help="also fit AutoGluon-Tabular (bench/peer, its own venv) on the same split: both scores, "
                             "their ratio and each one's wall time")
    parser.add_argument("--split", type=int, action="append", default=[],
                        help="download.local's seed, which draws the test rows (repeatable; default params.yaml's): "
                             "each table on each split, then each table's means")
    parser.add_argument("--through", choices=["stages", "dvc", "flow"], default="stages",
                        help="stages: each stage here; dvc / flow: `dvc repro` / the retrain flow in a project clone")
    args = parser.parse_args()
    specs = datasets(shared_dir())
    if args.csv is not None:
        if not args.csv.exists():
            print(f"{args.csv}: not found; pass --csv with a real PetFinder file", file=sys.stderr)
            return 2
        kinds = ["binary", "ordinal"] if args.label_kind == "both" else [
            "ordinal" if args.label_kind == "multiclass" else args.label_kind]
        chosen = {f"petfinder-{k}": {"dataset": {"preset": "petfinder", "label": {"problem_type": k}},
                                     "local": {"path": str(args.csv), "drop_bad_ids": True}} for k in kinds}
    else:
        names = args.dataset or list(specs)
        unknown = [n for n in names if n not in specs]
        if unknown:
            print(f"unknown dataset(s) {unknown}; choose from {list(specs)}", file=sys.stderr)
            return 2
        chosen = {n: specs[n] for n in names if Path(specs[n]["local"]["path"]).exists()}
        for n in set(names) - set(chosen):
            print(f"{n}: {specs[n]['local']['path']} not found; skipped", file=sys.stderr)
    results = []
    for (name, spec), split in itertools.product(chosen.items(), args.split or [None]):
        spec, work = split_of(spec, split), args.work / (name if split is None else f"{name}-split{split}")
        if args.through == "stages":
            r = run(name, spec, work)
        else:
            r = run_project(name, spec, work.with_name(f"{work.name}-{args.through}"), args.through)
        r["split"] = spec["local"].get("seed")
        if args.peer and args.through == "stages":
            r["peer"] = peer_side(r, work / "validated")
        if args.modalities and args.through == "stages":
            r["single_modality_val"] = single_modalities(spec, work, r)
        results.append(r)
        print(f"\n{name}{'' if split is None else f' split {split}'} ({r['problem_type']}): test {r['metric']} fusion {r['fusion']:.4f} vs baseline "
              f"{r['baseline']:.4f} (improvement {r['improvement']:+.4f}); rows {r['rows']}", flush=True)
        print("  ablation (masked -> score, drop): " + ", ".join(
            f"{m} {e['score']:.4f} ({e['drop']:+.4f})" for m, e in r["ablation"].items()))
        print("  seconds: " + ", ".join(f"{k} {v}" for k, v in r["seconds"].items()), flush=True)
        if "peer" in r:
            p = r["peer"]
            print(f"  AutoGluon-Tabular {p['score']:.4f}: network / peer {p['ratio']:.3f}; wall train "
                  f"{r['seconds']['train']} s vs peer fit {p['fit_wall_s']} s ({p['best_model']})", flush=True)
            if p["metrics"].get("log_loss") is not None:  # steadier than a rare class's F1 or a kappa
                print(f"  test log loss: network {r['fusion_metrics']['log_loss']:.4f}, "
                      f"peer {p['metrics']['log_loss']:.4f}", flush=True)
        if "single_modality_val" in r:
            print("  best validation score per model: " + ", ".join(
                f"{m} {v:.4f}" for m, v in r["single_modality_val"].items()), flush=True)
    if len(args.split) > 1:
        print_means(results)
    out = ROOT / "bench" / "results" / ("real_data.json" if args.through == "stages" else f"real_data_{args.through}.json")
    write_json(out, results)
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
