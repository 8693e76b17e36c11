"""The adapters' fast paths (issue 13) keep their behaviour: real create_agent graphs and SK kernels, scripted models.

- ``UndoLogMiddleware`` adds no graph node: the turn check runs inside the model call that starts a turn, and still
  refuses a turn on a thread whose session another process halted, and opens ``thread#2`` after a rollback made
  elsewhere (sync and async).
- On an event loop nothing waits for the store: LangGraph's ``awrap_tool_call`` and SK's filters decide inline when a
  connection is free at once (no thread hop), and in a worker thread when it is not. The event loop's thread never
  calls the engine with ``wait=True``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import InjectedToolCallId
from langchain_core.tools import tool as as_tool
from langgraph.checkpoint.memory import InMemorySaver
from semantic_kernel import Kernel
from semantic_kernel.contents import ChatHistory
from semantic_kernel.functions import kernel_function

from examples.semantic_kernel_support.llm import ScriptedChat, auto_settings, call
from examples.support_agent.model import ScriptedChatModel
from tests.support.lg_hooks import AfterModel
from undolog_adapters.langgraph import UndoLogMiddleware, _call, _tools
from undolog_adapters.semantic_kernel import install, undolog_session
from undolog_core import CompensationDescriptor, ToolTier, compensation, errors, undolog_tool
from undolog_core.testing import internals

# The adapters' fast paths (its own step in CI with the other perf tests).
pytestmark = pytest.mark.perf

ROOT = Path(__file__).resolve().parents[2]
BOOKED: list[str] = []


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("sp_unbook"))
def sp_book(day: str) -> str:
    """Book a slot."""
    BOOKED.append(day)
    return f"booked {day}"


@undolog_tool(tier=ToolTier.SAFE)
def sp_look(day: str) -> str:
    """Look a slot up."""
    return f"{day} is free"


@compensation("sp_unbook")
def sp_unbook(ctx: Any) -> None:
    return None


SCRIPTS = {"book": [[("sp_book", {"day": "mon"})]], "look": [[("sp_look", {"day": "tue"})]]}


def _agent(undolog: Any) -> Any:
    tools = [sp_book, sp_look]
    return create_agent(ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=InMemorySaver(),
                        middleware=[UndoLogMiddleware(undolog, tools=tools, compensations=[sp_unbook])])


def _cfg() -> dict[str, Any]:
    return {"configurable": {"thread_id": "sp-" + uuid.uuid4().hex[:10]}}


def _user(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


class Spy:
    """Records every decision the engine makes: on which thread, and whether it was allowed to wait."""

    def __init__(self, engine: Any) -> None:
        self.calls: list[tuple[int, bool]] = []
        self._real = engine.intercept_spec

    def __call__(self, session_id: str, spec: Any, args: Any, call_id: Any = None, match_digest: bool = False,
                 wait: bool = True) -> Any:
        self.calls.append((threading.get_ident(), wait))
        return self._real(session_id, spec, args, call_id, match_digest, wait)


@pytest.fixture
def spy(undolog: Any, monkeypatch: pytest.MonkeyPatch) -> Spy:
    s = Spy(undolog.engine)
    monkeypatch.setattr(undolog.engine, "intercept_spec", s)
    return s


# ------------------------------------------------------------------------------------------ LangGraph


def test_the_middleware_adds_no_graph_node(undolog: Any) -> None:
    plain = create_agent(ScriptedChatModel(scripts=SCRIPTS), [sp_book, sp_look], checkpointer=InMemorySaver())
    assert set(_agent(undolog).get_graph().nodes) == set(plain.get_graph().nodes)


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_turn_on_a_thread_halted_elsewhere_is_refused(db: Any, undolog: Any, mode: str) -> None:
    """Another process (another UndoLog on the same store, whose changes this one's cache never saw) halts the
    thread's session: the next user turn is answered "on hold" and nothing runs."""
    graph, c = _agent(undolog), _cfg()
    invoke = graph.invoke if mode == "sync" else None
    out = invoke(_user("book"), c) if invoke else await graph.ainvoke(_user("book"), c)
    assert BOOKED[-1:] == ["mon"] and out["messages"][-1].content.startswith("All done")
    other = db.open(migrate=False)
    other.sessions.set_state(c["configurable"]["thread_id"], "halted", allowed=("active",))
    before = len(BOOKED)
    out = invoke(_user("book"), c) if invoke else await graph.ainvoke(_user("book"), c)
    last = out["messages"][-1]
    assert isinstance(last, AIMessage) and last.response_metadata["undolog"] == {"refused": "session_halted"}
    assert "halted" in last.content and len(BOOKED) == before


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_rollback_made_elsewhere_opens_the_next_session(db: Any, undolog: Any, mode: str) -> None:
    graph, c = _agent(undolog), _cfg()
    tid = c["configurable"]["thread_id"]
    run = (lambda v: graph.invoke(v, c)) if mode == "sync" else None
    _ = run(_user("book")) if run else await graph.ainvoke(_user("book"), c)
    other = db.open(migrate=False)
    other.register(sp_book, sp_look, sp_unbook)
    assert (await asyncio.to_thread(other.rollback, tid)).complete
    out = run(_user("book")) if run else await graph.ainvoke(_user("book"), c)
    tool_msg = [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]
    assert tool_msg.status == "success"
    assert tool_msg.response_metadata["undolog"]["session_id"] == f"{tid}#2"


async def test_an_async_call_decides_on_the_loop_when_nothing_waits(undolog: Any, spy: Spy) -> None:
    graph, c = _agent(undolog), _cfg()
    await graph.ainvoke(_user("book"), c)  # the thread's first turn: its session is created (in a thread)
    spy.calls.clear()
    loop_thread = threading.get_ident()
    out = await graph.ainvoke(_user("book"), c)
    assert [m for m in out["messages"] if isinstance(m, ToolMessage)][-1].status == "success"
    assert spy.calls == [(loop_thread, False)]  # decided once, inline: no thread hop


class HogAfterModel(AgentMiddleware):
    """Once armed, checks out every connection of the hot path's pool right after the model asked for a tool, and
    hands them back from another thread a moment later: the tool call's decision meets a busy pool."""

    def __init__(self, pool: Any) -> None:
        super().__init__()
        self.pool = pool
        self.armed = False
        self.timer: threading.Timer | None = None

    async def awrap_model_call(self, request: Any, handler: Any) -> Any:
        out = await handler(request)
        if self.armed:
            self.armed = False
            held = [self.pool.checkout() for _ in range(self.pool.size)]
            self.timer = threading.Timer(0.3, lambda: [self.pool.checkin(*x) for x in held])
            self.timer.start()
        return out


async def test_an_async_call_never_waits_on_the_loop_for_a_connection(undolog: Any, spy: Spy) -> None:
    hog = HogAfterModel(undolog.engine.hot.durable)
    tools = [sp_book, sp_look]
    graph = create_agent(ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=InMemorySaver(),
                         middleware=[hog, UndoLogMiddleware(undolog, tools=tools, compensations=[sp_unbook])])
    c = _cfg()
    await graph.ainvoke(_user("book"), c)
    spy.calls.clear()
    loop_thread = threading.get_ident()
    ticks = 0

    async def heartbeat() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beat = asyncio.create_task(heartbeat())
    hog.armed = True
    try:
        out = await graph.ainvoke(_user("book"), c)
    finally:
        if hog.timer is not None:
            hog.timer.join()
        beat.cancel()
    assert hog.timer is not None
    assert [m for m in out["messages"] if isinstance(m, ToolMessage)][-1].status == "success"
    assert (loop_thread, True) not in spy.calls  # the loop's thread never decided with wait=True
    # Tried inline (the pool was busy: nothing written), then decided in a worker thread that waited for it.
    assert spy.calls[0] == (loop_thread, False) and any(t != loop_thread and w for t, w in spy.calls)
    assert ticks > 0  # the loop ran other tasks meanwhile


# ------------------------------------------------------------------------------------------ Semantic Kernel


class Shop:
    @kernel_function(name="book", description="Book a slot.")
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("sp_unbook"))
    def book(self, day: str) -> str:
        BOOKED.append(day)
        return f"booked {day}"


