"""Scoring new rows with the champion (tasks/score, flows/score.py): the stage function on a folder and a URL
listing of drops, its CLI, and the `score/...` deployments through a real Prefect server and worker.

Good rows get the champion's predictions (equal to Predictor.predict on them), bad rows a reject naming the
row, the column and the reason; each drop's folder names the model's version and sha256 and is written
whole; a drop already scored is skipped; no champion is an error saying how to get one; a failure in the
middle of a run leaves what earlier drops wrote as it was.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from prefect_stack import PrefectStack
from project_copy import make_project

from fusion_model.dataset import split_images
from fusion_model.predict import Predictor, read_rows_csv
from tasks.errors import StageError
from tasks.params import ScoreParams, load_params
from tasks.score import ScoreRefused, score

ROOT = Path(__file__).resolve().parents[1]
LABEL = "AdoptionSpeed"
OUTPUTS = ("predictions.csv", "rejects.jsonl", "manifest.json")
# the bad rows of the `mixed` drop (1-based, after the header): the column each one breaks and why
BAD = {2: ("Age", "twelve", "not a number"), 4: ("Gender", 9, "not a valid code"),
       6: ("Images", "../escape.jpg", "'..'"), 7: ("Images", "images/no-such-photo.jpg", "file not found")}


# --- without a model ------------------------------------------------------------------------------------


def test_params_yaml_declares_the_section_with_its_defaults() -> None:
    assert load_params(ROOT / "params.yaml").score == ScoreParams()
    assert ScoreParams().kind == "folder" and ScoreParams(source="file:///srv/listing.txt").kind == "url"
    assert ScoreParams(source="https://example.invalid/rows/listing.txt").kind == "url"


def test_no_champion_yet_is_an_error_saying_how_to_get_one(tmp_path: Path) -> None:
    from tasks.__main__ import main

    (tmp_path / "feed").mkdir()
    params = ScoreParams(source=str(tmp_path / "feed"), champion_dir=tmp_path / "models" / "champion",
                         out_dir=tmp_path / "scores")
    with pytest.raises(StageError) as err:
        score(params)
    message = str(err.value)
    assert f"{tmp_path / 'models' / 'champion'}: no champion yet" in message
    assert "python -m flows.retrain" in message and "score.champion_dir" in message
    assert not (tmp_path / "scores").exists()
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "champion").symlink_to("store/" + "0" * 64)  # a champion whose store folder is gone
    with pytest.raises(StageError, match="does not exist: the champion's model is gone.*rollback"):
        score(params)
    code = main(["score", "--params", str(ROOT / "params.yaml"), "--source", str(tmp_path / "feed"),
                 "--champion-dir", str(tmp_path / "nothing"), "--out-dir", str(tmp_path / "scores")])
    assert code == 1


# --- with the tiny model chain's trained model as champion -------------------------------------------------


@dataclass(frozen=True)
class Scoring:
    champion: Path  # the registry's champion link (version 1)
    sha: str
    feed: Path  # drops: good/ (every row fine), mixed/ (the BAD rows)
    rows: pd.DataFrame  # the rows of the drops, as the raw test table without its label
    images_root: Path  # the chain's dataset folder

    def params(self, out: Path, **kw: object) -> ScoreParams:
        return ScoreParams(**{"source": str(self.feed), "champion_dir": self.champion, "out_dir": out,
                              "workers": 1, **kw})


def write_drop(folder: Path, rows: pd.DataFrame, images_root: Path) -> Path:
    """A drop folder: rows.csv (no index column) and the photos its cells name."""
    folder.mkdir(parents=True)
    rows.to_csv(folder / "rows.csv", index=False)
    for cell in rows["Images"]:
        for rel in split_images(cell):
            if (images_root / rel).is_file():
                (folder / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(images_root / rel, folder / rel)
    return folder


def mixed_rows(rows: pd.DataFrame) -> pd.DataFrame:
    bad = rows.copy().astype({"Age": object, "Gender": object, "Images": object})
    for row, (column, value, _why) in BAD.items():
        bad.loc[row - 1, column] = value
    return bad


@pytest.fixture(scope="module")
def scoring(tiny_model_chain, tmp_path_factory: pytest.TempPathFactory) -> Scoring:
    from tasks.promote.registry import make_champion, store

    chain = tiny_model_chain
    work = tmp_path_factory.mktemp("score")
    champion = work / "models" / "champion"
    sha = store(champion, {p.name: p for p in chain.trained.iterdir() if p.is_file()}, {})
    make_champion(champion, sha, {"reason": "test champion"})
    rows = pd.read_csv(chain.images_root / "test.csv", index_col=0).drop(columns=[LABEL]).reset_index(drop=True)
    feed = work / "feed"
    write_drop(feed / "good", rows.iloc[:12].reset_index(drop=True), chain.images_root)
    write_drop(feed / "mixed", mixed_rows(rows.iloc[12:22].reset_index(drop=True)), chain.images_root)
    return Scoring(champion, sha, feed, rows, chain.images_root)


def expected(s: Scoring, drop: Path, keep: list[int]) -> pd.DataFrame:
    """Predictor.predict on the drop's rows at these 0-based positions, read as the CLI reads a CSV."""
    predictor = Predictor.load(s.champion)
    rows = read_rows_csv(drop / "rows.csv", predictor.schema.columns.text).reset_index(drop=True)
    return predictor.predict(rows.iloc[keep], drop)


