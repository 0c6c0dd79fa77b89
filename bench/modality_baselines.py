"""Fusion against single-modality baselines on the validated data, with the train section of params.yaml.

    python bench/modality_baselines.py [--params params.yaml] [--only image,tabular,text,fusion]

Each baseline is the same architecture trained with the other modalities masked (``modalities``), through
the same train stage (same strategy, epochs, learning rate); prints the best validation metric of each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tasks.params import load_params  # noqa: E402
from tasks.train import train  # noqa: E402

RUNS = {"fusion": ["image", "tabular", "text"], "image": ["image"], "tabular": ["tabular"], "text": ["text"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--only", default=",".join(RUNS))
    args = parser.parse_args()
    base = load_params(args.params).train
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only.split(","):
            summary = train(base.model_copy(update={"modalities": RUNS[name], "out_dir": Path(tmp) / name,
                                                    "live_dir": Path(tmp) / f"{name}.training"}))
            results[name] = {"best": summary.best_score, "metric": summary.monitor, "fit_wall_s": summary.fit_wall_s,
                             "wall_s": summary.wall_s}
            print(f"{name:>8}: best {summary.monitor} {summary.best_score:.4f} "
                  f"(fit {summary.fit_wall_s:.0f} s, total {summary.wall_s:.0f} s)", flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
