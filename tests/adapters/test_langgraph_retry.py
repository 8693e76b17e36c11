"""UndoLog's own retry policy beside LangChain's ``ToolRetryMiddleware`` (issue 12, item 3), with the real middleware.

``ToolRetryMiddleware`` listed before ``UndoLogMiddleware`` retries what reaches it as an exception: a SAFE tool's
error (UndoLog passes it on untouched). A COMPENSABLE tool's failure never reaches it as one: UndoLog records it,
rolls the session back and answers with a message, so a retry there would run the tool in a session already undone.
Such a tool is retried by UndoLog itself, with ``@undolog_tool(retry=...)``, under the same effect and ``do-`` key,
before the call counts as failed. Mirrors the README's "Retries" paragraph.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import ToolRetryMiddleware
from langchain_core.messages import ToolMessage
from langgraph.checkpoint.memory import InMemorySaver

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_core import RetryPolicy, ToolTier, compensation, current_call, undolog_tool

SCRIPTS = {"book": [[("book_seat", {"seat": "12A"})]], "look": [[("seat_map", {"flight": "LX8"})]]}


def build(undolog: Any, retry: Any, fails: int, calls: list[Any]) -> Any:
    @compensation("release_seat")
    def release_seat(ctx: Any) -> None:
        calls.append(("release", ctx.args))

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="release_seat", retry=retry)
    def book_seat(seat: str) -> str:
        """Book a seat."""
        ctx = current_call()
        calls.append(("book", ctx.idempotency_key if ctx else None, ctx.attempt if ctx else None))
        if sum(1 for c in calls if c[0] == "book") <= fails:
            raise ConnectionError("the airline timed out")
        return f"booked {seat}"

    @undolog_tool(tier=ToolTier.SAFE)
    def seat_map(flight: str) -> str:
        """Show the seat map."""
        calls.append(("map", flight))
        if sum(1 for c in calls if c[0] == "map") <= fails:
            raise ConnectionError("the airline timed out")
        return "12A free"

    tools = [book_seat, seat_map]
    return create_agent(
        ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=InMemorySaver(),
        middleware=[ToolRetryMiddleware(max_retries=2, initial_delay=0.0, jitter=False),
                    UndoLogMiddleware(undolog, tools=tools, compensations=[release_seat])],
    )


def answer(out: Any) -> ToolMessage:
    return [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]


def test_compensable_without_a_policy_is_not_retried_by_the_middleware(undolog: Any) -> None:
    calls: list[Any] = []
    agent = build(undolog, None, 1, calls)
    out = agent.invoke({"messages": [{"role": "user", "content": "book it"}]},
                       {"configurable": {"thread_id": uuid.uuid4().hex[:10]}})
    # One attempt, then the failed call's own compensation: the middleware got a message, not an exception.
    assert [c[0] for c in calls] == ["book", "release"]
    assert answer(out).status == "error" and "rolled" in str(answer(out).content)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_undologs_policy_retries_under_the_same_key(undolog: Any, mode: str) -> None:
    calls: list[Any] = []
    agent = build(undolog, RetryPolicy(attempts=3, backoff=0.0, on=(ConnectionError,)), 1, calls)
    thread = uuid.uuid4().hex[:10]
    msg = {"messages": [{"role": "user", "content": "book it"}]}
    cfg = {"configurable": {"thread_id": thread}}
    out = asyncio.run(agent.ainvoke(msg, cfg)) if mode == "async" else agent.invoke(msg, cfg)
    [effect] = undolog.sessions.effects(thread)
    assert effect["state"] == "committed"
    assert calls == [("book", f"do-{effect['effect_id']}", 1), ("book", f"do-{effect['effect_id']}", 2)]
    assert answer(out).status == "success" and answer(out).content == "booked 12A"


def test_safe_errors_reach_the_middleware_which_retries_them(undolog: Any) -> None:
    calls: list[Any] = []
    agent = build(undolog, None, 1, calls)
    out = agent.invoke({"messages": [{"role": "user", "content": "look at the map"}]},
                       {"configurable": {"thread_id": uuid.uuid4().hex[:10]}})
    assert calls == [("map", "LX8"), ("map", "LX8")] and answer(out).content == "12A free"


def test_a_third_party_tool_gets_its_policy_in_tiers(undolog: Any) -> None:
    # README "Retries": retry= in the tiers= vocabulary, for a tool @undolog_tool cannot decorate.
    from undolog_adapters.langgraph import UndoLogPolicy, UndoLogToolNode

    def lookup(q: str) -> str:
        """Look something up."""
        return q

    UndoLogToolNode([lookup], undolog=undolog, tiers={"lookup": UndoLogPolicy("safe", retry=2)})
    assert undolog.tool_spec("lookup").retry == RetryPolicy(attempts=2)
    UndoLogToolNode([lookup], undolog=undolog, tiers={"lookup": {"tier": "safe", "retry": RetryPolicy(attempts=4)}})
    assert undolog.tool_spec("lookup").retry.attempts == 4
    with pytest.raises(Exception, match="IRREVERSIBLE"):
        UndoLogToolNode([lookup], undolog=undolog, tiers={"lookup": UndoLogPolicy("irreversible", retry=2)})
