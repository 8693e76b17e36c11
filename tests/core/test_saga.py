"""Rollback: LIFO order, undo keys, retries, halting, resuming, version checks, missing compensations."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from undolog_core import CompensationDescriptor, ToolTier, compensation, errors, undolog_tool
from undolog_core.storage import schema as t
from undolog_core.testing import internals

from ..support.toolkit import setup


def undo_rows(undolog):
    with internals(undolog).read() as c:
        return [r._mapping for r in c.execute(sa.select(t.undo_stack).order_by(t.undo_stack.c.undo_id))]


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    from undolog_core._saga import Saga

    monkeypatch.setattr(Saga, "backoff_seconds", 0.001)


async def test_lifo_with_undo_keys_and_result_snapshots(undolog):
    world, tools = setup(undolog)
    async with undolog.session() as s:
        await s.call(tools["send_refund_email"], user_id="u1", amount=1)
        await s.call(tools["lock_account"], user_id="u2")
        await s.call(tools["send_refund_email"], user_id="u2", amount=2)
        report = await s.rollback()
    undo = undo_rows(undolog)
    assert [st.undo_id for st in report.steps] == [undo[2]["undo_id"], undo[1]["undo_id"], undo[0]["undo_id"]]
    cancels = [d for w, d in world.calls if w in ("cancel", "unlock")]
    assert cancels[0][0] == "u2" and cancels[0][1] == f"undo-{undo[2]['undo_id']}" and cancels[0][2] == 1
    assert cancels[0][3]["user_id"] == "u2"  # the compensation saw the result snapshot
    assert cancels[1] == ("u2", f"undo-{undo[1]['undo_id']}")
    assert all(u["state"] == "compensated" for u in undo)
    assert report.complete and undolog.sessions.get(s.id).state == "rolled_back"
    again = await s.rollback()
    assert again.already_rolled_back and again.steps == []
    assert world.count("cancel") == 2  # nothing ran twice


async def test_failed_compensation_retries_halts_and_a_later_rollback_resumes(undolog):
    world, tools = setup(undolog)
    s = undolog.session()
    await s.call(tools["send_refund_email"], user_id="u1", amount=1)
    await s.call(tools["lock_account"], user_id="u2")
    await s.call(tools["send_refund_email"], user_id="u2", amount=2)
    world.fail_cancel = 3  # every retry of the newest step fails
    report = await s.rollback()
    assert not report.complete
    assert [(st.tool_name, st.outcome, st.attempts) for st in report.steps] == [
        ("send_refund_email", "compensation_failed", 3)
    ]
    rec = undolog.sessions.get(s.id)
    assert rec.state == "halted" and "mail server unreachable" in rec.halted_reason
    assert [u["state"] for u in undo_rows(undolog)] == ["armed", "armed", "compensation_failed"]
    with pytest.raises(errors.SessionHalted):
        await s.call(tools["send_refund_email"], user_id="u3", amount=1)
    report2 = undolog.rollback(s.id)  # the mail server is back
    assert [(st.tool_name, st.outcome) for st in report2.steps] == [
        ("send_refund_email", "compensated"), ("lock_account", "compensated"), ("send_refund_email", "compensated")
    ]
    assert report2.steps[0].attempts == 4  # attempts continue from where the walk stopped
    assert world.count("unlock") == 1 and world.count("cancel") == 5
    assert undolog.sessions.get(s.id).state == "rolled_back"


async def test_transient_failure_is_retried_with_the_same_key(undolog):
    world, tools = setup(undolog)
    s = undolog.session()
    await s.call(tools["send_refund_email"], user_id="u1", amount=1)
    world.fail_cancel = 1
    report = await s.rollback()
    assert report.complete and report.steps[0].attempts == 2
    keys = {d[1] for w, d in world.calls if w == "cancel"}
    assert len(keys) == 1


async def test_version_mismatch_is_not_called_and_halts(db):
    u1 = db.open()
    world, tools = setup(u1)
    s = u1.session()
    await s.call(tools["send_refund_email"], user_id="u1", amount=1)
    sid = s.id
    u1.close()
    u2 = db.open()

    @compensation("cancel_refund_email", version=2)
    def cancel_v2(ctx):
        raise AssertionError("must not be called")

    u2.register(cancel_v2)
    with pytest.raises(errors.CompensationVersionMismatch, match="version 1"):
        u2.rollback(sid)
    rec = u2.sessions.get(sid)
    assert rec.state == "halted" and "version" in rec.halted_reason


async def test_missing_compensation_changes_nothing(db):
    u1 = db.open()
    world, tools = setup(u1)
    s = u1.session()
    await s.call(tools["send_refund_email"], user_id="u1", amount=1)
    u2 = db.open()  # a process without the app loaded (a CLI, a server)
    with pytest.raises(errors.CompensationNotFound, match="--app"):
        u2.rollback(s.id)
    assert u2.sessions.get(s.id).state == "active"
    assert [u["state"] for u in undo_rows(u2)] == ["armed"]


async def test_rollback_cancels_waiting_approvals_and_reports_kept_irreversible(undolog):
    world, tools = setup(undolog)
    s = undolog.session()
    await s.call(tools["send_refund_email"], user_id="u1", amount=1)
    w = undolog.engine.intercept(s.id, "wire_transfer", {"to": "a", "cents": 1}, call_id="w")
    d = undolog.engine.intercept(s.id, "delete_user_account", {"user_id": "u2"}, call_id="d")
    undolog.approvals.approve(d.approval_request_id, approver="ana")
    await s.call(tools["delete_user_account"], user_id="u2", call_id="d")
    report = await s.rollback()
    assert undolog.approvals.get(w.approval_request_id).state == "cancelled"
    assert report.kept_irreversible and "delete_user_account" in report.kept_irreversible[0]


def test_sync_compensation_from_inside_an_event_loop(undolog):
    import asyncio

    world, tools = setup(undolog)
    s = undolog.session()
    s.call_sync(tools["lock_account"], user_id="u1")

    async def inside():
        return undolog.rollback(s.id)  # an async compensation driven from sync code under a running loop

    report = asyncio.run(inside())
    assert report.complete and world.accounts["u1"]["locked"] is False


def test_rollback_of_unknown_session(undolog):
    with pytest.raises(errors.SessionNotFound):
        undolog.rollback("nope")


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("noop_undo"))
def noop(x: int) -> int:
    return x


def test_compensation_descriptor_validation():
    with pytest.raises(errors.InvalidDeclaration):
        CompensationDescriptor.new("")
    with pytest.raises(errors.InvalidDeclaration):
        CompensationDescriptor.new("x", version=0)
