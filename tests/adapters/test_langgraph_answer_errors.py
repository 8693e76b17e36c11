"""A malformed answer to an UndoLog pause gets one error: the problem and the fix, not every union branch's complaint.

Before: the resume raised a pydantic error of 4-5 union branches, the useful one third or fourth. Real
``create_agent``, a scripted model, a real checkpointer; LangGraph validates the answer against the pause's
``response_schema`` before saving it.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from langchain.agents import create_agent
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command
from pydantic import ValidationError

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_core import RequestState, ToolTier, undolog_tool

SCRIPTS = {"close": [[("close_account", {"user_id": "u-1"})]]}


@pytest.mark.parametrize(("answer", "says"), [
    ({"type": "edit", "edited_action": {"name": "close_account"}}, "edit.edited_action.args: Field required"),
    ({"decision": "reject", "approver": "ana"}, "a rejection needs a 'reason'"),
    ({"typ": "approve"}, "not an answer (keys ['typ']): answer with a LangChain decision"),
    ({"type": "aprove"}, "does not match any of the expected tags: 'approve', 'edit', 'reject', 'respond'"),
])
def test_one_error_with_the_problem_and_the_fix(undolog: Any, answer: Any, says: str) -> None:
    ran: list[str] = []

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good")
    def close_account(user_id: str) -> str:
        """Close a customer's account."""
        ran.append(user_id)
        return "closed"

    agent = create_agent(ScriptedChatModel(scripts=SCRIPTS), [close_account], checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=[close_account], approver="ana",
                                                       interrupt_mode="per_call")])
    config = {"configurable": {"thread_id": uuid.uuid4().hex}}
    out = agent.invoke({"messages": [{"role": "user", "content": "close my account"}]}, config, version="v2")
    [pause] = out.interrupts
    with pytest.raises(ValidationError) as raised:
        agent.invoke(Command(resume={pause.id: answer}), config)
    assert raised.value.error_count() == 1  # before: one per union branch
    problem = str(raised.value).splitlines()[1]
    assert says in problem and "send the answer again" in problem
    rid = pause.value["undolog"]["approval_request_id"]
    assert undolog.approvals.get(rid).state == RequestState.PENDING and ran == []


def test_a_middleware_without_an_approver_says_so_when_built(undolog: Any) -> None:
    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Closes the account for good")
    def close_account(user_id: str) -> str:
        """Close a customer's account."""
        return "closed"

    # Before: found only at the first decision, inside a union error dump.
    with pytest.warns(UserWarning, match="no approver= and close_account pause for a person"):
        UndoLogMiddleware(undolog, tools=[close_account])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        UndoLogMiddleware(undolog, tools=[close_account], approver="ana")
