"""UndoLog's pauses answered the way LangChain's human-in-the-loop clients answer them (issue 12, item 1), and what the
run's callbacks see (item 10).

The payloads are built from LangChain's own types (``langchain.agents.middleware.human_in_the_loop``): the interrupt
values are checked against ``ToolApprovalRequest`` / ``HITLRequest``, and the answers are ``ApproveDecision``,
``EditDecision``, ``RejectDecision``, ``RespondDecision`` and ``HITLResponse`` exactly as a client sends them. Real
``create_agent`` and ``StateGraph`` objects, a scripted model, a real checkpointer. The README's "Use a LangChain HITL
client as UndoLog's approval UI" mirrors these tests.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware.human_in_the_loop import (
    Action,
    ApproveDecision,
    EditDecision,
    HITLRequest,
    HITLResponse,
    RejectDecision,
    RespondDecision,
    ToolApprovalRequest,
)
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command
from pydantic import TypeAdapter, ValidationError

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode
from undolog_core import CompensationDescriptor, RequestState, ToolTier, compensation, undolog_tool

SCRIPTS: dict[str, Any] = {
    "close": [[("close_account", {"user_id": "u-1"})]],
    "ask": [[("ask_customer", {"question": "Which order?"})]],
    "both": [[("close_account", {"user_id": "u-1"}), ("close_account", {"user_id": "u-2"})]],
    "mixed": [[("close_account", {"user_id": "u-1"}), ("ask_customer", {"question": "Which order?"})]],
    "charge": [[("charge", {"amount": 5})], [("charge", {"amount": 900})]],
}


class World:
    """What really ran, in order."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, Any]] = []


def make_tools(world: World) -> list[Any]:
    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good", risk_tags=["pii"])
    def close_account(user_id: str) -> str:
        """Close a customer's account."""
        world.ran.append(("close_account", user_id))
        return f"closed {user_id}"

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Asks the customer; a person answers")
    def ask_customer(question: str) -> str:
        """Ask the customer a question."""
        world.ran.append(("ask_customer", question))
        return "no answer"

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("refund_charge"))
    def charge(amount: int) -> dict[str, Any]:
        """Charge the customer."""
        if amount > 100:
            raise ValueError("over the limit")
        world.ran.append(("charge", amount))
        return {"charged": amount}

    return [close_account, ask_customer, charge]


@pytest.fixture
def world() -> World:
    return World()


def refund_charge_for(world: World) -> Any:
    @compensation("refund_charge")
    def refund_charge(ctx: Any) -> None:
        world.ran.append(("refund_charge", ctx.args))

    return refund_charge


def agent(undolog: Any, world: World, **mw: Any) -> Any:
    tools = make_tools(world)
    return create_agent(ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=InMemorySaver(),
                        middleware=[UndoLogMiddleware(undolog, tools=tools, compensations=[refund_charge_for(world)],
                                                      interrupt_mode="per_call",
                                                      **mw)])


def graph(undolog: Any, world: World, **node: Any) -> Any:
    tools = make_tools(world)
    model = ScriptedChatModel(scripts=SCRIPTS)
    g = StateGraph(MessagesState)
    g.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    g.add_node("tools", UndoLogToolNode(tools, undolog=undolog, compensations=[refund_charge_for(world)], **node))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=InMemorySaver())


