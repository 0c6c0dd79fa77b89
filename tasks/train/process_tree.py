"""The training launcher's process group: remembered while it runs, ended whole when it fails or is stopped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import psutil


class ProcessTree:
    """Every process the launcher started, remembered while it runs.

    torchrun starts each rank in a session of its own, so killing the launcher's process group does not
    reach the ranks, and a rank orphaned by a dead launcher is no longer its descendant. The tree is
    therefore sampled while the launcher lives, and everything sampled is ended at the close.
    """

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.known: dict[int, psutil.Process] = {}
        self._lock = threading.Lock()

    def sample(self) -> None:
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return
        with self._lock:
            for child in children:
                self.known.setdefault(child.pid, child)

    def watch(self, interval_s: float = 0.5, grace_s: float = 2.0) -> None:
        """Runs in a thread: sample until the launcher exits, then end whatever it left behind."""
        while self.proc.poll() is None:
            self.sample()
            time.sleep(interval_s)
        time.sleep(grace_s)  # the launcher's own teardown of its ranks comes first
        self.kill()

    def alive(self) -> list[psutil.Process]:
        with self._lock:
            procs = list(self.known.values())
        alive = []
        for p in procs:
            # is_running() compares creation times: a recycled pid is not mistaken for a rank
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        return alive

    def kill(self, term_wait_s: float = 10.0) -> None:
        """SIGTERM the launcher (it forwards to its ranks) and every known process, then SIGKILL the rest."""
        self.sample()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        for p in self.alive():
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, still = psutil.wait_procs(self.alive(), timeout=term_wait_s)
        for p in still:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        psutil.wait_procs(still, timeout=5)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """A SIGTERM to the caller (a cancelled flow run) becomes an exception, so the ranks get ended too;
    Python's default would exit at once and orphan them. Only the main thread can install handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(f"train: received signal {signum}; stopping the training processes")

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
