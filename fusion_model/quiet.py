"""Known third-party noise, filtered in one place: ``install()`` (idempotent) adds a warnings filter per
entry of WARNINGS and a logging filter on each logger of LOGGED; ``is_printed_noise(line)`` names the lines
a library prints straight to stdout (the train stage's relay skips them; its train.log keeps every line).

Only the messages listed here are dropped, each matched on its text and the module / logger it comes from:
the project's own warnings, and anything else those libraries say, still come through. Imports neither
torch nor Lightning, so installing it costs nothing; a rank calls it at import (fusion_model/fit.py), the
CLI in main (tasks/__main__.py).
"""

from __future__ import annotations

import logging
import re
import warnings

# (message regex, matched from its start; category; module regex, matched from the start of the module the
# warning is attributed to). Each is Lightning's or torch's own call, never a sign of a problem in a run.
WARNINGS: list[tuple[str, type[Warning], str]] = [
    # fit.py logs per-rank epoch metrics on purpose: validation metrics come from the same gathered rows on
    # every rank, and the per-epoch training loss is each rank's own (an all-reduce per step costs more)
    (r".*when logging on epoch level in distributed setting", UserWarning, r"lightning\."),
    # the stage writes train_config.json into the checkpoint folder first: it is the run's own staging
    # folder (a temp folder beside out_dir, swapped in at the end), never a previous run's checkpoints
    (r"Checkpoint directory .* exists and is not empty", UserWarning,
     r"lightning\.pytorch\.callbacks\.model_checkpoint"),
    # per-step curves are DVCLive's; the epoch lines come from ProgressPrinter, so a small table that has
    # fewer batches than log_every_n_steps loses nothing the run reports
    (r"The number of training batches \(\d+\) is smaller than the logging interval", UserWarning,
     r"lightning\.pytorch\.loops\.fit_loop"),
    # torch 2.10+ deprecates the LeafSpec class that Lightning's own pytree helper still builds
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\."),
    # DeepSpeed's ZeRO calls torch's deprecated all_gather_into_tensor and (ZeRO-3) reduce_scatter_tensor (the
    # warning is raised in c10d's wrapper)
    (r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated", FutureWarning,
     r"torch\.distributed\.c10d_logger"),
    # Lightning's all_gather (metric sync across ranks) calls torch's deprecated autograd all_gather
    (r"torch\.distributed\.nn\.functional\.all_gather is deprecated", FutureWarning,
     r"lightning\.fabric\.utilities\.distributed"),
    # peft asks transformers' deprecated is_gradient_checkpointing when it wraps the text model (train.text_lora)
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
]

# Lightning's rank_zero_info goes to whichever of these modules imported last sets as its logger
_RANK_ZERO = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
              "lightning_utilities.core.rank_zero")
_RANK_ZERO_NOISE = [
    # the hardware summary: the stage's first line already says the strategy, processes and accelerator
    r"(GPU|TPU|HPU|IPU) available: ",
    # advertisements for Lightning's hosted services (LitLogger, cloud checkpoints); DVCLive logs the run
    r"💡 Tip: For seamless cloud ",
    # a step of Trainer.fit's set-up, said every run
    r"Loading `train_dataloader` to estimate number of stepping batches",
    # the normal end of a fit (train_summary.json has epochs, steps and stopped_early); "No training
    # batches" and the other reasons still print
    r"`Trainer\.fit` stopped: `max_(epochs|steps)=-?\d+` reached",
]
# logger name -> message regexes (matched from the start of the formatted message) dropped at that logger
LOGGED: dict[str, list[str]] = {
    **{name: _RANK_ZERO_NOISE for name in _RANK_ZERO},
    # one line per rank per run; the stage's first line says "deepspeed x N process(es)"
    **{name: [r"initializing deepspeed distributed: GLOBAL_RANK: "]
       for name in ("lightning.pytorch.strategies.deepspeed", "lightning.fabric.strategies.deepspeed")},
    # DeepSpeed imports torch's extension builder, which says this on any machine without CUDA; a CPU run
    # needs none (DS_ACCELERATOR=cpu), and a GPU run without CUDA fails in Lightning, loudly
    "torch.utils.cpp_extension": [r"No CUDA runtime is found"],
}

# Lines a library prints (print(), not warnings or logging): matched from the start of the stripped line
PRINTED: list[str] = [
    # DeepSpeed's CPU shared-memory all-reduce op, (re)loaded by every rank at start-up (a build failure
    # raises, with the compiler's output)
    r"DeepSpeed deepspeed\.ops\.comm\.\w+ built successfully$",
]

_PRINTED = [re.compile(p) for p in PRINTED]


class _DropMessages(logging.Filter):
    """Drops a logger's records whose message matches one of `patterns`."""

    def __init__(self, patterns: list[str]) -> None:
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


_FILTERS = {name: _DropMessages(patterns) for name, patterns in LOGGED.items()}  # one each: addFilter dedups


def install() -> None:
    """Installs every filter; calling it again adds none twice (warnings.filterwarnings replaces an
    identical filter, Logger.addFilter skips one it holds)."""
    for message, category, module in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, drop in _FILTERS.items():
        logging.getLogger(name).addFilter(drop)


def is_printed_noise(line: str) -> bool:
    """Whether `line` is one of the PRINTED lines (a relay may skip it; a log file should keep it)."""
    text = line.strip()
    return any(p.match(text) for p in _PRINTED)
