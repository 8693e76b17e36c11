"""The audit table refuses changes on both databases, and the hash chain catches edits made behind the triggers."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from undolog_core import ApprovalPending
from undolog_core.testing import internals

from ..support.toolkit import setup


async def _some_events(u):
    world, tools = setup(u)
    s = u.session()
    with pytest.raises(ApprovalPending) as p:
        await s.call(tools["delete_user_account"], user_id="u1", call_id="c")
    u.approvals.approve(p.value.approval_request_id, approver="ana")
    u.policy.set(actor="admin", context_calls=4)
    return p.value.approval_request_id


@pytest.mark.parametrize("stmt", [
    "UPDATE undolog_approval_events SET actor = 'mallory'",
    "DELETE FROM undolog_approval_events",
])
async def test_update_and_delete_refused_by_the_database(undolog, stmt):
    await _some_events(undolog)
    with pytest.raises(sa.exc.DBAPIError, match="append-only"):
        with internals(undolog).write() as c:
            c.exec_driver_sql(stmt)
    assert undolog.verify_audit().ok


async def test_truncate_refused_on_postgres_and_unavailable_on_sqlite(undolog):
    await _some_events(undolog)
    if internals(undolog).is_postgres:
        with pytest.raises(sa.exc.DBAPIError, match="append-only"):
            with internals(undolog).write() as c:
                c.exec_driver_sql("TRUNCATE undolog_approval_events")
    else:
        with pytest.raises(sa.exc.OperationalError):  # SQLite has no TRUNCATE statement at all
            with internals(undolog).write() as c:
                c.exec_driver_sql("TRUNCATE undolog_approval_events")
    assert undolog.verify_audit().ok


async def test_chain_catches_an_edit_behind_the_triggers(undolog):
    rid = await _some_events(undolog)
    report = undolog.verify_audit()
    assert report.ok and report.events_checked == 3
    with internals(undolog).write() as c:
        if internals(undolog).is_postgres:
            c.exec_driver_sql("ALTER TABLE undolog_approval_events DISABLE TRIGGER USER")
        else:
            c.exec_driver_sql("DROP TRIGGER undolog_events_no_update")
        c.exec_driver_sql(f"UPDATE undolog_approval_events SET actor = 'mallory' WHERE approval_request_id = '{rid}' AND action = 'approve'")
    bad = undolog.verify_audit()
    assert not bad.ok and bad.first_bad_event_id == 2 and "hash" in bad.problem


async def test_chain_catches_a_deleted_tail(undolog):
    await _some_events(undolog)
    with internals(undolog).write() as c:
        if internals(undolog).is_postgres:
            c.exec_driver_sql("ALTER TABLE undolog_approval_events DISABLE TRIGGER USER")
        else:
            c.exec_driver_sql("DROP TRIGGER undolog_events_no_delete")
        c.exec_driver_sql("DELETE FROM undolog_approval_events WHERE event_id = 3")
    assert not undolog.verify_audit().ok


async def test_outbox_written_with_each_approval_event(undolog):
    from undolog_core.storage import schema as t

    await _some_events(undolog)
    with internals(undolog).read() as c:
        kinds = c.execute(sa.select(t.outbox.c.event_type).order_by(t.outbox.c.outbox_id)).scalars().all()
    assert kinds == ["approval.requested", "approval.decided"]
