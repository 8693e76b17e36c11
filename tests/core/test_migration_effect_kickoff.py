"""Revision 0014: each effect records its kickoff (``undolog_effect_log.kickoff_id``), on a database made by 0011."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from undolog_core._decisions import kickoff_scope
from undolog_core.storage import migrate as _migrate
from undolog_core.storage.base import _MIGRATION_LOCK_KEY, Store

from ..support.toolkit import setup

pytestmark = pytest.mark.storage

PREVIOUS = "0011_due_index"


def _columns(store: Store) -> set[str]:
    with store.engine.connect() as c:
        return {col["name"] for col in sa.inspect(c).get_columns("undolog_effect_log")}


def _kickoffs(u) -> list[tuple[str, str | None]]:
    with u.store.engine.connect() as c:
        return [tuple(r) for r in c.execute(sa.text(
            "SELECT tool_name, kickoff_id FROM undolog_effect_log ORDER BY seq"))]


def test_a_database_of_the_previous_release_gains_the_column_and_keeps_its_rows(db):
    store = Store(db.url, schema=db.schema)
    try:
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target=PREVIOUS)
        if "kickoff_id" in _columns(store):
            # SQLite's 0003 rebuilds the effect log from the declared schema, the newest: the table the previous
            # release made had no such column.
            with store.engine.begin() as c:
                c.execute(sa.text("ALTER TABLE undolog_effect_log DROP COLUMN kickoff_id"))
        assert "kickoff_id" not in _columns(store)
    finally:
        store.dispose()
    u = db.open()  # upgrades to the head
    world, tools = setup(u)
    s = u.session(agent_id="old")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=1)  # outside any kickoff: NULL, hot path
    with kickoff_scope("kick-1"):
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=2)
    assert _kickoffs(u) == [("send_refund_email", None), ("send_refund_email", "kick-1")]
    u.close()

    store = Store(db.url, schema=db.schema)
    try:
        _migrate.downgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema, target=PREVIOUS)
        assert "kickoff_id" not in _columns(store)
        _migrate.upgrade(store.engine, lock_key=_MIGRATION_LOCK_KEY, schema=db.schema)  # and forward again
        assert "kickoff_id" in _columns(store)
    finally:
        store.dispose()
    u2 = db.open()
    setup(u2)
    assert [name for name, _ in _kickoffs(u2)] == ["send_refund_email"] * 2
    report = u2.session(session_id=s.id).rollback_sync(actor="test")
    assert [st.outcome for st in report.steps] == ["compensated", "compensated"]
