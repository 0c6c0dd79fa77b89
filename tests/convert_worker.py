"""Run one conversion of a `tests/zero_shards.py` checkpoint in its own process, slowed down on request.

    python tests/convert_worker.py CHECKPOINT_DIR OUT_DIR [--pause-after N] [--sleep-per-tensor S]

`--pause-after N` prints "PAUSED <temp file>" after the N-th tensor is written and then sleeps, so a
test can kill the process mid-write; `--sleep-per-tensor` stretches the write so two runs overlap.
Prints the summary as one JSON line, with the times the conversion was entered and left.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zero_shards import TinyNet  # noqa: E402

from tasks.convert import convert  # noqa: E402
from tasks.params import ConvertParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint_dir", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--pause-after", type=int, default=None)
    parser.add_argument("--sleep-per-tensor", type=float, default=0.0)
    parser.add_argument("--pause-after-swap", action="store_true",
                        help="stop between the folder exchange and the deletion of the old folder")
    args = parser.parse_args()
    if args.pause_after_swap:
        import tasks._io.folders as folders

        real_rmtree = folders.shutil.rmtree

        def rmtree_after_pause(path, *a, **kw):  # type: ignore[no-untyped-def]
            if Path(path).name.startswith(f".{args.out_dir.name}.incoming-") and Path(path).exists():
                print("SWAPPED", Path(path).name, flush=True)
                time.sleep(600)
            return real_rmtree(path, *a, **kw)

        folders.shutil.rmtree = rmtree_after_pause

    def on_tensor(i: int, plan: object) -> None:
        if args.sleep_per_tensor:
            time.sleep(args.sleep_per_tensor)
        if args.pause_after is not None and i + 1 == args.pause_after:
            temps = sorted(p.name for p in args.out_dir.parent.glob(f".{args.out_dir.name}.incoming-*"))
            print("PAUSED", *temps, flush=True)
            time.sleep(600)

    entered = time.time()
    summary = convert(
        ConvertParams(checkpoint_dir=args.checkpoint_dir, out_dir=args.out_dir),
        build_model=lambda c: TinyNet(width=c["width"], depth=c["depth"]),
        on_tensor=on_tensor,
    )
    print(json.dumps({**summary.model_dump(mode="json"), "entered": entered, "left": time.time()}), flush=True)


if __name__ == "__main__":
    main()
