"""The fragments of "Gating a LangChain tool" (docs/how-to/langgraph.md), run as written against a real agent.

A fragment names what is yours (``model``, ``builder``, ``agent``, ``graph``, ``config``, the tools): each test
builds that from the support agent of ``examples/`` (its real tools over a SQLite world, a scripted chat model,
LangChain's ``create_agent`` or a hand-built ``StateGraph`` with an in-memory checkpointer, a fresh UndoLog store)
and runs the page's text in a namespace holding it, then checks what the page says happened.

``CLAIMS`` lists every block run here; see ``tests/docs/test_howto.py`` for the rule.
"""

from __future__ import annotations

import ast
import asyncio
import gc
import inspect
import json
import uuid
import weakref
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command

from examples.support_agent.model import ScriptedChatModel
from examples.support_agent.tools import make_tools
from examples.support_agent.world import SupportWorld
from tests.docs.test_docs import blocks
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogPolicy, UndoLogToolNode
from undolog_core import ToolTier, undolog_tool

HERE = "tests/docs/test_howto_langgraph.py"
PAGE = "how-to/langgraph.md"

CLAIMS = [
    "from langchain.agents import create_agent",
    "from undolog_adapters.langgraph import UndoLogPolicy",
    "@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=\"remove_note\")",
    '{"type": "tool_approval"',
    "from langgraph.types import Command",
    'graph.invoke(Command(resume={"decision": "approve"',
    "from undolog_adapters.langgraph import aundolog_resume",
    "from langchain.agents.middleware import ToolRetryMiddleware",
    "class Audit(BaseCallbackHandler):",
]

#: The model's scripts, by a keyword of the user's message (the first key the message holds wins: longest first).
SCRIPTS = {
    "delete two": [[("delete_user_account", {"user_id": "u-1042"}), ("delete_user_account", {"user_id": "u-2002"})]],
    "refund and delete": [[("send_refund_email", {"user_id": "u-1042", "amount": 42.5, "order_id": "A-1042"})],
                          [("delete_user_account", {"user_id": "u-1042"})]],
    "erase sam": [[("delete_user_account", {"user_id": "u-2002"})]],
    "erase ravi": [[("delete_user_account", {"user_id": "u-3003"})]],
    "delete": [[("delete_user_account", {"user_id": "u-1042"})]],
    "overpay": [[("send_refund_email", {"user_id": "u-2002", "amount": 19.0, "order_id": "B-7"})],
                [("send_refund_email", {"user_id": "u-2002", "amount": 900.0, "order_id": "B-9"})]],
}


def block(first_line: str) -> str:
    assert first_line in CLAIMS, f"add {first_line!r} to CLAIMS"
    found = [b for b in blocks(PAGE) if b.code.startswith(first_line)]
    assert len(found) == 1, f"{PAGE}: {len(found)} blocks start with {first_line!r}"
    assert found[0].marker == ("runs-in", HERE), f"{PAGE}:{found[0].line}: mark the block <!-- runs-in: {HERE} -->"
    return found[0].code


def test_every_block_marked_for_this_file_is_run_here() -> None:
    for b in blocks(PAGE):
        if b.marker == ("runs-in", HERE):
            assert any(b.code.startswith(first) for first in CLAIMS), f"{PAGE}:{b.line}: no test here runs it"


def run(code: str, ns: dict[str, Any]) -> None:
    """Run a fragment as a notebook cell would: top-level ``await`` allowed."""
    out = eval(compile(code, PAGE, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT), ns)  # noqa: S307 - the page's own
    if inspect.iscoroutine(out):
        asyncio.run(out)


@pytest.fixture
def world(tmp_path: Path) -> SupportWorld:
    return SupportWorld(tmp_path / "world.sqlite", delivery_delay=30.0)


@pytest.fixture
def ns(undolog: Any, world: SupportWorld) -> dict[str, Any]:
    """What the page's fragments take as yours: the tools, a model, an UndoLog."""
    tools = make_tools(world)
    return {"undolog": undolog, "model": ScriptedChatModel(scripts=SCRIPTS), "ToolTier": ToolTier,
            "undolog_tool": undolog_tool, "UndoLogPolicy": UndoLogPolicy, "UndoLogMiddleware": UndoLogMiddleware,
            "search_knowledge_base": tools.search_knowledge_base, "send_refund_email": tools.send_refund_email,
            "delete_user_account": tools.delete_user_account, "cancel_refund_email": tools.cancel_refund_email,
            "tools": tools.agent_tools, "Command": Command}


