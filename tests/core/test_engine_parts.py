"""The engine in three parts (issue #35, step 2): the gate (``Engine``) holds the session table and the mark queue
and reaches them through their public methods, bound once under the names its callers have always used, so that
neither a caller nor the hot path sees a difference (no frame of the gate's own in between)."""

from __future__ import annotations

from undolog_core._mark_queue import MarkQueue
from undolog_core._sessions_table import SessionTable

from ..support.toolkit import setup

#: The engine's names that are the session table's own methods (what the adapters, the services and the tests call).
TABLE_NAMES = ("cached", "note_state", "trim", "needs_trim", "remember", "defer_start", "persist", "current_pins",
               "ensure_session", "try_start", "look_up_session", "session_states", "sessions_with_call",
               "session_cache", "note_safe", "note_safe_in")


def test_the_engines_session_names_are_the_tables_methods(undolog):
    """Each name is the table's bound method itself (an attribute read, then the method's own frame, as when it
    was the engine's), and the records, the pending starts and the queued marks are the collaborators' own objects,
    which the gate reads directly on the hot path."""
    engine = undolog.engine
    assert isinstance(engine.table, SessionTable) and isinstance(engine.mark_queue, MarkQueue)
    for name in TABLE_NAMES:
        bound = getattr(engine, name)
        assert bound.__self__ is engine.table and bound.__func__ is getattr(SessionTable, name), name
    assert engine.flush_marks.__self__ is engine.mark_queue
    assert engine._sessions is engine.table.records and engine._pending is engine.table.pending
    assert engine._marks is engine.mark_queue.queue and engine._flusher is engine.mark_queue.flusher
    assert engine.max_sessions == engine.table.max_sessions
    assert engine.mark_queue.hot is engine.hot is engine.table.hot  # one hot path, one pool set


def test_the_late_finish_probe_is_the_mark_queues(undolog):
    """The facade binds recovery's probe on ``engine.on_late_finish``; the mark queue, which records late finishes,
    is the one that asks it."""
    engine = undolog.engine
    assert engine.on_late_finish is not None
    assert engine.mark_queue.on_late_finish is engine.on_late_finish

    def probe(effect_id, late):
        return None

    engine.on_late_finish = probe
    assert engine.mark_queue.on_late_finish is probe


def test_a_session_through_the_parts(undolog):
    """A session's calls through the gate land in the table's record, and its end writes the table's counts and
    the queue's marks: the store has every call."""
    world, tools = setup(undolog)
    with undolog.session(agent_id="bot") as s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5)
        s.call_sync(tools["search_knowledge_base"], query="refunds")
        sid = s.id
        assert undolog.engine.table.records[sid] is undolog.engine.cached(sid)
        s.complete()
    assert not undolog.engine.mark_queue.queue
    assert undolog.sessions.get(sid).tool_calls_total == 2
