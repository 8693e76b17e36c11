"""The project's modules import one another without a circle, lazy and type-only imports included.

A circle through a lazy import (inside a function) or a ``TYPE_CHECKING`` block works at run time, but it ties two
modules into one: neither can be read, tested or moved without the other, and the README's architecture table
("what it may import") stops being a direction. Four such circles were broken at stop 26 (the LangGraph guard and
its siblings, the undo-check harness and its crash child, the MCP gateway and elicitation, five server modules);
this walks every ``import`` statement of the shipped packages (not only the top-level ones) so none comes back.
A package's ``__init__`` re-exporting its modules is not counted: it is the public face, not code of its own.

Three more rules keep the packages layered (the issue "a house the next maintainer can carry on"):

- the core imports none of the packages built on it (``undolog_server``, ``undolog_mcp``, ``undolog_adapters``):
  they come in through entry points (``undolog_core._plugins``);
- the adapters, the desk and the gateway import nothing private of the core: only public modules, and from
  ``undolog_core`` and ``undolog_core.integration`` only the names of their ``__all__``;
- they reach into no private service of an ``UndoLog`` (``undolog.engine.x``, ``undolog.store.x``), but for the
  reaches listed in ``REACHES`` with the reason each is still there. The list only shrinks: a listed reach that
  is gone fails too, so the entry is removed with the code.

Example of what it reports: ``[['undolog_mcp.elicit', 'undolog_mcp.gateway']]``.
"""

from __future__ import annotations

import ast
from collections import Counter
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


# -- layering ------------------------------------------------------------------------------------------------------

CLIENTS = ("undolog_adapters", "undolog_server", "undolog_mcp")

# The core's modules a client may import, and why each is public. From the two with an ``__all__`` only its names.
PUBLIC = {
    "undolog_core": "the app authors' API (its __all__)",
    "undolog_core.integration": "the integration contract (its __all__)",
    "undolog_core.errors": "every UndoLogError, public as `undolog_core.errors` (in the top-level __all__)",
    "undolog_core.limits": "the limits shared with the desk, public as `undolog_core.limits` (in the top-level __all__)",
    "undolog_core.webhooks": "stdlib-only webhook signing, documented for receivers",
    "undolog_core.testing": "the undo check and its pytest plugin, documented for app authors",
    "undolog_core.records": "the records the API's reads return, for app authors' type annotations",
}

# Where a client still reaches into an UndoLog's engine or store: (file, reach) -> (how many, why). Only shrinks; the
# last six (the desk's and the gateway's tables on the core's store, the gateway's two reads of a keyed call, a
# session record put back) went through the integration contract (`shared_store`, `session_of_client_key`,
# `find_call`, `session_table(u).remember`).
REACHES: dict[tuple[str, str], tuple[int, str]] = {}


# Imports of a name the top level still serves with a DeprecationWarning (``undolog_core._MOVED``), by a client not yet
# moved: (file, name) -> why. Only shrinks, as REACHES.
MOVED_IMPORTS: dict[tuple[str, str], str] = {}

# The services of an UndoLog that are not part of any contract, and the names clients hold an UndoLog under.
PRIVATE_SERVICES = frozenset({"engine", "store"})
UNDOLOG_NAMES = frozenset({"undolog", "u"})


def _client_files() -> list[Path]:
    return sorted(f for pkg in CLIENTS for f in (ROOT / pkg).rglob("*.py") if "migrations" not in f.parts)


def _all_of(module: str) -> set[str]:
    """The names a module's ``__all__`` lists (read from its source: nothing is imported)."""
    path = ROOT / module.replace(".", "/")
    f = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    for node in ast.parse(f.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}  # type: ignore[attr-defined]
    raise AssertionError(f"{module} has no __all__")


