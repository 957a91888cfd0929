"""No import cycles inside trajstore/, hidden ones included.

The graph is built from the source (AST), not by importing: every ``import``
and ``from ... import`` counts wherever it stands (module level, inside a
function, under ``TYPE_CHECKING``), and so does a module reached through
``importlib.import_module``/``__import__``: a module that calls either has an
edge to every trajstore module its string literals name (the names may sit in
a list next to the call). Importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__`` too; those implicit parent-package edges are left out, as
every package's own submodules would otherwise form a cycle with it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "trajstore"
DYNAMIC_IMPORTERS = {"import_module", "__import__"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(path: Path, name: str) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imported_names(path: Path, known: set[str]) -> set[str]:
    """Every trajstore module ``path`` imports, statically or through importlib."""
    name = module_name(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    literals: set[str] = set()
    dynamic = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_of(path, name).split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                # a submodule named here is the import; otherwise the package's own names are
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in known else base)
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            dynamic = dynamic or called in DYNAMIC_IMPORTERS
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            literals.add(node.value)
    if dynamic:
        found |= literals
    return {target for target in found if target in known and target != name}


def import_graph() -> dict[str, set[str]]:
    paths = sorted(PACKAGE_ROOT.rglob("*.py"))
    known = {module_name(path) for path in paths}
    return {module_name(path): imported_names(path, known) for path in paths}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_static_function_local_and_importlib_imports() -> None:
    graph = import_graph()
    assert "trajstore.replay.context" in graph["trajstore.router.stage"]
    assert "trajstore.router.stage" in graph["trajstore.replay.builtin"]
    # function-local imports count
    assert "trajstore.router.stage" in graph["trajstore.cli.router_cmd"]
    # importlib with the names in a list: the CLI's command modules
    assert "trajstore.cli.replay_cmd" in graph["trajstore.cli"]


def test_cycle_finder_reports_a_cycle_through_three_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_of_trajstore_imports_a_module_that_imports_it_back() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