def user(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def cfg(**configurable: Any) -> dict[str, Any]:
    return {"configurable": {"thread_id": uuid.uuid4().hex[:10], **configurable}}


def tool_messages(out: Any) -> list[ToolMessage]:
    return [m for m in out["messages"] if isinstance(m, ToolMessage)]


@dataclass
class AuthUser:
    """What LangGraph's auth puts in ``config["configurable"]["langgraph_auth_user"]`` (a BaseUser)."""

    identity: str


# ------------------------------------------------------------------------------------- the middleware


# README "Use a LangChain HITL client as UndoLog's approval UI": the payload, and the middleware's line of the
# "Answer with LangChain's decisions" snippet.
def test_middleware_pause_is_a_tool_approval_request_answered_by_a_decision(undolog: Any, world: World) -> None:
    a, c = agent(undolog, world, approver="ana"), cfg()
    a.invoke(user("close my account"), c)
    [intr] = a.get_state(c).interrupts
    # A valid ToolApprovalRequest, with UndoLog's own fields under one extra key.
    TypeAdapter(ToolApprovalRequest).validate_python(intr.value)
    assert intr.value["type"] == "tool_approval" and intr.value["name"] == "close_account"
    assert intr.value["args"] == {"user_id": "u-1"} and "Closes the account for good" in intr.value["description"]
    ours = intr.value["undolog"]
    assert ours["risk_tags"] == ["pii"] and ours["timeout_at"] and ours["approval_request_id"]
    assert ours["allowed_decisions"] == ["approve", "edit", "reject", "respond"] and ours["undo_plan"] == []
    # The response schema is attached (it is what refuses a bad answer) and compact: no docstrings in it.
    schema = json.dumps(intr.response_schema)
    assert '"approve"' in schema and '"decision"' in schema and "description" not in schema and len(schema) < 6000

    out = a.invoke(Command(resume={intr.id: ApproveDecision(type="approve")}), c)
    assert world.ran == [("close_account", "u-1")]
    rec = undolog.approvals.get(ours["approval_request_id"])
    assert rec.state == RequestState.APPROVED and rec.decided_by == "ana"
    assert tool_messages(out)[-1].content == "closed u-1"


def test_approver_from_langgraph_auth_and_refused_without_one(undolog: Any, world: World) -> None:
    a = agent(undolog, world)  # no approver= on the middleware
    c = cfg()
    a.invoke(user("close my account"), c)
    [intr] = a.get_state(c).interrupts
    rid = intr.value["undolog"]["approval_request_id"]
    # Nobody to record as the approver: refused inside the resume's validation, nothing saved, nothing ran.
    with pytest.raises(ValidationError, match="langgraph_auth_user"):
        a.invoke(Command(resume={intr.id: ApproveDecision(type="approve")}), c)
    assert undolog.approvals.get(rid).state == RequestState.PENDING and world.ran == []
    assert a.get_state(c).interrupts[0].id == intr.id  # still paused on the same request: send it again
    # LangGraph's auth names the user: that identity is the approver.
    authed = {"configurable": {**c["configurable"], "langgraph_auth_user": AuthUser("bo@example.com")}}
    a.invoke(Command(resume={intr.id: ApproveDecision(type="approve")}), authed)
    assert undolog.approvals.get(rid).decided_by == "bo@example.com" and world.ran == [("close_account", "u-1")]


def test_edit_is_a_validated_modify_pinned_to_its_tool(undolog: Any, world: World) -> None:
    a, c = agent(undolog, world, approver=lambda config: "ana"), cfg()
    a.invoke(user("close my account"), c)
    [intr] = a.get_state(c).interrupts
    rid = intr.value["undolog"]["approval_request_id"]
    switch = EditDecision(type="edit", edited_action=Action(name="ask_customer", args={"question": "?"}))
    with pytest.raises(ValidationError, match="cannot switch tools"):
        a.invoke(Command(resume={intr.id: switch}), c)
    assert undolog.approvals.get(rid).state == RequestState.PENDING
    # Arguments that do not fit the tool: recorded nowhere, the graph pauses again with the reason.
    bad = EditDecision(type="edit", edited_action=Action(name="close_account", args={"user": "u-7"}))
    a.invoke(Command(resume={intr.id: bad}), c)
    [again] = a.get_state(c).interrupts
    assert "user_id" in again.value["undolog"]["error"] and world.ran == []
    good = EditDecision(type="edit", edited_action=Action(name="close_account", args={"user_id": "u-7"}))
    a.invoke(Command(resume={again.id: good}), c)
    assert world.ran == [("close_account", "u-7")]
    events = undolog.approvals.events(rid)
    assert events[-1].action == "modify" and events[-1].payload["args"] == {"user_id": "u-7"}


def test_reject_without_a_message_halts_and_is_recorded(undolog: Any, world: World) -> None:
    a, c = agent(undolog, world, approver="ana"), cfg()
    a.invoke(user("close my account"), c)
    [intr] = a.get_state(c).interrupts
    out = a.invoke(Command(resume={intr.id: RejectDecision(type="reject")}), c)
    rec = undolog.approvals.get(intr.value["undolog"]["approval_request_id"])
    assert rec.state == RequestState.REJECTED and rec.decision_reason == "rejected without a reason"
    assert undolog.sessions.get(rec.session_id).state == "halted" and world.ran == []
    msg = tool_messages(out)[-1]
    assert msg.status == "error" and "rejected without a reason" in str(msg.content)


def test_respond_answers_in_the_tools_place(undolog: Any, world: World) -> None:
    a, c = agent(undolog, world, approver="ana"), cfg()
    a.invoke(user("ask the customer"), c)
    [intr] = a.get_state(c).interrupts
    out = a.invoke(Command(resume={intr.id: RespondDecision(type="respond", message="Order A-1042")}), c)
    msg = tool_messages(out)[-1]
    assert msg.content == "Order A-1042" and msg.status == "success" and world.ran == []
    rid = intr.value["undolog"]["approval_request_id"]
    assert undolog.approvals.get(rid).state == RequestState.RESPONDED
    assert undolog.approvals.events(rid)[-1].action == "respond"
    assert undolog.sessions.get(undolog.approvals.get(rid).session_id).state == "active"


def test_undologs_own_form_still_works_async(undolog: Any, world: World) -> None:
    a, c = agent(undolog, world), cfg()

    async def go() -> None:
        await a.ainvoke(user("close my account"), c)
        [intr] = (await a.aget_state(c)).interrupts
        await a.ainvoke(Command(resume={intr.id: {"decision": "approve", "approver": "cy"}}), c)
        assert undolog.approvals.get(intr.value["undolog"]["approval_request_id"]).decided_by == "cy"

    asyncio.run(go())
    assert world.ran == [("close_account", "u-1")]


# ------------------------------------------------------------------------------------- UndoLogToolNode


def test_node_pause_is_an_hitl_request_answered_in_order(undolog: Any, world: World) -> None:
    g, c = graph(undolog, world, approver="ana"), cfg()
    g.invoke(user("mixed"), c)
    [intr] = g.get_state(c).interrupts
    TypeAdapter(HITLRequest).validate_python(intr.value)
    assert [r["name"] for r in intr.value["action_requests"]] == ["close_account", "ask_customer"]
    assert [r["allowed_decisions"] for r in intr.value["review_configs"]] == [["approve", "edit", "reject",
                                                                                "respond"]] * 2
    with pytest.raises(ValidationError, match="1 decision"):
        g.invoke(Command(resume=HITLResponse(decisions=[ApproveDecision(type="approve")])), c)
    out = g.invoke(Command(resume=HITLResponse(decisions=[
        ApproveDecision(type="approve"), RespondDecision(type="respond", message="Order B-7")])), c)
    assert world.ran == [("close_account", "u-1")]
    by_name = {m.name: m for m in tool_messages(out)}
    assert by_name["close_account"].content == "closed u-1" and by_name["ask_customer"].content == "Order B-7"


# README: the node's line of the "Answer with LangChain's decisions" snippet, and the rejection paragraph.
def test_node_reject_halts_and_the_approved_sibling_does_not_run(undolog: Any, world: World) -> None:
    g, c = graph(undolog, world, approver="ana"), cfg()
    g.invoke(user("both"), c)
    [intr] = g.get_state(c).interrupts
    out = g.invoke(Command(resume=HITLResponse(decisions=[
        ApproveDecision(type="approve"), RejectDecision(type="reject", message="wrong customer")])), c)
    first, second = intr.value["undolog"]["requests"]
    assert undolog.approvals.get(second["approval_request_id"]).state == RequestState.REJECTED
    # A rejection halts the session: the approved sibling of the same message does not run either.
    assert world.ran == [] and all(m.status == "error" for m in tool_messages(out))


# ------------------------------------------------------------------------------------- callbacks (item 10)


class Events(BaseCallbackHandler):
    """A real callback handler, as a tracer is: it records LangChain custom events."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def on_custom_event(self, name: str, data: Any, **kwargs: Any) -> None:
        self.seen.append((name, data))


# README "Callbacks and tracing": the Audit handler snippet.
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_callbacks_see_decisions_and_compensations(undolog: Any, world: World, mode: str) -> None:
    a = agent(undolog, world, approver="ana")
    ev = Events()
    c1, c2 = {**cfg(), "callbacks": [ev]}, {**cfg(), "callbacks": [ev]}

    async def run(payload: Any, config: Any) -> Any:
        return await a.ainvoke(payload, config)

    def invoke(payload: Any, config: Any) -> Any:
        return asyncio.run(run(payload, config)) if mode == "async" else a.invoke(payload, config)

    invoke(user("close my account"), c1)
    [intr] = a.get_state(c1).interrupts
    invoke(Command(resume={intr.id: ApproveDecision(type="approve")}), c1)
    [(name, data)] = [e for e in ev.seen if e[0] == "undolog.approval_decision"]
    assert data["decision"] == "approve" and data["approver"] == "ana" and data["tool"] == "close_account"

    invoke(user("charge twice"), c2)  # 5 is charged, 900 fails: both are compensated, newest first
    comps = [d for n, d in ev.seen if n == "undolog.compensation"]
    assert [(d["tool_name"], d["compensation_name"], d["outcome"]) for d in comps] == [
        ("charge", "refund_charge", "compensated"), ("charge", "refund_charge", "compensated")]
    [end] = [d for n, d in ev.seen if n == "undolog.rollback"]
    assert end["complete"] and end["compensated"] == 2
