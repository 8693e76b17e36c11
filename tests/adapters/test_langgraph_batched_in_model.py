"""The batched gate asks inside the model call: the model is called once for a message whose calls pause.

``UndoLogMiddleware(interrupt_mode="batched")`` asks about a model message's IRREVERSIBLE calls inside the model call
it wraps (no ``after_model`` node). LangGraph re-runs an interrupted node from its start on resume, so the gate keeps
the model's message with its approval requests before it pauses and answers the re-run with it: the model is never
asked again (a re-run model answers differently: the scripted model here mints new call ids on every call). Checked
with a real ``create_agent``, a scripted model that counts its calls, LangChain's own resume format, in one process
and from a fresh one (a new UndoLog, middleware and agent on the same SQLite checkpointer file and UndoLog store),
under ``invoke`` and ``ainvoke``.
"""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware, ModelRetryMiddleware
from langchain.agents.middleware.human_in_the_loop import Decision, HITLRequest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
from langgraph.types import Command
from pydantic import TypeAdapter

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool

pytestmark = pytest.mark.reads_store

RAN: list[tuple[str, str]] = []
#: Every model call: the messages it was asked with.
ASKED: list[list[BaseMessage]] = []
SCRIPTS: dict[str, Any] = {
    # One model message: two IRREVERSIBLE calls and a COMPENSABLE one.
    "close both": [[("bm_close", {"user_id": "u-1"}), ("bm_close", {"user_id": "u-2"}), ("bm_hold", {"day": "mon"})]],
}


class CountingModel(ScriptedChatModel):
    """The scripted model, counting its calls (it mints new call ids on each: a second call would show)."""

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> Any:
        ASKED.append(list(messages))
        return super()._generate(messages, stop, run_manager, **kwargs)


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good")
def bm_close(user_id: str) -> str:
    """Close a customer's account."""
    RAN.append(("bm_close", user_id))
    return f"closed {user_id}"


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("bm_release"))
def bm_hold(day: str) -> str:
    """Hold a slot."""
    RAN.append(("bm_hold", day))
    return f"held {day}"


@compensation("bm_release")
def bm_release(ctx: Any) -> None:
    return None


TOOLS = [bm_close, bm_hold]


def approve_reject(action: Any) -> Decision:
    if action["args"] == {"user_id": "u-2"}:
        return {"type": "reject", "message": "u-2 has an open chargeback"}
    return {"type": "approve"}


def edit(action: Any) -> Decision:
    if action["args"] == {"user_id": "u-2"}:
        return {"type": "edit", "edited_action": {"name": "bm_close", "args": {"user_id": "u-9"}}}
    return {"type": "approve"}


def respond(action: Any) -> Decision:
    return {"type": "respond", "message": f"kept {action['args']['user_id']}: archived instead"}


def agent(u: Any, saver: Any) -> Any:
    return create_agent(CountingModel(scripts=SCRIPTS), TOOLS, checkpointer=saver,
                        middleware=[UndoLogMiddleware(u, tools=TOOLS, compensations=[bm_release], approver="ana")])


def first_calls_of_turn() -> int:
    """How many model calls were asked with the user's message last (the turn's first model call)."""
    return sum(isinstance(m[-1], HumanMessage) for m in ASKED)


def resume_value(out: Any, decide: Callable[[Any], Decision]) -> dict[str, Any]:
    [pause] = out.interrupts  # one HITLRequest for the message's two gated calls
    request = TypeAdapter(HITLRequest).validate_python(pause.value)
    assert [a["args"] for a in request["action_requests"]] == [{"user_id": "u-1"}, {"user_id": "u-2"}]
    return {"decisions": [decide(a) for a in request["action_requests"]]}


