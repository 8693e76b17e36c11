"""The engine's in-memory session cache in a long-running process: an ended session's record leaves it."""

from __future__ import annotations

import time

import pytest

from undolog_core import SessionState, errors
from undolog_core.testing import internals

from ..support.toolkit import setup


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


# -- the bound on session records (UndoLog(max_sessions=...)) -------------------------------------------------------


def _fill(u, n: int, prefix: str = "fill") -> None:
    """``n`` new sessions through a path that may write (a session resumed by id): the oldest records go."""
    for i in range(n):
        u.session(session_id=f"{prefix}-{i}", agent_id="filler")


def test_records_stay_within_the_bound_and_every_call_reaches_the_store(db):
    """300 sessions left open (never completed, their ``Session`` dropped), each with SAFE calls and a COMPENSABLE
    call whose counts are only in memory, with ``max_sessions=10``: never more than 10 records, and the store's count
    of every session equals the calls made in it. Failed before: 300 records."""
    u = db.open(max_sessions=10)
    world, tools = setup(u)
    for i in range(300):
        s = u.session(session_id=f"open-{i}", agent_id="bound")
        s.call_sync(tools["search_knowledge_base"], query="a")
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=i)
        s.call_sync(tools["search_knowledge_base"], query="b")
        del s
        assert len(u.engine._sessions) <= 10
    internals(u).flush()
    counted = {r.session_id: r.tool_calls_total for r in u.store.sessions.list_sessions(agent_id="bound", limit=1000)}
    assert len(counted) == 300 and set(counted.values()) == {3}
    assert world.count("send") == 300


def test_safe_only_sessions_are_written_by_the_background_trimmer(db):
    """Sessions known only from SAFE calls (no row, no write on their path): past the bound their counts are written
    by the background trimmer (rows created with their calls), then their records go."""
    u = db.open(max_sessions=10)
    world, tools = setup(u)
    for i in range(60):
        u.driver.call_sync(f"safe-only-{i}", tools["search_knowledge_base"], {"query": "x"})
    for _ in range(400):  # waits for the trimmer's pass (every 50 ms); asserts no duration
        if not u.engine.needs_trim():
            break
        time.sleep(0.05)
    assert len(u.engine._sessions) <= 10
    internals(u).flush()
    rows = [u.store.sessions.get_session(f"safe-only-{i}") for i in range(60)]
    assert all(r is not None and r.tool_calls_total == 1 and r.state == "active" for r in rows)


def test_an_evicted_session_halted_elsewhere_refuses_logged_calls(db):
    u = db.open(max_sessions=5)
    world, tools = setup(u)
    s = u.session(session_id="to-halt", agent_id="bot")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=1)
    del s
    _fill(u, 10)
    assert u.engine.cached("to-halt") is None
    db.open(migrate=False).sessions.set_state("to-halt", "halted", allowed=("active",))
    with pytest.raises(errors.SessionHalted):
        u.session(session_id="to-halt").call_sync(tools["send_refund_email"], user_id="u2", amount=2)
    assert world.count("send") == 1
    assert u.store.sessions.get_session("to-halt").tool_calls_total == 1


def test_an_evicted_session_still_refuses_a_safe_call_of_a_changed_contract(db):
    """The pin of a SAFE tool holds after eviction: the adapters' SAFE path (``decide_safe``, no I/O for a known
    session) reads an evicted session again instead of taking it for a new one with no pins."""
    from undolog_core import ToolTier, undolog_tool

    @undolog_tool(tier=ToolTier.SAFE)
    def peek(day: str) -> str:
        return day

    @undolog_tool(tier=ToolTier.SAFE, reason="now also reads the calendar of others")
    def peek_v2(day: str) -> str:
        return day

    u = db.open(max_sessions=5)
    [v1] = u.register(peek)
    u.session(session_id="pinned", agent_id="bot")
    u.engine.decide_safe("pinned", v1, {"day": "mon"})
    _fill(u, 10)
    assert u.engine.cached("pinned") is None
    [v2] = u.register((peek_v2, peek_v2.__undolog_spec__, {"name": "peek"}))
    assert v2.revision == 2
    with pytest.raises(errors.ContractChanged):
        u.engine.decide_safe("pinned", v2, {"day": "tue"})
    internals(u).flush()
    assert u.store.sessions.get_session("pinned").tool_calls_total == 1  # the refused call is not counted


def test_a_deferred_start_evicted_before_its_first_write_is_written_with_its_own_values(db):
    """A session started here whose row waits for its first logged call (PostgreSQL) is written with the values it
    was started with when its record is evicted first; its ``Session`` goes on in it, and its calls are counted."""
    u = db.open(max_sessions=5)
    world, tools = setup(u)
    s = u.session(agent_id="deferred", created_by="ana", on_failure="continue")
    started = u.engine.cached(s.id)
    created_at = (started.start or {}).get("created_at")
    s.call_sync(tools["search_knowledge_base"], query="before")
    _fill(u, 10)
    assert s.id not in u.engine._sessions and s.id not in u.engine._pending
    row = u.store.sessions.get_session(s.id)
    assert (row.agent_id, row.created_by, row.on_failure, row.state, row.tool_calls_total) == (
        "deferred", "ana", "continue", "active", 1)
    if created_at is not None:  # deferred (PostgreSQL): the row keeps the start's own time
        assert abs(row.created_at.timestamp() - created_at) < 1e-3
    with s:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=3)
        s.call_sync(tools["search_knowledge_base"], query="after")
    assert u.store.sessions.get_session(s.id).tool_calls_total == 3
    assert [e["tool_name"] for e in u.sessions.effects(s.id)] == ["send_refund_email"]


def test_a_held_record_comes_back_as_the_same_object(db):
    """A ``Session`` (or an adapter's map) holding an evicted record counts into it: the engine puts that same
    record back when the session is used again, so the counts are never split between two records."""
    u = db.open(max_sessions=5)
    world, tools = setup(u)
    s = u.session(session_id="held", agent_id="bot")
    held = u.engine.cached("held")
    _fill(u, 10)
    assert u.engine.cached("held") is held  # put back
    _fill(u, 10, "more")
    s.call_sync(tools["search_knowledge_base"], query="q")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=3)
    assert u.engine._sessions["held"] is held
    with s:
        pass
    assert u.store.sessions.get_session("held").tool_calls_total == 2


def test_a_call_counted_while_its_record_is_evicted_is_not_lost(db):
    """The race: a caller holds the record, the engine evicts it (clean at that moment), the caller counts into it.
    The caller sees the eviction after counting and puts the record back, with its count."""
    u = db.open(max_sessions=5)
    world, tools = setup(u)
    sc = u.engine.ensure_session("racing", agent_id="bot")
    assert u.engine._evict(sc)
    spec = u.tool_spec("search_knowledge_base")
    u.engine.note_safe_in(sc, spec, {"query": "q"})
    assert u.engine._sessions["racing"] is sc and not sc.gone
    internals(u).flush()
    assert u.store.sessions.get_session("racing").tool_calls_total == 1


def test_max_sessions_is_checked(db):
    with pytest.raises(errors.ConfigurationError, match="max_sessions"):
        db.open(max_sessions=0)


def test_rollback_locks_are_not_kept(undolog):
    """The saga's one-walk-per-session lock lives only while a rollback of that session runs or waits. Failed
    before: one lock kept per session ever rolled back."""
    world, tools = setup(undolog)
    for i in range(50):
        with undolog.session(agent_id="bot") as s:
            s.call_sync(tools["send_refund_email"], user_id="u1", amount=i)
            s.rollback_sync()
    assert undolog.saga._locks == {}
