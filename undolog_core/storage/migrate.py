"""Apply Alembic migrations programmatically; skip Alembic entirely when the database is already at head.

Alembic is imported only to migrate: the at-head check (every ``UndoLog.open``, every CLI command's revision check,
every gateway start) reads the version table and compares it with :data:`HEAD`, which spares a process Alembic's
import (about 0.08 s of a gateway's start-up).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from ..errors import ConfigurationError

if TYPE_CHECKING:
    from alembic.config import Config

VERSION_TABLE = "undolog_alembic_version"

# The newest revision in migrations/versions. A new revision updates it: tests/core/test_migrations.py compares it
# with the heads Alembic reads from the scripts. Stale, it would only cost time (a database at the real head would
# look behind, and Alembic would run and find nothing to do), never a skipped migration: it can name only a
# revision that exists, and every revision but the newest has a successor.
HEAD = "0015_audit_heads"


@functools.cache
def _config() -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    return cfg


def head() -> str:
    """The revision this code migrates to (:data:`HEAD`; no Alembic import)."""
    return HEAD


def alembic_heads() -> str:
    """The heads Alembic reads from the migration scripts (what :data:`HEAD` must name)."""
    from alembic.script import ScriptDirectory

    return ",".join(sorted(ScriptDirectory.from_config(_config()).get_heads()))


def current(engine: Engine) -> str | None:
    with engine.connect() as conn:
        return current_in(conn)


def current_in(conn: Connection) -> str | None:
    if not sa.inspect(conn).has_table(VERSION_TABLE):
        return None
    rows = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars().all()
    return ",".join(sorted(rows)) if rows else None


def upgrade(engine: Engine, *, lock_key: int, schema: str | None = None, target: str = "heads") -> None:
    """Bring the database to ``target`` (the newest revision unless told; tests stop at older ones)."""
    if target == "heads" and schema is None and current(engine) == head():
        return
    def step(cfg: Config) -> None:  # imports Alembic only past the at-head checks (_run's is for a schema)
        from alembic import command

        command.upgrade(cfg, target)

    _run(engine, lock_key, schema, step, skip_at_head=target == "heads")


def downgrade(engine: Engine, *, lock_key: int, target: str, schema: str | None = None) -> None:
    """Take the database back to revision ``target``, keeping its data (each revision's downgrade says how)."""
    def step(cfg: Config) -> None:
        from alembic import command

        command.downgrade(cfg, target)

    _run(engine, lock_key, schema, step, skip_at_head=False)


def _run(engine: Engine, lock_key: int, schema: str | None, step: Callable[[Config], None], *,
         skip_at_head: bool) -> None:
    with engine.connect() as conn:
        sqlite = conn.dialect.name == "sqlite"
        raw: Any = conn.connection.driver_connection
        if sqlite:
            # A revision that rebuilds a table (SQLite cannot alter a primary key) drops the old one while other
            # tables still refer to it. The pragma only takes effect outside a transaction, so it is set before
            # the migration's transaction begins; the references are checked before it commits.
            raw.execute("PRAGMA foreign_keys=OFF")
        try:
            with conn.begin():
                if not sqlite:
                    # Two processes opening a fresh database at once must not both create the schema or the
                    # tables; Alembic re-reads the version table after the lock, so the loser finds nothing to do.
                    conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({lock_key})")
                    if schema:
                        conn.exec_driver_sql(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
                        if skip_at_head and current_in(conn) == head():
                            return
                cfg = _config()
                cfg.attributes["connection"] = conn
                step(cfg)
                if sqlite:
                    broken = conn.exec_driver_sql("PRAGMA foreign_key_check").fetchall()
                    if broken:
                        raise ConfigurationError(
                            f"migration refused: {len(broken)} rows would break their references "
                            f"(first: {tuple(broken[0])}); the database was left as it was"
                        )
        finally:
            if sqlite:
                raw.execute("PRAGMA foreign_keys=ON")
