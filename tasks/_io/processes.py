"""Child processes that do not outlive their parent.

A process started in a session of its own (so the caller's Ctrl-C does not hit it twice) is not ended
when its caller is killed: with SIGKILL nothing in the caller runs. Linux's parent-death signal does it
instead: the kernel signals the child the moment its parent dies. Elsewhere this is a no-op.
"""

from __future__ import annotations

import os
import signal
import sys

from fusion_model.processes import die_with_parent


def preexec_die_with_parent(sig: int = signal.SIGTERM):  # noqa: ANN201 (a Popen preexec_fn)
    """A `subprocess.Popen(preexec_fn=...)` that ties the child to the process starting it."""
    parent = os.getpid()
    return lambda: die_with_parent(sig, parent)


REAPER_TOKEN = "RETRAIN_REAPER_TOKEN"


def reap_when_gone(pid: int, token: str | None = None, interval_s: float = 0.5, grace_s: float = 5.0) -> None:
    """Watch process `pid`; once it is gone, end every descendant it had (SIGTERM, then SIGKILL).

    For a parent that may be SIGKILLed with children it cannot tie to itself (a library started them):
    run this in a separate process (`start_reaper`), which outlives the parent by design. Descendants are
    found by polling and, at the end, by `token` in their environment: one started after the last poll, or
    one whose own parent exited first (re-parented, no longer a descendant), is found too.
    """
    import time

    import psutil

    known: dict[int, psutil.Process] = {}
    try:
        parent = psutil.Process(pid)
        while parent.is_running() and parent.status() != psutil.STATUS_ZOMBIE:
            for child in parent.children(recursive=True):
                if child.pid != os.getpid():  # the watcher is one of the children: it stays to the end
                    known.setdefault(child.pid, child)
            time.sleep(interval_s)
    except psutil.Error:
        pass
    if token is not None:
        for p in psutil.process_iter():
            try:
                if p.pid != os.getpid() and p.environ().get(REAPER_TOKEN) == token:
                    known.setdefault(p.pid, p)
            except psutil.Error:
                continue
    alive = [p for p in known.values() if p.is_running()]
    for p in alive:
        try:
            p.terminate()
        except psutil.Error:
            continue
    _, still = psutil.wait_procs(alive, timeout=grace_s)
    for p in still:
        try:
            p.kill()
        except psutil.Error:
            continue


def start_reaper() -> None:
    """Leave a watcher behind this process that ends its children if it dies without doing so itself
    (SIGKILL): e.g. the temporary Prefect server a flow run started. The watcher is in a session of its
    own, so a kill of this process's group does not reach it, and it exits after its clean-up. Every
    process started from here on inherits a token in its environment, by which the watcher finds it."""
    import subprocess
    import time

    token = f"{os.getpid()}-{time.time_ns()}"
    os.environ[REAPER_TOKEN] = token
    code = f"from tasks._io.processes import reap_when_gone; reap_when_gone({os.getpid()}, {token!r})"
    env = {k: v for k, v in os.environ.items() if k != REAPER_TOKEN}  # the watcher is not one of them
    subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdin=subprocess.DEVNULL,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True, env=env)
