"""fusion_model is a library: it imports nothing of the pipeline (tasks, flows) or its orchestration
(Prefect, DVC; DVCLive is a Lightning logger and allowed), so it can be installed and used on its own."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = ("tasks", "flows", "prefect", "dvc")  # dvclive, a Lightning logger, is not DVC


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_fusion_model_imports_nothing_of_the_pipeline() -> None:
    offending = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in sorted((ROOT / "fusion_model").rglob("*.py"))
        for name in _imports(path) if name.split(".")[0] in FORBIDDEN
    }
    assert not offending, sorted(offending)


def test_the_walk_sees_a_function_level_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from tasks._io.files import write_json\n    import prefect.logging\n")
    assert _imports(module) == {"tasks._io.files", "prefect.logging"}
