"""One resume that approves a gated call and rejects its sibling: with ``create_agent`` + ``UndoLogMiddleware`` the
approved call must not run (issue 12: a rejection halts the session and cancels its other pending requests).

``create_agent`` runs each tool call as its own task, so two IRREVERSIBLE calls of one model message pause twice and
one ``Command(resume={id_a: ..., id_b: ...})`` answers both; the two tasks then run in parallel. Which one records its
answer first is up to the scheduler, so the tests make the worst order certain instead of likely: the adapter's own
``approver=`` callable (called while a LangChain decision, or UndoLog's form without an approver, is validated inside
the task's ``interrupt()``) holds the task of the REJECTED call until the approved call either ran (the bug) or was
refused (the rule). The hold ends as soon as either is seen, with a 10 s cap so a regression cannot hang the suite;
no assertion depends on time. Real ``create_agent``, a scripted model, a real ``InMemorySaver``, both databases.
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, closing, contextmanager
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.types import Command

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_core import RequestState, ToolTier, undolog_tool

SCRIPTS: dict[str, Any] = {"both": [[("close_account", {"user_id": "u-1"}), ("close_account", {"user_id": "u-2"})]]}


class World:
    """What really ran; ``ran_event`` is set by every run of the tool."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.ran_event = threading.Event()


class Gate:
    """The middleware's ``approver=``: answers "ana", but first holds the task whose checkpoint namespace is ``hold``
    (the rejected call's task) until the approved sibling ran, or its request was settled without running."""

    def __init__(self, undolog: Any, world: World) -> None:
        self.u, self.world = undolog, world
        self.hold: str | None = None
        self.sibling_request: str | None = None
        self.held = 0

    def __call__(self, config: Any) -> str:
        ns = str((config.get("configurable") or {}).get("checkpoint_ns") or "")
        if self.hold is not None and ns.endswith(self.hold):  # "<node>:<task id>", in a subgraph "...|<node>:<id>"
            self.held += 1
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and not self.world.ran_event.wait(0.02):
                assert self.sibling_request is not None
                if self.u.approvals.get(self.sibling_request).state in (RequestState.CANCELLED,
                                                                         RequestState.REJECTED):
                    break
        return "ana"


def make_tools(world: World, *, is_async: bool) -> list[Any]:
    if is_async:
        @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good")
        async def close_account(user_id: str) -> str:
            """Close a customer's account."""
            world.ran.append(user_id)
            world.ran_event.set()
            return f"closed {user_id}"
    else:
        @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good")
        def close_account(user_id: str) -> str:  # type: ignore[misc]
            """Close a customer's account."""
            world.ran.append(user_id)
            world.ran_event.set()
            return f"closed {user_id}"

    return [close_account]


def make_agent(undolog: Any, world: World, *, is_async: bool = False, saver: Any = None) -> tuple[Any, Gate]:
    gate = Gate(undolog, world)
    tools = make_tools(world, is_async=is_async)
    agent = create_agent(ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=saver or InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools, approver=gate, interrupt_mode="per_call")])
    return agent, gate


def cfg() -> dict[str, Any]:
    return {"configurable": {"thread_id": uuid.uuid4().hex[:10]}}


def pauses(state: Any) -> dict[str, tuple[Any, str]]:
    """``{user_id: (interrupt, its task's checkpoint namespace)}`` of the agent's pending pauses."""
    out = {}
    for task in state.tasks:
        if task.state is not None and hasattr(task.state, "tasks"):  # a subgraph's snapshot (subgraphs=True)
            out.update(pauses(task.state))
            continue
        for intr in task.interrupts:
            out[intr.value["args"]["user_id"]] = (intr, f"{task.name}:{task.id}")
    return out


def approve(form: str) -> dict[str, Any]:
    return {"type": "approve"} if form == "langchain" else {"decision": "approve", "approver": "ana"}


def reject(form: str) -> dict[str, Any]:
    # UndoLog's form without an approver: the adapter's approver= names who decided (as for a LangChain decision).
    return {"type": "reject", "message": "wrong customer"} if form == "langchain" else {
        "decision": "reject", "reason": "wrong customer"}


