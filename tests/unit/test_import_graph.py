"""The package's layering, checked on its source: no import cycles (counting
imports inside functions and under TYPE_CHECKING too), no Qt outside ui/, and
the config, which every layer reads, reading nothing above it."""

from __future__ import annotations

import ast
import functools
from collections.abc import Collection, Mapping
from pathlib import Path

import tray_app

PACKAGE_ROOT = Path(tray_app.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every module this file imports, anywhere in it."""
    name = module_name(path)
    return imports_in(path.read_text(), name if path.name == "__init__.py" else name.rpartition(".")[0])


def imports_in(source: str, package: str) -> set[str]:
    """Every module `source`, a module of `package`, imports: at the top, in
    functions, and under `if TYPE_CHECKING:` (a type-only import is still a
    dependency, and a cycle through one breaks the moment it is evaluated)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.add(source)
            # `from pkg import module` imports the module.
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


@functools.cache
def graph() -> dict[str, frozenset[str]]:
    """Each tray_app module and the tray_app modules it imports (read once: every test asks)."""
    modules = {module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}
    return {name: frozenset(m for m in imports_of(path) if m in modules and m != name)
            for name, path in modules.items()}


def find_cycle(edges: Mapping[str, Collection[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_reader_counts_type_only_and_function_local_imports():
    source = ("from typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n"
              "    from ..service import Service\n"
              "def later():\n"
              "    from . import worker\n"
              "    import tray_app.core.config\n")
    found = imports_in(source, "tray_app.core.engine")
    assert {"tray_app.core.service", "tray_app.core.engine.worker", "tray_app.core.config"} <= found


def test_no_import_cycle_in_tray_app():
    assert find_cycle(graph()) is None


# core/base/ is the leaf package: its modules import no tray_app module, and
# the config, which every layer reads, builds on them alone.
LEAF_PACKAGE = "tray_app.core.base"


def is_leaf(module: str) -> bool:
    return module.startswith(LEAF_PACKAGE + ".")


def test_the_config_imports_nothing_above_it():
    edges = graph()
    above = sorted(m for m in edges["tray_app.core.config"] if not is_leaf(m) and m != LEAF_PACKAGE)
    assert not above, f"config.py is read by every layer: it may import only leaf modules, not {above}"
    leaves = [m for m in edges if is_leaf(m)]
    assert "tray_app.core.base.files" in leaves  # the check below has something to check
    for leaf in leaves:
        assert not edges[leaf], f"{leaf} is no leaf: it imports {sorted(edges[leaf])}"


def test_qt_only_in_the_ui_package():
    for path in PACKAGE_ROOT.rglob("*.py"):
        if module_name(path).startswith("tray_app.ui"):
            continue
        qt = [m for m in imports_of(path) if m.split(".")[0] in ("PySide6", "PyQt5", "PyQt6", "shiboken6")]
        assert not qt, f"{path} imports {qt}"


def test_dispatch_does_not_reach_up_into_the_http_layer():
    for name, targets in graph().items():
        if name.startswith(("tray_app.core.dispatch", "tray_app.core.engine", "tray_app.core.memory")):
            assert not [t for t in targets if t.startswith(("tray_app.core.api", "tray_app.core.service"))], name
