"""A finished training rank is not failed by its interpreter's teardown (fusion_model/processes.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a process whose teardown aborts, as a communication library's C++ destructor can after a rank's work
_ABORTING_TEARDOWN = """
import atexit, logging, os, sys
logging.basicConfig(stream=sys.stderr, level=logging.INFO)
atexit.register(os.abort)
print("written", end="")  # no newline: still in the buffer when the process ends
logging.getLogger("rank").info("logged")
{end}
"""


def _run(end: str) -> subprocess.CompletedProcess[str]:
    code = textwrap.dedent(_ABORTING_TEARDOWN).format(end=end)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_the_teardown_abort_fails_a_plain_exit() -> None:
    plain = _run("sys.exit(0)")
    assert plain.returncode != 0  # SIGABRT: what the launcher saw from a finished rank


def test_end_process_ends_with_the_code_and_every_line_flushed() -> None:
    ended = _run("from fusion_model.processes import end_process\nend_process(0)")
    assert ended.returncode == 0, ended.stderr
    assert ended.stdout == "written" and "logged" in ended.stderr
    failed = _run("from fusion_model.processes import end_process\nend_process(3)")
    assert failed.returncode == 3


def test_the_training_entry_point_ends_through_it() -> None:
    source = (ROOT / "fusion_model" / "fit.py").read_text()
    assert 'if __name__ == "__main__":\n    end_process(main())' in source