def check_halted(undolog: Any, world: World, gate: Gate, out: Any, approved: Any, rejected: Any) -> None:
    """The rejected call and its approved sibling both did not run, the session is halted, the model was told."""
    # gate.held counts the runs where the worst order was forced (the rejected task held until its approved sibling
    # ran or was settled). Under a loaded machine the approving task can settle the sibling's rejection before the
    # rejected task ever asks for its approver: the order differs, the outcome must not, so it is not asserted.
    assert world.ran == []  # neither tool function was ever called
    a = undolog.approvals.get(approved.value["undolog"]["approval_request_id"])
    r = undolog.approvals.get(rejected.value["undolog"]["approval_request_id"])
    assert r.state == RequestState.REJECTED and r.decided_by == "ana" and r.decision_reason == "wrong customer"
    assert a.state == RequestState.CANCELLED  # never approved-and-run: cancelled by the rejection
    assert undolog.sessions.get(r.session_id).state == "halted"
    msgs = out["messages"]
    tool_msgs = {m.tool_call_id: m for m in msgs if isinstance(m, ToolMessage)}
    ids = {approved.value["tool_call_id"], rejected.value["tool_call_id"]}
    assert set(tool_msgs) == ids and all(m.status == "error" for m in tool_msgs.values())
    assert tool_msgs[approved.value["tool_call_id"]].response_metadata["undolog"]["refused"]
    assert "wrong customer" in str(tool_msgs[rejected.value["tool_call_id"]].content)
    # The model was called again after both answers, and said nothing ran.
    assert isinstance(msgs[-1], AIMessage) and not msgs[-1].tool_calls
    assert all(isinstance(m, ToolMessage) for m in msgs[-3:-1])


# README "Use a LangChain HITL client as UndoLog's approval UI": the rejection paragraph (approved siblings answered in
# the same resume do not run either, whichever task comes first, in UndoLog's form too, sync or async).
@pytest.mark.parametrize("form", ["langchain", "undolog"])
@pytest.mark.parametrize("rejected_user", ["u-2", "u-1"], ids=["reject_second", "reject_first"])
def test_one_resume_reject_halts_before_the_approved_sibling_runs(undolog: Any, form: str,
                                                                   rejected_user: str) -> None:
    world = World()
    agent, gate = make_agent(undolog, world)
    c = cfg()
    agent.invoke({"messages": [{"role": "user", "content": "close both"}]}, c)
    found = pauses(agent.get_state(c))
    approved_user = "u-1" if rejected_user == "u-2" else "u-2"
    (approved, _), (rejected, rejected_ns) = found[approved_user], found[rejected_user]
    gate.hold, gate.sibling_request = rejected_ns, approved.value["undolog"]["approval_request_id"]
    out = agent.invoke(Command(resume={approved.id: approve(form), rejected.id: reject(form)}), c)
    check_halted(undolog, world, gate, out, approved, rejected)


@pytest.mark.parametrize("form", ["langchain", "undolog"])
@pytest.mark.parametrize("rejected_user", ["u-2", "u-1"], ids=["reject_second", "reject_first"])
def test_one_resume_reject_halts_before_the_approved_sibling_runs_async(undolog: Any, form: str,
                                                                         rejected_user: str) -> None:
    world = World()
    agent, gate = make_agent(undolog, world, is_async=True)
    c = cfg()

    async def go() -> tuple[Any, Any, Any]:
        await agent.ainvoke({"messages": [{"role": "user", "content": "close both"}]}, c)
        found = pauses(await agent.aget_state(c))
        approved_user = "u-1" if rejected_user == "u-2" else "u-2"
        (approved, _), (rejected, rejected_ns) = found[approved_user], found[rejected_user]
        gate.hold, gate.sibling_request = rejected_ns, approved.value["undolog"]["approval_request_id"]
        out = await agent.ainvoke(Command(resume={approved.id: approve(form), rejected.id: reject(form)}), c)
        return out, approved, rejected

    out, approved, rejected = asyncio.run(go())
    check_halted(undolog, world, gate, out, approved, rejected)


