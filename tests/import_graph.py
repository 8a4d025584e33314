"""The imports between the modules of a package, read from the source (every ``import``, at any depth, the lazy
ones too; those under ``if TYPE_CHECKING:`` left out: they never run). Used by ``tests/test_walls.py``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def modules(package: str) -> dict[str, Path]:
    """Every module of ``package`` by dotted name (a sub-package by its own name, for its ``__init__``)."""
    found = {}
    for path in sorted((ROOT / package.replace(".", "/")).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(tree: ast.AST) -> Iterator[str]:
    """Each name an import statement names: a module, and ``module.name`` for ``from module import name``."""
    for node in ast.iter_child_nodes(tree):
        if _type_checking(node):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)
        yield from _imports(node)


def top_level_imports(path: Path) -> set[str]:
    """The top-level packages a module imports anywhere in it (``ray``, ``redis``, ...)."""
    return {name.split(".")[0] for name in _imports(ast.parse(path.read_text()))}


def graph(package: str) -> dict[str, set[str]]:
    """module -> the modules of ``package`` it imports (a package's ``__init__`` counted only when named alone)."""
    mods = modules(package)
    edges = {}
    for name, path in mods.items():
        targets = {n for n in _imports(ast.parse(path.read_text())) if n in mods}
        # ``from workers.job import sandbox``: the module is the edge, not the package it sits in
        targets -= {t for t in targets if any(o.startswith(t + ".") for o in targets)}
        edges[name] = targets - {name}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found
