"""The stages on a local real dataset, fusion model vs the classical baseline, with each stage's wall time.

    python bench/real_data.py                      # ../shared/petfinder/real/dogs_train.csv, binary and 0-4
    python bench/real_data.py --csv FILE_OR_FOLDER --label-kind binary --work /tmp/real

Runs download (source: local, damaged PetIDs dropped) -> validate -> train -> convert -> evaluate with
params.yaml's defaults, every path inside --work, and prints the test metrics of the fusion model and of
the baseline fitted in the same evaluation, the per-modality ablation and the stage times. Results also
go to bench/results/real_data.json. Never copies the real file into the project.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.__main__ import run_stage  # noqa: E402
from tasks._io.files import write_json  # noqa: E402
from tasks.params import load_params  # noqa: E402

DEFAULT_CSV = ROOT.parent / "shared" / "petfinder" / "real" / "dogs_train.csv"
STAGES = ("download", "validate", "train", "convert", "evaluate")


def overrides(work: Path, csv: Path, label_kind: str) -> dict:
    return {
        "download": {"source": "local", "out_dir": str(work / "raw"), "report_dir": str(work / "reports"),
                     "local": {"path": str(csv), "drop_bad_pet_ids": True, "label_kind": label_kind}},
        "validate": {"dataset_dir": str(work / "raw/petfinder_for_tutorial"), "out_dir": str(work / "validated"),
                     "report_dir": str(work / "reports"), "label_kind": label_kind},
        "train": {"data_dir": str(work / "validated"), "out_dir": str(work / "checkpoints"),
                  "live_dir": str(work / "training")},
        "convert": {"checkpoint_dir": str(work / "checkpoints"), "out_dir": str(work / "model")},
        "evaluate": {"model_dir": str(work / "model"), "data_dir": str(work / "validated"), "out_dir": str(work / "eval")},
    }


def run(csv: Path, work: Path, label_kind: str) -> dict:
    params = load_params(ROOT / "params.yaml", overrides(work / label_kind, csv, label_kind))
    seconds = {}
    for stage in STAGES:
        started = time.perf_counter()
        result = run_stage(stage, params)
        seconds[stage] = round(time.perf_counter() - started, 1)
        if stage == "evaluate":
            seconds["baseline (inside evaluate)"] = result.baseline_seconds
    metrics = json.loads((work / label_kind / "eval" / "metrics.json").read_text())
    ablation = json.loads((work / label_kind / "eval" / "ablation.json").read_text())
    name = metrics["primary_metric"]["name"]
    return {
        "label_kind": label_kind, "rows": json.loads((work / label_kind / "validated/meta.json").read_text())["rows"],
        "metric": name, "fusion": metrics["primary_metric"]["value"],
        "baseline": metrics["baseline"]["primary_metric"]["value"], "delta": metrics["vs_baseline"]["delta"],
        "fusion_metrics": metrics["metrics"], "baseline_metrics": metrics["baseline"]["metrics"],
        "ablation": {m: {"score": e["score"], "drop": e["drop"]} for m, e in ablation["modalities"].items()},
        "seconds": seconds,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV, help="a real PetFinder CSV or folder")
    parser.add_argument("--work", type=Path, default=Path("/tmp/real_data_bench"))
    parser.add_argument("--label-kind", choices=["binary", "multiclass", "both"], default="both")
    args = parser.parse_args()
    if not args.csv.exists():
        print(f"{args.csv}: not found; pass --csv with a real PetFinder file", file=sys.stderr)
        return 2
    kinds = ["binary", "multiclass"] if args.label_kind == "both" else [args.label_kind]
    results = [run(args.csv, args.work, kind) for kind in kinds]
    for r in results:
        print(f"\n{r['label_kind']}: test {r['metric']} fusion {r['fusion']:.4f} vs baseline {r['baseline']:.4f} "
              f"({r['delta']:+.4f}); rows {r['rows']}")
        print("  ablation (masked -> score, drop): " + ", ".join(
            f"{m} {e['score']:.4f} ({e['drop']:+.4f})" for m, e in r["ablation"].items()))
        print("  seconds: " + ", ".join(f"{k} {v}" for k, v in r["seconds"].items()))
    out = ROOT / "bench" / "results" / "real_data.json"
    write_json(out, results)
    print(f"\nresults: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
