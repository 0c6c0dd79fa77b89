"""The code's shape, checked by walking the source with ast (nothing is imported):

- no module in fusion_model/, tasks/, flows/ is over MAX_LINES lines (split it by responsibility);
- no import cycle among the project's modules, function-level imports included (a cycle that works only
  because one side imports late is still a cycle: the two modules are one unit in disguise);
- no underscore-prefixed name is imported from another unit: a top-level package (fusion_model, flows, ...)
  or, under tasks/, another stage package (tasks.train, tasks.validate, ...; tasks._io, the shared
  plumbing, is a unit of its own whose public names anyone may import). A module importing its own
  package's private names is fine.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("fusion_model", "tasks", "flows")  # the project's importable packages
MAX_LINES = 400


def module_name(path: Path, root: Path) -> str:
    """`tasks/intake/drift.py` -> `tasks.intake.drift`; `tasks/intake/__init__.py` -> `tasks.intake`."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_modules(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Every module of the given packages under `root`, by dotted name."""
    return {module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return isinstance(test, ast.Name | ast.Attribute) and ast.unparse(test).endswith("TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (functions, methods, try blocks), except under
    `if TYPE_CHECKING:` (never run, so never part of a cycle)."""
    found = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    yield from sorted(found, key=lambda n: (n.lineno, n.col_offset))  # in the order of the source


def _base(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names (relative imports resolved against `name`)."""
    if not node.level:
        return node.module or ""
    parts = name.split(".") if is_package else name.split(".")[:-1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(module, imported name or None) for each import in `path` of a project module: `from a.b import c`
    is the module `a.b.c` when that is a module, else the name `c` of `a.b`."""
    is_package = path.name == "__init__.py"
    found: list[tuple[str, str | None]] = []
    for node in _import_nodes(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name in modules]
            continue
        base = _base(node, name, is_package)
        for alias in node.names:
            if f"{base}.{alias.name}" in modules:
                found.append((f"{base}.{alias.name}", None))
            elif base in modules:
                found.append((base, alias.name))
    return found


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {name: {target for target, _ in imports(name, path, modules) if target != name}
            for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a → ... → a, as a list of modules ending where it starts) per strongly connected
    component of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return [_cycle_through(sorted(c)[0], set(c), graph) for c in components]


def _cycle_through(start: str, members: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path start → ... → start inside one strongly connected component (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph.get(node, ())):
                if child not in members:
                    continue
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in no cycle of {sorted(members)}")


def unit(module: str) -> str:
    """What may share private names: a top-level package, or under tasks/ a stage package (or module)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "tasks" and len(parts) > 1 else parts[0]


def private_imports_across_units(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    offending = []
    for name, path in modules.items():
        for target, imported in imports(name, path, modules):
            private = imported is not None and imported.startswith("_") and not imported.startswith("__")
            if private and unit(target) != unit(name):
                offending.append(f"{path.relative_to(root)} ({name}) imports {target}.{imported}: a private name "
                                 f"of {unit(target)}; make it public or move it")
    return offending


# ------------------------------------------------------------------------------------------------ tests


def test_no_module_is_over_the_line_limit() -> None:
    long = [f"{path.relative_to(ROOT)}: {n} lines" for path in project_modules(ROOT).values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, f"modules over {MAX_LINES} lines (split them by responsibility): {long}"


def test_no_import_cycle() -> None:
    cycles = find_cycles(import_graph(project_modules(ROOT)))
    assert not cycles, "import cycles (function-level imports included): " + "; ".join(
        " -> ".join(c) for c in cycles)


def test_no_private_name_imported_across_packages() -> None:
    offending = private_imports_across_units(project_modules(ROOT))
    assert not offending, "\n".join(offending)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path: Path) -> None:
    _write(tmp_path, {
        "pkg/__init__.py": "", "pkg/sub/__init__.py": "_hidden = 1\n",
        "pkg/a.py": "from pkg.b import thing\n",
        "pkg/b.py": "def thing():\n    from . import a  # late, still a cycle\n",
        "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n",
        "pkg/sub/e.py": "from pkg.sub import _hidden  # its own package's: fine\nfrom .. import _a\n",
        "other/__init__.py": "",
        "other/d.py": "from pkg.sub import _hidden, __version__\ndef f():\n    from pkg import _a\n",
        "tasks/__init__.py": "", "tasks/_io/__init__.py": "", "tasks/_io/files.py": "def write(): ...\n",
        "tasks/one/__init__.py": "", "tasks/one/x.py": "_p = 1\n",
        "tasks/two/__init__.py": "",
        "tasks/two/y.py": "from tasks._io.files import write\nfrom tasks.one.x import _p\nfrom tasks.two import _q\n",
    })
    modules = project_modules(tmp_path, ("pkg", "other", "tasks"))
    graph = import_graph(modules)
    assert graph["pkg.c"] == set()  # a TYPE_CHECKING import never runs
    assert graph["tasks.two.y"] == {"tasks._io.files", "tasks.one.x", "tasks.two"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert find_cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}, "w": {"x"}}) == [["x", "y", "z", "x"]]
    assert find_cycles({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert unit("tasks.train.stage") == "tasks.train" and unit("tasks._io.files") == "tasks._io"
    assert unit("flows.retrain") == "flows" and unit("fusion_model.presets.petfinder") == "fusion_model"
    offending = private_imports_across_units(modules, tmp_path)
    assert [o.split(": ")[0] for o in offending] == [
        "other/d.py (other.d) imports pkg.sub._hidden",
        "other/d.py (other.d) imports pkg._a",
        "tasks/two/y.py (tasks.two.y) imports tasks.one.x._p",
    ], offending
