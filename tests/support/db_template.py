"""Migrate once per test session, then give each test a copy.

Running every Alembic migration on each test's fresh database cost 0.19-0.6 s per open (in ``core/test_tiers.py``
6.0 s of 10.4 s); copying an already-migrated database costs about a hundredth of that. The template is built at
session start by running the real migrations (never a checked-in file: other branches add migrations), so a copy
is exactly what ``UndoLog.open`` would have made.

- SQLite: the migrated file is copied (after every connection closed, so the WAL is checkpointed into it).
- PostgreSQL: a schema is cloned by replaying, inside one transaction on a fresh schema, the statements the real
  migration sent to the template schema (the template's name replaced by the new one). A template database
  (``CREATE DATABASE ... TEMPLATE``) was the other way; it would give each test a database of its own (another
  URL), and creating and dropping databases writes whole catalogs and checkpoints on a server seven people share.
  ``tests/core/test_db_template.py`` proves the clone has the same tables, columns, indexes, constraints, triggers,
  views, functions and rows as a real migration.

Two flavours: ``core`` (what ``UndoLog.open`` makes) and ``server`` (the desk's own tables too, as
``create_app`` makes them).
"""

from __future__ import annotations

import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

FLAVOURS = ("core", "server")


def _migrate(url: str, schema: str | None, flavour: str) -> None:
    """Run the real migrations, and nothing else: ``UndoLog.open`` also writes (its owner's row), which a copy
    must not inherit."""
    from undolog_core.storage import open_storage

    store = open_storage(url, schema=schema, pool_size=1)
    try:
        store.migrate()
        if flavour == "server":
            from undolog_server.storage import ServerStore

            ServerStore(store).migrate()
    finally:
        store.dispose()


@dataclass
class SQLiteTemplates:
    """Migrated SQLite files, one per flavour, copied into each test's path on its first open."""

    root: Path
    files: dict[str, Path] = field(default_factory=dict)
    #: Tests open databases from several threads: one thread builds a template, the others wait for it.
    lock: Any = field(default_factory=threading.RLock)

    def file(self, flavour: str) -> Path:
        with self.lock:
            return self._file(flavour)

    def _file(self, flavour: str) -> Path:
        if flavour not in self.files:
            path = self.root / f"template-{flavour}.db"
            _migrate(f"sqlite:///{path}", None, flavour)
            for suffix in ("-wal", "-shm", "-journal"):
                # The last close checkpoints the WAL into the file; a leftover would mean the copy misses rows.
                leftover = Path(str(path) + suffix)
                if leftover.exists() and leftover.stat().st_size:
                    raise RuntimeError(f"template {path} kept a non-empty {suffix} file after closing")
            self.files[flavour] = path
        return self.files[flavour]

    def copy_to(self, target: Path, flavour: str) -> bool:
        """Copy the template to ``target`` unless a database is already there; True when copied."""
        with self.lock:  # threads opening one database at once: the first copies, the others find it there
            if target.exists():
                return False
            shutil.copyfile(self.file(flavour), target)
            return True


@dataclass(frozen=True)
class Statement:
    sql: str
    params: Any
    many: bool


class _Recorder:
    """Records what a migration sends to PostgreSQL, so it can be replayed on another schema.

    It listens on every engine (the migration makes its own), so it keeps only the statements of the thread that
    migrates: another thread's statements meanwhile (a background thread of an UndoLog still open, another
    recording) would otherwise be replayed into every test's schema.
    """

    def __init__(self) -> None:
        self.statements: list[Statement] = []
        self.thread = threading.get_ident()

    def __call__(self, conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
                 executemany: bool) -> None:
        if threading.get_ident() == self.thread:
            self.statements.append(Statement(statement, parameters, executemany))


def _substitute(value: Any, old: str, new: str) -> Any:
    if isinstance(value, str):
        return value.replace(old, new)
    if isinstance(value, dict):
        return {k: _substitute(v, old, new) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_substitute(v, old, new) for v in value)
    return value


def _replayable(statements: list[Statement]) -> list[Statement]:
    """What a replay must send, in as few round trips as it can.

    Dropped: advisory locks (they serialise concurrent migrations; a replay into its own fresh schema needs none,
    and taking them would make parallel workers wait on each other) and Alembic's and SQLAlchemy's reads of the
    catalog (``SELECT pg_catalog...``: they change nothing; a ``SELECT setval(...)`` does, and is kept).
    Consecutive statements without parameters are joined into one (psycopg sends a statement without parameters
    as it is, several at once included).
    """
    kept: list[Statement] = []
    for s in statements:
        sql = s.sql.strip()
        if "pg_advisory" in sql or sql.startswith("SELECT pg_catalog."):
            continue
        if not s.params and kept and not kept[-1].params:
            kept[-1] = Statement(kept[-1].sql + ";\n" + sql, None, False)
        else:
            kept.append(Statement(sql, s.params, s.many))
    return kept


@dataclass
class PostgresTemplates:
    """Schemas migrated for real once per flavour, and the statements that made them, replayed per test."""

    url: str
    admin: Any
    #: Replays run in a transaction, so not on ``admin`` (an AUTOCOMMIT engine).
    engine: Any = None
    scripts: dict[str, tuple[str, list[Statement]]] = field(default_factory=dict)
    #: One recording at a time: two threads recording at once each recorded both migrations (CI: a worker's every
    #: later clone replayed the other template's statements, unrenamed, and failed "no schema has been selected").
    lock: Any = field(default_factory=threading.RLock)

    def script(self, flavour: str) -> tuple[str, list[Statement]]:
        with self.lock:
            return self._script(flavour)

    def _script(self, flavour: str) -> tuple[str, list[Statement]]:
        if flavour not in self.scripts:
            # A name no table, column or value contains, so replacing it touches only the schema's name.
            name = "tpl_" + uuid.uuid4().hex
            recorder = _Recorder()
            sa.event.listen(sa.engine.Engine, "before_cursor_execute", recorder)
            try:
                _migrate(self.url, name, flavour)
            finally:
                sa.event.remove(sa.engine.Engine, "before_cursor_execute", recorder)
                with self.admin.connect() as c:
                    c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')
            self.scripts[flavour] = (name, _replayable(recorder.statements))
        return self.scripts[flavour]

    def clone_to(self, schema: str, flavour: str) -> bool:
        """Make ``schema`` a migrated copy unless it exists already; True when made."""
        # One clone at a time in this process: threads opening the same database at once (its first opens) must
        # find it made by the first, not each make it (two CREATE SCHEMA of one name collide).
        with self.lock:
            return self._clone_to(schema, flavour)

    def _clone_to(self, schema: str, flavour: str) -> bool:
        name, statements = self.script(flavour)
        if self.engine is None:
            self.engine = sa.create_engine(self.url, pool_size=1, max_overflow=0)
        with self.engine.begin() as conn:
            if conn.exec_driver_sql("SELECT 1 FROM pg_namespace WHERE nspname = %(n)s", {"n": schema}).first():
                return False
            # A test's schema need not survive a crash of the server: its commit does not wait for the disk.
            conn.exec_driver_sql(f'SET LOCAL search_path TO "{schema}"; SET LOCAL synchronous_commit = off')
            for s in statements:
                sql = s.sql.replace(name, schema)
                if s.params:
                    conn.exec_driver_sql(sql, _substitute(s.params, name, schema))
                else:
                    conn.exec_driver_sql(sql)
        return True

    def dispose(self) -> None:
        if self.engine is not None:
            self.engine.dispose()
