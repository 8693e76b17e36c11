"""The project's modules import one another without a circle, lazy and type-only imports included.

A circle through a lazy import (inside a function) or a ``TYPE_CHECKING`` block works at run time, but it ties two
modules into one: neither can be read, tested or moved without the other, and the README's architecture table
("what it may import") stops being a direction. Four such circles were broken at stop 26 (the LangGraph guard and
its siblings, the undo-check harness and its crash child, the MCP gateway and elicitation, five server modules);
this walks every ``import`` statement of the shipped packages (not only the top-level ones) so none comes back.
A package's ``__init__`` re-exporting its modules is not counted: it is the public face, not code of its own.

Example of what it reports: ``[['undolog_mcp.elicit', 'undolog_mcp.gateway']]``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("undolog_core", "undolog_adapters", "undolog_server", "undolog_mcp")


def _modules() -> dict[str, Path]:
    mods: dict[str, Path] = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            if "migrations" in f.parts:  # Alembic loads these by path, nothing imports them
                continue
            rel = f.relative_to(ROOT).with_suffix("")
            mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = f
    return mods


def _targets(mods: dict[str, Path], name: str, is_pkg: bool, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The project modules one import statement names (``from pkg import mod`` names ``pkg.mod``)."""
    named: list[str] = []
    if isinstance(node, ast.Import):
        named = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = name.split(".") if is_pkg else name.split(".")[:-1]
            parts = parts[: len(parts) - (node.level - 1)]
            base = ".".join([*parts, base] if base else parts)
        for a in node.names:
            full = f"{base}.{a.name}" if base else a.name
            named.append(full if full in mods else base)
    out = []
    for m in named:
        while m and m not in mods:
            m = m.rpartition(".")[0]
        if m:
            out.append(m)
    return out


def import_circles() -> list[list[str]]:
    """Strongly connected groups of more than one module in the import graph (Tarjan), package inits left out."""
    mods = _modules()
    inits = {n for n, f in mods.items() if f.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, f in mods.items():
        if name in inits:
            continue
        tree = ast.parse(f.read_text(encoding="utf-8"))
        graph[name] = {t for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                       for t in _targets(mods, name, False, node) if t != name and t not in inits}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_module_imports_itself_back_through_others() -> None:
    assert import_circles() == []


def test_the_walk_sees_lazy_and_relative_imports() -> None:
    """The check is not vacuous: a lazy, relative import inside a function is an edge of the graph."""
    mods = _modules()
    tree = ast.parse("def f():\n    from ._guard import _Guard\n")
    node = tree.body[0].body[0]  # type: ignore[attr-defined]
    assert _targets(mods, "undolog_adapters.langgraph._siblings", False, node) == \
        ["undolog_adapters.langgraph._guard"]
