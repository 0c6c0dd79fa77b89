"""One CLI for every stage: ``python -m tasks <stage> [--params params.yaml] [--<key> VALUE ...]``.

The stage reads its section of params.yaml; any scalar key of that section can be overridden on the
command line (paths included), so dvc.yaml and people call the same function the Prefect flow calls.
``python -m tasks champion list`` and ``python -m tasks champion rollback [--to VERSION]`` show and
restore the promoted models kept under `promote.champion_dir`'s folder, waiting at most
`promote.lock_timeout_s` for a promotion in progress. ``python -m tasks drift --reference TABLE --batch
TABLE [--json]`` runs the drift gate on two CSV tables (exit 0 passed, 1 drifted, 2 bad input).
``python -m tasks dataset infer TABLE [--images-dir DIR] [--label COL]`` drafts the `dataset:` section for
a table of your own. ``python -m tasks score [--source FOLDER_OR_URL]`` scores new rows with the champion
(params.yaml `score:`; docs/scoring.md).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fusion_model import quiet
from tasks.errors import StageError
from tasks.params import Params, ParamsError, load_params

# stage name -> (module, params.yaml section); the module defines a function named like the stage.
# The stages that read the table itself also take the declared dataset (params.yaml `dataset:`); the later
# ones read it from the validated folder's meta.json.
DATASET_STAGES = frozenset({"download", "intake", "validate"})
# Sections a stage reads beside its own, passed after it: the intake builds on the download stage's data
# (download.out_dir), and its embedded feed is the download's generator (download.synthetic).
BESIDE: dict[str, tuple[str, ...]] = {"intake": ("download",)}
STAGES: dict[str, tuple[str, str]] = {
    "download": ("tasks.download", "download"),
    "intake": ("tasks.intake", "intake"),
    "validate": ("tasks.validate", "validate"),
    "train": ("tasks.train", "train"),
    "convert": ("tasks.convert", "convert"),
    "evaluate": ("tasks.evaluate", "evaluate"),
    "promote": ("tasks.promote", "promote"),
    "version": ("tasks.version", "version"),
    # not a DVC stage: it reads the champion (state outside the pipeline) and new rows, as the score flow does
    "score": ("tasks.score", "score"),
}

_SCALARS = (str, int, float, bool, Path)


def _scalar_type(annotation: Any) -> type | None:
    """The scalar type a CLI value converts to, or None for nested / list fields."""
    if annotation in _SCALARS:
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0])
    for a in args:  # Optional[X] / X | Literal[...]
        if a in _SCALARS:
            return a
    return None


def _section_model(section: str) -> type[BaseModel]:
    field = Params.model_fields["validate_" if section == "validate" else section]
    return field.annotation  # type: ignore[return-value]


def _add_overrides(parser: argparse.ArgumentParser, section: str) -> None:
    model = _section_model(section)
    group = parser.add_argument_group(f"overrides of params.yaml `{section}:`")
    for name, field in model.model_fields.items():
        if _scalar_type(field.annotation) is None:
            continue
        group.add_argument(
            f"--{name.replace('_', '-')}",
            dest=f"override_{name}",
            metavar=name.upper(),
            help=f"{field.description or ''} (params.yaml: {section}.{name}, default {field.default!r})".strip(),
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tasks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for stage, (_module, section) in STAGES.items():
        p = sub.add_parser(stage, help=f"run the {stage} stage (params.yaml `{section}:`)")
        p.add_argument("--params", default="params.yaml", type=Path, help="params file (default params.yaml)")
        _add_overrides(p, section)
    dataset = sub.add_parser("dataset", help="declare your table: draft params.yaml's dataset: section")
    dataset_action = dataset.add_subparsers(dest="action", required=True, metavar="ACTION")
    draft = dataset_action.add_parser("infer", help="print a draft dataset: section, a reason per column")
    draft.add_argument("table", type=Path, help="a CSV or Parquet file")
    draft.add_argument("--images-dir", type=Path, default=None,
                       help="the folder image paths are relative to (default: the table's folder)")
    draft.add_argument("--label", default=None, help="the column to predict")
    champion = sub.add_parser("champion", help="list the promoted models, or roll the champion back")
    champion.add_argument("--params", default="params.yaml", type=Path, help="params file (default params.yaml)")
    champion.add_argument("--champion-dir", type=Path, default=None, help="default: params.yaml promote.champion_dir")
    champion.add_argument("--lock-timeout-s", type=float, default=None, metavar="SECONDS",
                          help="wait this long for a promotion in progress (default: params.yaml promote.lock_timeout_s)")
    action = champion.add_subparsers(dest="action", required=True, metavar="ACTION")
    listing = action.add_parser("list", help="every promotion: version, sha256, score, run, data, code")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    back = action.add_parser("rollback", help="make an earlier promotion the champion again")
    back.add_argument("--to", type=int, default=None, metavar="VERSION",
                      help="the version to restore (default: the one promoted before the current champion)")
    batches = sub.add_parser("batches", help="the arriving batches (params.yaml `intake:`): list them, readmit or "
                                             "reject a quarantined one")
    batches.add_argument("--params", default="params.yaml", type=Path, help="params file (default params.yaml)")
    batches_action = batches.add_subparsers(dest="action", required=True, metavar="ACTION")
    batches_list = batches_action.add_parser("list", help="every batch seen: taken in, warned, quarantined, why")
    batches_list.add_argument("--json", action="store_true", help="print JSON instead of a table")
    for name, text in (("readmit", "take a quarantined batch in after review (its overridden check recorded)"),
                       ("reject", "refuse a quarantined batch for good")):
        one = batches_action.add_parser(name, help=text)
        one.add_argument("batch", type=int, metavar="N", help="the batch number (`batches list`)")
        if name == "reject":
            one.add_argument("--reason", default="", help="why, for the ledger")
    # the drift gate's statistics load scipy: defined here, imported only when `drift` runs
    drift = sub.add_parser("drift", help="the drift gate (params.yaml `intake:` drift_gate) on two CSV tables: exit 0 "
                                         "passed, 1 drifted, 2 bad input")
    drift.add_argument("--reference", type=Path, required=True, metavar="TABLE",
                       help="CSV of the rows the model was trained on (the dataset's columns)")
    drift.add_argument("--batch", type=Path, required=True, metavar="TABLE", help="CSV of the new rows")
    drift.add_argument("--json", action="store_true", help="print the report as JSON")
    drift.add_argument("--params", type=Path, default=Path("params.yaml"),
                       help="params file: its dataset section and intake.drift_gate (default params.yaml)")
    drift.add_argument("--problem-type", choices=["binary", "multiclass", "ordinal", "regression"], default=None,
                       help="the label's problem type (default: params.yaml dataset.label.problem_type)")
    return parser


def run_champion(args: argparse.Namespace) -> Any:
    # by name, as the stages are: no stage's command loads the registry
    promote = importlib.import_module("tasks.promote")
    registry = importlib.import_module("tasks.promote.registry")
    needs_params = args.champion_dir is None or args.lock_timeout_s is None
    section = load_params(args.params).promote if needs_params else None
    champion_dir = args.champion_dir if args.champion_dir is not None else section.champion_dir
    timeout_s = args.lock_timeout_s if args.lock_timeout_s is not None else section.lock_timeout_s
    if args.action == "rollback":
        return promote.rollback(champion_dir, args.to, lock_timeout_s=timeout_s)
    rows = promote.listing(champion_dir, lock_timeout_s=timeout_s)
    if problem := registry.dangling_link_problem(champion_dir):
        print(f"warning: {problem}", file=sys.stderr)
    if args.json:
        return rows
    print(registry.render_listing(rows), end="")
    return None


def run_batches(args: argparse.Namespace) -> int:
    review = importlib.import_module("tasks.intake.review")
    try:
        params = load_params(args.params)
        if args.action == "list":
            rows = review.listing(params.intake)
            print(json.dumps(rows, indent=2) if args.json else review.render(rows), end="\n" if args.json else "")
            return 0
        if args.action == "readmit":
            record = review.readmit(params.intake, params.download, params.schema, args.batch)
        else:
            record = review.reject(params.intake, args.batch, args.reason)
    except (StageError, ParamsError) as e:
        print(f"error: batches {args.action}: {e}", file=sys.stderr)
        return 1
    _print_result(record)
    return 0


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k.removeprefix("override_"): v for k, v in vars(args).items() if k.startswith("override_") and v is not None}


def _yaml_scalar(value: str) -> Any:
    """Parse a command-line value as YAML so `--pretrained false` and `--devices 2` get their types."""
    import yaml

    return yaml.safe_load(value)


def run_stage(stage: str, params: Params) -> Any:
    module_name, section = STAGES[stage]
    module = importlib.import_module(module_name)
    section_params = params.validate_ if section == "validate" else getattr(params, section)
    beside = [getattr(params, other) for other in BESIDE.get(stage, ())]
    if stage in DATASET_STAGES:
        return getattr(module, stage)(section_params, *beside, params.schema)
    return getattr(module, stage)(section_params, *beside)


def main(argv: list[str] | None = None) -> int:
    quiet.install()  # the stages that load torch / Lightning / DeepSpeed in this process
    args = build_parser().parse_args(argv)
    if args.stage == "drift":
        return importlib.import_module("tasks.intake.drift_cli").main(args)
    if args.stage == "dataset":
        # by name, as the champion command does: no stage's command loads it
        infer_section = importlib.import_module("tasks.dataset").infer_section
        try:
            print(infer_section(args.table, args.images_dir, args.label), end="")
        except StageError as e:
            print(f"error: dataset infer: {e}", file=sys.stderr)
            return 1
        return 0
    if args.stage == "batches":
        return run_batches(args)
    if args.stage == "champion":
        try:
            result = run_champion(args)
        except (StageError, ParamsError) as e:
            print(f"error: champion {args.action}: {e}", file=sys.stderr)
            return 1
        _print_result(result)
        return 0
    section = STAGES[args.stage][1]
    overrides = {k: _yaml_scalar(v) for k, v in _overrides(args).items()}
    try:
        params = load_params(args.params, {section: overrides} if overrides else None)
        result = run_stage(args.stage, params)
    except (StageError, ParamsError) as e:
        print(f"error: {args.stage}: {e}", file=sys.stderr)
        return 1
    _print_result(result)
    return 0


def _print_result(result: Any) -> None:
    if isinstance(result, BaseModel):
        result = result.model_dump(mode="json")
    if result is not None:
        print(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
