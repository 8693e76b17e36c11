"""Shared fixtures: every test gets a fresh database (a SQLite file, or a fresh PostgreSQL schema).

Which database is chosen by UNDOLOG_TEST_DB=sqlite|postgres; on postgres an unreachable server is an
error, never a skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from undolog_core import UndoLog

TEST_DB = os.environ.get("UNDOLOG_TEST_DB", "sqlite").lower()
PG_URL = os.environ.get("UNDOLOG_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

if TEST_DB not in ("sqlite", "postgres"):
    raise RuntimeError(f"UNDOLOG_TEST_DB must be sqlite or postgres, got {TEST_DB!r}")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the tests marked `long` (soak and repeated-chaos versions)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "long: a soak or chaos version that runs only with --long")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect (not skip) what this run does not cover: `long` tests without --long, `postgres_only` tests
    on the SQLite run (CI runs the suite on PostgreSQL too, where they run) and `sqlite_only` tests on the
    PostgreSQL run. A deselected test is reported as deselected, never as a skip that could hide a test from CI."""
    keep: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    run_long = config.getoption("--long")
    for item in items:
        if (item.get_closest_marker("long") and not run_long) or (
            item.get_closest_marker("postgres_only") and TEST_DB != "postgres"
        ) or (item.get_closest_marker("sqlite_only") and TEST_DB != "sqlite"):
            dropped.append(item)
        else:
            keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@dataclass
class Db:
    kind: str
    url: str
    schema: str | None
    opened: list[UndoLog] = field(default_factory=list)

    def open(self, **kw: Any) -> UndoLog:
        u = UndoLog.open(self.url, schema=self.schema, **kw)
        self.opened.append(u)
        return u

    @property
    def env(self) -> dict[str, str]:
        env = {"UNDOLOG_DATABASE_URL": self.url}
        if self.schema:
            env["UNDOLOG_SCHEMA"] = self.schema
        return env


def _pg_admin() -> Any:
    import sqlalchemy as sa

    return sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT", pool_size=1)


@pytest.fixture(scope="session")
def pg_admin() -> Iterator[Any]:
    if TEST_DB != "postgres":
        yield None
        return
    eng = _pg_admin()
    with eng.connect() as c:  # fails loudly when PostgreSQL is down
        c.exec_driver_sql("SELECT 1")
    yield eng
    eng.dispose()


@pytest.fixture
def db(tmp_path: Path, pg_admin: Any) -> Iterator[Db]:
    if TEST_DB == "postgres":
        schema = "t_" + uuid.uuid4().hex[:16]
        d = Db("postgres", PG_URL, schema)
    else:
        d = Db("sqlite", f"sqlite:///{tmp_path / 'undolog.db'}", None)
    yield d
    for u in d.opened:
        try:
            u.close()
        except Exception:
            pass
    if TEST_DB == "postgres":
        with pg_admin.connect() as c:
            c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{d.schema}" CASCADE')


@pytest.fixture
def undolog(db: Db) -> UndoLog:
    return db.open()
