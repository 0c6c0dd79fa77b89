"""Regenerate the PetFinder preset's reviewed suite JSON from `tasks/checks/suite.py`:
``python -m tasks.checks.write_suite``.

``--check`` exits 1 while the file is stale (the test suite checks the same).
"""

from __future__ import annotations

import sys

from fusion_model.dataset import resolve_schema
from tasks.checks.suite import expectation_specs, suite_json, suite_path


def main(argv: list[str] | None = None) -> int:
    """Write the suite JSON (or, with --check, exit 1 when the file is stale)."""
    argv = sys.argv[1:] if argv is None else argv
    schema = resolve_schema({"preset": "petfinder"})
    path, text = suite_path(schema), suite_json(schema)
    if "--check" in argv:
        current = path.read_text() if path.exists() else ""
        if current != text:
            print(f"{path} is stale: run python -m tasks.checks.write_suite", file=sys.stderr)
            return 1
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path} ({len(expectation_specs(schema))} expectations)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