def test_one_resume_reject_halts_with_durability_exit(undolog: Any) -> None:
    # durability="exit" saves the checkpoint and its interrupts only when the run stops: still found on resume.
    world = World()
    agent, gate = make_agent(undolog, world)
    c = cfg()
    agent.invoke({"messages": [{"role": "user", "content": "close both"}]}, c, durability="exit")
    found = pauses(agent.get_state(c))
    (approved, _), (rejected, rejected_ns) = found["u-1"], found["u-2"]
    gate.hold, gate.sibling_request = rejected_ns, approved.value["undolog"]["approval_request_id"]
    out = agent.invoke(Command(resume={approved.id: approve("langchain"), rejected.id: reject("langchain")}), c,
                       durability="exit")
    check_halted(undolog, world, gate, out, approved, rejected)


def test_one_resume_reject_halts_when_the_agent_is_a_subgraph(undolog: Any) -> None:
    # The agent as a node of a bigger graph: the tool calls' tasks live in the subgraph's namespace, and the
    # interrupts are read from the subgraph's own checkpoint.
    world = World()
    gate = Gate(undolog, world)
    tools = make_tools(world, is_async=False)
    inner = create_agent(ScriptedChatModel(scripts=SCRIPTS), tools,
                         middleware=[UndoLogMiddleware(undolog, tools=tools, approver=gate, interrupt_mode="per_call")])
    outer = StateGraph(MessagesState)
    outer.add_node("agent", inner)
    outer.add_edge(START, "agent")
    graph = outer.compile(checkpointer=InMemorySaver())
    c = cfg()
    graph.invoke({"messages": [{"role": "user", "content": "close both"}]}, c)
    found = pauses(graph.get_state(c, subgraphs=True))
    (approved, _), (rejected, rejected_ns) = found["u-2"], found["u-1"]
    gate.hold, gate.sibling_request = rejected_ns, approved.value["undolog"]["approval_request_id"]
    out = graph.invoke(Command(resume={approved.id: approve("undolog"), rejected.id: reject("undolog")}), c)
    check_halted(undolog, world, gate, out, approved, rejected)


PG_CHECKPOINTS = "postgresql://postgres@127.0.0.1:5432/test"
SAVERS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres_only)]


@contextmanager
def saver_of(kind: str, path: str) -> Iterator[Any]:
    """A checkpointer on a durable store, opened afresh (as another process would)."""
    if kind == "sqlite":
        with closing(sqlite3.connect(path, check_same_thread=False)) as conn:
            yield SqliteSaver(conn)
        return
    from langgraph.checkpoint.postgres import PostgresSaver

    with PostgresSaver.from_conn_string(PG_CHECKPOINTS) as saver:
        saver.setup()
        yield saver


@asynccontextmanager
async def asaver_of(kind: str, path: str) -> AsyncIterator[Any]:
    if kind == "sqlite":
        from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

        async with AsyncSqliteSaver.from_conn_string(path) as saver:
            yield saver
        return
    from langgraph.checkpoint.postgres.aio import AsyncPostgresSaver

    async with AsyncPostgresSaver.from_conn_string(PG_CHECKPOINTS) as saver:
        await saver.setup()
        yield saver


@pytest.mark.storage
@pytest.mark.parametrize("kind", SAVERS)
def test_durable_checkpointer_resumed_by_a_fresh_agent(undolog: Any, tmp_path: Path, kind: str) -> None:
    # Which pause a rejection answers is read from the checkpoint itself: a fresh agent on a fresh saver (as another
    # process would resume) finds it too.
    world, path, c = World(), str(tmp_path / "checkpoints.sqlite"), cfg()
    with saver_of(kind, path) as saver:
        agent, _ = make_agent(undolog, world, saver=saver)
        agent.invoke({"messages": [{"role": "user", "content": "close both"}]}, c)
    with saver_of(kind, path) as saver:
        agent, gate = make_agent(undolog, world, saver=saver)
        found = pauses(agent.get_state(c))
        (approved, _), (rejected, rejected_ns) = found["u-1"], found["u-2"]
        gate.hold, gate.sibling_request = rejected_ns, approved.value["undolog"]["approval_request_id"]
        out = agent.invoke(Command(resume={approved.id: approve("langchain"), rejected.id: reject("langchain")}), c)
    check_halted(undolog, world, gate, out, approved, rejected)


