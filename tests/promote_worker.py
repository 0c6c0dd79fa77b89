"""Runs one promotion and stops at a named point of it, for a test to SIGKILL it there.

    python tests/promote_worker.py '<PromoteParams JSON>' copying|stored|flipped
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.params import PromoteParams  # noqa: E402
from tasks.promote import promote, registry  # noqa: E402


def pause(point: str) -> None:
    print(f"PAUSED {point}", flush=True)
    time.sleep(600)


def main() -> None:
    params, point = PromoteParams.model_validate_json(sys.argv[1]), sys.argv[2]
    if point == "copying":  # the first file is in the store's temporary folder, the others are not
        real_copy = registry.shutil.copyfile

        def copy_then_pause(src, dst):  # type: ignore[no-untyped-def]
            real_copy(src, dst)
            pause(point)

        registry.shutil.copyfile = copy_then_pause
    elif point == "stored":  # the model's folder is in the store; the link still names the old champion
        registry._point_at = lambda champion_dir, sha: pause(point)
    elif point == "flipped":  # the link names the new model; its promotion is not logged yet
        registry._append = lambda champion_dir, event: pause(point)
    promote(params)


if __name__ == "__main__":
    main()
