"""A long-lived process keeps a bounded memory however many threads and conversations it serves.

LangGraph threads never end (the adapter never completes a thread's session) and Semantic Kernel conversations are
never closed: before the bound, the engine kept a record per session (with its last calls' arguments) and the
LangGraph guard an entry per thread, for the life of the process. With ``UndoLog(max_sessions=...)`` both stay within
the bound, counted (records, entries) and measured (tracemalloc bytes allocated by UndoLog's own code), and what was
only in memory still reaches the store: every SAFE call is in its session's ``tool_calls_total``.

Real ``create_agent`` graphs and SK kernels with the repo's scripted models, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import tracemalloc
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from semantic_kernel import Kernel
from semantic_kernel.contents import ChatHistory
from semantic_kernel.functions import kernel_function

from examples.semantic_kernel_support.llm import ScriptedChat, auto_settings, call
from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_adapters.semantic_kernel import install, undolog_session
from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool
from undolog_core.testing import internals

CAP = 40
# Threads (conversations) served, each a new one: first without tracing (tracemalloc triples a step's cost), then
# WARM more traced, then THREADS more, over which the bytes still allocated are measured.
UNTRACED, WARM, THREADS = 1500, 100, 400
TOTAL = UNTRACED + WARM + THREADS
# What the process may hold more after THREADS more threads: before the bound it held ~1.8 KB more per thread
# (730 KB over 400; SQLite), after it a few KB in all (the store's and the frameworks' caches settling).
SLACK_BYTES = 64 * 1024


@undolog_tool(tier=ToolTier.SAFE)
def mb_look(day: str) -> str:
    """Look a slot up."""
    return f"{day} is free"


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("mb_unbook"))
def mb_book(day: str) -> str:
    """Book a slot."""
    return f"booked {day}"


@compensation("mb_unbook")
def mb_unbook(ctx: Any) -> None:
    return None


SCRIPTS = {"look": [[("mb_look", {"day": "tue"})]], "book": [[("mb_book", {"day": "mon"})]]}


def _user(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def _measured(serve: Callable[[int], None]) -> tuple[int, int]:
    """(bytes allocated and still held after the warm-up, after THREADS more), serving one thread per ``serve(i)``."""
    for i in range(UNTRACED):
        serve(i)
    # Log records are kept by pytest's capture for the report (Semantic Kernel logs each function call at INFO, which
    # an earlier test may have turned on): the harness's memory, not the process's. None are made while measuring.
    logging.disable(logging.CRITICAL)
    tracemalloc.start(1)
    try:
        for i in range(UNTRACED, UNTRACED + WARM):
            serve(i)
        gc.collect()
        first = tracemalloc.get_traced_memory()[0]
        for i in range(UNTRACED + WARM, TOTAL):
            serve(i)
        gc.collect()
        return first, tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)


def _calls_counted(undolog: Any, agent_id: str) -> list[int]:
    internals(undolog).flush()  # what close() writes: the records still kept
    return [r.tool_calls_total for r in undolog.store.sessions.list_sessions(agent_id=agent_id, limit=100_000)]


@pytest.mark.perf  # a load test (2,000 agent runs in one process): CI's slow step
@pytest.mark.timeout(600)  # 2,000 agent runs on a shared 2-core machine
def test_langgraph_threads_keep_memory_within_the_bound(db: Any) -> None:
    """2,000 threads, each a SAFE call on its first turn, with ``max_sessions=40``: the engine keeps at most 40
    records and the middleware at most 40 thread entries, the bytes held do not grow with the threads, and every
    thread's call is counted in the store. Failed before: 2,000 records and entries, +730 KB over the last 400."""
    undolog = db.open(max_sessions=CAP)
    saver = InMemorySaver()
    mw = UndoLogMiddleware(undolog, tools=[mb_look, mb_book], compensations=[mb_unbook], agent_id="mem-lg")
    graph = create_agent(ScriptedChatModel(scripts=SCRIPTS), [mb_look, mb_book], checkpointer=saver, middleware=[mw])
    run = uuid.uuid4().hex[:8]

    def serve(i: int) -> None:
        out = graph.invoke(_user("look"), {"configurable": {"thread_id": f"mem-{run}-{i}"}})
        assert [m.content for m in out["messages"] if isinstance(m, ToolMessage)] == ["tue is free"]
        # LangGraph's own memory of the thread goes: what is measured is UndoLog's.
        for kept in (saver.storage, saver.writes, saver.blobs):
            kept.clear()

    first, last = _measured(serve)
    assert len(undolog.engine._sessions) <= CAP
    assert len(mw._undolog_guard.heads) <= CAP
    assert last - first < SLACK_BYTES, (first, last)
    counted = _calls_counted(undolog, "mem-lg")
    assert len(counted) == TOTAL and set(counted) == {1}


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_a_thread_evicted_and_halted_elsewhere_is_refused_and_a_rolled_back_one_moves_on(db: Any,
                                                                                               mode: str) -> None:
    """A thread whose record and guard entry were evicted (80 newer threads, ``max_sessions=20``) behaves as before:
    halted by another process, its next turn is refused and nothing runs; rolled back, its next turn opens
    ``thread#2``; a SAFE call in it still counts. Its calls made before the eviction are all in the store's count."""
    undolog = db.open(max_sessions=20)
    saver = InMemorySaver()
    mw = UndoLogMiddleware(undolog, tools=[mb_look, mb_book], compensations=[mb_unbook], agent_id="mem-ev")
    graph = create_agent(ScriptedChatModel(scripts=SCRIPTS), [mb_look, mb_book], checkpointer=saver, middleware=[mw])
    run = uuid.uuid4().hex[:8]

    async def invoke(text: str, thread: str) -> Any:
        cfg = {"configurable": {"thread_id": thread}}
        return graph.invoke(_user(text), cfg) if mode == "sync" else await graph.ainvoke(_user(text), cfg)

    halted, rolled = f"h-{run}", f"r-{run}"
    for t in (halted, rolled):
        await invoke("look", t)
        await invoke("book", t)
    for i in range(80):
        await invoke("look", f"other-{run}-{i}")
    assert undolog.engine.cached(halted) is None and halted not in mw._undolog_guard.heads
    assert undolog.store.sessions.get_session(halted).tool_calls_total == 2  # written before the eviction
    other = db.open(migrate=False)
    other.register_compensation(mb_unbook)
    other.sessions.set_state(halted, "halted", allowed=("active",))
    other.rollback(rolled)
    out = await invoke("book", halted)
    last = out["messages"][-1]
    assert isinstance(last, AIMessage) and last.response_metadata["undolog"] == {"refused": "session_halted"}
    assert [e["tool_name"] for e in undolog.sessions.effects(halted)] == ["mb_book"]
    out = await invoke("book", rolled)
    msg = [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]
    assert msg.status == "success" and msg.response_metadata["undolog"]["session_id"] == f"{rolled}#2"
    assert undolog.sessions.get(rolled).state == "rolled_back"
    for i in range(80):  # the rolled-back thread's record and entry evicted in turn
        await invoke("look", f"more-{run}-{i}")
    out = await invoke("look", rolled)  # a SAFE call in thread#2, after its eviction
    assert [m.content for m in out["messages"] if isinstance(m, ToolMessage)][-1] == "tue is free"
    internals(undolog).flush()
    assert undolog.store.sessions.get_session(f"{rolled}#2").tool_calls_total == 2


