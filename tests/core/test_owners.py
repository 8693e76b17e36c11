"""Sessions held by the live process serving them: a rollback asked elsewhere is filed for that process and run
there, the requester waiting for its report; with the owner gone, the requester runs it and says so. Two UndoLog
instances over one real database stand for the two processes (an instance is an owner of its own). On SQLite and
PostgreSQL."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from undolog_core import UndoLog
from undolog_core._owners import RollbackStillRunning
from undolog_core.errors import InvalidSessionState

from ..support.toolkit import setup

pytestmark = pytest.mark.storage


def serve_filed(owner: UndoLog, stop: threading.Event, ran: list[str]) -> None:
    """What the gateway's owner loop does: run each rollback filed for this owner and answer with its report."""
    while not stop.wait(0.02):
        for row in owner.owners.filed():
            try:
                report = owner.saga.rollback_sync(row.session_id, actor=row.rollback_actor, reason="requested")
            except InvalidSessionState as exc:
                owner.owners.answer(row.session_id, None, exc)
            else:
                ran.append(row.session_id)
                owner.owners.answer(row.session_id, report)


def test_a_rollback_is_run_by_the_owner_and_its_report_handed_back(db: Any) -> None:
    owner, requester = db.open(), db.open()
    world, tools = setup(owner)
    setup(requester, world)
    s = owner.session(agent_id="gw")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    s.call_sync(tools["send_refund_email"], user_id="u2", amount=7)
    owner.owners.hold([s.id])
    stop, ran = threading.Event(), []  # type: ignore[var-annotated]
    runner = threading.Thread(target=serve_filed, args=(owner, stop, ran))
    runner.start()
    try:
        report = requester.rollback(s.id, actor="ana", wait=60)
    finally:
        stop.set()
        runner.join()
    assert ran == [s.id], "run by the owner, not by the requester"
    assert report.complete and report.ran_by == owner.leases.owner and not report.ran_without_live_upstream
    assert [st.outcome for st in report.steps] == ["compensated", "compensated"]
    assert world.count("cancel") == 2
    # Answered and read: the session can be filed for again (already rolled back: nothing to do, said so).
    again = requester.rollback(s.id, actor="ana", wait=0.5)
    assert again.already_rolled_back or again.complete


def test_an_owner_that_does_not_answer_in_time_keeps_the_request(db: Any) -> None:
    owner, requester = db.open(), db.open()
    world, tools = setup(owner)
    setup(requester, world)
    s = owner.session(agent_id="gw")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    owner.owners.hold([s.id])
    with pytest.raises(RollbackStillRunning) as raised:
        requester.rollback(s.id, actor="ana", wait=0.3)
    assert "goes on there" in raised.value.message and world.count("cancel") == 0
    assert [r.session_id for r in owner.owners.filed()] == [s.id]  # it is still the owner's to run


def test_with_the_owner_gone_the_requester_runs_it_and_says_so(db: Any) -> None:
    owner, requester = db.open(), db.open()
    world, tools = setup(owner)
    setup(requester, world)
    s = owner.session(agent_id="gw")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    owner.owners.hold([s.id])
    owner.owners.let_go()  # the serving process stopped
    report = requester.rollback(s.id, actor="ana", wait=5)
    assert report.complete and report.ran_without_live_upstream and report.ran_by is None
    assert world.count("cancel") == 1


def test_a_refusal_by_the_owner_reaches_the_requester(db: Any) -> None:
    owner, requester = db.open(), db.open()
    world, tools = setup(owner)
    setup(requester, world)
    s = owner.session(agent_id="gw")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    owner.owners.hold([s.id])
    owner.owners.answer(s.id, None, InvalidSessionState("call x is still running; roll back after it ends"))
    # An answer left from before is not this request's: filing clears it, and the owner's next answer counts.
    stop, ran = threading.Event(), []  # type: ignore[var-annotated]
    runner = threading.Thread(target=serve_filed, args=(owner, stop, ran))
    runner.start()
    try:
        report = requester.rollback(s.id, actor="ana", wait=60)
    finally:
        stop.set()
        runner.join()
    assert report.complete and ran == [s.id]
