"""Apply Alembic migrations programmatically; skip Alembic entirely when the database is already at head."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from ..errors import ConfigurationError

VERSION_TABLE = "undolog_alembic_version"


@functools.cache
def _config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).parent / "migrations"))
    return cfg


@functools.cache
def head() -> str:
    heads = ScriptDirectory.from_config(_config()).get_heads()
    return ",".join(sorted(heads))


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
    _run(engine, lock_key, schema, lambda cfg: command.upgrade(cfg, target), skip_at_head=target == "heads")


def downgrade(engine: Engine, *, lock_key: int, target: str, schema: str | None = None) -> None:
    """Take the database back to revision ``target``, keeping its data (each revision's downgrade says how)."""
    _run(engine, lock_key, schema, lambda cfg: command.downgrade(cfg, target), skip_at_head=False)


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