def _imports_of_clients_in(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [f"{node.lineno} {n}" for n in names if n.split(".")[0] in CLIENTS]  # type: ignore[attr-defined]
    return found


def core_imports_of_clients() -> list[str]:
    """Imports of ``undolog_server``, ``undolog_mcp`` or ``undolog_adapters`` anywhere in the core (lazy ones too)."""
    return [f"{f.relative_to(ROOT)}:{hit}" for f in sorted((ROOT / "undolog_core").rglob("*.py"))
            if "migrations" not in f.parts for hit in _imports_of_clients_in(ast.parse(f.read_text(encoding="utf-8")))]


def private_core_imports() -> list[str]:
    """What the adapters, the desk and the gateway import of the core outside its public modules and names."""
    allowed = {m: _all_of(m) for m in ("undolog_core", "undolog_core.integration")}
    found = []
    for f in _client_files():
        where = f.relative_to(ROOT)
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                pairs = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                pairs = [(node.module, a.name) for a in node.names]
            else:
                continue
            for module, name in pairs:
                if module.split(".")[0] != "undolog_core":
                    continue
                if module not in PUBLIC:
                    found.append(f"{where}:{node.lineno} {module}")
                elif name is not None and (name.startswith("_") or (module in allowed and name not in allowed[module])):
                    found.append(f"{where}:{node.lineno} {module}.{name}")
    return found


def reaches_in(tree: ast.AST) -> Counter[str]:
    """Each ``<undolog>.engine`` / ``<undolog>.store`` a module touches, with the member it reaches for (counted)."""
    found: Counter[str] = Counter()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in PRIVATE_SERVICES):
            continue
        base = node.value
        held = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
        if held in UNDOLOG_NAMES:
            up = parents.get(node)
            found[f"{node.attr}.{up.attr}" if isinstance(up, ast.Attribute) and up.value is node else node.attr] += 1
    return found


def service_reaches() -> Counter[tuple[str, str]]:
    """:func:`reaches_in` of every module of the adapters, the desk and the gateway, by (file, reach)."""
    found: Counter[tuple[str, str]] = Counter()
    for f in _client_files():
        for reach, n in reaches_in(ast.parse(f.read_text(encoding="utf-8"))).items():
            found[(str(f.relative_to(ROOT)), reach)] += n
    return found


def test_the_core_imports_none_of_the_packages_built_on_it() -> None:
    assert core_imports_of_clients() == []


def test_adapters_desk_and_gateway_import_nothing_private_of_the_core() -> None:
    found = private_core_imports()
    listed = {f"{f}:{name}" for f, name in MOVED_IMPORTS}
    assert [i for i in found if _file_and_name(i) not in listed] == []
    still = {_file_and_name(i) for i in found}
    gone = sorted(k for k in listed if k not in still)
    assert not gone, f"moved over (good): remove their entries in MOVED_IMPORTS: {gone}"


def _file_and_name(found: str) -> str:
    """``undolog_mcp/gateway.py:27 undolog_core.ToolSpec`` -> ``undolog_mcp/gateway.py:ToolSpec``."""
    where, _, what = found.partition(" ")
    return f"{where.rpartition(':')[0]}:{what.rpartition('.')[2]}"


def test_reaches_into_an_undologs_engine_or_store_are_the_listed_ones_and_only_shrink() -> None:
    found = service_reaches()
    listed = {k: n for k, (n, _) in REACHES.items()}
    new = {k: n for k, n in found.items() if n > listed.get(k, 0)}
    assert not new, f"reaches into the core's engine or store outside the integration contract: {new}"
    gone = {k: n for k, n in listed.items() if found.get(k, 0) < n}
    assert not gone, f"fewer reaches than listed (good): lower or remove their entries in REACHES: {gone}"


def test_the_layering_checks_see_what_they_look_for() -> None:
    """Not vacuous: each check finds a planted violation in a module of the shape it reads."""
    planted = ast.parse("def f(self):\n    self.undolog.engine.ensure_session('s')\n    return u.store, db.store\n")
    assert reaches_in(planted) == Counter({"engine.ensure_session": 1, "store": 1})
    assert any("undolog_server" in i for i in _imports_of_clients_in(ast.parse("def f():\n    import undolog_server.cli\n")))
    assert "Engine" not in _all_of("undolog_core") and "UndoLog" in _all_of("undolog_core")
    assert "jsonable" in _all_of("undolog_core.integration")
