"""Edits like LangChain's, checked like UndoLog's: what a LangChain HITL client shows and what the model reads.

Before: an edit whose arguments failed the tool's schema came back as the same pause, the reason only in
``undolog.error`` (a LangChain client shows ``description``); the published ``response_schema`` lacked the tool's
argument schema; and after an edit the model read a result that did not match its call (it asked for u-1 and read
"closed u-7"), where LangChain's own middleware tells it the call was replaced.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware.human_in_the_loop import HITLRequest, ToolApprovalRequest
from langchain_core.messages import ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from pydantic import TypeAdapter

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_core import RequestState, ToolTier, undolog_tool

pytestmark = pytest.mark.reads_store

MODES = pytest.mark.parametrize("mode", ["batched", "per_call"])
SCRIPTS: dict[str, Any] = {"close": [[("close_account", {"user_id": "u-1"})]]}


def build(undolog: Any, mode: str, ran: list[str]) -> Any:
    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good")
    def close_account(user_id: str) -> str:
        """Close a customer's account."""
        ran.append(user_id)
        return f"closed {user_id}"

    return create_agent(ScriptedChatModel(scripts=SCRIPTS), [close_account], checkpointer=InMemorySaver(),
                        middleware=[UndoLogMiddleware(undolog, tools=[close_account], approver="ana",
                                                      interrupt_mode=mode)])


def descriptions(value: dict[str, Any]) -> list[str]:
    if "action_requests" in value:
        return [a["description"] for a in TypeAdapter(HITLRequest).validate_python(value)["action_requests"]]
    return [TypeAdapter(ToolApprovalRequest).validate_python(value)["description"]]


def edit(args: dict[str, Any], mode: str) -> Any:
    decision = {"type": "edit", "edited_action": {"name": "close_account", "args": args}}
    return {"decisions": [decision]} if mode == "batched" else decision


@MODES
def test_an_invalid_edit_stays_pending_and_the_next_pause_says_why(undolog: Any, mode: str) -> None:
    ran: list[str] = []
    agent, config = build(undolog, mode, ran), {"configurable": {"thread_id": uuid.uuid4().hex}}
    out = agent.invoke({"messages": [{"role": "user", "content": "close my account"}]}, config, version="v2")
    [pause] = out.interrupts
    rid = pause.value["undolog"]["approval_request_id"]
    out = agent.invoke(Command(resume={pause.id: edit({"user": "u-7"}, mode)}), config, version="v2")
    [again] = out.interrupts
    [text] = descriptions(again.value)
    assert text.startswith("Your previous answer was not applied:") and "user_id" in text  # the field, named
    assert undolog.approvals.get(rid).state == RequestState.PENDING and ran == []
    agent.invoke(Command(resume={again.id: edit({"user_id": "u-7"}, mode)}), config)
    assert ran == ["u-7"]


@MODES
def test_the_response_schema_publishes_the_tools_argument_schema_for_edit(undolog: Any, mode: str) -> None:
    agent, config = build(undolog, mode, []), {"configurable": {"thread_id": uuid.uuid4().hex}}
    out = agent.invoke({"messages": [{"role": "user", "content": "close my account"}]}, config, version="v2")
    [pause] = out.interrupts
    schema = json.dumps(pause.response_schema)
    assert '"user_id"' in schema  # the tool's own argument, for the reviewer's edit form


@MODES
def test_after_an_edit_the_model_is_told_what_changed(undolog: Any, mode: str) -> None:
    ran: list[str] = []
    agent, config = build(undolog, mode, ran), {"configurable": {"thread_id": uuid.uuid4().hex}}
    out = agent.invoke({"messages": [{"role": "user", "content": "close my account"}]}, config, version="v2")
    [pause] = out.interrupts
    out = agent.invoke(Command(resume={pause.id: edit({"user_id": "u-7"}, mode)}), config, version="v2")
    [msg] = [m for m in out.value["messages"] if isinstance(m, ToolMessage)]
    assert ran == ["u-7"]
    assert "a human reviewer replaced this tool call" in msg.content
    assert 'Executed instead: close_account with arguments {"user_id": "u-7"}' in msg.content
    assert msg.content.endswith("closed u-7")
