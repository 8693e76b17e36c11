"""Tools that take values LangChain injects (``ToolRuntime``, ``InjectedState``, ``InjectedStore``,
``InjectedToolCallId``, a ``RunnableConfig``) under ``@undolog_tool`` (issue 12, item 2).

UndoLog's argument schema, snapshot and digest cover only what the model sends (LangChain's ``tool_call_schema``),
and the tool still receives its injected values. Mirrors the README's "Injected arguments" paragraph.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import InjectedToolCallId
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import InjectedState, InjectedStore, ToolRuntime, tools_condition
from langgraph.store.memory import InMemoryStore
from langgraph.types import Command

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode
from undolog_core import ToolTier, compensation, undolog_tool

SCRIPTS = {"note": [[("add_note", {"text": "call back"})], [("purge_notes", {"reason": "gdpr"})]]}


def make(seen: list[dict[str, Any]]) -> tuple[Any, Any, Any]:
    @compensation("remove_note")
    def remove_note(ctx: Any) -> None:
        seen.append({"undo": ctx.args})

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="remove_note")
    def add_note(text: str, runtime: ToolRuntime, call_id_: Annotated[str, InjectedToolCallId],
                 messages: Annotated[list[Any], InjectedState("messages")],
                 store: Annotated[Any, InjectedStore()], config: RunnableConfig) -> str:
        """Add a note to the customer's file."""
        seen.append({"text": text, "runtime_call": runtime.tool_call_id, "call_id": call_id_,
                     "messages": len(messages), "store": store is not None,
                     "thread": config["configurable"]["thread_id"]})
        return f"noted {text}"

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Erases every note")
    def purge_notes(reason: str, runtime: ToolRuntime) -> str:
        """Erase the customer's notes."""
        seen.append({"purge": reason, "runtime_call": runtime.tool_call_id})
        return "purged"

    return add_note, purge_notes, remove_note


def run(graph: Any, undolog: Any, seen: list[dict[str, Any]]) -> None:
    c = {"configurable": {"thread_id": uuid.uuid4().hex[:10]}}
    graph.invoke({"messages": [{"role": "user", "content": "note this"}]}, c)
    [intr] = graph.get_state(c).interrupts
    # What the approver sees is what the model sent: no runtime, no state, no store.
    assert intr.value["undolog"]["args"] == {"reason": "gdpr"}
    out = graph.invoke(Command(resume={"decision": "approve", "approver": "ana"}), c)
    note, purge = seen[0], seen[1]
    # The tools got their injected values...
    assert note["text"] == "call back" and note["runtime_call"] == note["call_id"] and note["call_id"]
    assert note["messages"] >= 2 and note["store"] and note["thread"] == c["configurable"]["thread_id"]
    assert purge == {"purge": "gdpr", "runtime_call": intr.value["undolog"]["tool_call_id"]}
    # ...and UndoLog's snapshot, digest and contract hold only what the model sends.
    effects = {e["tool_name"]: e for e in undolog.sessions.effects(c["configurable"]["thread_id"])}
    assert effects["add_note"]["args_snapshot"] == {"text": "call back"}
    assert effects["purge_notes"]["args_snapshot"] == {"reason": "gdpr"}
    assert set(undolog.tool_spec("add_note").json_schema["properties"]) == {"text"}
    assert [m.status for m in out["messages"] if isinstance(m, ToolMessage)] == ["success", "success"]


@pytest.mark.parametrize("kind", ["middleware", "node", "node-lc-tool"])
def test_injected_values_reach_the_tool_and_stay_out_of_the_log(undolog: Any, kind: str) -> None:
    seen: list[dict[str, Any]] = []
    add_note, purge_notes, remove_note = make(seen)
    model = ScriptedChatModel(scripts=SCRIPTS)
    if kind == "middleware":
        graph = create_agent(model, [add_note, purge_notes], checkpointer=InMemorySaver(), store=InMemoryStore(),
                             middleware=[UndoLogMiddleware(undolog, tools=[add_note, purge_notes],
                                                           compensations=[remove_note])])
    else:
        tools = [add_note, purge_notes] if kind == "node" else [lc_tool(add_note), lc_tool(purge_notes)]
        g = StateGraph(MessagesState)
        g.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
        g.add_node("tools", UndoLogToolNode(tools, undolog=undolog, compensations=[remove_note]))
        g.add_edge(START, "agent")
        g.add_conditional_edges("agent", tools_condition)
        g.add_edge("tools", "agent")
        graph = g.compile(checkpointer=InMemorySaver(), store=InMemoryStore())
    run(graph, undolog, seen)
