"""The first-party import graph has no cycle, read statically from the source: every import
statement counts, those under ``if TYPE_CHECKING:`` and inside functions too, so a cycle kept
alive only for a type hint fails here as well. A type two modules both need lives in the one
it belongs to, or the user states what it needs as a ``Protocol``."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def first_party_packages() -> list[str]:
    """The packages pyproject.toml installs, so a new one is checked without editing this test."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in patterns]


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the first-party packages."""
    modules = {}
    for package in first_party_packages():
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The first-party modules ``name`` names in any import statement: ``from a.b import c``
    is the module a.b.c when there is one, a.b otherwise."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            candidates = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in modules:  # import a.b.c of a module a.b: a.b
                candidate = candidate.rpartition(".")[0]
            if candidate and candidate != name:
                imported.add(candidate)
    return imported


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycles_finds_a_cycle_and_only_the_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_imports_under_type_checking_and_relative_imports_count(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (tmp_path / "pkg" / "b.py").write_text("from . import a\nfrom .a import thing\n")
    modules = {
        "pkg": tmp_path / "pkg" / "__init__.py",
        "pkg.a": tmp_path / "pkg" / "a.py",
        "pkg.b": tmp_path / "pkg" / "b.py",
    }
    assert imported_modules("pkg.a", modules["pkg.a"], modules) == {"pkg.b"}
    assert imported_modules("pkg.b", modules["pkg.b"], modules) == {"pkg.a"}


def test_the_first_party_import_graph_has_no_cycle() -> None:
    modules = module_files()
    assert "engine.engine_core" in modules and "gateway.app" in modules  # the packages were found
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    found = cycles(graph)
    described = [
        "; ".join(f"{name} imports {', '.join(sorted(graph[name] & set(component)))}" for name in component)
        for component in found
    ]
    assert not found, "import cycles (move the shared type where it belongs, or use a Protocol):\n" + "\n".join(
        described
    )
