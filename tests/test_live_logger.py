"""The DVCLive logger's step decision, made from frame names (fusion_model/live_logger.py): a step is written
when Lightning's step-end functions log, as dvclive decides it, without reading every frame's source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fusion_model.live_logger import SYNC_FROM, LiveLogger, OfflineLive, called_from_step_end


def update_train_step_metrics() -> bool:  # the name Lightning's logger connector logs a step's metrics from
    return called_from_step_end()


def log_eval_end_metrics() -> bool:
    return (lambda: called_from_step_end())()  # deeper frames below it count too


def test_the_step_is_written_only_below_lightnings_step_end_functions() -> None:
    assert {"update_train_step_metrics", "update_train_epoch_metrics", "log_eval_end_metrics"} == SYNC_FROM
    assert update_train_step_metrics() and log_eval_end_metrics()
    assert not called_from_step_end()


def test_with_studio_off_a_sync_writes_the_run_files_and_gathers_nothing_for_studio(tmp_path: Path,
                                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DVC_STUDIO_OFFLINE", "true")  # as the train stage sets it
    logger = LiveLogger(dir=str(tmp_path / "live"), save_dvc_exp=False, dvcyaml=False, report=None,
                        monitor_system=False)
    logger.log_hyperparams({"lr": 0.1, "members": [{"text_l2": 0.0}]})
    logger.log_metrics({"val/roc_auc": 0.75}, step=0, sync=True)
    live = logger.experiment
    assert isinstance(live, OfflineLive) and live._studio_queue is None  # no Studio payload was built
    assert json.loads((tmp_path / "live/metrics.json").read_text())["val"]["roc_auc"] == 0.75
    assert "lr: 0.1" in (tmp_path / "live/params.yaml").read_text()
