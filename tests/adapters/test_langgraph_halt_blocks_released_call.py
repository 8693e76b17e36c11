"""Hole 1 end to end: an approved call released by a LangGraph interrupt must not run once its session is halted.

A real graph (StateGraph + UndoLogToolNode + a scripted model) and a real checkpointer. The model asks for two
IRREVERSIBLE calls in one message; the person approves the second in one resume and rejects the first in the next.
Between the two, the node claimed the approved call and handed it back (``engine.release``) because its sibling was
still undecided. The reject halts the session, so the approved sibling must never run: the world's own operation
log counts its real executions.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command

from examples.support_agent.model import ScriptedChatModel
from examples.support_agent.tools import make_tools
from examples.support_agent.world import SupportWorld
from undolog_adapters.langgraph import UndoLogToolNode

SCRIPTS: dict[str, Any] = {
    "two gated": [[("delete_user_account", {"user_id": "u-1042"}), ("delete_user_account", {"user_id": "u-3003"})]],
}
ANA = {"decision": "approve", "approver": "ana"}
REJECT = {"decision": "reject", "approver": "bo", "reason": "open chargeback"}


def _graph(undolog: Any, tools: Any) -> Any:
    model = ScriptedChatModel(scripts=SCRIPTS)

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", UndoLogToolNode(tools.agent_tools, undolog=undolog, compensations=[tools.cancel_refund_email]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=InMemorySaver())


def test_approved_sibling_never_runs_once_the_session_is_halted_by_a_reject(undolog: Any, tmp_path: Path) -> None:
    world = SupportWorld(tmp_path / "world.sqlite", delivery_delay=30.0)
    tools = make_tools(world)
    graph = _graph(undolog, tools)
    thread = uuid.uuid4().hex[:10]
    c = {"configurable": {"thread_id": thread}}

    graph.invoke({"messages": [{"role": "user", "content": "two gated"}]}, c)
    [intr] = graph.get_state(c).interrupts
    first, second = intr.value["undolog"]["requests"]
    assert (first["args"]["user_id"], second["args"]["user_id"]) == ("u-1042", "u-3003")

    # Resume 1: approve the second only. The node claims it, sees the first still undecided, and releases it.
    graph.invoke(Command(resume={"decisions": {second["approval_request_id"]: ANA}}), c)
    [left] = graph.get_state(c).interrupts
    assert [r["approval_request_id"] for r in left.value["undolog"]["requests"]] == [first["approval_request_id"]]
    assert undolog.approvals.get(second["approval_request_id"]).state == "approved"
    # Today the node claims it and hands it back ("released"); a fix may as well leave it unclaimed ("approved").
    waiting = [e for e in undolog.sessions.effects(thread) if e["call_id"] == second["tool_call_id"]]
    assert [e["state"] for e in waiting] in (["released"], ["approved"])
    assert len(world.operations("delete_account")) == 0

    # Resume 2: reject the first. The session halts; the approved sibling must not run in a halted session.
    graph.invoke(Command(resume=REJECT), c)
    assert undolog.sessions.get(thread).state == "halted"
    assert len(world.operations("delete_account")) == 0, world.operations("delete_account")
    assert world.account_status("u-3003") != "deleted" and world.account_status("u-1042") != "deleted"
    assert graph.get_state(c).interrupts == ()
