"""The refit (AutoGluon's refit_full): validation picks the epoch count, the members' mix and the decision
rule; the kept model is then fitted on train + val with them. Real 2-rank ddp runs on the tiny table."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from fusion_model.build import build_module
from fusion_model.config import TrainConfig
from fusion_model.data import ValidatedData
from tasks.train import train

pytestmark = pytest.mark.slow


def _config(data_dir: Path, out_dir: Path, **overrides: object) -> TrainConfig:
    base: dict[str, object] = {
        "data_dir": data_dir, "out_dir": out_dir, "live_dir": out_dir.parent / "training",
        "image_model": "test_resnet", "image_size": 32, "text_buckets": 1024, "cat_dim": 4, "adapter_dim": 16,
        "hidden_sizes": [32], "batch_size": 32, "max_epochs": 3, "devices": 2, "accelerator": "cpu",
        "strategy": "ddp", "ensemble_size": 4, "refit": True,
        # codes also read as numbers (tests/test_model.py) leave the linear member's fit on these few rows so
        # flat that two ranks' fit and one process's part further than the comparisons below allow
        "codes_as_numbers": False,
    }
    return TrainConfig.model_validate({**base, **overrides})


def test_the_kept_model_is_refitted_on_every_labelled_row_with_the_selected_epochs_mix_and_rule(
        tiny_validated: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    cfg = _config(tiny_validated, out)
    summary = train(cfg)
    data = ValidatedData.read(tiny_validated)
    on_disk = json.loads((out / "train_summary.json").read_text())

    # selection as before: three validated epochs, the best one named with its score
    assert [h["epoch"] for h in on_disk["history"]] == [1, 2, 3] and summary.best_epoch in (1, 2, 3)
    assert summary.best_score == next(h["val/roc_auc"] for h in on_disk["history"] if h["epoch"] == summary.best_epoch)
    # the refit: every labelled row, as many epochs as the best one, no validation of its own
    assert summary.refit is not None
    assert summary.refit["rows"] == len(data.train) + len(data.val)
    assert summary.refit["epochs"] == summary.best_epoch == summary.refit["decision_from_epoch"]
    steps_per_epoch = (len(data.train) + len(data.val)) // (2 * cfg.batch_size)
    assert summary.refit["steps"] == summary.best_epoch * steps_per_epoch
    assert summary.best_checkpoint == "best.ckpt" and summary.last_checkpoint == "last.ckpt"

    # the kept checkpoint is the refit's: its preprocessing was fitted on train + val (not train alone) ...
    config = json.loads((out / "model_config.json").read_text())
    every = dataclasses.replace(data, train=pd.concat([data.train, data.val]))
    assert config["preprocess"] == build_module(cfg, every)[0].to_dict()
    assert config["preprocess"] != build_module(cfg, data)[0].to_dict()
    # ... and it carries the selected epoch's mix of members, not the uniform start
    state = torch.load(out / "best.ckpt", map_location="cpu", weights_only=True)
    weights = state["state_dict"]["model.member_weights"].tolist()
    assert weights == pytest.approx(on_disk["decision"]["member_weights"])
    assert state["epoch"] + 1 == summary.best_epoch
    # last.ckpt stays the selection's, so a resumed run continues the selection
    last = torch.load(out / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["global_step"] == summary.steps == 3 * (len(data.train) // (2 * cfg.batch_size))


def test_without_refit_the_best_validated_epoch_is_kept(tiny_validated: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    summary = train(_config(tiny_validated, out, refit=False))
    assert summary.refit is None
    state = torch.load(out / "best.ckpt", map_location="cpu", weights_only=True)
    assert state["epoch"] + 1 == summary.best_epoch
    config = json.loads((out / "model_config.json").read_text())
    assert config["preprocess"] == build_module(_config(tiny_validated, out), ValidatedData.read(tiny_validated))[0].to_dict()


def test_selection_stops_after_patience_epochs_without_a_better_score_and_refits_the_best_one(
        tiny_validated: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    # a learning rate below float32's resolution moves no weight, and without the image no batch norm's
    # statistics move either: every epoch validates exactly as the first one did
    summary = train(_config(tiny_validated, out, max_epochs=6, early_stopping_patience=2, lr=1e-12,
                            modalities=["tabular", "text"]))
    on_disk = json.loads((out / "train_summary.json").read_text())
    scores = [h["val/roc_auc"] for h in on_disk["history"]]
    assert [h["epoch"] for h in on_disk["history"]] == [1, 2, 3] and len(set(scores)) == 1
    assert summary.stopped_early and summary.epochs == 3
    # the first of equal scores is the best epoch, and the refit trains that many epochs
    assert summary.best_epoch == 1 and summary.refit is not None and summary.refit["epochs"] == 1


def test_candidates_are_each_selected_and_the_best_validated_one_is_refitted(
        tiny_validated: Path, tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    cfg = _config(tiny_validated, out, max_epochs=2, candidates=[{}, {"lr": 1e-5, "dropout": 0.3}],
                  candidate_tolerance=0.0)
    summary = train(cfg)
    on_disk = json.loads((out / "train_summary.json").read_text())
    table = on_disk["candidates"]
    assert [c["candidate"] for c in table] == [0, 1] and table[1]["lr"] == 1e-5 and table[1]["dropout"] == 0.3
    # each candidate's score is its own selection's best validated epoch
    for entry in table:
        record = json.loads((out / "candidates" / f"{entry['candidate']}.json").read_text())["summary"]
        assert entry["val_roc_auc"] == max(h["val/roc_auc"] for h in record["history"])
        assert entry["best_epoch"] == record["best_epoch"]
    best = max(table, key=lambda c: c["val_roc_auc"])
    assert summary.chosen_candidate == on_disk["chosen_candidate"] == best["candidate"]
    assert summary.best_score == best["val_roc_auc"] and summary.refit["epochs"] == best["best_epoch"]
    # candidate 1 trained in its own folder; the run's checkpoints and log are where a single run keeps them
    assert (out / "candidates" / "1" / "last.ckpt").exists() and (out / "best.ckpt").exists()
    live = json.loads((cfg.live_dir / "metrics.json").read_text())  # the stage moved DVCLive's log there
    assert live["chosen_candidate"] == best["candidate"]
    assert live["candidates"] == {str(c["candidate"]): {"val_roc_auc": c["val_roc_auc"]} for c in table}


@pytest.mark.parametrize(("candidate", "message"), [
    ({"strategy": "ddp"}, r"\['strategy'\] set where and how the run trains"),
    ({"learning_rate": 0.1}, r"\['learning_rate'\] are not train keys"),
    ({"lr": -1.0}, r"candidates\[1\] \{'lr': -1.0\} does not make a valid train section"),
])
def test_a_candidate_that_is_not_a_model_setting_is_refused(tmp_path: Path, candidate: dict[str, object],
                                                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, tmp_path / "ckpt", candidates=[{}, candidate])


def test_a_later_candidate_must_win_by_more_than_the_tolerance() -> None:
    from fusion_model.fit import _best_candidate

    def done(*scores: float | None) -> list[dict[str, object]]:
        return [{"index": i, "summary": {"best_score": s}} for i, s in enumerate(scores)]

    assert _best_candidate(done(0.500, 0.5009), True, 0.002)["index"] == 0  # within 0.2 % of 0.5: noise
    assert _best_candidate(done(0.500, 0.502, 0.600), True, 0.002)["index"] == 2
    assert _best_candidate(done(0.300, 0.290), False, 0.002)["index"] == 1  # a loss: lower is better
    assert _best_candidate(done(None, 0.1), True, 0.002)["index"] == 1


def test_refit_linear_keeps_the_best_epochs_deep_members_and_the_linear_member_fitted_on_every_labelled_row(
        tiny_validated: Path, tmp_path: Path) -> None:
    data = ValidatedData.read(tiny_validated)
    kept = train(_config(tiny_validated, tmp_path / "linear", refit="linear"))
    alone = train(_config(tiny_validated, tmp_path / "none", refit=False))

    # validation weighed the linear member fitted on the training rows: the same history as without a refit
    on_disk = [json.loads((tmp_path / d / "train_summary.json").read_text()) for d in ("linear", "none")]
    assert on_disk[0]["history"] == on_disk[1]["history"] and kept.best_epoch == alone.best_epoch
    linear_member = on_disk[0]["linear_member"]
    assert kept.refit is None and linear_member["refit"]["rows"] == len(data.train) + len(data.val)
    assert linear_member["refit"]["l2"] == linear_member["l2"]  # the penalties validation chose

    state, before = (torch.load(tmp_path / d / "best.ckpt", map_location="cpu", weights_only=True)["state_dict"]
                     for d in ("linear", "none"))
    linear = {k for k in state if k.startswith("model.linear.")}
    fitted = {f"model.linear.{n}" for n in ("text_weight", "categorical_weight", "numerical_weight", "intercept")}
    assert fitted & linear == fitted & set(before)
    # the best epoch's deep members and mix, as the run without a refit kept them ...
    for key in set(state) - fitted:
        torch.testing.assert_close(state[key], before[key], msg=key)
    # ... beside the linear member fitted again on train + val: its logits on every labelled row are those of
    # the same fit in one process here (two ranks in training), not those of the training rows' fit
    pre, _, module = build_module(_config(tiny_validated, tmp_path / "again", refit="linear"), data)
    rows = pd.concat([data.train, data.val])
    ids, counts = pre.text(rows)
    batch = {"text_ids": ids, "text_counts": counts, "categorical": pre.categorical(rows),
             "numeric": pre.numeric(rows, in_train=True)}
    linear = module.model.linear
    with torch.no_grad():
        expected = linear(module.model.text, batch, set())

        def logits(checkpoint: dict[str, torch.Tensor]) -> torch.Tensor:
            module.model.load_linear_fit_state({k.removeprefix("model."): checkpoint[k] for k in fitted & set(checkpoint)})
            return linear(module.model.text, batch, set())

        torch.testing.assert_close(logits(state), expected, rtol=5e-3, atol=5e-3)
        assert (logits(before) - expected).abs().max() > 0.05
