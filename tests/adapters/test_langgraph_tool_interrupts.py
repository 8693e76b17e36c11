"""A tool that asks its own question with ``interrupt()``, in the task where UndoLog paused for an approval.

LangGraph hands resume values to the interrupts of one task by their order. UndoLog's pause comes first (nothing runs
before the IRREVERSIBLE calls are decided); once it is decided, UndoLog does not pause again on the next re-run, so
the tool's own ``interrupt()`` becomes the task's first and is handed UndoLog's old answer (``{"type": "approve"}``)
instead of the person's answer to the tool ("no"). A tool that checks its answer for truth would proceed. Both the
node (an ask_human tool beside an IRREVERSIBLE call) and the middleware (an IRREVERSIBLE tool that confirms with the
customer) are affected.

Fixed: once UndoLog's pauses of a task are decided and before any tool runs, their answers are dropped from the
task's resume values (``_siblings.forget_answers``), so the tool's interrupts are the task's first. Sync and async,
after one answer or several (an undecided ``from_store`` resume first).
"""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import HumanInTheLoopMiddleware
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from langgraph.types import Command, interrupt

from examples.support_agent.model import ScriptedChatModel
from tests.adapters.test_langgraph_hitl import World, cfg, make_tools, refund_charge_for, user
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


def _run(g: Any, value: Any, c: Any, aio: bool) -> Any:
    return asyncio.run(g.ainvoke(value, c)) if aio else g.invoke(value, c)


def _answer_all(g: Any, c: Any, answers_undolog: list[Any], keyed: bool, aio: bool) -> None:
    """Answer UndoLog's pauses with ``answers_undolog`` in turn, and the tool's question with "no"."""
    left = list(answers_undolog)
    for _ in range(6):
        pauses = g.get_state(c).interrupts
        if not pauses:
            return
        p = pauses[0]
        value = left.pop(0) if "undolog" in p.value else "no"
        _run(g, Command(resume={p.id: value} if keyed else value), c, aio)


CASES = pytest.mark.parametrize(("aio", "rounds"), [(False, 1), (True, 1), (False, 2), (True, 2)],
                                ids=["sync", "async", "sync-after-from_store", "async-after-from_store"])



@CASES
def test_node_a_tools_own_question_gets_the_persons_answer(undolog: Any, aio: bool, rounds: int) -> None:
    world, answers = World(), []
    tools = make_tools(world) + _asking_tools(answers)
    model = ScriptedChatModel(scripts={"mix": [[("close_account", {"user_id": "u-1"}),
                                                ("ask_human", {"question": "colour?"})]]})
    b = StateGraph(MessagesState)
    b.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
    # (charge's compensation given: an adapter refuses a compensation registered nowhere when it is built)
    b.add_node("tools", UndoLogToolNode(tools, undolog=undolog, approver="ana",
                                        compensations=[refund_charge_for(world)]))
    b.add_edge(START, "agent")
    b.add_conditional_edges("agent", tools_condition)
    b.add_edge("tools", "agent")
    g, c = b.compile(checkpointer=InMemorySaver()), cfg()
    _run(g, user("mix"), c, aio)
    first = [{"decision": "from_store"}] if rounds == 2 else []  # undecided yet: it pauses again
    _answer_all(g, c, [*first, {"decisions": [{"type": "approve"}]}], keyed=False, aio=aio)
    assert world.ran == [("close_account", "u-1")]
    assert answers == ["no"], answers



@CASES
def test_middleware_an_irreversible_tools_own_question_gets_the_persons_answer(undolog: Any, aio: bool,
                                                                               rounds: int) -> None:
    answers: list[Any] = []
    tools = _asking_tools(answers)
    model = ScriptedChatModel(scripts={"wire": [[("wire", {"amount": 5})]]})
    g = create_agent(model, tools, checkpointer=InMemorySaver(),
                     middleware=[UndoLogMiddleware(undolog, tools=tools, approver="ana", interrupt_mode="per_call")])
    c = cfg()
    _run(g, user("wire"), c, aio)
    first = [{"decision": "from_store"}] if rounds == 2 else []
    _answer_all(g, c, [*first, {"type": "approve"}], keyed=True, aio=aio)
    assert answers == ["no"], answers


@pytest.mark.storage
def test_node_with_a_durable_checkpointer_resumed_by_fresh_graphs(undolog: Any, tmp_path: Path) -> None:
    """The shortened resume values are what the checkpointer saves: a fresh graph (as another process) reads them."""
    world, answers = World(), []
    tools = make_tools(world) + _asking_tools(answers)
    model = ScriptedChatModel(scripts={"mix": [[("close_account", {"user_id": "u-1"}),
                                                ("ask_human", {"question": "colour?"})]]})
    node = UndoLogToolNode(tools, undolog=undolog, approver="ana", compensations=[refund_charge_for(world)])
    c = cfg()

    def step(value: Any) -> Any:
        with closing(sqlite3.connect(tmp_path / "cp.sqlite", check_same_thread=False)) as conn:
            b = StateGraph(MessagesState)
            b.add_node("agent", lambda state: {"messages": [model.invoke(state["messages"])]})
            b.add_node("tools", node)
            b.add_edge(START, "agent")
            b.add_conditional_edges("agent", tools_condition)
            b.add_edge("tools", "agent")
            g = b.compile(checkpointer=SqliteSaver(conn))
            if value is not None:
                g.invoke(value, c)
            return g.get_state(c).interrupts

    step(user("mix"))
    assert "undolog" in step(Command(resume={"decision": "from_store"}))[0].value
    [question] = step(Command(resume={"decisions": [{"type": "approve"}]}))
    assert question.value == {"question": "colour?"}
    assert step(Command(resume="no")) == ()
    assert answers == ["no"] and world.ran == [("close_account", "u-1")]


def test_middleware_behind_langchains_per_call_hitl_keeps_its_answer(undolog: Any) -> None:
    """LangChain's HumanInTheLoopMiddleware (per call) listed before UndoLog pauses first in the task: only UndoLog's
    own answers are dropped, at their place; the HITL keeps its answer and the tool gets the customer's."""
    answers: list[Any] = []
    tools = _asking_tools(answers)
    model = ScriptedChatModel(scripts={"wire": [[("wire", {"amount": 5})]]})
    hitl = HumanInTheLoopMiddleware(interrupt_on={"wire": True}, interrupt_mode="per_call")
    g = create_agent(model, tools, checkpointer=InMemorySaver(),
                     middleware=[hitl, UndoLogMiddleware(undolog, tools=tools, approver="ana", interrupt_mode="per_call")])
    c = cfg()
    g.invoke(user("wire"), c)
    seen = []
    for _ in range(6):
        pauses = g.get_state(c).interrupts
        if not pauses:
            break
        p = pauses[0]
        kind = "undolog" if "undolog" in p.value else "hitl" if p.value.get("type") == "tool_approval" else "tool"
        seen.append(kind)
        value = {"type": "approve"} if kind != "tool" else "no"
        if kind == "hitl":  # the reviewer edits the amount before UndoLog sees the call
            value = {"type": "edit", "edited_action": {"name": "wire", "args": {"amount": 7}}}
        g.invoke(Command(resume={p.id: value}), c)
    assert seen == ["hitl", "undolog", "tool"]
    assert answers == ["no"], answers
    [req] = undolog.approvals.list()
    assert req.proposed_args == {"amount": 7}  # UndoLog gated the call as the HITL reviewer edited it
