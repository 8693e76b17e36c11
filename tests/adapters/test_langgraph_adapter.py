"""UndoLogToolNode and UndoLogMiddleware on real LangGraph/LangChain objects, driven by scripted models.

Only the outside world is fake (examples.support_agent.world: an outbox and account store in SQLite);
its ``operations()`` log is how these tests prove each tool ran exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command, interrupt

from examples.support_agent.model import ScriptedChatModel
from examples.support_agent.tools import make_tools
from examples.support_agent.world import SupportWorld
from undolog_adapters.langgraph import (
    UndoLogMiddleware,
    UndoLogPolicy,
    UndoLogToolNode,
    aundolog_resume,
    resume_decided,
    rollback,
    session_for_thread,
    undolog_resume,
)
from undolog_core import ToolTier, errors

ROOT = Path(__file__).resolve().parents[2]
PG_CHECKPOINTS = "postgresql://postgres@127.0.0.1:5432/test"
KINDS = ["node", "middleware"]

REFUND = ("send_refund_email", {"user_id": "u-1042", "amount": 42.5, "order_id": "A-1042"})
DELETE = ("delete_user_account", {"user_id": "u-1042"})
SEARCH = ("search_knowledge_base", {"query": "refund damaged"})
SCRIPTS: dict[str, Any] = {
    "three tiers": [[SEARCH], [REFUND], [DELETE]],
    "parallel": [[SEARCH, ("send_refund_email", {"user_id": "u-2002", "amount": 19.0, "order_id": "B-7"}),
                  ("delete_user_account", {"user_id": "u-3003"}),
                  ("send_refund_email", {"user_id": "u-2002", "amount": 25.0, "order_id": "B-8"})]],
    "two gated": [[("delete_user_account", {"user_id": "u-1042"}), ("delete_user_account", {"user_id": "u-3003"})]],
    "failing": [[("send_refund_email", {"user_id": "u-2002", "amount": 19.0, "order_id": "B-7"})],
                [("send_refund_email", {"user_id": "u-2002", "amount": 25.0, "order_id": "B-8"})],
                [("send_refund_email", {"user_id": "u-2002", "amount": 900.0, "order_id": "B-9"})]],
    "refund only": [[REFUND]],
    "delete only": [[DELETE]],
}
ANA = {"decision": "approve", "approver": "ana"}


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture
def world(tmp_path: Path) -> SupportWorld:
    return SupportWorld(tmp_path / "world.sqlite", delivery_delay=30.0)


@pytest.fixture
def tools(world: SupportWorld) -> Any:
    return make_tools(world)


def build(kind: str, undolog: Any, tools: Any, checkpointer: Any, scripts: dict[str, Any] | None = None) -> Any:
    """The same agent two ways: a hand-built graph with UndoLogToolNode, or create_agent + middleware."""
    model = ScriptedChatModel(scripts=scripts or SCRIPTS)
    if kind == "middleware":
        return create_agent(
            model, tools.agent_tools, checkpointer=checkpointer,
            middleware=[UndoLogMiddleware(undolog, tools=tools.agent_tools, compensations=[tools.cancel_refund_email],
                                          interrupt_mode="per_call")],
        )

    def agent(state: MessagesState) -> dict[str, Any]:
        return {"messages": [model.invoke(state["messages"])]}

    g = StateGraph(MessagesState)
    g.add_node("agent", agent)
    g.add_node("tools", UndoLogToolNode(tools.agent_tools, undolog=undolog, compensations=[tools.cancel_refund_email]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=checkpointer)


def user(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def cfg(thread: str | None = None) -> dict[str, Any]:
    return {"configurable": {"thread_id": thread or uuid.uuid4().hex[:10]}}


def tms(out: Any, name: str | None = None) -> list[ToolMessage]:
    return [m for m in out["messages"] if isinstance(m, ToolMessage) and (name is None or m.name == name)]


def final(out: Any) -> AIMessage:
    return [m for m in out["messages"] if isinstance(m, AIMessage)][-1]


def count(world: SupportWorld, op: str) -> int:
    return len(world.operations(op))


# ------------------------------------------------------------------------------------------ the tiers


@pytest.mark.parametrize("kind", KINDS)
def test_each_tier_and_approve(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    graph.invoke(user("three tiers please"), c)
    # SAFE ran, COMPENSABLE ran with an undo entry, IRREVERSIBLE stopped before running.
    assert count(world, "search") == 1 and count(world, "send_refund_email") == 1
    assert count(world, "delete_account") == 0
    [intr] = graph.get_state(c).interrupts
    # LangChain's vocabulary on the outside (a ToolApprovalRequest per call, an HITLRequest per message), UndoLog's
    # own fields under "undolog".
    if kind == "middleware":
        assert intr.value["type"] == "tool_approval" and intr.value["name"] == "delete_user_account"
    else:
        assert [a["name"] for a in intr.value["action_requests"]] == ["delete_user_account"]
    v = intr.value["undolog"]
    assert v["type"] == "undolog.approval_request" and v["tool"] == "delete_user_account"
    assert v["args"] == {"user_id": "u-1042"} and v["reason"].startswith("Deletes every record")
    assert v["risk_tags"] == ["account-deletion", "pii"] and v["approval_request_id"]
    assert undolog.approvals.get(v["approval_request_id"]).state == "pending"
    effects = undolog.sessions.effects(c["configurable"]["thread_id"])
    refund = next(e for e in effects if e["tool_name"] == "send_refund_email")
    assert refund["state"] == "committed" and refund["compensation_name"] == "cancel_refund_email"
    assert refund["result_snapshot"]["message_id"].startswith("m-")  # the raw result, not the message text

    out = graph.invoke(Command(resume={**ANA, "reason": "verified"}), c)
    assert world.account_status("u-1042") == "deleted" and count(world, "delete_account") == 1
    assert count(world, "send_refund_email") == 1 and count(world, "search") == 1
    assert final(out).content.startswith("All done")
    rec = undolog.approvals.get(v["approval_request_id"])
    assert rec.state == "approved" and rec.decided_by == "ana"
    assert [e.action for e in undolog.approvals.events(v["approval_request_id"])][-1] == "approve"
    assert graph.get_state(c).interrupts == ()


@pytest.mark.parametrize("kind", KINDS)
# README "Use a LangChain HITL client as UndoLog's approval UI" > "UndoLog's own form is accepted too": the approve,
# modify and reject lines are run by the three tests below (respond: test_langgraph_readme.py).
def test_modify_runs_the_edited_arguments(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    graph.invoke(user("delete only"), c)
    # A bad edit is refused by the core and the graph asks again, saying why.
    graph.invoke(Command(resume={"decision": "modify", "args": {"user_id": 7, "x": 1}, "approver": "ana"}), c)
    [intr] = graph.get_state(c).interrupts
    assert intr.value["undolog"]["error"] and "x" in intr.value["undolog"]["error"]
    graph.invoke(Command(resume={"decision": "modify", "args": {"user_id": "u-3003"}, "approver": "ana"}), c)
    assert world.account_status("u-3003") == "deleted" and world.account_status("u-1042") == "active"
    assert count(world, "delete_account") == 1


@pytest.mark.parametrize("kind", KINDS)
def test_reject_ends_normally_and_halts_the_thread(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    tid = c["configurable"]["thread_id"]
    graph.invoke(user("three tiers"), c)
    out = graph.invoke(Command(resume={"decision": "reject", "approver": "bo", "reason": "open chargeback"}), c)
    [m] = tms(out, "delete_user_account")
    assert m.status == "error" and "NOT run" in m.content and "open chargeback" in m.content and "bo" in m.content
    assert world.account_status("u-1042") == "active" and count(world, "delete_account") == 0
    assert undolog.sessions.get(tid).state == "halted"
    # A later turn: refused until a person resolves the session.
    out = graph.invoke(user("three tiers again"), c)
    if kind == "middleware":
        assert "halted" in final(out).content and "undolog sessions resume" in final(out).content
        assert count(world, "search") == 1  # nothing ran at all
    else:
        refused = tms(out, "send_refund_email")[-1]
        assert refused.status == "error" and "halted" in refused.content
    assert count(world, "send_refund_email") == 1
    # Resolved by a person: the thread works again.
    undolog.sessions.resume(tid, actor="ana")
    graph.invoke(user("refund only"), c)
    assert count(world, "send_refund_email") == 2


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_is_told_truthfully(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    undolog.policy.set(actor="admin", approval_timeout_seconds=1)
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    graph.invoke(user("delete only"), c)
    time.sleep(1.2)
    assert undolog.approvals.expire_due()
    out = graph.invoke(Command(resume=undolog_resume(graph, c, undolog=undolog)), c)
    [m] = tms(out, "delete_user_account")
    assert m.status == "error" and "timed out" in m.content and "NOT run" in m.content
    assert world.account_status("u-1042") == "active"


@pytest.mark.parametrize("kind", KINDS)
def test_resume_before_any_decision_runs_nothing(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    graph.invoke(user("delete only"), c)
    first = graph.get_state(c).interrupts[0].value["undolog"]["approval_request_id"]
    graph.invoke(Command(resume=undolog_resume(graph, c, undolog=undolog)), c)
    [again] = graph.get_state(c).interrupts
    assert again.value["undolog"]["approval_request_id"] == first  # the same request, not a second one
    assert len(undolog.approvals.list()) == 1 and count(world, "delete_account") == 0
    undolog.approvals.approve(first, approver="ana")
    graph.invoke(Command(resume=undolog_resume(graph, c, undolog=undolog)), c)
    assert count(world, "delete_account") == 1


def test_bad_resume_value_is_refused_and_can_be_answered_again(undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build("middleware", undolog, tools, InMemorySaver())
    c = cfg()
    graph.invoke(user("delete only"), c)
    with pytest.raises(Exception, match="approver"):
        graph.invoke(Command(resume={"decision": "approve"}), c)
    assert graph.get_state(c).interrupts and count(world, "delete_account") == 0
    graph.invoke(Command(resume=ANA), c)
    assert count(world, "delete_account") == 1


# ------------------------------------------------------------------------------------------ parallel calls


@pytest.mark.parametrize("kind", KINDS)
def test_parallel_calls_each_run_exactly_once(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    # create_agent runs each call as its own task: the ungated ones run at once. A hand-built ToolNode
    # runs the whole message as one task that LangGraph re-runs from the top on resume, and SAFE calls
    # are not logged (so not replayable): UndoLogToolNode runs none of the message's calls until every
    # gated one is decided, and then each exactly once.
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    graph.invoke(user("parallel"), c)
    ran_before = 1 if kind == "middleware" else 0
    assert count(world, "send_refund_email") == 2 * ran_before and count(world, "search") == ran_before
    assert count(world, "delete_account") == 0
    [intr] = graph.get_state(c).interrupts
    graph.invoke(Command(resume=ANA), c)
    assert count(world, "send_refund_email") == 2 and count(world, "delete_account") == 1
    assert count(world, "search") == 1
    assert len(world.emails()) == 2
    assert [m.status for m in tms(graph.get_state(c).values)] == ["success"] * 4


def test_node_rerun_on_resume_runs_no_sibling_twice(undolog: Any, world: SupportWorld, tools: Any) -> None:
    # Several resumes of the same node (undecided, then a bad edit, then the approval): LangGraph re-runs the
    # task each time; the SAFE and COMPENSABLE siblings still run once, after the decision.
    graph = build("node", undolog, tools, InMemorySaver())
    c = cfg()
    graph.invoke(user("parallel"), c)
    graph.invoke(Command(resume=undolog_resume(graph, c, undolog=undolog)), c)
    graph.invoke(Command(resume={"decision": "modify", "args": {"nope": 1}, "approver": "ana"}), c)
    assert graph.get_state(c).interrupts[0].value["undolog"]["error"]
    assert count(world, "search") == 0 and count(world, "send_refund_email") == 0
    graph.invoke(Command(resume=ANA), c)
    assert count(world, "search") == 1 and count(world, "send_refund_email") == 2
    assert count(world, "delete_account") == 1 and graph.get_state(c).interrupts == ()


@pytest.mark.parametrize("kind", KINDS)
def test_two_gated_calls_in_one_message(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    graph.invoke(user("two gated"), c)
    interrupts = graph.get_state(c).interrupts
    reqs = [r for i in interrupts for r in i.value["undolog"]["requests"]]
    assert sorted(r["args"]["user_id"] for r in reqs) == ["u-1042", "u-3003"]
    assert len(undolog.approvals.pending()) == 2
    if kind == "node":
        # One interrupt holding both requests; a single decision would be ambiguous and is refused.
        [intr] = interrupts
        with pytest.raises(Exception, match="holds several calls"):
            graph.invoke(Command(resume=ANA), c)
        first, second = reqs
        graph.invoke(Command(resume={"decisions": {first["approval_request_id"]: ANA}}), c)
        [left] = graph.get_state(c).interrupts
        assert [r["approval_request_id"] for r in left.value["undolog"]["requests"]] == [second["approval_request_id"]]
        graph.invoke(Command(resume=ANA), c)
    else:
        graph.invoke(Command(resume={i.id: ANA for i in interrupts}), c)
    assert world.account_status("u-1042") == "deleted" and world.account_status("u-3003") == "deleted"
    assert count(world, "delete_account") == 2
    assert graph.get_state(c).interrupts == ()


# ------------------------------------------------------------------------------------------ failure and rollback


@pytest.mark.parametrize("kind", KINDS)
def test_compensable_failure_rolls_back(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    out = graph.invoke(user("failing"), c)
    failed = tms(out, "send_refund_email")[-1]
    assert failed.status == "error" and "exceeds the total of order B-9" in failed.content
    assert failed.content.count("cancel_refund_email undid send_refund_email") == 2
    assert [e.status for e in world.emails()] == ["recalled", "recalled"]
    assert undolog.sessions.get(c["configurable"]["thread_id"]).state == "rolled_back"
    steps = failed.response_metadata["undolog"]["rollback"]
    assert [s["outcome"] for s in steps] == ["compensated"] * 3  # LIFO, the failed call's own undo first
    assert "I could not finish" in final(out).content
    # The next user turn starts a new session for the thread (the old one is closed).
    if kind == "middleware":
        graph.invoke(user("refund only"), c)
        assert session_for_thread(c["configurable"]["thread_id"], undolog=undolog).endswith("#2")
        assert world.emails()[-1].status == "queued"


def test_compensation_after_delivery_fails_honestly(undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build("middleware", undolog, tools, InMemorySaver())
    c = cfg()
    tid = c["configurable"]["thread_id"]
    graph.invoke(user("refund only"), c)
    world.deliver_now()
    report = rollback(tid, undolog=undolog)
    assert [s.outcome for s in report.steps] == ["compensation_failed"]
    assert "already delivered" in (report.steps[0].error or "")
    assert not report.complete and undolog.sessions.get(tid).state == "halted"
    assert world.emails()[0].status == "delivered"


def test_graph_interrupt_inside_a_tool_passes_through(undolog: Any, world: SupportWorld, tools: Any) -> None:
    @lc_tool
    def ask_customer(question: str) -> str:
        """Ask the customer and wait for the answer."""
        return f"customer says {interrupt({'question': question})}"

    model = ScriptedChatModel(scripts={"ask": [[("ask_customer", {"question": "which order?"})], [REFUND]]})
    graph = create_agent(model, [ask_customer, *tools.agent_tools], checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tiers={"ask_customer": ToolTier.SAFE},
                                                       compensations=[tools.cancel_refund_email])])
    c = cfg()
    graph.invoke(user("ask first"), c)
    [intr] = graph.get_state(c).interrupts
    assert intr.value == {"question": "which order?"}  # untouched
    assert undolog.sessions.get(c["configurable"]["thread_id"]).state == "active"
    out = graph.invoke(Command(resume="A-1042"), c)
    assert tms(out, "ask_customer")[0].content == "customer says A-1042"
    assert count(world, "send_refund_email") == 1


def test_interrupt_inside_a_compensable_tool_runs_it_once_on_resume(undolog: Any, world: SupportWorld) -> None:
    ran: list[str] = []

    @lc_tool
    def book_slot(day: str) -> dict:
        """Book a call-back slot, after the customer confirms."""
        answer = interrupt({"confirm": day})  # LangGraph re-runs the tool from the top on resume
        ran.append(answer)
        return {"booking": f"b-{day}-{answer}"}

    model = ScriptedChatModel(scripts={"book": [[("book_slot", {"day": "mon"})]]})
    tiers = {"book_slot": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=lambda ctx: None)}
    graph = create_agent(model, [book_slot], checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tiers=tiers)])
    c = cfg()
    graph.invoke(user("book"), c)
    assert graph.get_state(c).interrupts[0].value == {"confirm": "mon"}
    sid = c["configurable"]["thread_id"]
    [eff] = undolog.sessions.effects(sid)
    assert eff["state"] == "released" and undolog.recover().reconciled == []  # paused, not crashed
    out = graph.invoke(Command(resume="yes"), c)
    assert tms(out, "book_slot")[0].status != "error"
    assert ran == ["yes"]
    [eff2] = undolog.sessions.effects(sid)
    assert eff2["effect_id"] == eff["effect_id"] and eff2["state"] == "committed"
    assert eff2["result_snapshot"] == {"booking": "b-mon-yes"}


def test_third_party_tools_with_a_tier_mapping(undolog: Any, world: SupportWorld) -> None:
    undone: list[str] = []

    @lc_tool
    def book_slot(day: str) -> dict:
        """Book a call-back slot."""
        return {"booking": f"b-{day}"}

    @lc_tool
    def charge_card(amount: float) -> str:
        """Charge the card on file."""
        raise RuntimeError("card declined")

    def release_slot(ctx: Any) -> None:
        undone.append(ctx.result["booking"])

    model = ScriptedChatModel(scripts={"book": [[("book_slot", {"day": "mon"})], [("charge_card", {"amount": 5.0})]]})
    tiers = {
        "book_slot": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=release_slot),
        "charge_card": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=lambda ctx: None),
    }
    node = UndoLogToolNode([book_slot, charge_card], undolog=undolog, tiers=tiers)
    g = StateGraph(MessagesState)
    g.add_node("agent", lambda s: {"messages": [model.invoke(s["messages"])]})
    g.add_node("tools", node)
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    out = g.compile(checkpointer=InMemorySaver()).invoke(user("book it"), cfg())
    assert undone == ["b-mon"]
    assert "card declined" in tms(out, "charge_card")[0].content


def _switch_to_delete(request: Any, delete_tool: Any) -> Any:
    call = {**request.tool_call, "name": "delete_user_account", "args": {"user_id": "u-1042"}}
    return request.override(tool_call=call, tool=delete_tool)


def test_node_wrapper_cannot_switch_or_repeat_a_gated_call(undolog: Any, world: SupportWorld, tools: Any) -> None:
    # LangChain #40166: a wrapper inside UndoLog's that edits the call after the gate must not run an
    # IRREVERSIBLE tool unapproved, nor run a logged call twice.
    holder: dict[str, Any] = {}

    def wrapper(request: Any, execute: Any) -> Any:
        if request.tool_call["name"] == "search_knowledge_base":
            return execute(_switch_to_delete(request, holder["node"].tools_by_name["delete_user_account"]))
        execute(request)
        return execute(request)  # a naive retry

    model = ScriptedChatModel(scripts={"go": [[SEARCH, REFUND]]})
    node = UndoLogToolNode(tools.agent_tools, undolog=undolog, compensations=[tools.cancel_refund_email],
                           wrap_tool_call=wrapper)
    holder["node"] = node
    g = StateGraph(MessagesState)
    g.add_node("agent", lambda s: {"messages": [model.invoke(s["messages"])]})
    g.add_node("tools", node)
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    out = g.compile(checkpointer=InMemorySaver()).invoke(user("go"), cfg())
    [switched] = [m for m in tms(out) if "switched the call" in m.content]
    assert switched.status == "error" and "NOT run" in switched.content
    [repeated] = [m for m in tms(out) if "second time" in m.content]
    assert repeated.status == "error"
    assert world.account_status("u-1042") == "active" and count(world, "delete_account") == 0
    assert count(world, "search") == 0
    assert count(world, "send_refund_email") == 1 and len(world.emails()) == 1


def test_middleware_must_be_the_innermost_tool_wrapper(undolog: Any, world: SupportWorld, tools: Any) -> None:
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.tools import tool as to_tool

    delete_tool = to_tool(tools.delete_user_account)

    class Switcher(AgentMiddleware):  # type: ignore[misc]
        def wrap_tool_call(self, request: Any, handler: Any) -> Any:
            return handler(_switch_to_delete(request, delete_tool))

    model = ScriptedChatModel(scripts={"look": [[SEARCH]]})

    def agent(*middleware: Any) -> Any:
        return create_agent(model, tools.agent_tools, checkpointer=InMemorySaver(), middleware=list(middleware))

    # Inside UndoLog's wrapper, the switch would run the deletion unapproved: refused, nothing runs.
    ul_mw = UndoLogMiddleware(undolog, tools=tools.agent_tools, compensations=[tools.cancel_refund_email],
                              interrupt_mode="per_call")
    with pytest.raises(errors.ConfigurationError, match="last middleware"):
        agent(ul_mw, Switcher()).invoke(user("look it up"), cfg())
    assert count(world, "delete_account") == 0 and count(world, "search") == 0
    # Outside it, UndoLog gates the call that will really run: the deletion waits for a person.
    c = cfg()
    graph = agent(Switcher(), ul_mw)
    graph.invoke(user("look it up"), c)
    [intr] = graph.get_state(c).interrupts
    assert intr.value["undolog"]["tool"] == "delete_user_account" and count(world, "delete_account") == 0


def test_unclassified_tools_are_refused_before_anything_runs(undolog: Any, world: SupportWorld, tools: Any) -> None:
    @lc_tool
    def wire_money(amount: float) -> str:
        """Wire money."""
        raise AssertionError("must never run")

    with pytest.raises(errors.ToolNotClassified, match="wire_money"):
        UndoLogToolNode([tools.search_knowledge_base, wire_money], undolog=undolog)
    with pytest.raises(errors.ToolNotClassified, match="wire_money"):
        UndoLogMiddleware(undolog, tools=[wire_money])
    # Without tools=, the middleware checks the first model request: the run fails, nothing ran.
    model = ScriptedChatModel(scripts={"wire": [[("wire_money", {"amount": 1.0})]]})
    agent = create_agent(model, [tools.search_knowledge_base, wire_money], checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog)])
    with pytest.raises(errors.ToolNotClassified, match="wire_money"):
        agent.invoke(user("wire it"), cfg())
    assert count(world, "search") == 0


# ------------------------------------------------------------------------------------------ async


@pytest.mark.parametrize("kind", KINDS)
async def test_async_approve_and_rollback(kind: str, undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build(kind, undolog, tools, InMemorySaver())
    c = cfg()
    await graph.ainvoke(user("parallel"), c)
    assert count(world, "delete_account") == 0
    await graph.ainvoke(Command(resume=await aundolog_resume(graph, c, undolog=undolog)), c)  # undecided
    assert (await graph.aget_state(c)).interrupts
    await graph.ainvoke(Command(resume=ANA), c)
    assert count(world, "delete_account") == 1 and count(world, "send_refund_email") == 2
    assert len(world.emails()) == 2
    c2 = cfg()
    out = await graph.ainvoke(user("failing"), c2)
    assert "cancel_refund_email undid" in tms(out, "send_refund_email")[-1].content
    assert [e.status for e in world.emails()][-2:] == ["recalled", "recalled"]


# ------------------------------------------------------------------------------------------ durability


_RESUME_SCRIPT = """
import json, os, sys
from langgraph.types import Command
sys.path.insert(0, os.environ["TEST_DIR"])
from test_langgraph_adapter import SCRIPTS, build, open_saver
from examples.support_agent.tools import make_tools
from examples.support_agent.world import SupportWorld
from undolog_adapters.langgraph import undolog_resume
from undolog_core import UndoLog

