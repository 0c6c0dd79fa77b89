"""Regenerate the reviewed suite JSON from `tasks/validate/suite.py`: ``python -m tasks.validate.write_suite``.

``--check`` exits 1 while the file is stale (the test suite checks the same).
"""

from __future__ import annotations

import sys

from tasks.validate.suite import SUITE_PATH, expectation_specs, suite_json


def main(argv: list[str] | None = None) -> int:
    """Write the suite JSON (or, with --check, exit 1 when the file is stale)."""
    argv = sys.argv[1:] if argv is None else argv
    text = suite_json()
    if "--check" in argv:
        current = SUITE_PATH.read_text() if SUITE_PATH.exists() else ""
        if current != text:
            print(f"{SUITE_PATH} is stale: run python -m tasks.validate.write_suite", file=sys.stderr)
            return 1
        return 0
    SUITE_PATH.parent.mkdir(parents=True, exist_ok=True)
    SUITE_PATH.write_text(text)
    print(f"wrote {SUITE_PATH} ({len(expectation_specs())} expectations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