async def _sk_turn(kernel: Any, sid: str, call_id: str) -> Any:
    chat = ScriptedChat(ai_model_id="scripted", turns=[[call(call_id, "shop-book", day="wed")]])
    history = ChatHistory()
    history.add_user_message("book wed")
    with undolog_session(sid):
        return await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)


async def test_sk_decides_on_the_loop_when_nothing_waits_and_in_a_thread_when_it_would(
        undolog: Any, spy: Spy) -> None:
    kernel = Kernel()
    kernel.add_plugin(Shop(), plugin_name="shop")
    install(kernel, undolog, compensations=[sp_unbook])
    sid = "sk-" + uuid.uuid4().hex[:8]
    await _sk_turn(kernel, sid, "k1")  # the session's first call creates it
    loop_thread = threading.get_ident()
    spy.calls.clear()
    reply = await _sk_turn(kernel, sid, "k2")
    assert "booked wed" in str(reply) or BOOKED[-1] == "wed"
    assert spy.calls == [(loop_thread, False)]
    pool = undolog.engine.hot.durable
    held = [pool.checkout() for _ in range(pool.size)]
    spy.calls.clear()
    timer = threading.Timer(0.3, lambda: [pool.checkin(*x) for x in held])
    timer.start()
    try:
        await _sk_turn(kernel, sid, "k3")
    finally:
        timer.join()
    assert (loop_thread, True) not in spy.calls
    assert any(t != loop_thread and w for t, w in spy.calls)
    assert [e["state"] for e in undolog.sessions.effects(sid)] == ["committed"] * 3


