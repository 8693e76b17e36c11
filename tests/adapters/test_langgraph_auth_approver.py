"""Under LangGraph's auth, a resume value cannot name another person as the approver.

On LangGraph Platform the run's config carries the authenticated user (``langgraph_auth_user``), and UndoLog records
that identity as the approver of a LangChain decision. UndoLog's own form names its approver itself
(``{"decision": "approve", "approver": "ana"}``): sent by an authenticated user, it recorded "ana" in the audit trail
although mallory decided. The authenticated identity is who decided: a value naming someone else for a request still
pending is not recorded, and the graph pauses again with the reason (``undolog.error``). A request already decided
(at the desk, then resumed with ``undolog_resume`` by a service account) is read from the store as before.

Real ``create_agent`` and ``StateGraph`` + ``UndoLogToolNode`` objects, a scripted model, a real checkpointer.
"""

from __future__ import annotations

from typing import Any

import pytest
from langgraph.types import Command

from tests.adapters.test_langgraph_hitl import AuthUser, World, agent, cfg, graph, user
from undolog_adapters.langgraph import undolog_resume
from undolog_core import RequestState


def _authed(c: dict[str, Any], who: str) -> dict[str, Any]:
    return {"configurable": {**c["configurable"], "langgraph_auth_user": AuthUser(who)}}


def _value(kind: str, pause: Any, decision: dict[str, Any]) -> Any:
    return {pause.id: decision} if kind == "agent" else {"decisions": [decision]}


@pytest.mark.parametrize("kind", ["agent", "graph"])
def test_an_authenticated_resume_cannot_name_another_approver(undolog: Any, kind: str) -> None:
    world = World()
    a, c = (agent if kind == "agent" else graph)(undolog, world), cfg()
    a.invoke(user("close my account"), c)
    [pause] = a.get_state(c).interrupts
    rid = pause.value["undolog"]["approval_request_id"]
    mallory = _authed(c, "mallory@example.com")

    a.invoke(Command(resume=_value(kind, pause, {"decision": "approve", "approver": "ana"})), mallory)
    assert world.ran == [] and undolog.approvals.get(rid).state == RequestState.PENDING, "recorded as ana's"
    [again] = a.get_state(c).interrupts
    assert "mallory@example.com" in again.value["undolog"]["error"]

    # Her own name (or none: the identity is the approver) is recorded.
    a.invoke(Command(resume=_value(kind, again, {"decision": "approve", "approver": "mallory@example.com"})), mallory)
    rec = undolog.approvals.get(rid)
    assert rec.state == RequestState.APPROVED and rec.decided_by == "mallory@example.com"
    assert world.ran == [("close_account", "u-1")]


@pytest.mark.parametrize("kind", ["agent", "graph"])
def test_decided_at_the_desk_then_resumed_by_an_authenticated_service(undolog: Any, kind: str) -> None:
    world = World()
    a, c = (agent if kind == "agent" else graph)(undolog, world), cfg()
    a.invoke(user("close my account"), c)
    [pause] = a.get_state(c).interrupts
    rid = pause.value["undolog"]["approval_request_id"]
    undolog.approvals.approve(rid, approver="ana")  # the desk
    svc = _authed(c, "svc-resumer")
    a.invoke(Command(resume=undolog_resume(a, c, undolog=undolog)), svc)  # the value names ana, who decided: read from the store
    assert world.ran == [("close_account", "u-1")] and undolog.approvals.get(rid).decided_by == "ana"
    assert a.get_state(c).interrupts == ()