def check(u: Any, messages: list[BaseMessage], decide: Any, thread: str) -> None:
    assert first_calls_of_turn() == 1, ASKED  # the model was called once for the gated message, never again
    [asked] = [m for m in messages if isinstance(m, AIMessage) and m.tool_calls]
    ids = {c["id"] for c in asked.tool_calls}
    # The message the tools answered is the one the requests were raised for (the model's first and only answer).
    assert {r.call_id for r in u.approvals.list()} == {c["id"] for c in asked.tool_calls if c["name"] == "bm_close"}
    answered = {m.tool_call_id: m for m in messages if isinstance(m, ToolMessage)}
    assert set(answered) == ids
    text = "\n".join(str(m.content) for m in answered.values())
    sid = u.approvals.list()[0].session_id
    if decide is approve_reject:
        # UndoLog's reject halts the session: nothing of the message runs after it, the approved sibling included.
        assert not [r for r in RAN if r[0] == "bm_close"]
        assert u.sessions.get(sid).state == "halted"
        assert "u-2 has an open chargeback" in text
    elif decide is edit:
        assert sorted(r for r in RAN if r[0] == "bm_close") == [("bm_close", "u-1"), ("bm_close", "u-9")]
        assert ("bm_hold", "mon") in RAN
        assert u.sessions.get(sid).state == "active"
    else:
        assert not [r for r in RAN if r[0] == "bm_close"] and ("bm_hold", "mon") in RAN
        assert "kept u-1: archived instead" in text and "kept u-2: archived instead" in text
    assert sid.startswith(thread)


DECIDES = pytest.mark.parametrize("decide", [approve_reject, edit, respond], ids=["approve+reject", "edit", "respond"])


@pytest.fixture(autouse=True)
def _clean() -> None:
    RAN.clear()
    ASKED.clear()


@DECIDES
def test_resumed_in_the_same_process(undolog: Any, decide: Any) -> None:
    graph = agent(undolog, InMemorySaver())
    thread = "bm-" + uuid.uuid4().hex[:8]
    c = {"configurable": {"thread_id": thread}}
    out = graph.invoke({"messages": [{"role": "user", "content": "close both accounts"}]}, c, version="v2")
    assert RAN == [] and first_calls_of_turn() == 1
    out = graph.invoke(Command(resume=resume_value(out, decide)), c, version="v2")
    assert not out.interrupts
    check(undolog, out.value["messages"], decide, thread)


@DECIDES
def test_resumed_from_a_fresh_process(db: Any, tmp_path: Path, decide: Any) -> None:
    """A new UndoLog, middleware and agent (what a new process builds) on the same checkpointer file and store."""
    first = db.open()
    path = tmp_path / "checkpoints.db"
    thread = "bm-" + uuid.uuid4().hex[:8]
    c = {"configurable": {"thread_id": thread}}
    with sqlite3.connect(path, check_same_thread=False) as conn:
        out = agent(first, SqliteSaver(conn)).invoke(
            {"messages": [{"role": "user", "content": "close both accounts"}]}, c, version="v2")
        resume = resume_value(out, decide)
    first.close()
    assert RAN == [] and first_calls_of_turn() == 1
    again = db.open()
    with sqlite3.connect(path, check_same_thread=False) as conn:
        out = agent(again, SqliteSaver(conn)).invoke(Command(resume=resume), c, version="v2")
    assert not out.interrupts
    check(again, out.value["messages"], decide, thread)


@DECIDES
async def test_resumed_under_ainvoke_in_the_same_process(undolog: Any, decide: Any) -> None:
    graph = agent(undolog, InMemorySaver())
    thread = "bm-" + uuid.uuid4().hex[:8]
    c = {"configurable": {"thread_id": thread}}
    out = await graph.ainvoke({"messages": [{"role": "user", "content": "close both accounts"}]}, c, version="v2")
    assert RAN == [] and first_calls_of_turn() == 1
    out = await graph.ainvoke(Command(resume=resume_value(out, decide)), c, version="v2")
    assert not out.interrupts
    check(undolog, out.value["messages"], decide, thread)