# ------------------------------------------------------------------------------------------ Semantic Kernel


class Desk:
    @kernel_function(name="look", description="Look a slot up.")
    @undolog_tool(tier=ToolTier.SAFE)
    def look(self, day: str) -> str:
        return f"{day} is free"


@pytest.mark.perf  # a load test (2,000 conversations in one process): CI's slow step
@pytest.mark.timeout(600)
def test_sk_conversations_keep_memory_within_the_bound(db: Any) -> None:
    """2,000 SK conversations of one SAFE call each (known only in memory until their count is written) with
    ``max_sessions=40``: at most 40 records kept, the filter's own map within the bound, UndoLog's bytes flat, and
    every conversation's call in the store's count (written when its record was evicted)."""
    undolog = db.open(max_sessions=CAP)
    kernel = Kernel()
    kernel.add_plugin(Desk(), plugin_name="desk")
    f = install(kernel, undolog, agent_id="mem-sk")
    run = uuid.uuid4().hex[:8]
    loop = asyncio.new_event_loop()

    async def turn(i: int) -> None:
        chat = ScriptedChat(ai_model_id="scripted", turns=[[call(f"c{i}", "desk-look", day="fri")]])
        history = ChatHistory()
        history.add_user_message("look fri")
        with undolog_session(f"sk-{run}-{i}"):
            reply = await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
        assert reply is not None

    try:
        first, last = _measured(lambda i: loop.run_until_complete(turn(i)))
    finally:
        loop.close()
    assert len(undolog.engine._sessions) <= CAP
    assert len(f._seen) <= CAP
    assert last - first < SLACK_BYTES, (first, last)
    counted = _calls_counted(undolog, "mem-sk")
    assert len(counted) == TOTAL and set(counted) == {1}