async def test_sk_starts_a_conversations_session_on_the_loop_when_nothing_waits(
        undolog: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new conversation's first COMPENSABLE call writes its session's row inline (wait=False), as the pre-write
    is: no worker thread in the whole call (the hop and the fsync of a durable start were about as much as UndoLog's
    whole per-call bookkeeping over its lower bound in benchmarks/agent_step.py's SK row). On SQLite the insert is
    on the fast pool (not fsynced): the pre-write right after it, before the tool runs, is the durable commit that
    makes it durable. When the insert would wait (here: every connection of its pool taken), it is made in a worker
    thread, and the loop never waits."""
    kernel = Kernel()
    kernel.add_plugin(Shop(), plugin_name="shop")
    install(kernel, undolog, compensations=[sp_unbook])
    await _sk_turn(kernel, "sk-warm-" + uuid.uuid4().hex[:8], "w1")  # connections opened, the function learnt
    hops: list[Any] = []
    real = asyncio.to_thread

    async def counted(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        hops.append(getattr(fn, "__name__", fn))
        return await real(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", counted)
    sid = "sk-" + uuid.uuid4().hex[:8]
    await _sk_turn(kernel, sid, "n1")
    assert hops == [], hops
    assert [e["state"] for e in undolog.sessions.effects(sid)] == ["committed"]
    assert undolog.sessions.get(sid).agent_id == "semantic-kernel"
    hot = undolog.engine.hot
    pool = hot.durable if internals(undolog).is_postgres else hot.fast  # where the insert goes
    held = [pool.checkout() for _ in range(pool.size)]
    timer = threading.Timer(0.3, lambda: [pool.checkin(*x) for x in held])
    sid2 = "sk-" + uuid.uuid4().hex[:8]
    timer.start()
    try:
        await _sk_turn(kernel, sid2, "n2")
    finally:
        timer.join()
    # (On PostgreSQL the session's first read, on the same pool, is the one that goes to the thread.)
    assert hops == (["look_up_session"] if internals(undolog).is_postgres else ["ensure_session"]), hops
    assert [e["state"] for e in undolog.sessions.effects(sid2)] == ["committed"]


# ------------------------------------------------------------------------------------------ LangGraph: per-call work


SEEN: list[tuple[str, Any, Any]] = []


@undolog_tool(tier=ToolTier.SAFE)
def sp_peek(day: str) -> str:
    """Look a slot up, noting what UndoLog set around the call."""
    SEEN.append(("sp_peek", _tools._CAPTURE.get(), _call._ADMIT.get()))
    return f"{day} is free"


RELEASED: list[Any] = []


@compensation("sp_release")
def sp_release(ctx: Any) -> None:
    RELEASED.append(ctx.result)


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("sp_release"))
def sp_hold(day: str) -> dict[str, str]:
    """Hold a slot, noting what UndoLog set around the call."""
    SEEN.append(("sp_hold", _tools._CAPTURE.get(), _call._ADMIT.get()))
    return {"hold": day}


def test_a_safe_call_through_the_middleware_sets_nothing_around_the_tool(undolog: Any) -> None:
    """A SAFE call keeps no raw value and nothing checks it inside the middleware (the innermost tool wrapper): the
    tool runs as it is, with no context set. A COMPENSABLE call still keeps its raw value (the stored result)."""
    SEEN.clear()
    RELEASED.clear()
    tools = [sp_peek, sp_hold]
    scripts = {"peek": [[("sp_peek", {"day": "wed"})]], "hold": [[("sp_hold", {"day": "thu"})]]}
    graph = create_agent(ScriptedChatModel(scripts=scripts), tools, checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools, compensations=[sp_release])])
    c = _cfg()
    out = graph.invoke(_user("peek"), c)
    assert [m for m in out["messages"] if isinstance(m, ToolMessage)][-1].content == "wed is free"
    out = graph.invoke(_user("hold"), c)
    msg = [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]
    assert SEEN[0] == ("sp_peek", None, None)
    assert SEEN[1][0] == "sp_hold" and SEEN[1][1] is not None and SEEN[1][2] is None
    assert msg.status == "success" and msg.response_metadata["undolog"]["tier"] == "compensable"
    assert undolog.rollback(c["configurable"]["thread_id"]).complete
    assert RELEASED == [{"hold": "thu"}]  # the compensation got the raw value, not the message's text


def test_signatures_langchain_reads_per_call_are_stored_once(undolog: Any) -> None:
    """LangChain (LangSmith's ``traceable`` around each hook, the tool's run) reads signatures on every call: the
    middleware's hooks and the capturing copy of a tool carry theirs, equal to what inspect would build."""
    for name in ("wrap_model_call", "awrap_model_call", "wrap_tool_call", "awrap_tool_call"):
        fn = getattr(UndoLogMiddleware, name)
        assert "__signature__" in vars(fn)
        assert inspect.signature(fn) == inspect.signature(fn, follow_wrapped=False).replace()
        assert list(inspect.signature(getattr(UndoLogMiddleware(undolog), name)).parameters) == ["request", "handler"]
    tool = as_tool(sp_hold)
    copy = _tools._capturing(tool, _tools._Box())
    assert copy is not tool and "__signature__" in vars(copy.func)
    assert inspect.signature(copy.func) == inspect.signature(sp_hold)


def test_hooks_langchain_wraps_are_plain_functions_and_a_subclass_keeps_its_own(undolog: Any) -> None:
    """LangSmith's ``traceable`` (around each hook) reads the hook's signature per call, which ``inspect`` rebuilds for
    a bound method: the middleware's hooks are plain functions carrying theirs (sync and async as they were). A
    subclass that overrides a hook keeps its override, and it runs."""
    mw = UndoLogMiddleware(undolog)
    for name in ("wrap_model_call", "awrap_model_call", "wrap_tool_call", "awrap_tool_call"):
        hook = getattr(mw, name)
        assert not inspect.ismethod(hook) and "__signature__" in vars(hook)
        assert inspect.iscoroutinefunction(hook) is name.startswith("a")
        assert list(inspect.signature(hook).parameters) == ["request", "handler"]
    seen: list[str] = []

    class Counting(UndoLogMiddleware):
        def wrap_tool_call(self, request: Any, handler: Any) -> Any:
            seen.append(request.tool_call["name"])
            return super().wrap_tool_call(request, handler)

    tools = [sp_peek]
    counting = Counting(undolog, tools=tools)
    assert inspect.ismethod(counting.wrap_tool_call) and not inspect.ismethod(counting.wrap_model_call)
    graph = create_agent(ScriptedChatModel(scripts={"peek": [[("sp_peek", {"day": "fri"})]]}), tools,
                         checkpointer=InMemorySaver(), middleware=[counting])
    out = graph.invoke(_user("peek"), _cfg())
    assert seen == ["sp_peek"]
    assert [m for m in out["messages"] if isinstance(m, ToolMessage)][-1].content == "fri is free"


@pytest.mark.storage
def test_a_safe_turn_checks_the_session_without_a_statement_and_writes_nothing(
    db: Any, undolog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user turn whose tool is SAFE, once the thread's session exists: the turn's session check is the only time
    the store is asked, and never the SAFE call itself: no SQLAlchemy statement, no write. On PostgreSQL the check
    is one read on the hot path's pool; on SQLite, while nothing was committed since its last read, not even that:
    the wal-index header says so (a statement lets go of the GIL, which inside a LangGraph step costs about ten times
    the read; benchmarks/agent_step.py's SAFE row counts on it)."""
    from sqlalchemy import event

    graph, c = _agent(undolog), _cfg()
    graph.invoke(_user("look"), c)  # creates the thread's session (a commit: the next check reads)
    graph.invoke(_user("look"), c)
    store, hot = undolog.engine.store, undolog.engine.hot
    statements: list[str] = []
    checkouts: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        statements.append(statement)

    for pool, name in ((hot.durable, "durable"), (hot.fast, "fast")):
        real = pool.checkout
        monkeypatch.setattr(pool, "checkout", lambda *, wait=True, real=real, name=name: (
            checkouts.append(name), real(wait=wait))[1])
    reads: list[list[str]] = []
    real_states = hot.session_states
    monkeypatch.setattr(hot, "session_states", lambda ids, *, wait=True: (reads.append(list(ids)),
                                                                          real_states(ids, wait=wait))[1])
    engines = {store.engine, store.fast}
    for e in engines:
        event.listen(e, "before_cursor_execute", count)
    try:
        out = graph.invoke(_user("look"), c)
    finally:
        for e in engines:
            event.remove(e, "before_cursor_execute", count)
    assert [m for m in out["messages"] if isinstance(m, ToolMessage)][-1].content == "tue is free"
    assert statements == []
    assert len(reads) == 1  # the turn's check, nothing else
    assert checkouts == ([] if db.kind == "sqlite" else ["durable"])
    # The counters are live: a COMPENSABLE turn is seen writing.
    graph.invoke(_user("book"), c)
    assert len(checkouts) >= 2


def _trace_durable_checkouts(hot: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement run on the hot path's durable connections checked out from now on."""
    traced: list[str] = []
    real = hot.durable.checkout

    def checkout(*, wait: bool = True) -> Any:
        conn, gen = real(wait=wait)
        conn.set_trace_callback(traced.append)
        return conn, gen

    monkeypatch.setattr(hot.durable, "checkout", checkout)
    return traced


def _trace_pool(pool: Any, monkeypatch: pytest.MonkeyPatch, into: list[str] | None = None) -> list[str]:
    """Every statement run on ``pool``'s connections checked out from now on (appended to ``into`` if given)."""
    traced: list[str] = [] if into is None else into
    real = pool.checkout

    def checkout(*, wait: bool = True) -> Any:
        conn, gen = real(wait=wait)
        conn.set_trace_callback(traced.append)
        return conn, gen

    monkeypatch.setattr(pool, "checkout", checkout)
    return traced


@pytest.mark.sqlite_only
def test_a_threads_first_turn_starts_its_session_without_waiting_for_the_disk(
    db: Any, undolog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: the thread's session is started on its first turn by one insert committed with ``synchronous=NORMAL``
    (written to the WAL, not fsynced: the fsync was most of what UndoLog added to a SAFE agent step), on the fast
    pool's connection, in one statement: the durable pool's connections are never switched (a switch to NORMAL and
    back was two statements more, each letting go of the GIL inside the step). The row is committed all the same:
    another connection reads it at once (a halt made elsewhere finds it, see the test below), and the next durable
    commit fsyncs the WAL with it."""
    import sqlite3

    graph, c = _agent(undolog), _cfg()
    graph.invoke(_user("look"), _cfg())  # another thread first: the pool's connections are opened and warm
    hot = undolog.engine.hot
    traced = _trace_durable_checkouts(hot, monkeypatch)
    fast = _trace_pool(hot.fast, monkeypatch)
    out = graph.invoke(_user("look"), c)
    assert out["messages"][-2].content == "tue is free"
    tid = c["configurable"]["thread_id"]
    assert traced == [], traced  # nothing on the durable connections: no read, no switch
    assert len(fast) == 1 and fast[0].startswith("INSERT INTO undolog_sessions"), fast
    for conn, _gen in hot.fast._idle:
        conn.set_trace_callback(None)
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL: the commit did not wait for the disk
    for conn, _gen in hot.durable._idle:  # every write of the durable pool waits for the disk
        conn.set_trace_callback(None)
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2
    path = undolog.engine.store.engine.url.database
    other = sqlite3.connect(path)
    try:
        assert other.execute("SELECT state FROM undolog_sessions WHERE session_id = ?", (tid,)).fetchall() == [
            ("active",)]
    finally:
        other.close()
    # A session started by anything else (here: the core's own) keeps its fsynced start, on the durable pool.
    traced.clear()
    fast.clear()
    undolog.engine.ensure_session("sp-core-" + uuid.uuid4().hex[:8], agent_id="core", fresh=True)
    assert any(s.startswith("INSERT INTO undolog_sessions") for s in traced) and fast == [], (traced, fast)


@pytest.mark.sqlite_only
def test_a_threads_second_turn_checks_its_session_without_a_statement(
    db: Any, undolog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: the insert that starts a thread on its first turn is what the second turn's check would read (the
    session active, its next one absent, both in that statement), so while nothing else commits the second turn
    issues no statement at all, as every later SAFE turn: one statement a thread, not two. A commit made elsewhere
    after the first turn (here a halt, by another connection) is still seen by the second turn."""
    import sqlite3

    graph = _agent(undolog)
    graph.invoke(_user("look"), _cfg())  # the pools' connections opened and warm
    hot = undolog.engine.hot
    traced = _trace_durable_checkouts(hot, monkeypatch)
    fast = _trace_pool(hot.fast, monkeypatch)
    c = _cfg()
    graph.invoke(_user("look"), c)
    assert traced + fast, "the first turn starts the thread's session"
    traced.clear()
    fast.clear()
    out = graph.invoke(_user("look"), c)
    assert out["messages"][-2].content == "tue is free"
    assert traced == [] and fast == [], (traced, fast)
    # A halt made elsewhere after a thread's first turn: its second turn reads, and is refused.
    c = _cfg()
    graph.invoke(_user("look"), c)
    other = sqlite3.connect(undolog.engine.store.engine.url.database)
    try:
        other.execute("UPDATE undolog_sessions SET state = 'halted', halted_reason = 'elsewhere' WHERE session_id = ?",
                      (c["configurable"]["thread_id"],))
        other.commit()
    finally:
        other.close()
    out = graph.invoke(_user("look"), c)
    last = out["messages"][-1]
    assert isinstance(last, AIMessage) and last.response_metadata["undolog"] == {"refused": "session_halted"}
    assert not isinstance(out["messages"][-2], ToolMessage)  # the turn ran nothing


@pytest.mark.sqlite_only
def test_a_new_threads_first_turn_inserts_its_session_without_reading_first(
    db: Any, undolog: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite: a thread this process has not seen is started by one insert that writes nothing when the thread's
    session or its next one exists, with no read of the store before it (inside a step that read costs as much as
    the insert). A thread whose next session exists, even without its first one (made elsewhere), is not started
    over: its turn finds that session, and is refused when it is halted."""
    graph = _agent(undolog)
    graph.invoke(_user("look"), _cfg())  # the pool's connections opened and warm
    hot = undolog.engine.hot
    traced = _trace_durable_checkouts(hot, monkeypatch)
    _trace_pool(hot.fast, monkeypatch, into=traced)  # in one list: the order of both pools' statements
    c = _cfg()
    graph.invoke(_user("look"), c)
    statements = [t for t in traced if not t.startswith("PRAGMA")]
    assert statements and statements[0].startswith("INSERT INTO undolog_sessions"), traced
    assert undolog.sessions.get(c["configurable"]["thread_id"]).agent_id == "langchain-agent"
    # Elsewhere: the thread's second session exists (halted), its first one does not.
    tid = "sp-" + uuid.uuid4().hex[:10]
    undolog.engine.ensure_session(f"{tid}#2", agent_id="elsewhere")
    undolog.sessions.set_state(f"{tid}#2", "halted", allowed=("active",))
    out = graph.invoke(_user("look"), {"configurable": {"thread_id": tid}})
    last = out["messages"][-1]
    assert isinstance(last, AIMessage) and last.response_metadata["undolog"] == {"refused": "session_halted"}
    assert not isinstance(out["messages"][-2], ToolMessage)  # the turn ran nothing
    with pytest.raises(Exception, match=tid):
        undolog.sessions.get(tid)  # not started over next to its later session


_ELSEWHERE = """
import os, sys
from undolog_core import UndoLog
u = UndoLog.open(os.environ["UNDOLOG_DATABASE_URL"], schema=os.environ.get("UNDOLOG_SCHEMA"), migrate=False)
if sys.argv[2] == "halt":
    u.sessions.set_state(sys.argv[1], "halted", allowed=("active",))
else:
    assert u.rollback(sys.argv[1]).complete
u.close()
"""


@pytest.mark.parametrize("action", ["halt", "rollback"])
def test_a_halt_or_rollback_by_another_process_stops_the_next_safe_turn(db: Any, undolog: Any, action: str) -> None:
    """The turn's check answered from memory (SQLite, nothing committed since its last read) still sees what another
    process commits: after SAFE turns that read nothing, a halt made in another process refuses the next turn, and
    a rollback there moves it to the thread's next session."""
    graph, c = _agent(undolog), _cfg()
    tid = c["configurable"]["thread_id"]
    for _ in range(3):
        graph.invoke(_user("look"), c)
    env = {**os.environ, **db.env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _ELSEWHERE, tid, action], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = graph.invoke(_user("look"), c)
    last = out["messages"][-1]
    if action == "halt":
        assert isinstance(last, AIMessage) and last.response_metadata["undolog"] == {"refused": "session_halted"}
        assert not isinstance(out["messages"][-2], ToolMessage)  # the turn ran nothing
    else:
        assert out["messages"][-2].content == "tue is free"
        assert undolog.sessions.get(f"{tid}#2").state == "active"


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_safe_call_on_the_middlewares_short_path_keeps_its_checks(undolog: Any, mode: str) -> None:
    """The middleware decides a SAFE call of a known thread on a short path (``_Guard.safe``): its arguments are still
    validated (bad ones are refused and the tool does not run), coerced ones reach the tool as validated, and every
    call is counted for the session."""
    SEEN.clear()
    tools = [sp_peek]
    scripts = {"bad": [[("sp_peek", {})]], "good": [[("sp_peek", {"day": "fri"})]]}
    graph = create_agent(ScriptedChatModel(scripts=scripts), tools, checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools)])
    c = _cfg()

    async def turn(text: str) -> Any:
        return graph.invoke(_user(text), c) if mode == "sync" else await graph.ainvoke(_user(text), c)

    await turn("good")  # the thread's session is made: the next calls take the short path
    out = await turn("bad")
    msg = [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]
    assert msg.status == "error" and msg.response_metadata["undolog"] == {"refused": "arguments_invalid"}
    assert len(SEEN) == 1  # the tool did not run
    out = await turn("good")
    assert [m for m in out["messages"] if isinstance(m, ToolMessage)][-1].content == "fri is free"
    assert len(SEEN) == 2
    undolog.engine.flush_counts(c["configurable"]["thread_id"])
    assert undolog.sessions.get(c["configurable"]["thread_id"]).tool_calls_total == 2


def _counting_hooks(mw: Any, frames: list[str], on: list[bool], *, everything: bool = False) -> None:
    """Wrap ``mw``'s sync hooks (before the agent is built: it takes them then) so that, while ``on[0]``, every
    Python frame of UndoLog's own code run inside them, in the thread that runs the hook (the tool's hook runs in
    ToolNode's worker thread), is recorded in ``frames``. ``everything``: the frames of the libraries UndoLog's code
    calls too (pydantic, LangGraph), named ``module:function``."""
    import functools

    from undolog_adapters.langgraph._middleware import _HOOK_SIGNATURE

    roots = ("",) if everything else (str(ROOT / "undolog_core"), str(ROOT / "undolog_adapters"))

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            code = frame.f_code
            frames.append(f"{Path(code.co_filename).stem}:{code.co_name}" if everything else code.co_name)

    def counted(inner: Any, request: Any, handler: Any) -> Any:
        if not on[0]:
            return inner(request, handler)

        def unprofiled(req: Any) -> Any:  # LangChain's part of the step (the model, the tool) is not counted
            sys.setprofile(None)
            try:
                return handler(req)
            finally:
                sys.setprofile(profile)

        sys.setprofile(profile)
        try:
            return inner(request, unprofiled)
        finally:
            sys.setprofile(None)

    for name in ("wrap_model_call", "wrap_tool_call"):
        hook: Any = functools.partial(counted, getattr(mw, name))
        hook.__name__, hook.__signature__ = name, _HOOK_SIGNATURE
        setattr(mw, name, hook)


def _third_turn_frames(undolog: Any, text: str, *, everything: bool = False) -> tuple[Any, list[str], Any]:
    """A thread's third turn asking ``text`` (the session known, the tool warm): its result, the Python frames counted
    under UndoLog's hooks (``_counting_hooks``), and the thread's config."""
    tools = [sp_book, sp_look]
    mw = UndoLogMiddleware(undolog, tools=tools, compensations=[sp_unbook])
    frames: list[str] = []
    on = [False]
    _counting_hooks(mw, frames, on, everything=everything)
    graph = create_agent(ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=InMemorySaver(), middleware=[mw])
    c = _cfg()
    for _ in range(2):
        graph.invoke(_user(text), c)
    on[0] = True
    return graph.invoke(_user(text), c), frames, c


@pytest.mark.sqlite_only
def test_a_later_safe_turn_runs_few_python_frames_of_undologs_own(undolog: Any) -> None:
    """A later SAFE turn of a thread (its session known, nothing committed since: no statement) runs UndoLog's hooks
    with the fewest Python frames: inside an agent step each costs 1-3 us (its code and data are cold), and they
    were most of what UndoLog added above a pass-through middleware with the same hooks. Counted, not timed: the
    frames of undolog_core and undolog_adapters code under the two model calls' and the tool call's hooks."""
    out, frames, c = _third_turn_frames(undolog, "look")
    assert out["messages"][-2].content == "tue is free"
    # The turn: wrap_model_call, base_id, turn, the engine's and the hot path's session_states; the model's answer:
    # wrap_model_call; the SAFE call: wrap_tool_call, run_known, _known (run_safe and safe_decision before),
    # base_id, decide_safe, check_id, validate, values, note_safe_in, run_safe_sync and the lambda running the tool.
    # (There were 22.)
    assert len(frames) <= 17, frames


@pytest.mark.sqlite_only
def test_a_later_compensable_turn_runs_few_python_frames(undolog: Any) -> None:
    """A later COMPENSABLE turn of a thread runs UndoLog's hooks with few Python frames, the library code they call
    included: the tool's message is marked in place when ToolNode built it for this call (a pydantic ``model_copy``
    of it cost some 10 us of every step), the request to run is built without ``ToolCallRequest.override`` (its
    ``dataclasses.replace`` runs a deprecation-checking ``__setattr__`` per field: some 10 us more), and the hot
    path reads the wal-index header around each durable write inline. The call of a thread whose session is known
    is decided by the engine's ``intercept_spec`` straight (``_known``), and run and marked by ``run_known`` itself:
    not through ``run_logged``'s ``_decide``/``prepare`` (with ``head``, the driver's ``decide`` and its look-up by
    name), ``runnable``, ``_settled``/``committed``, a ``_Run`` or a ``_Box.__init__``; the turn's check reads the run's
    config and walks the step's own commits (the pre-write and the mark) in its own frames. Counted, not timed: every
    Python frame under the two model calls' and the tool call's hooks, LangChain's own part (the model, the tool)
    left out."""
    out, frames, c = _third_turn_frames(undolog, "book", everything=True)
    msg = out["messages"][-2]
    assert msg.content == "booked mon" and msg.response_metadata["undolog"]["tier"] == "compensable"
    assert msg.response_metadata["undolog"]["session_id"] == c["configurable"]["thread_id"]
    assert not {"main:model_copy", "tool_node:override", "sqlite:stamp"} & set(frames), frames
    gone = {"_call:run_logged", "_call:_decide", "_guard:prepare", "_guard:head", "_driver:decide", "_guard:runnable",
            "_call:_settled", "_guard:committed", "_tools:__init__", "<string>:__init__", "_call:_hooks",
            "config:get_config", "sqlite:_only_own_since"}
    assert not gone & set(frames), frames
    # 106 before the message was marked in place (model_copy, 5 frames with copy's), override (9, its __setattr__
    # per field), the tier's .value (2) and the header's reads around both writes (6); then 86 before the short
    # path: run_safe and safe_decision (2) then run_logged's path (21: _decide, _pending, undolog_name, _config_of,
    # prepare, base_id, head, _chain, the driver's decide, spec and spec_for, a second check_id, _Run's __init__,
    # runnable, _Box's __init__, _capturing, _admit, _hooks, _unadmit, _settled, committed, _remember), less _known
    # (1); the turn's check: LangGraph's get_config and the walk over the step's own commits inline (2); the
    # engine's lease-loop start and execute_now inline (3).
    assert len(frames) <= 58, frames


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_compensable_call_on_the_middlewares_short_path_keeps_its_checks(undolog: Any, mode: str) -> None:
    """A COMPENSABLE call of a known thread (``_known``, ``run_known``) is still validated (bad arguments are refused,
    nothing runs and nothing is stored), stores the tool's raw value as its result (what compensations read), marks
    the message, and a call id LangGraph re-issues after the call ran gets its stored result without running again."""
    SEEN.clear()
    RELEASED.clear()
    tools = [sp_hold]
    scripts = {"bad": [[("sp_hold", {})]], "good": [[("sp_hold", {"day": "wed"})]]}
    mw = UndoLogMiddleware(undolog, tools=tools, compensations=[sp_release])
    again: list[Any] = []
    real = mw.wrap_tool_call, mw.awrap_tool_call

    def twice(request: Any, handler: Any) -> Any:  # LangGraph re-running the task: the same call id again
        out = real[0](request, handler)
        again.append(real[0](request, handler))
        return out

    async def atwice(request: Any, handler: Any) -> Any:
        out = await real[1](request, handler)
        again.append(await real[1](request, handler))
        return out

    from undolog_adapters.langgraph._middleware import _HOOK_SIGNATURE

    for name, fn in (("wrap_tool_call", twice), ("awrap_tool_call", atwice)):
        fn.__signature__ = _HOOK_SIGNATURE  # type: ignore[attr-defined]
        setattr(mw, name, fn)
    graph = create_agent(ScriptedChatModel(scripts=scripts), tools, checkpointer=InMemorySaver(), middleware=[mw])
    c = _cfg()
    sid = c["configurable"]["thread_id"]

    async def turn(text: str) -> Any:
        out = graph.invoke(_user(text), c) if mode == "sync" else await graph.ainvoke(_user(text), c)
        return [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]

    await turn("good")  # the thread's session is made: the next calls take the short path
    SEEN.clear()
    again.clear()
    msg = await turn("bad")
    assert msg.status == "error" and msg.response_metadata["undolog"] == {"refused": "arguments_invalid"}
    assert SEEN == [] and len(undolog.sessions.effects(sid)) == 1  # not run, nothing stored
    msg = await turn("good")
    assert msg.status == "success" and [s[0] for s in SEEN] == ["sp_hold"]  # ran once
    mark = msg.response_metadata["undolog"]
    assert mark["tier"] == "compensable" and mark["session_id"] == sid
    effects = undolog.sessions.effects(sid)
    assert [e["state"] for e in effects] == ["committed", "committed"]
    assert effects[-1]["effect_id"] == mark["effect_id"] and effects[-1]["call_id"] == msg.tool_call_id
    assert undolog.saga.undo_plan(sid)  # armed: the raw value is what its compensation gets
    assert undolog.rollback(sid).complete
    assert RELEASED == [{"hold": "wed"}] * 2  # the tools' raw values, not the messages' text
    replayed = again[-1]
    assert replayed.response_metadata["undolog"] == {"effect_id": mark["effect_id"], "replayed": True}
    assert [s[0] for s in SEEN] == ["sp_hold"]  # the re-issued call did not run the tool again


async def _book_twice_hooked(undolog: Any, hook: AfterModel, mode: str) -> tuple[str, ToolMessage]:
    """Two "book" turns of a new thread (``invoke`` or ``ainvoke``), ``hook`` armed for the second: (the thread id,
    the second turn's tool message)."""
    tools = [sp_book, sp_look]
    graph = create_agent(ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=InMemorySaver(),
                         middleware=[hook, UndoLogMiddleware(undolog, tools=tools, compensations=[sp_unbook])])
    c = _cfg()

    async def turn() -> ToolMessage:
        out = graph.invoke(_user("book"), c) if mode == "sync" else await graph.ainvoke(_user("book"), c)
        return [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]

    await turn()
    hook.armed = True
    msg = await turn()
    assert not hook.armed
    return c["configurable"]["thread_id"], msg


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_session_closed_after_the_turns_check_moves_a_new_compensable_call_on(
    db: Any, undolog: Any, mode: str
) -> None:
    """The thread's session is rolled back elsewhere between the turn's check and the tool call (the call of a known
    thread, on the short path): nothing is written for it there, and the call, part of a new plan, runs in the
    thread's next session (as ``prepare`` decides it), never in the closed one."""
    other = db.open(migrate=False)
    other.register(sp_book, sp_look, sp_unbook)

    def roll_back(tid: str) -> None:
        assert other.rollback(tid).complete

    hook = AfterModel(roll_back)  # another process's rollback, right after the model asked for a tool
    tid, msg = await _book_twice_hooked(undolog, hook, mode)
    assert msg.status == "success" and msg.response_metadata["undolog"]["session_id"] == f"{tid}#2"
    assert undolog.sessions.get(tid).state == "rolled_back"
    assert [e["state"] for e in undolog.sessions.effects(tid)] == ["compensated"]  # nothing new in the closed one
    assert [e["call_id"] for e in undolog.sessions.effects(f"{tid}#2")] == [msg.tool_call_id]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("next_state", ["active", "halted"])
async def test_a_next_session_opened_elsewhere_is_the_threads_not_a_third(
    db: Any, undolog: Any, mode: str, next_state: str
) -> None:
    """Between the turn's check and the tool call another process rolls the thread's session back AND opens the
    thread's next one (its own turn), maybe halting it. The call here must land in that session, or be refused by its
    halt: never open a third session beside it (two live sessions of one thread, the halt stepped around)."""
    other = db.open(migrate=False)
    other.register(sp_book, sp_look, sp_unbook)

    def roll_back_and_open_next(tid: str) -> None:
        assert other.rollback(tid).complete
        other.engine.ensure_session(f"{tid}#2")
        if next_state == "halted":
            other.sessions.set_state(f"{tid}#2", "halted", allowed=("active",))

    hook = AfterModel(roll_back_and_open_next)
    ran_before = len(BOOKED)
    tid, msg = await _book_twice_hooked(undolog, hook, mode)
    with pytest.raises(errors.SessionNotFound):
        undolog.sessions.get(f"{tid}#3")
    effects = [e["call_id"] for e in undolog.sessions.effects(f"{tid}#2")]
    if next_state == "active":
        assert msg.status == "success" and msg.response_metadata["undolog"]["session_id"] == f"{tid}#2"
        assert effects == [msg.tool_call_id]
        assert len(BOOKED) == ran_before + 2
    else:
        assert msg.status == "error" and msg.response_metadata["undolog"]["refused"] == "session_halted", msg
        assert effects == []
        assert len(BOOKED) == ran_before + 1  # the first turn's call only


OWN_MESSAGES: list[ToolMessage] = []


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("sp_unbook"))
def sp_reply(day: str, call_id_: Annotated[str, InjectedToolCallId]) -> ToolMessage:
    """Book a slot, answering with a message of the tool's own."""
    msg = ToolMessage(content=f"booked {day}", tool_call_id=call_id_, response_metadata={"by": "tool"})
    OWN_MESSAGES.append(msg)
    return msg


def test_the_effect_mark_goes_into_toolnodes_message_and_never_into_the_tools_own(undolog: Any) -> None:
    """The effect's ``response_metadata["undolog"]`` is set in place only on a message ToolNode built for the call;
    a message the tool returned itself is copied, the tool's object left as it was (its own metadata kept)."""
    OWN_MESSAGES.clear()
    tools = [sp_book, sp_reply]
    scripts = {"book": [[("sp_book", {"day": "mon"})]], "reply": [[("sp_reply", {"day": "sat"})]]}
    graph = create_agent(ScriptedChatModel(scripts=scripts), tools, checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools, compensations=[sp_unbook])])
    c = _cfg()
    sid = c["configurable"]["thread_id"]
    built = graph.invoke(_user("book"), c)["messages"][-2]
    assert built.response_metadata["undolog"]["session_id"] == sid
    own = graph.invoke(_user("reply"), c)["messages"][-2]
    assert own.content == "booked sat" and own.response_metadata["by"] == "tool"
    assert own.response_metadata["undolog"]["tier"] == "compensable"
    assert own.response_metadata["undolog"]["effect_id"] != built.response_metadata["undolog"]["effect_id"]
    assert [m.response_metadata for m in OWN_MESSAGES] == [{"by": "tool"}]
