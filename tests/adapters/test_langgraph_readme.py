"""The README's "LangGraph and LangChain" section, snippet by snippet and claim by claim.

Each test names the README paragraph it runs. The other snippets of the section are run by:
``test_langgraph_hitl.py`` ("Use a LangChain HITL client as UndoLog's approval UI": the decisions, who decided, the
callbacks), ``test_langgraph_siblings.py`` (the same section's rejection paragraph, for ``create_agent``),
``test_langgraph_injected.py`` ("Injected arguments"), ``test_langgraph_retry.py`` ("Retries") and
``test_langgraph_adapter.py`` (UndoLog's own resume form, deciding elsewhere: ``undolog_resume``,
``aundolog_resume``, ``resume_decided``).
"""

from __future__ import annotations

import decimal
import uuid
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command

from examples.support_agent.model import ScriptedChatModel
from examples.support_agent.tools import make_tools
from examples.support_agent.world import SupportWorld
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogPolicy, UndoLogToolNode
from undolog_core import OnFailure, ToolTier, compensation, undolog_tool
from undolog_core.errors import ConfigurationError, ContractChanged

SCRIPTS = {
    "delete": [[("delete_user_account", {"user_id": "u-1042"})]],
    "refund": [[("send_refund_email", {"user_id": "u-1042", "amount": 42.5, "order_id": "A-1042"})]],
    "pay": [[("pay_invoice", {"amount": "25.50"})], [("pay_invoice", {"amount": "900.10"})]],
}


@pytest.fixture
def tools(tmp_path: Path) -> Any:
    return make_tools(SupportWorld(tmp_path / "world.sqlite", delivery_delay=30.0))


def cfg() -> dict[str, Any]:
    return {"configurable": {"thread_id": uuid.uuid4().hex[:10]}}


def test_wiring_snippet(undolog: Any, tools: Any) -> None:
    # README "LangGraph and LangChain": the first snippet, as written.
    model = ScriptedChatModel(scripts=SCRIPTS)
    search_knowledge_base, send_refund_email = tools.search_knowledge_base, tools.send_refund_email
    delete_user_account, cancel_refund_email = tools.delete_user_account, tools.cancel_refund_email
    builder = StateGraph(MessagesState)

    tools = [search_knowledge_base, send_refund_email, delete_user_account]

    agent = create_agent(model, tools, checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools, compensations=[cancel_refund_email],
                                                       approver="ana")])

    builder.add_node("tools", UndoLogToolNode(tools, undolog=undolog, compensations=[cancel_refund_email]))

    c = cfg()
    agent.invoke({"messages": [{"role": "user", "content": "delete my account"}]}, c)
    [pause] = agent.get_state(c).interrupts
    agent.invoke(Command(resume={pause.id: {"type": "approve"}}), c)
    rid = pause.value["undolog"]["approval_request_id"]
    assert undolog.approvals.get(rid).decided_by == "ana"


def test_on_failure_and_approver_are_checked_at_construction(undolog: Any, tools: Any) -> None:
    # README "LangGraph and LangChain": on_failure "bogus" raises ConfigurationError when the adapter is built.
    with pytest.raises(ConfigurationError, match="on_failure.*'bogus'"):
        UndoLogMiddleware(undolog, tools=tools.agent_tools, on_failure="bogus")
    with pytest.raises(ConfigurationError, match="on_failure.*'bogus'"):
        UndoLogToolNode(tools.agent_tools, undolog=undolog, on_failure="bogus")
    with pytest.raises(ConfigurationError, match="approver"):
        UndoLogMiddleware(undolog, approver=" ")
    UndoLogToolNode(tools.agent_tools, undolog=undolog, on_failure=OnFailure.CONTINUE,
                    compensations=[tools.cancel_refund_email])


def test_tiers_snippet(undolog: Any) -> None:
    # README "LangGraph and LangChain" > "Tiers": the tiers= snippet, for third-party (undecorated) tools.
    def search(query: str) -> str:
        """Search."""
        return "found"

    def send_refund_email(user_id: str) -> str:
        """Send a refund email."""
        return "sent"

    def delete_user_account(user_id: str) -> str:
        """Delete an account."""
        return "deleted"

    def cancel_refund_email(ctx: Any) -> None:
        return None

    tiers = {
        "search": ToolTier.SAFE,
        "send_refund_email": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=cancel_refund_email),
        "delete_user_account": {"tier": "irreversible", "reason": "Erases the customer", "risk_tags": ["pii"]},
    }
    UndoLogToolNode([search, send_refund_email, delete_user_account], undolog=undolog, tiers=tiers)
    assert undolog.tool_spec("delete_user_account").risk_tags == ("pii",)
    assert undolog.tool_spec("send_refund_email").compensation.name == "cancel_refund_email"


