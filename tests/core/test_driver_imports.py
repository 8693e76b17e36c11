"""No product module imports psycopg (the [postgres] extra) when it is imported: a SQLite-only process (every
``undolog`` CLI command, a gateway, ``undolog mcp connect``, which MCP clients start once per session) is spared
the driver's import. SQLAlchemy loads psycopg itself when an engine opens a ``postgresql+psycopg`` URL, and the
pool's map from driver errors to ours looks psycopg up in ``sys.modules`` (a psycopg error exists only in a
process that loaded psycopg). Checked on the source (no subprocess: what the check saves, it would not spend).
"""

from __future__ import annotations

import ast
import sqlite3
from pathlib import Path

import undolog_core
from undolog_core.storage.pool import is_unavailable

ROOT = Path(undolog_core.__file__).resolve().parent.parent
PACKAGES = ("undolog_core", "undolog_adapters", "undolog_server", "undolog_mcp")


def _module_level_imports(tree: ast.Module) -> set[str]:
    """The modules a file imports when it is imported: its top level, and the bodies of its top-level ``try``
    and ``if`` blocks (an ``if TYPE_CHECKING:`` import is not run, but none of psycopg belongs there either)."""
    found: set[str] = set()
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.If):
            todo += node.body + node.orelse
    return found


def test_no_product_module_imports_psycopg_at_import_time() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            imports = _module_level_imports(ast.parse(path.read_text(encoding="utf-8")))
            if any(name == "psycopg" or name.startswith("psycopg.") for name in imports):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"these import psycopg when imported (import it inside the function that needs it): " \
                          f"{offenders}"


def test_sqlite_errors_are_still_told_apart_from_mistakes() -> None:
    assert is_unavailable(sqlite3.OperationalError("database is locked"))
    assert not is_unavailable(sqlite3.OperationalError("no such table: nowhere"))
