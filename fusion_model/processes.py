"""A child process that does not outlive its parent (Linux's parent-death signal), and one that ends once
its work is flushed.

A process started in a session of its own (so the caller's Ctrl-C does not hit it twice) is not ended
when its caller is killed: with SIGKILL nothing in the caller runs. The kernel signals the child the moment
its parent dies instead. Elsewhere this is a no-op. (tasks/_io/processes.py builds its helpers on it.)
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM, parent: int | None = None) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux); if the parent is already
    gone (`parent` given and no longer our parent), exit at once."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return  # not permitted here: the caller's own clean-up still applies
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def end_process(code: int) -> NoReturn:
    """End this process with `code` once its output and logs are flushed, without the interpreter's teardown.

    A training rank's teardown can abort in a communication library's C++ destructors ("terminate called
    without an active exception", SIGABRT) after every file of the run is written; the launcher then fails
    a finished run. Nothing a rank writes waits for that teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    os._exit(code)