def test_a_classification_stays_in_the_store(undolog: Any) -> None:
    # README "Tiers": re-classifying a tool is a new revision; a running session refuses it until revalidated.
    def lookup(q: str) -> str:
        """Look something up."""
        return q

    UndoLogToolNode([lookup], undolog=undolog, tiers={"lookup": "safe"})
    s = undolog.session()
    assert s.call_sync("lookup", q="x") == "x"
    UndoLogToolNode([lookup], undolog=undolog,
                    tiers={"lookup": UndoLogPolicy("compensable", compensation=lambda ctx: None)})
    assert [h["tier"] for h in undolog.registry.history("lookup")] == ["safe", "compensable"]
    with pytest.raises(ContractChanged):
        s.call_sync("lookup", q="y")
    s.revalidate(actor="ana")
    assert s.call_sync("lookup", q="y") == "y"


def test_tool_messages_carry_undolog_metadata(undolog: Any, tools: Any) -> None:
    # README "What the model reads": response_metadata["undolog"] on the messages UndoLog writes or lets through.
    model = ScriptedChatModel(scripts={**SCRIPTS, "search": [[("search_knowledge_base", {"query": "refund"})]]})
    agent = create_agent(model, tools.agent_tools, checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools.agent_tools, approver="ana",
                                                       compensations=[tools.cancel_refund_email])])
    c = cfg()
    out = agent.invoke({"messages": [{"role": "user", "content": "refund please"}]}, c)
    [sent] = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    meta = sent.response_metadata["undolog"]
    assert meta["tier"] == "compensable" and meta["effect_id"] and meta["session_id"] == c["configurable"]["thread_id"]
    out = agent.invoke({"messages": [{"role": "user", "content": "search it"}]}, c)
    assert "undolog" not in [m for m in out["messages"] if isinstance(m, ToolMessage)][-1].response_metadata
    agent.invoke({"messages": [{"role": "user", "content": "delete it"}]}, c)
    [pause] = agent.get_state(c).interrupts
    out = agent.invoke(Command(resume={pause.id: {"type": "reject", "message": "no"}}), c)
    refused = [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]
    assert refused.response_metadata["undolog"] == {"refused": "approval_rejected"}


def test_a_failed_call_is_compensated_too_with_its_json_snapshot(undolog: Any) -> None:
    # README "Failures roll back": the failed call's own compensation runs first; a Decimal arrives as a string.
    seen: list[Any] = []

    @compensation("void_payment")
    def void_payment(ctx: Any) -> None:
        seen.append((ctx.args, ctx.result))

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="void_payment")
    def pay_invoice(amount: decimal.Decimal) -> dict[str, Any]:
        """Pay an invoice."""
        if amount > 100:
            raise ValueError("over the limit")
        return {"paid": amount}

    agent = create_agent(ScriptedChatModel(scripts=SCRIPTS), [pay_invoice], checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=[pay_invoice], compensations=[void_payment])])
    out = agent.invoke({"messages": [{"role": "user", "content": "pay twice"}]}, cfg())
    assert seen == [({"amount": "900.10"}, None), ({"amount": "25.50"}, {"paid": "25.50"})]
    last = [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]
    assert last.status == "error" and last.response_metadata["undolog"]["failed"] is True
    assert [s["outcome"] for s in last.response_metadata["undolog"]["rollback"]] == ["compensated", "compensated"]


def test_undologs_own_form_respond(undolog: Any, tools: Any) -> None:
    # README "UndoLog's own form is accepted too": the respond line (approve / modify / reject are run by
    # test_langgraph_adapter.py: test_each_tier_and_approve, test_modify_runs_the_edited_arguments,
    # test_reject_ends_normally_and_halts_the_thread).
    model = ScriptedChatModel(scripts=SCRIPTS)
    g = StateGraph(MessagesState)
    g.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    g.add_node("tools", UndoLogToolNode(tools.agent_tools, undolog=undolog, compensations=[tools.cancel_refund_email]))
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    graph, config = g.compile(checkpointer=InMemorySaver()), cfg()
    graph.invoke({"messages": [{"role": "user", "content": "delete my account"}]}, config)

    out = graph.invoke(Command(resume={"decision": "respond", "approver": "ana", "response": "Archived instead."}),
                       config)

    [msg] = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert msg.content == "Archived instead." and msg.status == "success"


def test_responded_elsewhere_then_resumed_from_the_store(undolog: Any, tools: Any) -> None:
    # README "Deciding elsewhere": a respond decided through the approval service reaches the model on resume.
    from undolog_adapters.langgraph import undolog_resume

    agent = create_agent(ScriptedChatModel(scripts=SCRIPTS), tools.agent_tools, checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools.agent_tools,
                                                       compensations=[tools.cancel_refund_email])])
    config = cfg()
    agent.invoke({"messages": [{"role": "user", "content": "delete my account"}]}, config)
    [pause] = agent.get_state(config).interrupts
    undolog.approvals.respond(pause.value["undolog"]["approval_request_id"], approver="ana",
                              response="Kept the account; sent the export instead.")
    out = agent.invoke(Command(resume=undolog_resume(agent, config, undolog=undolog)), config)
    [msg] = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert msg.content == "Kept the account; sent the export instead." and msg.status == "success"