a = json.loads(os.environ["ARGS"])
undolog = UndoLog.open()
tools = make_tools(SupportWorld(a["world"]))
with open_saver(a["saver"], a["saver_path"]) as saver:
    graph = build(a["kind"], undolog, tools, saver)
    config = {"configurable": {"thread_id": a["thread"]}}
    out = graph.invoke(Command(resume=undolog_resume(graph, config, undolog=undolog)), config)
print(json.dumps({"final": out["messages"][-1].content}))
"""


class open_saver:
    """A checkpointer on a durable store, opened afresh (as another process would)."""

    def __init__(self, kind: str, path: str) -> None:
        self.kind, self.path = kind, path

    def __enter__(self) -> Any:
        if self.kind == "sqlite":
            self.conn = sqlite3.connect(self.path, check_same_thread=False)
            return SqliteSaver(self.conn)
        from langgraph.checkpoint.postgres import PostgresSaver

        self.cm = PostgresSaver.from_conn_string(PG_CHECKPOINTS)
        saver = self.cm.__enter__()
        saver.setup()
        return saver

    def __exit__(self, *exc: Any) -> None:
        if self.kind == "sqlite":
            self.conn.close()
        else:
            self.cm.__exit__(*exc)


@pytest.mark.parametrize(("kind", "saver_kind"), [("node", "sqlite"), ("middleware", "sqlite"), ("middleware", "postgres")])
# README "Deciding elsewhere": undolog_resume (here), aundolog_resume (test_async_approve_and_rollback),
# resume_decided (test_resume_decided_resumes_only_fully_decided_threads).
@pytest.mark.storage
def test_decided_elsewhere_then_resumed_by_a_new_process(
    kind: str, saver_kind: str, db: Any, world: SupportWorld, tools: Any, tmp_path: Path
) -> None:
    undolog = db.open()
    saver_path = str(tmp_path / "checkpoints.sqlite")
    thread = "t-" + uuid.uuid4().hex[:10]
    with open_saver(saver_kind, saver_path) as saver:
        graph = build(kind, undolog, tools, saver)
        graph.invoke(user("parallel"), cfg(thread))
        [intr] = graph.get_state(cfg(thread)).interrupts
    assert count(world, "send_refund_email") == (2 if kind == "middleware" else 0)
    # An approver decides through the core API (as the CLI or dashboard would), from another UndoLog.
    other = db.open()
    other.approvals.approve(intr.value["undolog"]["approval_request_id"], approver="ana", reason="checked")
    env = {**os.environ, **db.env, "TEST_DIR": str(Path(__file__).parent), "PYTHONPATH": str(ROOT),
           "ARGS": json.dumps({"kind": kind, "world": world.path, "saver": saver_kind, "saver_path": saver_path,
                               "thread": thread})}
    proc = subprocess.run([sys.executable, "-c", _RESUME_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["final"].startswith("All done")
    assert count(world, "delete_account") == 1 and count(world, "send_refund_email") == 2
    assert count(world, "search") == 1
    assert world.account_status("u-3003") == "deleted"


def test_resume_decided_resumes_only_fully_decided_threads(undolog: Any, world: SupportWorld, tools: Any) -> None:
    graph = build("middleware", undolog, tools, InMemorySaver())
    a, b = cfg(), cfg()
    graph.invoke(user("delete only"), a)
    graph.invoke(user("two gated"), b)
    undolog.approvals.approve(graph.get_state(a).interrupts[0].value["undolog"]["approval_request_id"], approver="ana")
    first_b = graph.get_state(b).interrupts[0].value["undolog"]["approval_request_id"]
    undolog.approvals.approve(first_b, approver="ana")
    done = resume_decided(graph, undolog=undolog)
    assert list(done) == [a["configurable"]["thread_id"]]
    assert world.account_status("u-1042") == "deleted" and count(world, "delete_account") == 1
    assert graph.get_state(b).interrupts


def test_async_sqlite_saver(undolog: Any, world: SupportWorld, tools: Any, tmp_path: Path) -> None:
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver

    async def go() -> None:
        async with AsyncSqliteSaver.from_conn_string(str(tmp_path / "a.sqlite")) as saver:
            graph = build("node", undolog, tools, saver)
            c = cfg()
            await graph.ainvoke(user("three tiers"), c)
            await graph.ainvoke(Command(resume=ANA), c)
        assert count(world, "delete_account") == 1 and count(world, "send_refund_email") == 1

    asyncio.run(go())
