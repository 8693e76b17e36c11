"""One client function, written only for LangChain's ``HumanInTheLoopMiddleware``, drives UndoLog's middleware
unchanged in both of LangChain's interrupt modes.

LangChain's default is ``interrupt_mode="batched"``: one ``HITLRequest`` per model message, answered by
``{"decisions": [...]}``. UndoLog's middleware used to pause per call only, so a client written for the default broke
as soon as one message held two gated calls (LangGraph: "must specify the interrupt id"). Here LangChain's own
middleware and UndoLog's run side by side under the same client, a real ``create_agent``, a scripted model and a real
checkpointer; every interrupt value is checked against the installed LangChain's own TypedDicts.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langchain.agents.middleware.human_in_the_loop import (
    Decision,
    HITLRequest,
    HITLResponse,
    ToolApprovalRequest,
)
from langchain_core.messages import AIMessage, ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from pydantic import TypeAdapter

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_core import ToolTier, errors, undolog_tool

pytestmark = pytest.mark.reads_store

MODES = pytest.mark.parametrize("mode", ["batched", "per_call"])
SCRIPTS: dict[str, Any] = {
    # One model message, two gated calls: the case a per-call-only middleware broke a batched client on.
    "close both": [[("close_account", {"user_id": "u-1"}), ("close_account", {"user_id": "u-2"})]],
}


def make_tools(ran: list[tuple[str, str]]) -> list[Any]:
    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good")
    def close_account(user_id: str) -> str:
        """Close a customer's account."""
        ran.append(("close_account", user_id))
        return f"closed {user_id}"

    return [close_account]


def langchain_agent(mode: str, ran: list[tuple[str, str]]) -> Any:
    return create_agent(ScriptedChatModel(scripts=SCRIPTS), make_tools(ran), checkpointer=InMemorySaver(),
                        middleware=[HumanInTheLoopMiddleware(interrupt_on={"close_account": True},
                                                             interrupt_mode=mode)])


def undolog_agent(undolog: Any, mode: str, ran: list[tuple[str, str]]) -> Any:
    tools = make_tools(ran)
    return create_agent(ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=InMemorySaver(),
                        middleware=[UndoLogMiddleware(undolog, tools=tools, approver="ana", interrupt_mode=mode)])


def client(agent: Any, text: str, decide: Any, mode: str) -> list[str]:
    """A client written for LangChain's HumanInTheLoopMiddleware, and nothing else: it shows each pause's actions,
    answers them with ``decide(action) -> Decision`` as LangChain's docs do for the mode, and returns what it shows
    the user at the end (the tool results and the agent's last message)."""
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    out = agent.invoke({"messages": [{"role": "user", "content": text}]}, config, version="v2")
    while out.interrupts:
        if mode == "batched":
            [pause] = out.interrupts  # batched: one HITLRequest for the message
            request = TypeAdapter(HITLRequest).validate_python(pause.value)
            response = HITLResponse(decisions=[decide(a) for a in request["action_requests"]])
            resume: Any = response
        else:
            resume = {}
            for pause in out.interrupts:  # per_call: one ToolApprovalRequest per call, keyed by interrupt id
                request = TypeAdapter(ToolApprovalRequest).validate_python(pause.value)
                resume[pause.id] = decide(request)
        out = agent.invoke(Command(resume=resume), config, version="v2")
    messages = out.value["messages"]
    shown = [str(m.content) for m in messages if isinstance(m, ToolMessage)]
    last = messages[-1]
    return [*shown, str(last.content)] if isinstance(last, AIMessage) else shown


def approve(action: Any) -> Decision:
    return {"type": "approve"}


def edit_u2(action: Any) -> Decision:
    if action["args"] == {"user_id": "u-2"}:
        return {"type": "edit", "edited_action": {"name": "close_account", "args": {"user_id": "u-9"}}}
    return {"type": "approve"}


def respond(action: Any) -> Decision:
    return {"type": "respond", "message": f"kept {action['args']['user_id']}: archived instead"}


def reject_u2(action: Any) -> Decision:
    if action["args"] == {"user_id": "u-2"}:
        return {"type": "reject", "message": "u-2 has an open chargeback"}
    return {"type": "approve"}


