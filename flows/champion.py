"""Champion registry from Prefect: list the promoted models, or roll the champion back.

    python -m flows.champion list
    python -m flows.champion rollback [--to VERSION]
or the `champion` deployment of prefect.yaml (`prefect deployment run 'champion/champion' --param
action=rollback`). The same functions as `python -m tasks champion ...` (tasks/promote/registry.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from tasks._io.processes import start_reaper
from tasks.params import load_params


@flow(name="champion", log_prints=True)
def champion(action: Literal["list", "rollback"] = "list", to: int | None = None,
             params_path: Path = Path("params.yaml")) -> list[dict[str, Any]]:
    """`list`: every promotion (version, sha256, score, run, data, code), the champion marked; `rollback`:
    make version `to` (default: the one before the current champion) the champion again, then list."""
    from tasks.promote import listing, registry, rollback

    section = load_params(params_path).promote
    if action == "rollback":
        event = rollback(section.champion_dir, to, lock_timeout_s=section.lock_timeout_s)
        get_run_logger().info("champion rolled back to version %d (%s)", event.version, event.sha256[:12])
    rows = listing(section.champion_dir, lock_timeout_s=section.lock_timeout_s)
    if problem := registry.dangling_link_problem(section.champion_dir):
        get_run_logger().warning(problem)
    create_markdown_artifact(key="champion-registry", markdown="# Champions\n\n" + registry.render_listing(rows),
                             description="Every promoted model; * marks the champion")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.champion", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["list", "rollback"])
    parser.add_argument("--to", type=int, default=None, metavar="VERSION")
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    args = parser.parse_args(argv)
    start_reaper()  # a SIGKILL of this process must not leave Prefect's temporary server running
    state = champion(action=args.action, to=args.to, params_path=args.params, return_state=True)
    if not state.is_completed():
        print(f"error: {state.message}", file=sys.stderr)
        return 1
    from tasks.promote import registry

    print(registry.render_listing(state.result()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
