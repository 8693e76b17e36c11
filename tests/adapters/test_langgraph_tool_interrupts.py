"""A tool that asks its own question with ``interrupt()``, in the task where UndoLog paused for an approval.

LangGraph hands resume values to the interrupts of one task by their order. UndoLog's pause comes first (nothing runs
before the IRREVERSIBLE calls are decided); once it is decided, UndoLog does not pause again on the next re-run, so
the tool's own ``interrupt()`` becomes the task's first and is handed UndoLog's old answer (``{"type": "approve"}``)
instead of the person's answer to the tool ("no"). A tool that checks its answer for truth would proceed. Both the
node (an ask_human tool beside an IRREVERSIBLE call) and the middleware (an IRREVERSIBLE tool that confirms with the
customer) are affected.

OPEN (xfail, strict): LangGraph keeps no record of which resume values answered which interrupt, so UndoLog cannot
tell how many of the task's values were its own once it stops pausing. A fix has to keep that count per task (e.g. in
UndoLog's store, with the pause's requests) and consume that many values before any tool runs.
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain.agents import create_agent
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command, interrupt

from examples.support_agent.model import ScriptedChatModel
from tests.adapters.test_langgraph_hitl import World, cfg, make_tools, user
from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode
from undolog_core import ToolTier, undolog_tool


def _asking_tools(answers: list[Any]) -> list[Any]:
    @undolog_tool(tier=ToolTier.SAFE)
    def ask_human(question: str) -> str:
        """Ask the person a question."""
        answers.append(interrupt({"question": question}))
        return str(answers[-1])

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Wires money")
    def wire(amount: int) -> str:
        """Wire money once the customer confirms."""
        answers.append(interrupt({"question": f"wire {amount}?"}))
        return "wired" if answers[-1] == "yes" else "not wired"

    return [ask_human, wire]


def _answer_all(g: Any, c: Any, answer_undolog: Any, keyed: bool) -> None:
    for _ in range(5):
        pauses = g.get_state(c).interrupts
        if not pauses:
            return
        p = pauses[0]
        value = answer_undolog if "undolog" in p.value else "no"
        g.invoke(Command(resume={p.id: value} if keyed else value), c)


@pytest.mark.xfail(strict=True, reason="open: a tool's own interrupt takes UndoLog's earlier answer (see docstring)")
def test_node_a_tools_own_question_gets_the_persons_answer(undolog: Any) -> None:
    world, answers = World(), []
    tools = make_tools(world) + _asking_tools(answers)
    model = ScriptedChatModel(scripts={"mix": [[("close_account", {"user_id": "u-1"}),
                                                ("ask_human", {"question": "colour?"})]]})
    b = StateGraph(MessagesState)
    b.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    b.add_node("tools", UndoLogToolNode(tools, undolog=undolog, approver="ana"))
    b.add_edge(START, "agent")
    b.add_conditional_edges("agent", tools_condition)
    b.add_edge("tools", "agent")
    g, c = b.compile(checkpointer=InMemorySaver()), cfg()
    g.invoke(user("mix"), c)
    _answer_all(g, c, {"decisions": [{"type": "approve"}]}, keyed=False)
    assert world.ran == [("close_account", "u-1")]
    assert answers == ["no"], answers


@pytest.mark.xfail(strict=True, reason="open: a tool's own interrupt takes UndoLog's earlier answer (see docstring)")
def test_middleware_an_irreversible_tools_own_question_gets_the_persons_answer(undolog: Any) -> None:
    answers: list[Any] = []
    tools = _asking_tools(answers)
    model = ScriptedChatModel(scripts={"wire": [[("wire", {"amount": 5})]]})
    g = create_agent(model, tools, checkpointer=InMemorySaver(),
                     middleware=[UndoLogMiddleware(undolog, tools=tools, approver="ana")])
    c = cfg()
    g.invoke(user("wire"), c)
    _answer_all(g, c, {"type": "approve"}, keyed=True)
    assert answers == ["no"], answers