def assert_predictions(got: pd.DataFrame, want: pd.DataFrame) -> None:
    assert list(got.columns) == ["row", "PetID", "prediction", "proba_0", "proba_1"]
    assert got["row"].tolist() == [i + 1 for i in want.index]
    assert got["PetID"].tolist() == want["PetID"].tolist()
    assert got["prediction"].tolist() == want["prediction"].tolist()
    for col in ("proba_0", "proba_1"):  # float32 values written as text and read back
        np.testing.assert_allclose(got[col].to_numpy(), want[col].to_numpy(np.float64), rtol=1e-6)


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _bytes(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_every_drop_is_scored_by_the_champion_and_bad_rows_are_rejected_naming_row_column_reason(
        scoring: Scoring, tmp_path: Path) -> None:
    out = tmp_path / "scores"
    summary = score(scoring.params(out), extra={"flow_run_id": "test"})
    assert summary.model == {"version": "1", "sha256": scoring.sha, "folder": str(scoring.champion.resolve())}
    assert [(d.drop, d.rows, d.scored, d.rejected) for d in summary.scored] == [("good", 12, 12, 0), ("mixed", 10, 6, 4)]
    assert (summary.rows_scored, summary.rows_rejected) == (18, 4)
    assert "18 row(s) scored and 4 rejected in 2 drop(s) by model version 1" in summary.message
    assert sorted(p.name for p in out.iterdir()) == ["good", "mixed"]  # no staging folder left
    for drop in ("good", "mixed"):
        assert sorted(p.name for p in (out / drop).iterdir()) == sorted(OUTPUTS)
    assert_predictions(pd.read_csv(out / "good" / "predictions.csv"), expected(scoring, scoring.feed / "good",
                                                                               list(range(12))))
    good_rows = [i for i in range(10) if i + 1 not in BAD]
    assert_predictions(pd.read_csv(out / "mixed" / "predictions.csv"), expected(scoring, scoring.feed / "mixed",
                                                                                good_rows))
    assert (out / "good" / "rejects.jsonl").read_text() == ""
    rejects = _jsonl(out / "mixed" / "rejects.jsonl")
    assert [r["row"] for r in rejects] == sorted(BAD)
    for record in rejects:
        column, value, why = BAD[record["row"]]
        (problem,) = record["problems"]
        assert problem["column"] == column and problem["value"] == value and why in problem["reason"], record
        assert record["id"] == scoring.rows.at[12 + record["row"] - 1, "PetID"]
        assert record["values"]["PetID"] == record["id"] and record["values"][column] == value
    manifest = json.loads((out / "mixed" / "manifest.json").read_text())
    assert manifest["model"]["version"] == "1" and manifest["model"]["sha256"] == scoring.sha
    assert (manifest["rows"], manifest["scored"], manifest["rejected"]) == (10, 6, 4)
    assert manifest["drop"]["name"] == "mixed" and manifest["drop"]["table"] == "rows.csv"
    assert manifest["flow_run_id"] == "test" and manifest["ignored_columns"] == []
    import hashlib

    assert manifest["files"]["rejects.jsonl"] == hashlib.sha256((out / "mixed" / "rejects.jsonl").read_bytes()).hexdigest()


@pytest.mark.slow
def test_a_drop_already_scored_is_skipped_changed_content_refused_and_rescore_replaces_it(
        scoring: Scoring, tmp_path: Path) -> None:
    feed, out = tmp_path / "feed", tmp_path / "scores"
    shutil.copytree(scoring.feed / "good", feed / "good")
    params = scoring.params(out).model_copy(update={"source": str(feed)})
    score(params)
    before = _bytes(out)
    again = score(params)
    assert again.already == ["good"] and again.scored == [] and _bytes(out) == before
    rows = pd.read_csv(feed / "good" / "rows.csv")
    rows.head(5).to_csv(feed / "good" / "rows.csv", index=False)  # new content under a name already scored
    with pytest.raises(ScoreRefused, match=r"good \(.*\): .* has changed since it was scored .*score.rescore"):
        score(params)
    assert _bytes(out) == before
    redone = score(params.model_copy(update={"rescore": True}))
    assert [(d.drop, d.rows) for d in redone.scored] == [("good", 5)]
    assert len(pd.read_csv(out / "good" / "predictions.csv")) == 5


@pytest.mark.slow
def test_a_failure_midway_leaves_the_drops_written_before_it(scoring: Scoring, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    feed, out = tmp_path / "feed", tmp_path / "scores"
    for name in ("a", "b", "c"):
        shutil.copytree(scoring.feed / "good", feed / name)
    params = scoring.params(out).model_copy(update={"source": str(feed)})
    score(params.model_copy(update={"source": str(feed / "a"), "glob": "nothing"}))  # (no drop: nothing written)
    assert not out.exists() or list(out.iterdir()) == []
    calls = {"n": 0}
    real = Predictor.predict

    def fail_on_the_second(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("killed in the middle of drop b")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Predictor, "predict", fail_on_the_second)
    with pytest.raises(RuntimeError, match="drop b"):
        score(params)
    assert sorted(p.name for p in out.iterdir()) == ["a"]  # b has no folder, not even a half one; c not begun
    written = _bytes(out / "a")
    assert sorted(written) == sorted(OUTPUTS)
    monkeypatch.setattr(Predictor, "predict", real)
    rerun = score(params)
    assert rerun.already == ["a"] and [d.drop for d in rerun.scored] == ["b", "c"]
    assert _bytes(out / "a") == written


@pytest.mark.slow
def test_a_url_listing_and_a_drop_lacking_a_column_refused_by_name(scoring: Scoring, tmp_path: Path) -> None:
    from tasks.__main__ import main

    site = tmp_path / "site"
    site.mkdir()
    with zipfile.ZipFile(site / "good.zip", "w") as z:  # a zip of a drop folder
        for path in sorted((scoring.feed / "good").rglob("*")):
            z.write(path, Path("good") / path.relative_to(scoring.feed / "good"))
    scoring.rows.iloc[30:33].drop(columns=["Age"]).to_csv(site / "no_age.csv", index=False)
    (site / "listing.txt").write_text(f"day-1 {(site / 'good.zip').as_uri()}\nday-2 {(site / 'no_age.csv').as_uri()}\n")
    out = tmp_path / "scores"
    with pytest.raises(ScoreRefused) as err:
        score(scoring.params(out, source=(site / "listing.txt").as_uri()))
    message = str(err.value)
    assert f"day-2 ({(site / 'no_age.csv').as_uri()}): {(site / 'no_age.csv').as_uri()}: lacks the column(s) ['Age']" \
        in message and "add them" in message.lower()
    assert err.value.summary.scored[0].drop == "day-1" and err.value.summary.rows_scored == 12
    assert sorted(p.name for p in out.iterdir()) == ["day-1"]  # the refused drop wrote nothing
    assert_predictions(pd.read_csv(out / "day-1" / "predictions.csv"), expected(scoring, scoring.feed / "good",
                                                                                list(range(12))))
    args = ["score", "--params", str(ROOT / "params.yaml"), "--source", (site / "listing.txt").as_uri(),
            "--champion-dir", str(scoring.champion), "--out-dir", str(out), "--workers", "1"]
    assert main(args) == 1  # the CLI: the same refusal, exit 1; the scored drop is skipped
    (site / "listing.txt").write_text(f"day-1 {(site / 'good.zip').as_uri()}\n")
    assert main(args) == 0


# --- the deployments ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_score_deployments_through_a_prefect_server_and_worker(scoring: Scoring, tmp_path: Path) -> None:
    """`prefect deploy --all`, a worker, `prefect deployment run 'score/on-demand'` twice: the first scores
    both drops in the workspace and says so in its artifact; the second meets a refused drop, fails naming
    it, scores the new good one and leaves the first run's files byte for byte. The nightly one has its cron."""
    project = make_project(tmp_path / "project")
    (tmp_path / "prefect_home").mkdir()
    feed = tmp_path / "feed"
    shutil.copytree(scoring.feed, feed)
    s = PrefectStack(project, tmp_path / "prefect_home", tmp_path / "retrain_home")
    overrides = {"champion_dir": str(scoring.champion), "workers": 1}
    try:
        s.deploy()
        nightly = s.get("/deployments/name/score/nightly")
        assert [x["schedule"].get("cron") for x in nightly["schedules"]] == ["30 3 * * *"]
        for name in ("score/nightly", "score/on-demand"):
            assert s.get(f"/deployments/name/{name}")["global_concurrency_limit"]["limit"] == 1
        first = s.wait(s.submit("score/on-demand", source=str(feed), overrides=overrides), timeout_s=600)
        assert first["state"]["type"] == "COMPLETED", (first["state"], s.log("worker"))
        assert "18 row(s) scored and 4 rejected in 2 drop(s) by model version 1" in first["state"]["message"]
        assert s.task_states(first["id"]) == {"score": "COMPLETED"}
        artifacts = {a["key"]: a for a in s.post("/artifacts/filter",
                                                 {"artifacts": {"flow_run_id": {"any_": [first["id"]]}}})}
        summary = artifacts["score-summary"]["data"]
        assert "**18 row(s) scored, 4 rejected**" in summary and f"version **1**, sha256 `{scoring.sha}`" in summary
        assert "| mixed | 10 | 6 | 4 |" in summary and "score-drops" in artifacts
        scores = s.workspace / "data" / "scores"  # in the run's own workspace, never the project
        assert sorted(p.name for p in scores.iterdir()) == ["good", "mixed"] and not (project / "data").exists()
        manifest = json.loads((scores / "mixed" / "manifest.json").read_text())
        assert manifest["model"]["sha256"] == scoring.sha and manifest["flow_run_id"] == first["id"]
        before = {d: _bytes(scores / d) for d in ("good", "mixed")}

        write_drop(feed / "later", scoring.rows.iloc[40:44].reset_index(drop=True), scoring.images_root)
        write_drop(feed / "broken", scoring.rows.iloc[44:46].drop(columns=["Fee"]), scoring.images_root)
        second = s.wait(s.submit("score/on-demand", source=str(feed), overrides=overrides), timeout_s=600)
        assert second["state"]["type"] == "FAILED", (second["state"], s.log("worker"))
        assert "broken" in second["state"]["message"] and "['Fee']" in second["state"]["message"]
        assert sorted(p.name for p in scores.iterdir()) == ["good", "later", "mixed"]
        assert {d: _bytes(scores / d) for d in ("good", "mixed")} == before
        artifacts = s.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [second["id"]]}}})
        refused = next(a["data"] for a in artifacts if a["key"] == "score-summary")
        assert "**4 row(s) scored, 0 rejected**" in refused and "## Refused" in refused and "broken" in refused
    finally:
        s.stop()
    assert s.leftovers() == []