@DECIDES
async def test_resumed_under_ainvoke_from_a_fresh_process(db: Any, tmp_path: Path, decide: Any) -> None:
    first = db.open()
    path = str(tmp_path / "checkpoints.db")
    thread = "bm-" + uuid.uuid4().hex[:8]
    c = {"configurable": {"thread_id": thread}}
    async with AsyncSqliteSaver.from_conn_string(path) as saver:
        out = await agent(first, saver).ainvoke(
            {"messages": [{"role": "user", "content": "close both accounts"}]}, c, version="v2")
        resume = resume_value(out, decide)
    first.close()
    assert RAN == [] and first_calls_of_turn() == 1
    again = db.open()
    async with AsyncSqliteSaver.from_conn_string(path) as saver:
        out = await agent(again, saver).ainvoke(Command(resume=resume), c, version="v2")
    assert not out.interrupts
    check(again, out.value["messages"], decide, thread)


def test_the_kept_message_is_audited_with_the_requests(undolog: Any) -> None:
    """The message is kept as an audit event of each request it pauses for (hash-chained, as the decisions are)."""
    graph = agent(undolog, InMemorySaver())
    c = {"configurable": {"thread_id": "bm-" + uuid.uuid4().hex[:8]}}
    graph.invoke({"messages": [{"role": "user", "content": "close both accounts"}]}, c, version="v2")
    requests = undolog.approvals.list()
    assert len(requests) == 2
    for r in requests:
        [kept] = [e for e in undolog.approvals.events(r.approval_request_id) if e.action == "model_message"]
        [message] = kept.payload["message"]["messages"]
        assert [c["name"] for c in message["data"]["tool_calls"]] == ["bm_close", "bm_close", "bm_hold"]
        assert r.call_id in {c["id"] for c in message["data"]["tool_calls"]}


def test_an_ungated_message_and_another_interrupt_are_left_alone(undolog: Any) -> None:
    """A message without a call that pauses is returned as it is (nothing kept, no request); the graph is
    LangChain's own (no node of UndoLog's)."""
    graph = agent(undolog, InMemorySaver())
    assert set(graph.get_graph().nodes) == {"__start__", "model", "tools", "__end__"}
    c = {"configurable": {"thread_id": "bm-" + uuid.uuid4().hex[:8]}}
    out = graph.invoke({"messages": [{"role": "user", "content": "hello"}]}, c, version="v2")
    assert not out.interrupts and undolog.approvals.list() == [] and len(ASKED) == 1


class Outer(AgentMiddleware):
    """A model-call wrapper outside UndoLog's (as an app's logging or retry middleware is): it sees every model call
    its handler answers, the re-run on resume included."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def wrap_model_call(self, request: Any, handler: Any) -> Any:
        out = handler(request)
        self.seen.append(type(out).__name__)
        return out

    async def awrap_model_call(self, request: Any, handler: Any) -> Any:
        out = await handler(request)
        self.seen.append(type(out).__name__)
        return out


@pytest.mark.parametrize("api", ["invoke", "ainvoke"])
async def test_other_middleware_around_it(undolog: Any, api: str) -> None:
    """LangChain's retry middleware and an app's wrapper outside UndoLog's: the pause passes through them (LangGraph's
    GraphBubbleUp is not retried), the resume's re-run reaches UndoLog's hook through them, and the model is still
    called once for the message."""
    outer = Outer()
    graph = create_agent(CountingModel(scripts=SCRIPTS), TOOLS, checkpointer=InMemorySaver(),
                         middleware=[outer, ModelRetryMiddleware(max_retries=2),
                                     UndoLogMiddleware(undolog, tools=TOOLS, compensations=[bm_release],
                                                       approver="ana")])
    thread = "bm-" + uuid.uuid4().hex[:8]
    c = {"configurable": {"thread_id": thread}}
    start = {"messages": [{"role": "user", "content": "close both accounts"}]}
    out = graph.invoke(start, c, version="v2") if api == "invoke" else await graph.ainvoke(start, c, version="v2")
    assert RAN == [] and first_calls_of_turn() == 1 and outer.seen == []  # the pause passed through both
    resume = Command(resume=resume_value(out, edit))
    out = graph.invoke(resume, c, version="v2") if api == "invoke" else await graph.ainvoke(resume, c, version="v2")
    assert not out.interrupts
    check(undolog, out.value["messages"], edit, thread)
    assert len(outer.seen) == 2  # the resumed gated call (the kept message), then the model's last answer