@pytest.mark.parametrize("kind", SAVERS)
def test_async_durable_checkpointer_resumed_by_a_fresh_agent(undolog: Any, tmp_path: Path, kind: str) -> None:
    # The same through ainvoke and an async saver: its synchronous read runs in the task's worker thread, never on
    # the event loop (an async saver refuses a synchronous call on its loop).
    world, path, c = World(), str(tmp_path / "checkpoints.sqlite"), cfg()

    async def go() -> tuple[Any, Any, Any, Gate]:
        async with asaver_of(kind, path) as saver:
            agent, _ = make_agent(undolog, world, is_async=True, saver=saver)
            await agent.ainvoke({"messages": [{"role": "user", "content": "close both"}]}, c)
        async with asaver_of(kind, path) as saver:
            agent, gate = make_agent(undolog, world, is_async=True, saver=saver)
            found = pauses(await agent.aget_state(c))
            (approved, _), (rejected, rejected_ns) = found["u-2"], found["u-1"]
            gate.hold, gate.sibling_request = rejected_ns, approved.value["undolog"]["approval_request_id"]
            out = await agent.ainvoke(Command(resume={approved.id: approve("undolog"),
                                                      rejected.id: reject("undolog")}), c)
        return out, approved, rejected, gate

    out, approved, rejected, gate = asyncio.run(go())
    check_halted(undolog, world, gate, out, approved, rejected)


# README, the same paragraph: a call approved in an earlier resume has run; the later rejection halts the session.
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_approved_in_an_earlier_resume_ran_then_the_reject_halts(undolog: Any, mode: str) -> None:
    # Approved before any rejection existed: it runs (correct), the other call pauses again; its later rejection
    # halts the session.
    world = World()
    agent, _ = make_agent(undolog, world, is_async=mode == "async")
    c = cfg()

    async def ainvoke(value: Any) -> Any:
        return await agent.ainvoke(value, c)

    def invoke(value: Any) -> Any:
        return agent.invoke(value, c) if mode == "sync" else asyncio.run(ainvoke(value))

    invoke({"messages": [{"role": "user", "content": "close both"}]})
    found = pauses(agent.get_state(c))
    (first, _), (second, _) = found["u-1"], found["u-2"]
    invoke(Command(resume={first.id: {"type": "approve"}}))
    assert world.ran == ["u-1"]
    [again] = agent.get_state(c).interrupts
    assert again.value["undolog"]["approval_request_id"] == second.value["undolog"]["approval_request_id"]
    out = invoke(Command(resume={again.id: {"type": "reject", "message": "wrong customer"}}))
    assert world.ran == ["u-1"]
    r = undolog.approvals.get(second.value["undolog"]["approval_request_id"])
    assert r.state == RequestState.REJECTED and undolog.sessions.get(r.session_id).state == "halted"
    tool_msgs = {m.tool_call_id: m for m in out["messages"] if isinstance(m, ToolMessage)}
    assert tool_msgs[first.value["tool_call_id"]].content == "closed u-1"
    assert tool_msgs[second.value["tool_call_id"]].status == "error"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_one_resume_approving_both_runs_each_once(undolog: Any, mode: str) -> None:
    world = World()
    agent, _ = make_agent(undolog, world, is_async=mode == "async")
    c = cfg()

    async def ainvoke(value: Any) -> Any:
        return await agent.ainvoke(value, c)

    def invoke(value: Any) -> Any:
        return agent.invoke(value, c) if mode == "sync" else asyncio.run(ainvoke(value))

    invoke({"messages": [{"role": "user", "content": "close both"}]})
    found = pauses(agent.get_state(c))
    out = invoke(Command(resume={found["u-1"][0].id: {"type": "approve"},
                                 found["u-2"][0].id: {"decision": "approve", "approver": "bo"}}))
    assert sorted(world.ran) == ["u-1", "u-2"]
    contents = sorted(str(m.content) for m in out["messages"] if isinstance(m, ToolMessage))
    assert contents == ["closed u-1", "closed u-2"]
    sid = undolog.approvals.get(found["u-1"][0].value["undolog"]["approval_request_id"]).session_id
    assert undolog.sessions.get(sid).state != "halted"
