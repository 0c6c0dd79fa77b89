"""Promotion: better challengers replace the champion atomically, worse ones leave it byte-identical."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from filelock import FileLock
from safetensors.torch import save_file

from fusion_model.dataset import resolve_schema, split_images
from fusion_model.predict import Predictions
from tasks._io.hashing import sha256_file
from tasks.errors import StageError
from tasks.evaluate.inputs import TestSet
from tasks.evaluate.metrics import fingerprint_test_set
from tasks.evaluate.stage import write_evaluation
from tasks.params import PromoteParams
from tasks.promote import history_path, promote, read_history, registry, render_decision_markdown

N_TEST = 120


def _write_test_set(data_dir: Path, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    table = pd.DataFrame({
        "row_id": np.arange(N_TEST, dtype=np.int64),
        "Age": rng.integers(1, 60, N_TEST),
        "Images": [f"images/p{i}-1.jpg" for i in range(N_TEST)],
        "AdoptionSpeed": rng.integers(0, 2, N_TEST),
    })
    data_dir.mkdir(parents=True, exist_ok=True)
    table.to_parquet(data_dir / "test.parquet", index=False)
    schema = resolve_schema({"preset": "petfinder"}).model_dump(mode="json")
    meta = {"dataset_root": "../raw", "label": "AdoptionSpeed", "problem_type": "binary", "classes": [0, 1],
            "schema": schema, "rows": {"test": N_TEST}}
    (data_dir / "meta.json").write_text(json.dumps(meta))
    return table


def _skilled_proba(y: np.ndarray, skill: float, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    p1 = np.clip(0.5 + skill * (y - 0.5) + rng.normal(0, 0.3, len(y)), 0.01, 0.99)
    return np.stack([1 - p1, p1], axis=1)


def _challenger(root: Path, name: str, table: pd.DataFrame, skill: float, passed: bool = True,
                baseline_skill: float | None = -0.6) -> PromoteParams:
    """A model folder plus its evaluation, whose predictions carry `skill` signal (0 = chance), beside a
    classical baseline of `baseline_skill` (by default worse than chance, so the gate passes every challenger
    of the tests on the champion; None: the evaluation ran without one)."""
    model_dir, eval_dir = root / name / "model", root / name / "eval"
    model_dir.mkdir(parents=True)
    eval_dir.mkdir(parents=True)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    save_file({"head.weight": torch.randn(2, 8, generator=gen)}, str(model_dir / "model.safetensors"))
    (model_dir / "model_config.json").write_text(json.dumps({"name": name}))
    manifest = {"output": {"sha256": sha256_file(model_dir / "model.safetensors"),
                           "model_config_sha256": sha256_file(model_dir / "model_config.json")},
                "verification": {"strict_load": True, "all_finite": True}}
    (model_dir / "manifest.json").write_text(json.dumps(manifest))
    y = table["AdoptionSpeed"].to_numpy()
    proba = _skilled_proba(y, skill)
    baseline = None if baseline_skill is None else _skilled_proba(y, baseline_skill, seed=11)
    provenance = {
        "test_set": {"fingerprint": fingerprint_test_set(table, "AdoptionSpeed")},
        "model": {"sha256": sha256_file(model_dir / "model.safetensors")},
    }

    def outputs(p: np.ndarray | None) -> Predictions | None:
        return None if p is None else Predictions(prediction=p.argmax(1), proba=p, score=p[:, 1])

    test = TestSet(table=table, meta={}, images_root=root, schema=resolve_schema({"preset": "petfinder"}),
                   problem_type="binary", classes=[0, 1])
    write_evaluation(eval_dir, test, outputs(proba), {}, provenance, baseline=outputs(baseline))
    report = root / name / "validation.json"
    report.write_text(json.dumps({"success": passed}))
    return PromoteParams(
        model_dir=model_dir, eval_dir=eval_dir, champion_dir=root / "models" / "champion",
        data_dir=root / "validated", validation_report=report, lock_timeout_s=5,
    )


LAYOUT = [".champion.lock", "champion", "champions.jsonl", "history.jsonl", "score_history.png", "store"]


def _beside(champion: Path) -> list[str]:
    return sorted(f.name for f in champion.parent.iterdir())


def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def _score(p: PromoteParams) -> float:
    return json.loads((p.eval_dir / "metrics.json").read_text())["primary_metric"]["value"]


@pytest.fixture
def table(tmp_path: Path) -> pd.DataFrame:
    return _write_test_set(tmp_path / "validated")


def test_first_model_becomes_champion_with_every_file(tmp_path: Path, table: pd.DataFrame) -> None:
    p = _challenger(tmp_path, "first", table, skill=0.4)
    decision = promote(p)
    assert decision.promoted and decision.reason == "first model: no champion yet"
    assert decision.champion_score is None and decision.challenger_score == _score(p)
    champion = p.champion_dir
    assert sorted(f.name for f in champion.iterdir()) == sorted(
        ["model.safetensors", "model_config.json", "manifest.json", "metrics.json", "promotion.json"]
    )
    for name in ("model.safetensors", "model_config.json", "manifest.json"):
        assert (champion / name).read_bytes() == (p.model_dir / name).read_bytes()
    assert (champion / "metrics.json").read_bytes() == (p.eval_dir / "metrics.json").read_bytes()
    assert json.loads((champion / "promotion.json").read_text())["promoted"] is True
    assert [h["reason"] for h in read_history(champion)] == ["first model: no champion yet"]
    assert history_path(champion) == tmp_path / "models" / "history.jsonl"
    # The champion is a link to the model's own folder in the store, named by its weights' sha256.
    sha = sha256_file(p.model_dir / "model.safetensors")
    assert champion.is_symlink() and os.readlink(champion) == f"store/{sha}"
    assert [(e.version, e.sha256) for e in registry.promotions(champion)] == [(1, sha)]
    assert decision.champion_version == 1
    # Nothing half-written is left beside the champion; every decision so far is on the scores plot.
    assert _beside(champion) == LAYOUT and sorted(f.name for f in (champion.parent / "store").iterdir()) == [sha]
    assert (champion.parent / "score_history.png").read_bytes()[:4] == b"\x89PNG"


def test_a_challenger_that_loses_to_the_baseline_is_not_promoted(tmp_path: Path, table: pd.DataFrame) -> None:
    weak = _challenger(tmp_path, "weak", table, skill=0.1, baseline_skill=0.6)
    metrics = json.loads((weak.eval_dir / "metrics.json").read_text())
    model, baseline = metrics["vs_baseline"]["model"], metrics["vs_baseline"]["baseline"]
    assert model < baseline
    decision = promote(weak)
    assert not decision.promoted and not weak.champion_dir.exists()
    assert decision.validation_passed and decision.baseline_score == baseline
    assert "loses to the classical baseline" in decision.reason
    assert f"{model:.4f}" in decision.reason and f"{baseline:.4f}" in decision.reason
    assert f"{baseline:.4f}" in render_decision_markdown(decision)
    # without a baseline in metrics.json the gate cannot judge: refused, naming both ways out
    blind = _challenger(tmp_path, "blind", table, skill=0.4, baseline_skill=None)
    refused = promote(blind)
    assert not refused.promoted and "evaluate.baseline: true" in refused.reason
    # the switch off: the same weak challenger becomes the first champion
    decision = promote(weak.model_copy(update={"require_beat_baseline": False}))
    assert decision.promoted and decision.reason == "first model: no champion yet"


def test_worse_challenger_leaves_champion_byte_identical(tmp_path: Path, table: pd.DataFrame) -> None:
    good = _challenger(tmp_path, "good", table, skill=0.5)
    promote(good)
    before = _snapshot(good.champion_dir)
    worse = _challenger(tmp_path, "worse", table, skill=0.0)
    decision = promote(worse)
    assert not decision.promoted
    assert decision.champion_score == _score(good) and decision.challenger_score == _score(worse)
    assert not decision.champion_rescored
    assert "needs > 0" in decision.reason
    assert _snapshot(good.champion_dir) == before
    history = read_history(good.champion_dir)
    assert [(h["promoted"], h["challenger_score"], h["champion_score"]) for h in history] == [
        (True, _score(good), None), (False, _score(worse), _score(good)),
    ]
    assert "roc_auc" in render_decision_markdown(decision) and "not promoted" in render_decision_markdown(decision)


def test_better_challenger_replaces_champion(tmp_path: Path, table: pd.DataFrame) -> None:
    weak = _challenger(tmp_path, "weak", table, skill=0.1)
    promote(weak)
    strong = _challenger(tmp_path, "strong", table, skill=0.6)
    decision = promote(strong)
    assert decision.promoted and decision.champion_score == _score(weak)
    assert decision.previous_champion_sha256 == sha256_file(weak.model_dir / "model.safetensors")
    champion = strong.champion_dir
    assert (champion / "model.safetensors").read_bytes() == (strong.model_dir / "model.safetensors").read_bytes()
    assert (champion / "metrics.json").read_bytes() == (strong.eval_dir / "metrics.json").read_bytes()
    assert [h["promoted"] for h in read_history(champion)] == [True, True]
    assert not [f for f in champion.parent.iterdir() if f.name.startswith(".champion.") and f.is_dir()]


def test_min_delta_and_ties_are_not_promoted(tmp_path: Path, table: pd.DataFrame) -> None:
    base = _challenger(tmp_path, "base", table, skill=0.3)
    promote(base)
    slightly = _challenger(tmp_path, "slightly", table, skill=0.35)
    delta = _score(slightly) - _score(base)
    assert delta > 0
    before = _snapshot(base.champion_dir)
    decision = promote(slightly.model_copy(update={"min_delta": delta + 0.01}))
    assert not decision.promoted and f"min_delta {delta + 0.01}" in decision.reason
    tie = _challenger(tmp_path, "tie", table, skill=0.3)  # same predictions, other weights: equal score
    assert _score(tie) == _score(base)
    assert not promote(tie).promoted
    assert _snapshot(base.champion_dir) == before
    assert len(read_history(base.champion_dir)) == 3


def test_failed_validation_is_never_promoted(tmp_path: Path, table: pd.DataFrame) -> None:
    first = _challenger(tmp_path, "first", table, skill=0.2, passed=False)
    decision = promote(first)
    assert not decision.promoted and not decision.validation_passed
    assert "validation did not pass" in decision.reason
    assert not first.champion_dir.exists()
    promote(_challenger(tmp_path, "ok", table, skill=0.2))
    before = _snapshot(first.champion_dir)
    better_but_failed = _challenger(tmp_path, "failed", table, skill=0.9, passed=False)
    assert not promote(better_but_failed).promoted
    missing_report = better_but_failed.model_copy(update={"validation_report": tmp_path / "nope.json"})
    decision = promote(missing_report)
    assert not decision.promoted and "no validation report at" in decision.reason
    unverified = _challenger(tmp_path, "unverified", table, skill=0.9)
    manifest = json.loads((unverified.model_dir / "manifest.json").read_text())
    (unverified.model_dir / "manifest.json").write_text(json.dumps({**manifest, "output": {"sha256": "0" * 64}}))
    decision = promote(unverified)
    assert not decision.promoted and "is not the file its manifest verified" in decision.reason
    assert _snapshot(first.champion_dir) == before
    assert [h["promoted"] for h in read_history(first.champion_dir)] == [False, True, False, False, False]


def test_unusable_challengers_raise_and_touch_nothing(tmp_path: Path, table: pd.DataFrame) -> None:
    good = _challenger(tmp_path, "good", table, skill=0.5)
    promote(good)
    before, history_before = _snapshot(good.champion_dir), history_path(good.champion_dir).read_bytes()

    stale = _challenger(tmp_path, "stale", table, skill=0.9)
    save_file({"head.weight": torch.zeros(2, 8)}, str(stale.model_dir / "model.safetensors"))
    with pytest.raises(StageError, match=r"the evaluation is stale\. Run `python -m tasks evaluate` again"):
        promote(stale)

    no_eval = _challenger(tmp_path, "no_eval", table, skill=0.9)
    (no_eval.eval_dir / "metrics.json").unlink()
    with pytest.raises(StageError, match=r"metrics\.json: missing\. Run `python -m tasks evaluate`"):
        promote(no_eval)

    no_weights = _challenger(tmp_path, "no_weights", table, skill=0.9)
    (no_weights.model_dir / "model.safetensors").unlink()
    with pytest.raises(StageError, match=r"missing model\.safetensors.*python -m tasks convert"):
        promote(no_weights)

    other_data = _challenger(tmp_path, "other", table, skill=0.9)
    _write_test_set(tmp_path / "validated", seed=1)  # the data changed after this evaluation
    with pytest.raises(StageError, match=r"computed on another test set.*Run `python -m tasks evaluate`"):
        promote(other_data)

    assert _snapshot(good.champion_dir) == before
    assert history_path(good.champion_dir).read_bytes() == history_before


def test_crash_while_copying_keeps_old_champion(
    tmp_path: Path, table: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    promote(_challenger(tmp_path, "weak", table, skill=0.1))
    champion = tmp_path / "models" / "champion"
    before = _snapshot(champion)
    real_copy = registry.shutil.copyfile
    calls = []

    def copy_then_fail(src: Path, dst: Path) -> None:
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_copy(src, dst)

    monkeypatch.setattr(registry.shutil, "copyfile", copy_then_fail)
    with pytest.raises(OSError, match="No space left"):
        promote(_challenger(tmp_path, "strong", table, skill=0.6))
    assert _snapshot(champion) == before
    assert _beside(champion) == LAYOUT and len(list((champion.parent / "store").iterdir())) == 1
    assert len(read_history(champion)) == 1  # the failed install is not recorded as a promotion
    assert len(registry.promotions(champion)) == 1


def test_promote_cli_prints_the_decision(
    tmp_path: Path, table: pd.DataFrame, capsys: pytest.CaptureFixture[str]
) -> None:
    from tasks.__main__ import main

    p = _challenger(tmp_path, "cli", table, skill=0.4)
    args = ["promote", "--params", str(Path(__file__).resolve().parents[1] / "params.yaml")]
    for key in ("model_dir", "eval_dir", "champion_dir", "data_dir", "validation_report"):
        args += [f"--{key.replace('_', '-')}", str(getattr(p, key))]
    assert main([*args, "--min-delta", "0.01"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["promoted"] is True and printed["min_delta"] == 0.01
    assert printed == read_history(p.champion_dir)[0]
    (p.eval_dir / "metrics.json").unlink()
    assert main(args) == 1
    assert "metrics.json: missing. Run `python -m tasks evaluate`" in capsys.readouterr().err


def test_a_champion_folder_of_the_earlier_layout_is_adopted(tmp_path: Path, table: pd.DataFrame) -> None:
    good = _challenger(tmp_path, "good", table, skill=0.5)
    promote(good)
    champion = good.champion_dir
    before = {name: data for name, (data, _) in _snapshot(champion).items()}
    # the earlier layout: the champion a plain folder, no store, no champions.jsonl
    folder = champion.resolve()
    champion.unlink()
    os.rename(folder, champion)
    shutil.rmtree(champion.parent / "store")
    (champion.parent / "champions.jsonl").unlink()
    decision = promote(_challenger(tmp_path, "worse", table, skill=0.0))
    assert not decision.promoted and decision.champion_score == _score(good)
    assert champion.is_symlink() and {name: data for name, (data, _) in _snapshot(champion).items()} == before
    assert [e.sha256 for e in registry.promotions(champion)] == [sha256_file(good.model_dir / "model.safetensors")]


def test_rollback_restores_an_earlier_champion_byte_for_byte(tmp_path: Path, table: pd.DataFrame,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    from tasks.__main__ import main

    weak = _challenger(tmp_path, "weak", table, skill=0.1)
    promote(weak)
    weak_files = {name: data for name, (data, _) in _snapshot(weak.champion_dir).items()}
    strong = _challenger(tmp_path, "strong", table, skill=0.6)
    promote(strong)
    champion = strong.champion_dir
    assert (champion / "model.safetensors").read_bytes() == (strong.model_dir / "model.safetensors").read_bytes()
    cli = ["champion", "--params", str(Path(__file__).resolve().parents[1] / "params.yaml"),
           "--champion-dir", str(champion)]

    assert main([*cli, "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["version"], r["current"]) for r in rows] == [(1, False), (2, True)]
    assert rows[0]["sha256"] == sha256_file(weak.model_dir / "model.safetensors")
    assert rows[1]["score"] == _score(strong) and rows[1]["data_sha256"]

    assert main([*cli, "rollback"]) == 0
    event = json.loads(capsys.readouterr().out)
    assert event["event"] == "rollback" and event["version"] == 1
    assert {name: data for name, (data, _) in _snapshot(champion).items()} == weak_files  # byte for byte
    assert main([*cli, "list"]) == 0
    table_text = capsys.readouterr().out
    assert "| * | 1 |" in table_text and "|  | 2 |" in table_text

    assert main([*cli, "rollback"]) == 1  # the first promotion has nothing before it
    assert "there is no earlier one to roll back to" in capsys.readouterr().err
    assert main([*cli, "rollback", "--to", "9"]) == 1
    assert "no promoted version 9; the versions are 1, 2" in capsys.readouterr().err
    assert main([*cli, "rollback", "--to", "2"]) == 0
    capsys.readouterr()
    assert (champion / "model.safetensors").read_bytes() == (strong.model_dir / "model.safetensors").read_bytes()
    # a promotion after a rollback compares with the champion now in place
    middle = _challenger(tmp_path, "middle", table, skill=0.3)
    assert not promote(middle).promoted


def _promote_worker(p: PromoteParams, pause_at: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "promote_worker.py"), p.model_dump_json(), pause_at],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1],
    )


@pytest.mark.parametrize("point", ["copying", "stored", "flipped"])
def test_a_kill_at_each_point_of_a_promotion_leaves_the_old_or_the_new_champion(
        tmp_path: Path, table: pd.DataFrame, point: str) -> None:
    """SIGKILL while the model is copied into the store, after it is stored, after the link flipped (before
    the promotion is logged): the champion is always one complete model, and the log is repaired."""
    weak = _challenger(tmp_path, "weak", table, skill=0.1)
    promote(weak)
    champion = weak.champion_dir
    old = {name: data for name, (data, _) in _snapshot(champion).items()}
    strong = _challenger(tmp_path, "strong", table, skill=0.6)
    proc = _promote_worker(strong, point)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.strip() == f"PAUSED {point}", line + proc.stderr.read()  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    now = {name: data for name, (data, _) in _snapshot(champion).items()}
    new_weights = (strong.model_dir / "model.safetensors").read_bytes()
    if point == "flipped":
        assert now["model.safetensors"] == new_weights and now["metrics.json"] == (strong.eval_dir / "metrics.json").read_bytes()
    else:
        assert now == old
    # the next call repairs what the kill left: the log names the champion in place, no temporary folder stays
    rows = registry.listing(champion) if point != "flipped" else None
    decision = promote(_challenger(tmp_path, "chance", table, skill=0.0))  # worse than either
    assert not decision.promoted
    shas = [e.sha256 for e in registry.promotions(champion)]
    assert shas[-1] == registry.current_sha(champion)
    assert len(shas) == (2 if point == "flipped" else 1), (point, rows)
    assert not [f for f in (champion.parent / "store").iterdir() if f.name.startswith(".")]


def test_concurrent_promotions_are_serialised(tmp_path: Path, table: pd.DataFrame) -> None:
    a = _challenger(tmp_path, "a", table, skill=0.3)
    b = _challenger(tmp_path, "b", table, skill=0.6)
    lock = FileLock(tmp_path / "models" / ".champion.lock")
    (tmp_path / "models").mkdir()
    with lock:
        with pytest.raises(StageError, match=r"another promotion or rollback into .*champion held .*\.champion\.lock"):
            promote(a.model_copy(update={"lock_timeout_s": 0.2}))
    assert not a.champion_dir.exists() and not history_path(a.champion_dir).exists()

    errors: list[BaseException] = []

    def run(p: PromoteParams) -> None:
        try:
            promote(p)
        except BaseException as e:  # surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(p,)) for p in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    history = read_history(a.champion_dir)
    assert len(history) == 2 and history[0]["reason"] == "first model: no champion yet"
    # Whatever the order, the better model ends up champion and the second decision saw the first.
    assert (a.champion_dir / "model.safetensors").read_bytes() == (b.model_dir / "model.safetensors").read_bytes()
    assert history[1]["champion_score"] == history[0]["challenger_score"]


# ------------------------------------------------------------------------------------- registry robustness
def _whole_lines(path: Path) -> list[dict]:
    """Every line of a JSONL file, each required to be one whole JSON object ending in a newline."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), data[-80:]
    return [json.loads(line) for line in data.decode().splitlines()]


