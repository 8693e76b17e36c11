"""``UndoLogMiddleware``'s hook inside a plain ``ToolNode`` (a hand-built graph) must not answer one call with another's
decision.

``create_agent`` runs each tool call as its own task, so each UndoLog pause is the only interrupt of its task. A plain
``ToolNode(tools, wrap_tool_call=middleware.wrap_tool_call)`` runs all calls of a model message in ONE task, where
LangGraph matches resume values to interrupts by the order in which they are raised. That order is not stable: a call
approved in the first resume does not pause again, so on the next resume its sibling takes the first value. Two
IRREVERSIBLE calls: the person approved u-1 and rejected u-2, and both accounts were closed (u-2 with u-1's
approval). The middleware now refuses to pause in a task that holds several IRREVERSIBLE calls (nothing is asked,
nothing runs): ``UndoLogToolNode`` is the hand-built graph's node. One IRREVERSIBLE call per task works as before.

Real ``StateGraph`` + ``ToolNode`` objects, a scripted model, a real checkpointer, sync and async.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition
from langgraph.types import Command

from examples.support_agent.model import ScriptedChatModel
from tests.adapters.test_langgraph_hitl import World, cfg, make_tools, refund_charge_for, user
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_core import ToolTier, errors, undolog_tool

SCRIPTS: dict[str, Any] = {
    "both": [[("close_account", {"user_id": "u-1"}), ("close_account", {"user_id": "u-2"})]],
    "one": [[("close_account", {"user_id": "u-1"}), ("lookup", {"user_id": "u-1"})]],
}


@undolog_tool(tier=ToolTier.SAFE)
def lookup(user_id: str) -> str:
    """Look the customer up."""
    return f"{user_id}: active"


def _graph(undolog: Any, world: World) -> Any:
    # The ungated sibling is SAFE: under ``ainvoke`` a plain ToolNode's pause ends the node while its siblings may
    # still run, and ``asyncio.run`` then cancels them; a COMPENSABLE sibling cancelled that way is a failure that
    # halts the session (its compensation is not registered here), which is not what this test is about.
    tools = [*make_tools(world), lookup]
    # Per call: a hand-built ToolNode has no after_model hook for the batched pause.
    mw = UndoLogMiddleware(undolog, tools=tools, compensations=[refund_charge_for(world)], approver="ana",
                           interrupt_mode="per_call")
    model = ScriptedChatModel(scripts=SCRIPTS)
    g = StateGraph(MessagesState)
    g.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    g.add_node("tools", ToolNode(tools, wrap_tool_call=mw.wrap_tool_call, awrap_tool_call=mw.awrap_tool_call))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=InMemorySaver())


def _run(g: Any, value: Any, c: Any, aio: bool) -> Any:
    return asyncio.run(g.ainvoke(value, c)) if aio else g.invoke(value, c)


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_two_gated_calls_in_one_toolnode_task_never_take_each_others_decision(undolog: Any, aio: bool) -> None:
    world = World()
    g, c = _graph(undolog, world), cfg()
    # Before: paused on one call at a time; answering each as shown closed u-2 with u-1's approval.
    with pytest.raises(errors.ConfigurationError, match="UndoLogToolNode"):
        _run(g, user("both"), c, aio)
    assert world.ran == [] and undolog.approvals.pending() == []  # nothing was asked, nothing ran


@pytest.mark.parametrize("aio", [False, True], ids=["sync", "async"])
def test_one_gated_call_in_a_toolnode_task_pauses_and_runs_once(undolog: Any, aio: bool) -> None:
    world = World()
    g, c = _graph(undolog, world), cfg()
    _run(g, user("one"), c, aio)
    [pause] = g.get_state(c).interrupts
    assert pause.value["args"] == {"user_id": "u-1"}
    _run(g, Command(resume={"type": "approve"}), c, aio)
    assert world.ran.count(("close_account", "u-1")) == 1 and g.get_state(c).interrupts == ()
