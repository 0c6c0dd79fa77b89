"""The DVCLive logger's step decision, made from frame names (fusion_model/live_logger.py): a step is written
when Lightning's step-end functions log, as dvclive decides it, without reading every frame's source."""

from __future__ import annotations

from fusion_model.live_logger import SYNC_FROM, called_from_step_end


def update_train_step_metrics() -> bool:  # the name Lightning's logger connector logs a step's metrics from
    return called_from_step_end()


def log_eval_end_metrics() -> bool:
    return (lambda: called_from_step_end())()  # deeper frames below it count too


def test_the_step_is_written_only_below_lightnings_step_end_functions() -> None:
    assert {"update_train_step_metrics", "update_train_epoch_metrics", "log_eval_end_metrics"} == SYNC_FROM
    assert update_train_step_metrics() and log_eval_end_metrics()
    assert not called_from_step_end()