def promote_rollback(champion: Path) -> registry.ChampionEvent:
    from tasks.promote import rollback

    return rollback(champion, lock_timeout_s=5)


def test_a_torn_last_line_is_skipped_with_a_warning_and_repaired_on_the_next_write(
        tmp_path: Path, table: pd.DataFrame, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A crash mid-append leaves the last line of champions.jsonl and history.jsonl cut short: list, promote
    and rollback still work (the line skipped, with a warning naming the file), and the next append
    removes it, so both files are whole again."""
    from tasks.__main__ import main

    weak = _challenger(tmp_path, "weak", table, skill=0.1)
    promote(weak)
    champion = weak.champion_dir
    logs = [champion.parent / "champions.jsonl", history_path(champion)]
    for path in logs:  # what a kill in the middle of the next append leaves: half a record, no newline
        whole = path.read_bytes()
        path.write_bytes(whole + whole[: len(whole) // 2].rstrip(b"\n"))

    cli = ["champion", "--params", str(Path(__file__).resolve().parents[1] / "params.yaml"),
           "--champion-dir", str(champion)]
    with caplog.at_level("WARNING"):
        assert main([*cli, "list", "--json"]) == 0
    assert [r["version"] for r in json.loads(capsys.readouterr().out)] == [1]
    assert "champions.jsonl:2: the last line is cut short" in caplog.text and "skipped" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert [h["promoted"] for h in read_history(champion)] == [True]
    assert "history.jsonl:2: the last line is cut short" in caplog.text

    strong = _challenger(tmp_path, "strong", table, skill=0.6)
    caplog.clear()
    with caplog.at_level("WARNING"):
        decision = promote(strong)
    assert decision.promoted and decision.champion_score == _score(weak)  # compared with the kept champion
    assert "removed the cut-short last line" in caplog.text
    champions, history = (_whole_lines(path) for path in logs)
    assert [(e["event"], e["version"]) for e in champions] == [("promoted", 1), ("promoted", 2)]
    assert [h["promoted"] for h in history] == [True, True]
    caplog.clear()
    assert promote_rollback(champion).version == 1
    assert caplog.text == ""  # nothing left to skip or repair


def test_a_damaged_line_that_is_not_the_last_is_an_error_naming_it(tmp_path: Path, table: pd.DataFrame) -> None:
    weak = _challenger(tmp_path, "weak", table, skill=0.1)
    promote(weak)
    log = weak.champion_dir.parent / "champions.jsonl"
    log.write_bytes(b"#NOMBRE?\n" + log.read_bytes())  # not a crash: someone edited the file
    before = log.read_bytes()
    with pytest.raises(StageError, match=r"champions\.jsonl:1: not a JSON record, and not the last line.*"
                                         r"Restore champions\.jsonl from a backup"):
        promote(_challenger(tmp_path, "strong", table, skill=0.6))
    assert log.read_bytes() == before and len(read_history(weak.champion_dir)) == 1
    log.write_bytes(b'{"event": "promoted"}\n' + before.split(b"\n", 1)[1])  # whole JSON, not an event
    with pytest.raises(StageError, match=r"champions\.jsonl:1: not a ChampionEvent record \(version: Field required"):
        registry.listing(weak.champion_dir)


def test_a_dangling_champion_link_refuses_promotion_until_repaired(tmp_path: Path, table: pd.DataFrame) -> None:
    """The champion's store folder is gone: no challenger is promoted without a comparison; the message
    says how to repair, and a rollback does."""
    weak = _challenger(tmp_path, "weak", table, skill=0.1)
    promote(weak)
    promote(_challenger(tmp_path, "strong", table, skill=0.6))
    champion = weak.champion_dir
    gone = champion.resolve()
    shutil.rmtree(gone)
    link_before, history_before = os.readlink(champion), history_path(champion).read_bytes()
    store_before = sorted(p.name for p in (champion.parent / "store").iterdir())
    middle = _challenger(tmp_path, "middle", table, skill=0.3)
    with pytest.raises(StageError) as err:
        promote(middle)
    message = str(err.value)
    assert f"is a link to {gone}, which does not exist" in message and "nothing is promoted" in message
    assert "python -m tasks champion rollback --to VERSION" in message and f"rm {champion}" in message
    assert os.readlink(champion) == link_before and history_path(champion).read_bytes() == history_before
    assert sorted(p.name for p in (champion.parent / "store").iterdir()) == store_before
    assert len(registry.promotions(champion)) == 2  # a dangling link is not logged as a recovered promotion

    assert promote_rollback(champion).version == 1  # the repair the message names
    decision = promote(middle)
    assert decision.promoted and decision.champion_score == _score(weak)  # compared, this time


def test_a_rollback_is_in_the_history(tmp_path: Path, table: pd.DataFrame) -> None:
    weak = _challenger(tmp_path, "weak", table, skill=0.1)
    promote(weak)
    strong = _challenger(tmp_path, "strong", table, skill=0.6)
    promote(strong)
    champion = weak.champion_dir
    plot = champion.parent / "score_history.png"
    plot_before = plot.read_bytes()
    event = promote_rollback(champion)
    history = read_history(champion)
    assert [h["event"] for h in history] == ["decision", "decision", "rollback"]
    record = history[-1]
    assert record["champion_version"] == event.version == 1
    assert record["champion_sha256"] == sha256_file(weak.model_dir / "model.safetensors")
    assert record["previous_champion_sha256"] == sha256_file(strong.model_dir / "model.safetensors")
    assert record["champion_score"] == _score(weak) and record["reason"].startswith("rolled back from")
    assert plot.read_bytes() != plot_before  # the score history shows the rollback


def test_the_champion_cli_honours_promote_lock_timeout_s(tmp_path: Path, table: pd.DataFrame,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    import time

    import yaml

    from tasks.__main__ import main

    weak = _challenger(tmp_path, "weak", table, skill=0.1)
    promote(weak)
    promote(_challenger(tmp_path, "strong", table, skill=0.6))
    params = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    params["promote"].update(champion_dir=str(weak.champion_dir), lock_timeout_s=0.3)
    params_file = tmp_path / "params.yaml"
    params_file.write_text(yaml.safe_dump(params))
    cli = ["champion", "--params", str(params_file)]
    link_before = os.readlink(weak.champion_dir)
    with FileLock(tmp_path / "models" / ".champion.lock"):  # a promotion in progress
        for action in ("list", "rollback"):
            started = time.monotonic()
            assert main([*cli, action]) == 1
            assert time.monotonic() - started < 5  # 0.3 s, not the 600 s default
            err = capsys.readouterr().err
            assert f"error: champion {action}: another promotion or rollback into {weak.champion_dir} held " in err
            assert "for 0.3 s (promote.lock_timeout_s)" in err
    assert os.readlink(weak.champion_dir) == link_before
    assert main([*cli, "rollback"]) == 0 and main([*cli, "list"]) == 0  # the lock released: both run


# ------------------------------------------------------- real converted models and evaluations (slow chain)
@pytest.mark.slow
def test_the_baseline_gate_refuses_a_real_model_worse_than_the_baseline(tiny_model_chain, tmp_path: Path) -> None:
    """The evaluate stage fitted the classical baseline on the same rows; the constant model loses to it."""
    chain = tiny_model_chain
    vs = json.loads((chain.constant_eval / "metrics.json").read_text())["vs_baseline"]
    assert vs["model"] == 0.5 and vs["baseline"] > 0.6, vs  # the tiny synthetic set carries real signal
    champion = tmp_path / "champion"
    decision = promote(_real(chain, "constant", champion))
    assert not decision.promoted and not champion.exists()
    assert "loses to the classical baseline" in decision.reason and f"{vs['baseline']:.4f}" in decision.reason
    assert read_history(champion)[-1]["baseline_score"] == vs["baseline"]


def _real(chain, model: str, champion_dir: Path, **update: object) -> PromoteParams:
    fields = {"model_dir": getattr(chain, model), "eval_dir": getattr(chain, f"{model}_eval"),
              "champion_dir": champion_dir, "data_dir": chain.data_dir,
              "validation_report": chain.validation_report, "lock_timeout_s": 30}
    return PromoteParams(**{**fields, **update})


@pytest.mark.slow
def test_real_worse_model_is_refused_and_better_one_promoted(tiny_model_chain, tmp_path: Path) -> None:
    chain = tiny_model_chain
    trained_score = json.loads((chain.trained_eval / "metrics.json").read_text())["primary_metric"]["value"]
    # the champion comparison itself (the baseline gate has its own test below)
    ungated = {"require_beat_baseline": False}

    # The trained model is champion; the constant one (AUC 0.5) is refused, the champion untouched.
    champion = tmp_path / "a" / "champion"
    assert promote(_real(chain, "trained", champion, **ungated)).promoted
    before = _snapshot(champion)
    decision = promote(_real(chain, "constant", champion, **ungated))
    assert not decision.promoted and (decision.challenger_score, decision.champion_score) == (0.5, trained_score)
    assert _snapshot(champion) == before

    # The other way round, the trained model replaces the constant one.
    champion = tmp_path / "b" / "champion"
    promote(_real(chain, "constant", champion, **ungated))
    decision = promote(_real(chain, "trained", champion, **ungated))
    assert decision.promoted and (decision.challenger_score, decision.champion_score) == (trained_score, 0.5)
    for name in ("model.safetensors", "model_config.json", "manifest.json"):
        assert (champion / name).read_bytes() == (chain.trained / name).read_bytes()
    assert [h["promoted"] for h in read_history(champion)] == [True, True]


@pytest.mark.slow
def test_champion_scored_on_another_test_set_is_rescored(tiny_model_chain, tmp_path: Path) -> None:
    from tasks.evaluate import evaluate
    from tasks.params import EvaluateParams

    chain = tiny_model_chain
    # Last run's test set: half of today's rows (the dataset grew since the champion was evaluated).
    old_data = tmp_path / "old_validated"
    old_data.mkdir()
    test = pd.read_parquet(chain.data_dir / "test.parquet")
    test.head(len(test) // 2).to_parquet(old_data / "test.parquet", index=False)
    meta = json.loads((chain.data_dir / "meta.json").read_text())
    (old_data / "meta.json").write_text(json.dumps({**meta, "dataset_root": str(chain.images_root)}))
    evaluate(EvaluateParams(model_dir=chain.trained, data_dir=old_data, out_dir=tmp_path / "old_eval", baseline=False))
    champion = tmp_path / "models" / "champion"
    promote(_real(chain, "trained", champion, eval_dir=tmp_path / "old_eval", data_dir=old_data,
                  require_beat_baseline=False))
    before = _snapshot(champion)

    decision = promote(_real(chain, "constant", champion, require_beat_baseline=False))
    assert decision.champion_rescored and not decision.promoted
    # Re-scored on today's test set by the Predictor: exactly the evaluation's score of that model there.
    trained = json.loads((chain.trained_eval / "metrics.json").read_text())["primary_metric"]["value"]
    assert decision.champion_score == trained and decision.challenger_score == 0.5
    assert "re-scored on the current test set" in decision.reason
    assert _snapshot(champion) == before


@pytest.mark.slow
def test_failed_validation_run_never_touches_champion(tiny_model_chain, tmp_path: Path) -> None:
    from tasks.params import ValidateParams
    from tasks.validate import validate

    chain = tiny_model_chain
    reports = tmp_path / "reports"
    shutil.copytree(chain.validation_report.parent, reports)
    champion = tmp_path / "models" / "champion"
    promote(_real(chain, "constant", champion, validation_report=reports / "validation.json",
                  require_beat_baseline=False))
    before, history_before = _snapshot(champion), history_path(champion).read_bytes()

    # A new run on bad data: a label outside the binary set. Validation fails and says so in its report.
    bad = tmp_path / "bad" / "petfinder_for_tutorial"
    bad.mkdir(parents=True)
    (bad / "images").mkdir()
    for name in ("train.csv", "test.csv"):
        rows = pd.read_csv(chain.images_root / name, index_col=0).head(30)
        if name == "train.csv":
            rows.loc[rows.index[3], "AdoptionSpeed"] = 7
        rows.to_csv(bad / name)
        for cell in rows["Images"]:
            for image in split_images(cell):
                shutil.copy2(chain.images_root / image, bad / image)
    with pytest.raises(StageError, match="AdoptionSpeed"):
        validate(ValidateParams(dataset_dir=bad, out_dir=tmp_path / "validated", report_dir=reports))
    assert json.loads((reports / "validation.json").read_text())["success"] is False

    # Even a better model (the trained one) is not promoted after that failed validation.
    decision = promote(_real(chain, "trained", champion, validation_report=reports / "validation.json"))
    assert not decision.promoted and not decision.validation_passed
    assert "validation did not pass" in decision.reason
    assert _snapshot(champion) == before
    assert history_path(champion).read_bytes().startswith(history_before)
    assert len(read_history(champion)) == 2
