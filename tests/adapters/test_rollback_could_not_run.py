"""What the model reads when a failure's rollback could not run at all: it must not say the session was rolled back.

Two calls of one model message run in parallel (``UndoLogToolNode``'s threads, ``create_agent``'s tasks): one fails
while its COMPENSABLE sibling is still running, so the policy's rollback cannot run (a call in flight) and the session
halts for a person, with nothing undone. The model was told "UndoLog rolled the session back (undone: nothing
earlier). The rollback stopped (...)": a rollback that never happened, and the earlier charge, still done, read as
"nothing to undo". The text now says that nothing was undone and the earlier steps stay done.

The order is made certain, not likely: the failing tool raises only once its sibling is running, and the sibling
returns only once the session is halted (bounded waits for a condition; no timing is asserted).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition

from examples.support_agent.model import ScriptedChatModel
from tests.adapters.test_langgraph_hitl import cfg, user
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode
from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool

SCRIPTS: dict[str, Any] = {"both": [[("charge", {"amount": 5}), ("book", {"seat": "1A"})]]}


def _tools(undolog: Any, ran: list[Any], thread: list[str]) -> list[Any]:
    running = threading.Event()

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("refund_it"))
    def charge(amount: int) -> str:
        """Charge the customer."""
        running.set()
        deadline = time.monotonic() + 10  # returns once the failure halted the session (bounded)
        while time.monotonic() < deadline and undolog.sessions.get(thread[0]).state != "halted":
            time.sleep(0.01)
        ran.append(("charge", amount))
        return f"charged {amount}"

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("refund_it"))
    def book(seat: str) -> str:
        """Book a seat."""
        running.wait(10)  # fails only while its sibling is running
        raise ValueError("no such seat")

    @compensation("refund_it")
    def refund_it(ctx: Any) -> None:
        ran.append(("undo", ctx.args))

    undolog.register(refund_it)
    return [charge, book]


@pytest.mark.parametrize("kind", ["graph", "agent"])
def test_a_rollback_that_could_not_run_is_not_told_as_done(undolog: Any, kind: str) -> None:
    ran: list[Any] = []
    c = cfg()
    thread = [c["configurable"]["thread_id"]]
    tools = _tools(undolog, ran, thread)
    model = ScriptedChatModel(scripts=SCRIPTS)
    if kind == "agent":
        g = create_agent(model, tools, checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools, approver="ana")])
    else:
        b = StateGraph(MessagesState)
        b.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
        b.add_node("tools", UndoLogToolNode(tools, undolog=undolog, approver="ana"))
        b.add_edge(START, "agent")
        b.add_conditional_edges("agent", tools_condition)
        b.add_edge("tools", "agent")
        g = b.compile(checkpointer=InMemorySaver())
    out = g.invoke(user("both"), c)

    assert ran == [("charge", 5)]  # nothing was undone: the rollback could not run
    session = undolog.sessions.get(thread[0])
    assert session.state == "halted" and "could not run" in (session.halted_reason or "")
    [failed] = [m for m in out["messages"] if isinstance(m, ToolMessage) and m.status == "error"]
    assert "rolled the session back" not in failed.content, failed.content
    assert "nothing was undone" in failed.content and "halted" in failed.content
