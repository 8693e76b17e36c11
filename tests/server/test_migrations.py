"""The server's tables are a migration branch of its own; databases migrated before the move keep their data.

Before the desk became ``undolog_server``, the core's revision ``0002_server`` created its tables, so every
database at the old head (``0003_effect_seq``) already holds them, with keys, targets and deliveries. Now
``0002_server`` is a frozen no-op and the server's branch (``s0001_server_tables``, its own version table)
creates each table only when it is missing.
"""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core.cli import app
from undolog_core.storage import migrate as _migrate
from undolog_core.storage.base import _MIGRATION_LOCK_KEY, Store
from undolog_server import create_app
from undolog_server import storage as server_store
from undolog_server.state import ServerSettings
from undolog_server.storage import ServerStore

from ..test_cli import CLEAN_ENV, runner

# Every open runs the real migrations (these tests are about them); the database layer is what they check.
pytestmark = [pytest.mark.real_migrations, pytest.mark.storage]

SERVER_TABLES = {
    "undolog_api_keys", "undolog_approver_groups", "undolog_webhook_targets", "undolog_notification_policies",
    "undolog_webhook_deliveries", "undolog_escalations", "undolog_server_settings",
}


def _tables(store: Any) -> set[str]:
    with store.engine.connect() as c:
        return set(sa.inspect(c).get_table_names())


def _database_at_the_old_head(db: Any) -> None:
    """What the old chain (0001_core → 0002_server creating the desk's tables → 0003_effect_seq) left behind.

    The old 0002's tables are exactly the server store's table definitions (they mirrored the migration).
    """
    store = Store(db.url, schema=db.schema)
    try:
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0001_core")
        with store.engine.begin() as conn:
            server_store.metadata.create_all(
                conn, tables=[t for t in server_store.metadata.sorted_tables if t.name in SERVER_TABLES])
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target="0003_effect_seq")
        assert _migrate.current(store.engine) == "0003_effect_seq"
        assert server_store.migration_current(store) is None
        # A desk that ran on it: keys, a webhook target and a delivery.
        old = ServerStore(store)
        old.create_key("ops", ["admin"])
        old.create_target("pager", "http://127.0.0.1:9/hook", secret="s3cret")
        with store.tx() as conn:
            old.enqueue(conn, "outbox:1", "approval.requested", "{}", [old.targets()[0].target_id])
    finally:
        store.dispose()


def test_a_database_at_the_old_head_keeps_the_desks_data(db: Any) -> None:
    _database_at_the_old_head(db)
    u = db.open()
    try:
        store = ServerStore(u.store)
        assert [k.name for k in store.list_keys()] == ["ops"]
        _, token = store.create_key("ana", ["approver"])
        create_app(u, settings=ServerSettings(background=False))  # the server migrates its branch at start
        assert server_store.migration_current(u.store) == server_store.migration_head()
        assert [k.name for k in store.list_keys()] == ["ops", "ana"]
        assert store.authenticate(token) is not None
        assert [(t.name, t.secret) for t in store.targets()] == [("pager", "s3cret")]
        assert [d["event_id"] for d in store.deliveries()] == ["outbox:1"]
        assert not store.migrate()  # at head: nothing to do
    finally:
        u.close()


def test_a_new_database_gets_the_desks_tables_from_the_server_only(db: Any) -> None:
    u = db.open()
    try:
        assert not _tables(u.store) & SERVER_TABLES  # the core's migrations no longer create them
        store = ServerStore(u.store)
        assert store.migrate()
        assert SERVER_TABLES <= _tables(u.store)
        assert not store.migrate()
        key, token = store.create_key("ops", ["admin"])
        assert store.authenticate(token) == key
    finally:
        u.close()


def test_db_upgrade_server_creates_the_desks_tables(db: Any) -> None:
    base = ["--db", db.url] + (["--schema", db.schema] if db.schema else [])
    first = runner.invoke(app, [*base, "db", "upgrade", "--server"], env=CLEAN_ENV, catch_exceptions=False)
    assert first.exit_code == 0, first.output
    assert f"upgraded the server's tables from none to {server_store.migration_head()}" in first.output
    again = runner.invoke(app, [*base, "db", "upgrade", "--server"], env=CLEAN_ENV, catch_exceptions=False)
    assert again.exit_code == 0 and f"already at their latest revision ({server_store.migration_head()})" in again.output
    store = Store(db.url, schema=db.schema)
    try:
        assert SERVER_TABLES <= _tables(store)
    finally:
        store.dispose()