@MODES
@pytest.mark.parametrize("decide", [approve, edit_u2, respond], ids=["approve", "edit", "respond"])
def test_the_same_client_drives_langchains_middleware_and_undologs(undolog: Any, mode: str, decide: Any) -> None:
    theirs: list[tuple[str, str]] = []
    ours: list[tuple[str, str]] = []
    shown_theirs = client(langchain_agent(mode, theirs), "close both accounts", decide, mode)
    shown_ours = client(undolog_agent(undolog, mode, ours), "close both accounts", decide, mode)
    assert sorted(ours) == sorted(theirs)  # the same calls ran, with the same arguments
    if decide is approve:
        assert sorted(ours) == [("close_account", "u-1"), ("close_account", "u-2")]
        assert "closed u-1" in shown_ours and "closed u-2" in shown_ours
    elif decide is edit_u2:
        assert sorted(ours) == [("close_account", "u-1"), ("close_account", "u-9")]
    else:
        assert ours == [] and "kept u-1: archived instead" in shown_ours
        assert "kept u-1: archived instead" in shown_theirs
    assert len(undolog.approvals.list()) == 2


@MODES
def test_a_reject_halts_the_session_and_the_client_shows_the_halt_notice(undolog: Any, mode: str) -> None:
    theirs: list[tuple[str, str]] = []
    ours: list[tuple[str, str]] = []
    client(langchain_agent(mode, theirs), "close both accounts", reject_u2, mode)
    assert theirs == [("close_account", "u-1")]  # LangChain runs the approved sibling
    shown = client(undolog_agent(undolog, mode, ours), "close both accounts", reject_u2, mode)
    # UndoLog's reject halts the session (the design's rule): the approved sibling answered in the same resume does
    # not run either, and what the client shows says so.
    assert ours == []
    text = "\n".join(shown)
    assert "u-2 has an open chargeback" in text and "halted" in text
    [session] = {r.session_id for r in undolog.approvals.list()}
    assert undolog.sessions.get(session).state == "halted"


def test_batched_is_the_default_and_one_pause_holds_the_message(undolog: Any) -> None:
    ran: list[tuple[str, str]] = []
    tools = make_tools(ran)
    agent = create_agent(ScriptedChatModel(scripts=SCRIPTS), tools, checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools, approver="ana")])
    config = {"configurable": {"thread_id": "t-default"}}
    out = agent.invoke({"messages": [{"role": "user", "content": "close both accounts"}]}, config, version="v2")
    [pause] = out.interrupts
    value = TypeAdapter(HITLRequest).validate_python(pause.value)
    assert [a["args"] for a in value["action_requests"]] == [{"user_id": "u-1"}, {"user_id": "u-2"}]
    assert [c["allowed_decisions"] for c in value["review_configs"]] == [["approve", "edit", "reject", "respond"]] * 2
    assert len(pause.value["undolog"]["requests"]) == 2 and ran == []
    # LangChain's own form, posted as its clients post it (no interrupt id: there is one pause).
    agent.invoke(Command(resume={"decisions": [{"type": "approve"}, {"type": "approve"}]}), config)
    assert sorted(ran) == [("close_account", "u-1"), ("close_account", "u-2")]


def test_an_unknown_interrupt_mode_is_refused_naming_both(undolog: Any) -> None:
    with pytest.raises(errors.ConfigurationError, match="'batched' or 'per_call'"):
        UndoLogMiddleware(undolog, interrupt_mode="batch")  # type: ignore[arg-type]


def test_batched_adds_no_graph_node_even_when_a_tool_pauses(undolog: Any) -> None:
    """The batched gate asks inside the model call the middleware wraps: no after_model node (nor any other node of
    UndoLog's) in the compiled graph, with or without a tool that pauses; the agent's graph is LangChain's own."""
    @undolog_tool(tier=ToolTier.SAFE)
    def look_up(order_id: str) -> str:
        """Look an order up."""
        return "shipped"

    ran: list[tuple[str, str]] = []
    quiet = UndoLogMiddleware(undolog, tools=[look_up])
    gated = UndoLogMiddleware(undolog, tools=make_tools(ran), approver="ana")
    assert isinstance(quiet, UndoLogMiddleware) and quiet.interrupt_mode == "batched"
    nodes = set(create_agent(ScriptedChatModel(scripts=SCRIPTS), [look_up], middleware=[quiet]).get_graph().nodes)
    assert "UndoLogMiddleware.after_model" not in nodes  # nothing to batch: no node per turn
    nodes = set(create_agent(ScriptedChatModel(scripts=SCRIPTS), make_tools(ran),
                             middleware=[gated]).get_graph().nodes)
    assert nodes == {"__start__", "model", "tools", "__end__"}, nodes  # the gate asks inside the model node
