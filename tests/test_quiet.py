"""fusion_model/quiet.py: each listed third-party message is dropped, nothing else is, and install() twice
adds no filter twice. Samples are emitted as coming from the module / logger each entry names."""

from __future__ import annotations

import logging
import re
import warnings

import pytest

from fusion_model import quiet


def _sample(pattern: str) -> str:
    """A message the regex matches: its groups and classes filled in (the patterns are simple by design)."""
    text = pattern.replace(r"\d+", "3").replace("-?", "").replace(r"\w+", "deepspeed_shm_comm_op")
    text = re.sub(r"\(([^()|]*)\|[^()]*\)", r"\1", text)  # (a|b) -> a
    text = text.replace(".*", " x ").rstrip("$")
    return re.sub(r"\\(.)", r"\1", text)


def _module(pattern: str) -> str:
    return re.sub(r"\\(.)", r"\1", pattern).rstrip(".") + ".sample"


def _emit(message: str, category: type[Warning], module: str) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()
        warnings.simplefilter("always")
        quiet.install()
        warnings.warn_explicit(message, category, filename=f"{module}.py", lineno=1, module=module)
    return seen


@pytest.mark.parametrize("message,category,module", quiet.WARNINGS, ids=[m for m, _, _ in quiet.WARNINGS])
def test_each_listed_warning_is_dropped(message: str, category: type[Warning], module: str) -> None:
    sample = _sample(message)
    assert re.match(message, sample), sample
    assert _emit(sample, category, _module(module)) == []


@pytest.mark.parametrize("message,category,module", quiet.WARNINGS, ids=[m for m, _, _ in quiet.WARNINGS])
def test_another_warning_of_the_same_module_or_the_project_still_shows(
        message: str, category: type[Warning], module: str) -> None:
    assert len(_emit(_sample(message), category, "fusion_model.fit")) == 1  # the same text, ours: shown
    assert len(_emit("something else entirely", category, _module(module))) == 1
    assert len(_emit("a warning of our own", UserWarning, "fusion_model.fit")) == 1
    assert len(_emit("a stage warning", UserWarning, "tasks.train.stage")) == 1


def test_a_warning_is_matched_on_its_module_too() -> None:
    sample = _sample(quiet.WARNINGS[1][0])  # Checkpoint directory ... exists and is not empty
    assert _emit(sample, UserWarning, "lightning.pytorch.callbacks.model_checkpoint") == []
    assert len(_emit(sample, UserWarning, "fusion_model.fit")) == 1


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _log(name: str, message: str) -> list[str]:
    logger = logging.getLogger(name)
    recorder = _Recorder()
    level, propagate = logger.level, logger.propagate
    logger.addHandler(recorder)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        quiet.install()
        logger.info("%s", message)
        logger.warning(message)
    finally:
        logger.removeHandler(recorder)
        logger.setLevel(level)
        logger.propagate = propagate
    return recorder.messages


@pytest.mark.parametrize("name,pattern", [(n, p) for n, ps in quiet.LOGGED.items() for p in ps])
def test_each_listed_log_message_is_dropped_and_others_of_that_logger_are_not(name: str, pattern: str) -> None:
    sample = _sample(pattern)
    assert re.match(pattern, sample), sample
    assert _log(name, sample) == []
    assert _log(name, "`Trainer.fit` stopped: No training batches.") == ["`Trainer.fit` stopped: No training batches."] * 2
    assert _log("fusion_model.fit", sample) == [sample] * 2  # only the named loggers filter


def test_the_lightning_messages_seen_in_a_run_are_dropped() -> None:
    logger = "lightning.pytorch.utilities.rank_zero"
    for message in (
        "GPU available: False, used: False",
        "TPU available: False, using: 0 TPU cores",
        "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger](https://pypi.org/"
        "project/litlogger/) to enable LitLogger, which logs metrics and artifacts automatically.",
        "Loading `train_dataloader` to estimate number of stepping batches.",
        "`Trainer.fit` stopped: `max_epochs=2` reached.",
    ):
        assert _log(logger, message) == [], message
    assert _log("lightning.pytorch.strategies.deepspeed", "initializing deepspeed distributed: GLOBAL_RANK: 1, "
                "MEMBER: 2/2") == []
    assert _log("torch.utils.cpp_extension", "No CUDA runtime is found, using CUDA_HOME='/usr/local'") == []


def test_printed_noise() -> None:
    assert quiet.is_printed_noise("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully")
    assert not quiet.is_printed_noise("DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op failed to build")
    assert not quiet.is_printed_noise("[train] epoch 1/2 done: val/roc_auc 0.7")


def test_install_twice_adds_no_duplicate_filter() -> None:
    with warnings.catch_warnings():
        quiet.install()
        count = len(warnings.filters)
        loggers = {name: len(logging.getLogger(name).filters) for name in quiet.LOGGED}
        quiet.install()
        assert len(warnings.filters) == count
        assert {name: len(logging.getLogger(name).filters) for name in quiet.LOGGED} == loggers
        assert all(n == 1 for n in loggers.values()), loggers
        ours = [f for f in warnings.filters if f[0] == "ignore" and f[1] is not None
                and any(f[1].pattern == m for m, _, _ in quiet.WARNINGS)]
        assert len(ours) == len(quiet.WARNINGS)
