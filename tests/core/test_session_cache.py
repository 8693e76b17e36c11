"""The engine's in-memory session cache in a long-running process: an ended session's record leaves it."""

from __future__ import annotations

import pytest

from undolog_core import SessionState, errors

from .toolkit import setup


def test_ended_sessions_leave_the_session_cache(undolog):
    """A process that runs many sessions to their end keeps no record of them (each record holds its last calls'
    arguments): completed on the hot path, completed after SAFE calls only, and rolled back. Failed before: 300
    sessions left 300 records."""
    world, tools = setup(undolog)
    engine = undolog.engine
    before = len(engine._sessions)
    for i in range(100):
        with undolog.session(agent_id="bot") as s:
            s.call_sync(tools["send_refund_email"], user_id=f"u{i}", amount=5)
            s.call_sync(tools["search_knowledge_base"], query="refunds")
            s.complete()
        with undolog.session(agent_id="bot") as s:  # known only in memory until it ends
            s.call_sync(tools["search_knowledge_base"], query="refunds")
            s.complete()
        with undolog.session(agent_id="bot") as s:
            s.call_sync(tools["send_refund_email"], user_id=f"r{i}", amount=5)
            s.rollback_sync()
    assert len(engine._sessions) == before


def test_a_safe_call_after_the_end_is_still_counted(undolog):
    """The ``Session`` keeps its record after the session left the cache: a SAFE call made after ``complete()``
    still reaches the store's count when the session is left, and the session stays completed."""
    world, tools = setup(undolog)
    with undolog.session(agent_id="bot") as s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
        s.complete()
        assert undolog.engine.cached(s.id) is None
        s.call_sync(tools["search_knowledge_base"], query="refunds")
    rec = undolog.sessions.get(s.id)
    assert rec.state == SessionState.COMPLETED
    assert rec.tool_calls_total == 2


def test_an_ended_session_read_again_refuses_logged_calls(undolog):
    """Once its record is gone, a logged call on the ended session reads it from the store and is refused, as
    when the record was kept."""
    world, tools = setup(undolog)
    with undolog.session(agent_id="bot") as s:
        s.complete()
    assert undolog.engine.cached(s.id) is None
    with pytest.raises(errors.UndoLogError) as refused:
        undolog.session(session_id=s.id).call_sync(tools["send_refund_email"], user_id="u2", amount=5)
    assert "completed" in str(refused.value)
    assert world.count("send") == 0
