"""The package's layering, checked on its source: no import cycles (counting
imports inside functions and under TYPE_CHECKING too), and no Qt outside ui/."""

from __future__ import annotations

import ast
from pathlib import Path

import tray_app

PACKAGE_ROOT = Path(tray_app.__file__).parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every tray_app module this file imports, anywhere in it."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
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


def test_no_import_cycle_in_tray_app():
    assert find_cycle(graph()) is None


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
