"""The collection-time rule: a test that opens a store directly must say which databases it needs.

**The rule.** A test *opens a store directly* when its own code names the database layer, that is when the test
function, or any function, class or fixture defined in the test's own module (or in a ``conftest.py`` other than
``tests/conftest.py``) that it uses, transitively:

- names something imported from ``sqlalchemy``, ``sqlite3``, ``psycopg`` or ``undolog_core.storage`` (a module,
  or a function, class or constant taken from one: a local import counts too), or
- calls ``exec_driver_sql``, ``raw_connection``, ``driver_connection`` or ``open_storage``, or
- asks for the ``pg_admin`` fixture itself.

Such a test speaks SQL to the store, or builds one without ``UndoLog.open``, so how each database behaves is part
of what it checks. It must carry ``storage`` (runs on both databases), ``pg_smoke``, ``postgres_only``,
``sqlite_only`` or ``reads_store`` (a test of the gateway, an adapter or the desk that only reads the store to see
what happened: it runs on SQLite, the storage it reads being pinned on both databases by the storage tests); tests under ``tests/core``, ``tests/conformance`` and ``tests/faults`` carry ``storage`` by
their directory (they pin the store's own behaviour). A test that reaches the store only through ``UndoLog``'s
public API (the ``db`` / ``undolog`` fixtures) does not open it directly: what the database does underneath is
pinned by those storage tests, so it runs on SQLite only.

``tests/conftest.py`` (the fixtures' own machinery) and ``tests/support`` helpers are not followed: a helper
module that opens a store is judged by the tests that import it only when they name the database layer
themselves.
"""

from __future__ import annotations

import ast
import dis
import functools
import inspect
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .source_facts import facts

SQL_MODULES = ("sqlalchemy", "sqlite3", "psycopg", "undolog_core.storage")
SQL_CALLS = frozenset({"exec_driver_sql", "raw_connection", "driver_connection", "open_storage"})
MARKERS = ("storage", "pg_smoke", "postgres_only", "sqlite_only", "reads_store")


def _is_sql_module(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in SQL_MODULES)


@functools.cache
def sql_names(path: Path) -> frozenset[str]:
    """Names a module binds (anywhere in it) to the database layer, by its imports."""
    def read(tree: ast.Module) -> list[str]:
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if _is_sql_module(a.name):
                        names.add((a.asname or a.name).split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and _is_sql_module(node.module):
                names.update(a.asname or a.name for a in node.names)
        return sorted(names)

    return frozenset(facts(path, "sql_names", read))  # parsed once per module text (tests/support/source_facts.py)


def _codes(code: types.CodeType) -> Iterable[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _code_of(obj: Any) -> list[types.CodeType]:
    obj = inspect.unwrap(obj) if callable(obj) else obj
    obj = getattr(obj, "__func__", obj)
    if isinstance(obj, types.FunctionType):
        return [obj.__code__]
    if isinstance(obj, type):
        return [c for v in vars(obj).values() for c in _code_of(v)]
    return []


#: The instructions the rule reads (``LOAD_*`` and ``IMPORT_NAME`` of a name).
_READ_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "IMPORT_NAME", "LOAD_GLOBAL", "LOAD_NAME"})


@functools.cache
def _named(code: types.CodeType) -> tuple[tuple[str, str], ...]:
    """``(opname, name)`` of each instruction of ``code`` the rule reads, in order.

    Cached: every xdist worker checks every collected test, and the fixtures and helpers they share were
    disassembled again for each test (``dis`` was most of the rule's 3-4 CPU s per worker)."""
    return tuple((ins.opname, ins.argval) for ins in dis.get_instructions(code)
                 if ins.opname in _READ_OPS and isinstance(ins.argval, str))


def _opens_store(obj: Any, module: types.ModuleType, names: frozenset[str], seen: set[int]) -> str | None:
    """Why ``obj`` (a function or class of ``module``) names the database layer, or None."""
    for code in _code_of(obj):
        for c in _codes(code):
            if id(c) in seen:
                continue
            seen.add(id(c))
            # Every name the instructions below read is one of co_names: a code none of whose names can matter
            # is not disassembled (most of a test module's code; ``dis`` is the rule's cost).
            if not any(n in names or n in SQL_CALLS or _is_sql_module(n)
                       or getattr(vars(module).get(n), "__module__", None) == module.__name__
                       for n in c.co_names):
                continue
            for opname, n in _named(c):
                if opname in ("LOAD_ATTR", "LOAD_METHOD"):
                    if n in SQL_CALLS:
                        return f"calls {n} in {c.co_name}"
                    continue
                if opname == "IMPORT_NAME":
                    if _is_sql_module(n):
                        return f"imports {n} in {c.co_name}"
                    continue
                if n in names:
                    return f"names {n!r} (the database layer) in {c.co_name}"
                if n in SQL_CALLS:
                    return f"calls {n} in {c.co_name}"
                helper = vars(module).get(n)
                if helper is not None and getattr(helper, "__module__", None) == module.__name__:
                    why = _opens_store(helper, module, names, seen)
                    if why:
                        return why
    return None


#: ``_opens_store`` from a fresh start, by (the object's code, its module): a fixture or a parametrized test
#: function is shared by many tests, and its answer does not depend on which test asks.
_verdicts: dict[tuple[tuple[types.CodeType, ...], str, frozenset[str]], str | None] = {}


def _opens_store_cached(obj: Any, module: types.ModuleType, names: frozenset[str]) -> str | None:
    key = (tuple(_code_of(obj)), module.__name__, names)
    if key not in _verdicts:
        _verdicts[key] = _opens_store(obj, module, names, set())
    return _verdicts[key]


def why_it_opens_a_store(item: Any, root_conftest: Path) -> str | None:
    """Why the test ``item`` opens a store directly (the rule above), or None."""
    function = getattr(item, "function", None)
    module = getattr(item, "module", None)
    if function is None or module is None or not getattr(module, "__file__", None):
        return None
    if "pg_admin" in inspect.signature(inspect.unwrap(function)).parameters:
        return "asks for the pg_admin fixture"
    why = _opens_store_cached(function, module, sql_names(Path(module.__file__)))
    if why:
        return why
    # Fixtures defined beside the test (its module, a directory's conftest), not the root fixtures' machinery.
    for name in item.fixturenames:
        defs = item._fixtureinfo.name2fixturedefs.get(name)
        if not defs:
            continue
        func = defs[-1].func
        mod = inspect.getmodule(func)
        if mod is None or not getattr(mod, "__file__", None):
            continue
        path = Path(mod.__file__).resolve()
        tests = root_conftest.parent
        if path == root_conftest or tests not in path.parents or path.is_relative_to(tests / "support"):
            continue
        why = _opens_store_cached(func, mod, sql_names(path))
        if why:
            return f"its fixture {name!r} {why}"
    return None


def needs_marker(item: Any) -> bool:
    return not any(item.get_closest_marker(m) for m in MARKERS)