def config() -> dict[str, Any]:
    return {"configurable": {"thread_id": "ticket-" + uuid.uuid4().hex[:8]}}


def turn(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def agent_of(ns: dict[str, Any], **kw: Any) -> Any:
    return create_agent(ns["model"], ns["tools"], checkpointer=InMemorySaver(),
                        middleware=[UndoLogMiddleware(ns["undolog"], tools=ns["tools"], approver="ana",
                                                      compensations=[ns["cancel_refund_email"]], **kw)])


def graph_of(ns: dict[str, Any]) -> Any:
    """A hand-built graph: the model, then ``UndoLogToolNode`` for its tool calls."""
    model = ns["model"]
    builder = StateGraph(MessagesState)
    builder.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    builder.add_node("tools", UndoLogToolNode(ns["tools"], undolog=ns["undolog"], approver="ana",
                                              compensations=[ns["cancel_refund_email"]]))
    builder.add_edge(START, "agent")
    builder.add_conditional_edges("agent", tools_condition)
    builder.add_edge("tools", "agent")
    return builder.compile(checkpointer=InMemorySaver())


def test_wiring_fragment_builds_both_entry_points(ns: dict[str, Any], world: SupportWorld) -> None:
    ns["builder"] = StateGraph(MessagesState)
    run(block("from langchain.agents import create_agent"), ns)
    assert "tools" in ns["builder"].nodes
    agent, c = ns["agent"], config()
    agent.invoke(turn("delete my account"), c)
    [pause] = agent.get_state(c).interrupts
    agent.invoke(Command(resume={pause.id: {"type": "approve"}}), c)
    request = ns["undolog"].approvals.get(pause.value["undolog"]["approval_request_id"])
    assert request.decided_by == "ana" and request.state == "approved"
    assert world.account_status("u-1042") == "deleted"


def test_tiers_fragment_classifies_third_party_tools(ns: dict[str, Any]) -> None:
    def search(query: str) -> str:
        """Search."""
        return query

    def send_refund_email(user_id: str) -> str:
        """Send a refund email."""
        return user_id

    def delete_user_account(user_id: str) -> str:
        """Delete an account."""
        return user_id

    def cancel_refund_email(ctx: Any) -> None:
        return None

    ns["cancel_refund_email"] = cancel_refund_email
    run(block("from undolog_adapters.langgraph import UndoLogPolicy"), ns)
    UndoLogToolNode([search, send_refund_email, delete_user_account], undolog=ns["undolog"], tiers=ns["tiers"])
    undolog = ns["undolog"]
    assert undolog.tool_spec("search").tier == ToolTier.SAFE
    assert undolog.tool_spec("send_refund_email").compensation.name == "cancel_refund_email"
    assert undolog.tool_spec("delete_user_account").risk_tags == ("pii",)


def test_injected_arguments_fragment_logs_only_what_the_model_sends(ns: dict[str, Any]) -> None:
    from langchain.tools import ToolRuntime
    from langchain_core.runnables import RunnableConfig

    from undolog_core import compensation

    ns.update(ToolRuntime=ToolRuntime, RunnableConfig=RunnableConfig)
    run(block('@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="remove_note")'), ns)

    @compensation("remove_note")
    def remove_note(ctx: Any) -> None:
        return None

    UndoLogToolNode([ns["add_note"]], undolog=ns["undolog"], compensations=[remove_note])
    schema = ns["undolog"].tool_spec("add_note").json_schema
    assert set(schema["properties"]) == {"text"}, schema


def _keys(value: Any) -> Any:
    return {k: _keys(v) for k, v in value.items()} if isinstance(value, dict) else None


def test_the_interrupt_value_shown_is_what_a_client_receives(ns: dict[str, Any]) -> None:
    agent, c = agent_of(ns, interrupt_mode="per_call"), config()
    agent.invoke(turn("refund and delete"), c)
    [pause] = agent.get_state(c).interrupts
    shown = json.loads(block('{"type": "tool_approval"'))
    real = pause.value
    assert set(real) == set(shown), f"real {sorted(real)}, shown {sorted(shown)}"
    assert set(real["undolog"]) == set(shown["undolog"]), f"real {sorted(real['undolog'])}, shown {sorted(shown['undolog'])}"
    assert real["type"] == shown["type"] and real["name"] == shown["name"] and real["args"] == shown["args"]
    assert real["undolog"]["allowed_decisions"] == shown["undolog"]["allowed_decisions"]
    assert set(real["undolog"]["undo_plan"][0]) == set(shown["undolog"]["undo_plan"][0])
    assert real["description"].startswith("UndoLog: delete_user_account is irreversible and needs a person's approval.")


def test_langchain_decisions_fragment(ns: dict[str, Any], world: SupportWorld) -> None:
    # `agent` pauses per call (one Decision by interrupt id); `graph` pauses once for a message of two deletions.
    agent, graph, c = agent_of(ns, interrupt_mode="per_call"), graph_of(ns), config()
    agent.invoke(turn("delete my account"), c)
    ns.update(agent=agent, graph=graph, config=c)
    graph.invoke(turn("delete two accounts"), c)
    assert len(graph.get_state(c).interrupts) == 1
    run(block("from langgraph.types import Command"), ns)
    # The agent's approved deletion ran; the graph's reject halted the session: its approved sibling did not run.
    assert world.account_status("u-1042") == "deleted"
    assert world.account_status("u-2002") == "active"
    assert ns["undolog"].sessions.get(c["configurable"]["thread_id"]).state == "halted"


def test_undolog_resume_form_fragment(ns: dict[str, Any]) -> None:
    lines = block('graph.invoke(Command(resume={"decision": "approve"').strip().splitlines()
    assert len(lines) == 4
    graph = graph_of(ns)
    states = []
    for line in lines:  # each answers a pause of its own
        c = config()
        graph.invoke(turn("delete my account"), c)
        [pause] = graph.get_state(c).interrupts
        ns.update(graph=graph, config=c)
        run(line, ns)
        rid = pause.value["undolog"]["approval_request_id"]
        states.append([e.action for e in ns["undolog"].approvals.events(rid)][1])  # the decision, after "request"
    assert states == ["approve", "modify", "reject", "respond"], states


def test_deciding_elsewhere_fragment(ns: dict[str, Any], world: SupportWorld, monkeypatch: pytest.MonkeyPatch) -> None:
    lines = [ln for ln in block("from undolog_adapters.langgraph import aundolog_resume").splitlines() if ln.strip()]
    imports, calls = lines[0], lines[1:]
    assert len(calls) == 3 and "resume_decided" in calls[2]
    # `undolog_resume(graph, config)` finds "the" UndoLog of the process's live adapters, as in an app that has one:
    # the adapters earlier tests built (and dropped) must be collected first.
    gc.collect()
    graph = graph_of(ns)
    undolog = ns["undolog"]
    # Adapters other tests of this worker still hold (a fixture, a module global) are not this app's: the process
    # the page describes has one UndoLog, so only this test's adapters are seen (random order made this flaky).
    from undolog_adapters.langgraph import _sessions

    own = weakref.WeakSet(a for a in list(_sessions._ADAPTERS) if a.undolog is undolog)
    monkeypatch.setattr(_sessions, "_ADAPTERS", own)
    run(imports, ns)
    asks = ["delete my account", "erase sam", "erase ravi"]
    for ask, line in zip(asks, calls, strict=True):  # each resumes a graph paused on a request decided at "the desk"
        c = config()
        graph.invoke(turn(ask), c)
        for request in undolog.approvals.pending(session_id=c["configurable"]["thread_id"]):
            undolog.approvals.approve(request.approval_request_id, approver="ana")
        ns.update(graph=graph, config=c)
        run(line, ns)
        assert not graph.get_state(c).interrupts, line
    assert [world.account_status(u) for u in ("u-1042", "u-2002", "u-3003")] == ["deleted"] * 3


def test_retries_fragment(ns: dict[str, Any]) -> None:
    ns["undolog"].register(ns["cancel_refund_email"])  # your tools' compensations, registered as the page says
    run(block("from langchain.agents.middleware import ToolRetryMiddleware"), ns)
    from undolog_core import RetryPolicy

    spec = ns["book_seat"]
    assert isinstance(ns["tiers"]["seat_map"], UndoLogPolicy)
    retry, gate = ns["middleware"]
    assert type(retry).__name__ == "ToolRetryMiddleware" and isinstance(gate, UndoLogMiddleware)
    policy = ns["tiers"]["seat_map"].retry
    assert getattr(policy, "attempts", policy) == 2 and callable(spec)  # retry=2: two attempts
    assert RetryPolicy(attempts=3, backoff=0.2).attempts == 3


def test_callbacks_fragment_prints_the_rollback(ns: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    ns.update(BaseCallbackHandler=BaseCallbackHandler, agent=agent_of(ns), user_turn=turn("overpay my orders"))
    run(block("class Audit(BaseCallbackHandler):"), ns)
    out = capsys.readouterr().out
    assert "undolog.compensation" in out and "undolog.rollback" in out, out
    assert isinstance(AIMessage(content=""), AIMessage)
