"""A tool name the agent does not have is answered as LangGraph answers it, by UndoLog's node and middleware alike.

Before: ``UndoLogToolNode`` answered "UndoLog refused no_such_tool: it was not let through UndoLog's gate", which tells
the model nothing it can use; LangGraph's own ToolNode says "not a valid tool, try one of [...]". Real graphs, a
scripted model, sync and async.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import ToolMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from examples.support_agent.model import ScriptedChatModel
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode
from undolog_core import ToolTier, undolog_tool

SCRIPTS = {"go": [[("no_such_tool", {"a": 1})]]}


@undolog_tool(tier=ToolTier.SAFE)
def lookup(q: str) -> str:
    """Look something up."""
    return "found"


def graph(node: Any) -> Any:
    model = ScriptedChatModel(scripts=SCRIPTS)
    g = StateGraph(MessagesState)
    g.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    g.add_node("tools", node)
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    return g.compile(checkpointer=InMemorySaver())


async def answer(app: Any, run_async: bool) -> str:
    inp, cfg = {"messages": [{"role": "user", "content": "go"}]}, {"configurable": {"thread_id": "t"}}
    out = await app.ainvoke(inp, cfg) if run_async else app.invoke(inp, cfg)
    [msg] = [m for m in out["messages"] if isinstance(m, ToolMessage)]
    assert msg.status == "error"
    return str(msg.content)


@pytest.mark.parametrize("run_async", [False, True], ids=["sync", "async"])
async def test_unknown_tool_names_are_answered_as_langgraph_does(undolog: Any, run_async: bool) -> None:
    langgraphs = await answer(graph(ToolNode([lookup])), run_async)
    assert langgraphs == "Error: no_such_tool is not a valid tool, try one of [lookup]."
    assert await answer(graph(UndoLogToolNode([lookup], undolog=undolog)), run_async) == langgraphs
    agent = create_agent(ScriptedChatModel(scripts=SCRIPTS), [lookup], checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=[lookup])])
    assert await answer(agent, run_async) == langgraphs
