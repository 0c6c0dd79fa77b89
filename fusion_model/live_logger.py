"""DVCLive as the Lightning logger, without its per-call `inspect.stack()` and its Studio payloads.

`dvclive.lightning.DVCLiveLogger.log_metrics` decides whether to write the step by looking for Lightning's
step-end functions in `inspect.stack()`, which reads the source file of every frame: on a 2-core machine
that was a sixth of rank 0's training time (BENCHMARKS.md), and the other ranks wait for it. This makes
the same decision from the frames' function names alone. And every `Live.sync` gathers the run's data for
Studio (its params.yaml parsed again by ruamel, ~60 ms) before finding Studio off, as it always is here
(DVC_STUDIO_OFFLINE): `OfflineLive` gathers nothing then.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

from dvclive import Live
from dvclive.fabric import DVCLiveLogger as FabricDVCLiveLogger
from dvclive.lightning import DVCLiveLogger
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

# Lightning's functions whose metrics DVCLive writes as a step (dvclive.lightning._should_sync's list)
SYNC_FROM = frozenset({"update_train_step_metrics", "update_train_epoch_metrics", "log_eval_end_metrics"})


def called_from_step_end() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in SYNC_FROM:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class OfflineLive(Live):
    def post_data_to_studio(self) -> None:
        if "data" not in self._studio_events_to_skip:  # Studio configured: DVCLive's own behaviour
            super().post_data_to_studio()


class LiveLogger(DVCLiveLogger):
    @property
    @rank_zero_experiment
    def experiment(self) -> Live:
        if self._experiment is None:  # as the fabric logger makes it, on rank 0 only
            self._experiment = OfflineLive(**self._kwargs)
        return self._experiment

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, int | float | str], step: int | None = None,
                    sync: bool | None = False) -> None:
        FabricDVCLiveLogger.log_metrics(self, metrics, step, bool(sync) or called_from_step_end())
