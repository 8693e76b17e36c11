"""LangGraph time travel: re-running a thread from an earlier checkpoint must not run a logged call a second time.

``graph.invoke(None, past.config)`` (a checkpoint from ``get_state_history``, as LangGraph Studio's "Re-run from
here" sends it) re-executes every step after that checkpoint, with the tool calls of the messages saved there: the
same tool call ids. Within one UndoLog session the call id makes that a replay. But a rollback moves the thread to
its next session (``thread#2``) at its next turn, and a call of the earlier plan, re-issued there, was new to that
session: a COMPENSABLE call the rollback had undone ran again (the customer charged twice), and an IRREVERSIBLE call
that had run asked a person again, as if it had never run. A call id of an earlier session of the thread is
answered as that session answers it: its stored result, or its refusal (the plan was undone).

Real ``create_agent`` (sync and async) and ``StateGraph`` + ``UndoLogToolNode`` objects, a scripted model, a real
checkpointer; the tools count their real executions.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command

from examples.support_agent.model import ScriptedChatModel
from tests.adapters.test_langgraph_hitl import World, cfg, make_tools, refund_charge_for, user
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode

SCRIPTS: dict[str, Any] = {
    "gated travel": [[("close_account", {"user_id": "u-1"})], [("charge", {"amount": 900})]],
    "travel": [[("charge", {"amount": 5})], [("charge", {"amount": 900})]],  # the second fails: rolled back
    "again": [[("charge", {"amount": 7})]],
}


def _run(a: Any, value: Any, config: Any, aio: bool) -> Any:
    return asyncio.run(a.ainvoke(value, config)) if aio else a.invoke(value, config)


def _build(kind: str, undolog: Any, world: World) -> Any:
    tools, model = make_tools(world), ScriptedChatModel(scripts=SCRIPTS)
    if kind == "agent":
        return create_agent(model, tools, checkpointer=InMemorySaver(), middleware=[
            UndoLogMiddleware(undolog, tools=tools, compensations=[refund_charge_for(world)], approver="ana")])
    g = StateGraph(MessagesState)
    g.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    g.add_node("tools", UndoLogToolNode(tools, undolog=undolog, compensations=[refund_charge_for(world)],
                                        approver="ana"))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=InMemorySaver())


def _approve(kind: str, a: Any, c: Any, aio: bool) -> None:
    [pause] = a.get_state(c).interrupts
    value = {pause.id: {"type": "approve"}} if kind == "agent" else {"decisions": [{"type": "approve"}]}
    _run(a, Command(resume=value), c, aio)


def _before_call(a: Any, c: Any, name: str, args: dict[str, Any]) -> Any:
    """The checkpoint just before the tools ran the (first) call ``name(args)``: what time travel re-runs from."""
    found = [s for s in a.get_state_history(c)
             if s.next and "tools" in s.next and isinstance(s.values["messages"][-1], AIMessage)
             and any(tc["name"] == name and tc["args"] == args for tc in s.values["messages"][-1].tool_calls)]
    assert found, f"no checkpoint before {name}({args})"
    return found[-1]  # get_state_history is newest first: the original run's checkpoint, not a later fork's


def _answer(out: Any, call_id: str) -> ToolMessage:
    return [m for m in out["messages"] if isinstance(m, ToolMessage) and m.tool_call_id == call_id][-1]


CASES = [("agent", False), ("agent", True), ("graph", False), ("graph", True)]


@pytest.mark.parametrize(("kind", "aio"), CASES)
def test_replaying_an_undone_plan_after_the_thread_moved_on_runs_nothing_again(undolog: Any, kind: str,
                                                                              aio: bool) -> None:
    world = World()
    a, c = _build(kind, undolog, world), cfg()
    _run(a, user("travel"), c, aio)  # charge 5 runs, charge 900 fails: the session is rolled back, 5 refunded
    assert world.ran == [("charge", 5), ("refund_charge", {"amount": 900}), ("refund_charge", {"amount": 5})]
    _run(a, user("again"), c, aio)  # the thread's next turn: its next session
    tid = c["configurable"]["thread_id"]
    assert [e["state"] for e in undolog.sessions.effects(f"{tid}#2")] == ["committed"]
    ran = list(world.ran)

    past = _before_call(a, c, "charge", {"amount": 5})
    call_id = past.values["messages"][-1].tool_calls[0]["id"]
    out = _run(a, None, past.config, aio)  # time travel: re-run the first turn from before its first tool call

    assert world.ran == ran, "the undone charge ran again"
    msg = _answer(out, call_id)
    assert msg.status == "error" and msg.response_metadata["undolog"] == {"refused": "session_closed"}
    assert "NOT" in msg.content or "rolled_back" in msg.content
    assert [e["call_id"] for e in undolog.sessions.effects(f"{tid}#2")] != [] and call_id not in {
        e["call_id"] for e in undolog.sessions.effects(f"{tid}#2")}


@pytest.mark.parametrize(("kind", "aio"), CASES)
def test_replaying_an_approved_irreversible_call_after_the_thread_moved_on_replays_its_result(
        undolog: Any, kind: str, aio: bool) -> None:
    world = World()
    a, c = _build(kind, undolog, world), cfg()
    _run(a, user("gated travel"), c, aio)
    _approve(kind, a, c, aio)  # close_account runs; then charge 900 fails: rolled back, the closure kept
    ran = [("close_account", "u-1"), ("refund_charge", {"amount": 900}), ("charge", 7)]
    assert world.ran == ran[:2]
    _run(a, user("again"), c, aio)
    assert world.ran == ran

    past = _before_call(a, c, "close_account", {"user_id": "u-1"})
    call_id = past.values["messages"][-1].tool_calls[0]["id"]
    out = _run(a, None, past.config, aio)

    # Not asked again (a person would approve "the same call" a second time), not run again: its result, replayed.
    # (The fork then goes on as time travel does: the model asks for a new charge, with a new call id, which fails
    # and is rolled back in the thread's current session like any other.)
    assert a.get_state(c).interrupts == () and undolog.approvals.pending() == []
    assert world.ran[:3] == ran and world.ran.count(("close_account", "u-1")) == 1, world.ran
    msg = _answer(out, call_id)
    assert msg.status == "success" and msg.content == "closed u-1", msg.content
    assert msg.response_metadata["undolog"]["replayed"] is True
