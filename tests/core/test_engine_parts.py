"""The engine in parts (issue #35, step 2): the router (``Engine``) holds the session table, the mark queue, the
COMPENSABLE path and the gate and reaches them through their public methods, bound once under the names its callers
have always used, so that neither a caller nor the hot path sees a difference (no frame of the engine's own in
between); the gate and the COMPENSABLE path call the session table's public methods, never callbacks."""

from __future__ import annotations

import pytest

from undolog_core import ToolTier, undolog_tool
from undolog_core._compensable import CompensablePath
from undolog_core._gate import Gate
from undolog_core._mark_queue import MarkQueue
from undolog_core._sessions_table import SessionTable
from undolog_core.errors import SessionHalted

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


#: The engine's names that are its parts' own methods: (the engine's name, the part's attribute, the part's class).
PART_NAMES = (("complete", "mark_queue", MarkQueue, "complete"),
              ("intercept_compensable", "compensable", CompensablePath, "intercept_compensable"),
              ("release", "compensable", CompensablePath, "release"),
              ("record_failure", "compensable", CompensablePath, "record_failure"),
              ("intercept_irreversible", "gate", Gate, "intercept_irreversible"))


def test_the_engines_call_names_are_its_parts_methods(undolog):
    """``complete`` (every COMPENSABLE call's last step), ``intercept_compensable`` (its first, past
    ``intercept_spec``), ``release``, ``record_failure`` and ``intercept_irreversible`` are the parts' bound methods
    themselves: an attribute read, no frame of the engine's own. The parts share the engine's table, hot path and
    leases, and the gate answers a re-issue through the COMPENSABLE path's own methods."""
    engine = undolog.engine
    for name, part, cls, method in PART_NAMES:
        bound = getattr(engine, name)
        assert bound.__self__ is getattr(engine, part), name
        assert bound.__func__ is getattr(cls, method), name
    calls, gate = engine.compensable, engine.gate
    assert calls.table is gate.table is engine.table and calls.hot is engine.hot
    assert calls._sessions is engine.table.records and calls._inflight is gate._inflight is engine.leases.inflight
    assert gate.calls is calls and calls.flush_marks.__self__ is engine.mark_queue


def test_the_gate_guards_its_writes_through_the_table(undolog, monkeypatch):
    """An IRREVERSIBLE request's write is guarded by the session table's ``guard`` (found on the table, not handed
    to the gate): a table whose guard refuses refuses the request, and nothing is written."""
    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="wipes it")
    def wipe(name: str) -> str:
        return f"wiped {name}"

    undolog.register(wipe)
    s = undolog.session()
    guarded: list[str] = []

    def refuse(conn, sc, count, *, pin):
        guarded.append(sc.session_id)
        raise SessionHalted(sc.session_id, "refused by the test")

    monkeypatch.setattr(undolog.engine.table, "guard", refuse)
    with pytest.raises(SessionHalted):
        s.call_sync(wipe, name="x", call_id="c1")
    assert guarded == [s.id]
    assert undolog.approvals.list(state="pending") == []
