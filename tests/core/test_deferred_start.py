"""A session started with a minted id is written by its first logged call's own pre-write statement on
PostgreSQL (a statement and a durable commit fewer per session; tests/test_overhead_statements.py counts them),
and every reader in the process finds it all the same: the session service, the saga, the adapters' state check,
``complete()`` after SAFE calls only, a gated first call, ``close()``. Another process finds it from its first
logged call on, as it finds a framework adapter's session. On SQLite the start is written at once, as before:
every assertion here holds on both databases, except the one about another process before the first call."""

from __future__ import annotations

from typing import Any

import pytest

from undolog_core import ApprovalPending, SessionState, errors
from undolog_core.testing import internals

from ..support.toolkit import setup


def _in_store(db: Any, session_id: str) -> bool:
    """Whether another process (another UndoLog on the same store, no shared memory) finds the session."""
    other = db.open()
    try:
        other.sessions.get(session_id)
        return True
    except errors.SessionNotFound:
        return False


def test_a_started_session_is_found_by_every_reader_here_with_its_values(db: Any) -> None:
    u = db.open()
    world, tools = setup(u)
    s = u.session(agent_id="bot", created_by="ana", on_failure="continue")
    deferred = internals(u).is_postgres
    assert _in_store(db, s.id) is not deferred  # no row yet on PostgreSQL: nothing logged
    rec = u.sessions.get(s.id)  # this process's reader writes it first
    assert (rec.agent_id, rec.created_by, rec.on_failure, rec.state) == ("bot", "ana", "continue", "active")
    assert rec.pinned_revisions == u.engine.current_pins()
    assert _in_store(db, s.id)
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)  # the row exists: the ordinary pre-write
    s.complete()
    rec = u.sessions.get(s.id)
    assert (rec.state, rec.tool_calls_total, rec.created_by) == ("completed", 1, "ana")


def test_the_first_logged_call_writes_the_session_with_the_safe_calls_before_it(db: Any) -> None:
    u = db.open()
    world, tools = setup(u)
    s = u.session(agent_id="bot", created_by="ana", on_failure="continue")
    s.call_sync(tools["search_knowledge_base"], query="refunds")
    s.call_sync(tools["search_knowledge_base"], query="policy")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    assert u.engine.cached(s.id).persisted
    assert _in_store(db, s.id)  # another process finds it from the first logged call on
    other = db.open()
    rec = other.sessions.get(s.id)
    assert (rec.agent_id, rec.created_by, rec.on_failure, rec.state, rec.tool_calls_total) == (
        "bot", "ana", "continue", "active", 2)  # the SAFE calls counted before it; this call rides with the next
    assert [e["tool_name"] for e in other.sessions.effects(s.id)] == ["send_refund_email"]
    s.complete()
    assert other.sessions.get(s.id).tool_calls_total == 3


def test_list_state_rollback_and_complete_find_a_session_with_no_logged_call(db: Any) -> None:
    u = db.open()
    world, tools = setup(u)
    listed = u.session(agent_id="listed")
    assert listed.id in [r.session_id for r in u.sessions.list(agent_id="listed")]
    assert u.session(agent_id="state").state == "active"
    rolled = u.session(agent_id="rolled")
    report = u.rollback(rolled.id)
    assert report.complete and u.sessions.get(rolled.id).state == SessionState.ROLLED_BACK
    safe_only = u.session(agent_id="safe", created_by="ana")
    safe_only.call_sync(tools["search_knowledge_base"], query="refunds")
    safe_only.complete()
    rec = u.sessions.get(safe_only.id)
    assert (rec.state, rec.tool_calls_total, rec.created_by) == ("completed", 1, "ana")
    states = u.engine.session_states([listed.id, u.session(agent_id="checked").id])
    assert len(states) == 2 and {st for st, _ in states.values()} == {"active"}


def test_leaving_a_session_or_closing_the_process_writes_it(db: Any) -> None:
    u = db.open()
    setup(u)
    with u.session(agent_id="left") as left:
        pass
    assert _in_store(db, left.id)
    kept = u.session(agent_id="kept", on_failure="continue")
    u.close()
    other = db.open()
    assert (other.sessions.get(kept.id).agent_id, other.sessions.get(kept.id).on_failure) == ("kept", "continue")


def test_a_gated_first_call_writes_the_session_with_its_values(db: Any) -> None:
    u = db.open()
    world, tools = setup(u)
    s = u.session(agent_id="gated", created_by="ana", on_failure="continue")
    with pytest.raises(ApprovalPending):
        s.call_sync(tools["delete_user_account"], user_id="u1", call_id="c1")
    rec = db.open().sessions.get(s.id)
    assert (rec.agent_id, rec.created_by, rec.on_failure, rec.state) == ("gated", "ana", "continue",
                                                                         "awaiting_approval")


def test_a_session_left_by_an_error_after_its_first_call_is_rolled_back(db: Any) -> None:
    u = db.open()
    world, tools = setup(u)
    s = u.session(agent_id="bot")
    with pytest.raises(ZeroDivisionError), s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
        raise ZeroDivisionError("the agent failed")
    assert u.sessions.get(s.id).state == SessionState.ROLLED_BACK and world.count("cancel") == 1


def test_a_first_call_that_fails_rolls_back_the_session_it_wrote(db: Any) -> None:
    u = db.open()
    world, tools = setup(u)
    world.fail_send = 1
    s = u.session(agent_id="bot")
    with pytest.raises(RuntimeError, match="smtp exploded"):
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
    rec = db.open().sessions.get(s.id)
    assert rec.state == SessionState.ROLLED_BACK and rec.agent_id == "bot"
