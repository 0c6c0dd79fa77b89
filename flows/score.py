"""The scoring flow: new rows scored with the champion, one thin task over `tasks.score.score`.

Each drop of `score.source` (a folder of drops, or the URL of a listing: the intake's feed kinds) is
checked row by row with the validation rules; its good rows are predicted by the champion, its bad rows go
to a rejects file naming the row, the column and the reason, and its folder under `score.out_dir`
(predictions.csv, rejects.jsonl, manifest.json with the model's version and sha256) is written whole. A
drop already scored is skipped. The run's artifacts say how many rows were scored and rejected, by which
model (docs/scoring.md).

    python -m flows.score                                 # params.yaml `score:`
    python -m flows.score --source /data/new_rows         # a folder of drops, or the URL of a listing
    python -m flows.score --set score.rescore=true        # any `score:` key, for this run only
or the `score/on-demand` and `score/nightly` deployments of prefect.yaml. `python -m tasks score` runs the
same function without Prefect.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Completed
from pydantic import BaseModel, ValidationError

from flows.overrides import overrides_dict, parse_set, partial_model, resolve_params
from flows.stage_tasks import score_task
from tasks._io.processes import start_reaper
from tasks.params import ParamsError, ScoreParams
from tasks.score import ScoreSummary

ScoreOverrides: type[BaseModel] = partial_model(ScoreParams, "ScoreOverrides")
ScoreOverrides.__doc__ = "params.yaml `score:` keys to replace for one run, e.g. {'rescore': true}."


def score_changes(source: str | None, overrides: BaseModel | None) -> dict:
    """The run's changes to params.yaml: {"score": {...}} (`source` wins over an override of it)."""
    changes = overrides_dict(overrides)
    if source is not None:
        changes["source"] = source
    return {"score": changes}


@flow(name="score", log_prints=True)
def score(
    params_path: Path = Path("params.yaml"),
    source: str | None = None,
    overrides: ScoreOverrides | None = None,  # type: ignore[valid-type]
) -> ScoreSummary:
    """Score the new rows of `source` with the champion and write each drop's predictions and rejects.

    Args:
        params_path: params.yaml to read, relative to the project root (the working directory).
        source: a folder of drops, or the http(s):// / file:// URL of a listing of drops; None keeps
            params.yaml's `score.source`.
        overrides: `score:` keys to replace for this run, e.g. {"rescore": true} or {"champion_dir": "..."}.
    """
    params = resolve_params(params_path, score_changes(source, overrides))
    summary: ScoreSummary = score_task(params.score, {"flow_run_id": flow_run.get_id()})
    return Completed(message=summary.message, data=summary)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.score", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="params.yaml", type=Path, help="params file (default params.yaml)")
    parser.add_argument("--source", default=None, help="a folder of drops, or the URL of a listing (default: params.yaml)")
    parser.add_argument("--set", dest="assignments", action="append", default=[], metavar="score.KEY=VALUE",
                        help="override one params.yaml `score:` key for this run (repeatable)")
    args = parser.parse_args(argv)
    try:
        changes = parse_set(args.assignments)
        if set(changes) - {"score"}:
            raise ParamsError(f"--set: the score flow reads only params.yaml `score:`, not {sorted(set(changes) - {'score'})}")
        overrides = ScoreOverrides.model_validate(changes.get("score", {}))
        resolve_params(args.params, score_changes(args.source, overrides))  # fail before Prefect starts
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except ValidationError as e:
        print(f"error: --set: {e}", file=sys.stderr)
        return 2
    start_reaper()  # a SIGKILL of this process must not leave Prefect's temporary server running
    state = score(params_path=args.params, source=args.source, overrides=overrides, return_state=True)
    if not state.is_completed():
        print(f"error: the score flow ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    summary: ScoreSummary = state.result()
    print(summary.message)
    for drop in summary.scored:
        print(f"  {drop.drop}: {drop.scored} scored, {drop.rejected} rejected -> {drop.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
