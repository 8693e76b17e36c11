"""Attacks on the adapters' newest short paths, the way real use meets them (real framework objects, scripted models).

LangGraph: a COMPENSABLE call of a thread the middleware already knows is decided by ``_known`` (the engine's
``intercept_spec`` straight) and run by ``run_known`` / ``arun_call``, past the adapter's former layers. Semantic
Kernel: a later COMPENSABLE call under auto function calling asks the engine itself, and a schema-declared contract's
exact-JSON-type arguments are taken as they are (``ToolSpec._as_is_json``). Each attack checks what those layers used
to guarantee: nothing runs in a halted session, a tool's failure is recorded and undone, an interrupt passes through,
arguments of the wrong JSON type are refused (or converted as the contract's model converts them) with nothing
written.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import pytest
from langchain.agents import create_agent
from langchain_core.messages import ToolMessage
from langchain_core.tools import InjectedToolCallId
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.types import Command, interrupt
from semantic_kernel import Kernel
from semantic_kernel.contents import ChatHistory
from semantic_kernel.functions import kernel_function

from examples.semantic_kernel_support.llm import ScriptedChat, auto_settings, call
from examples.support_agent.model import ScriptedChatModel
from tests.support.lg_hooks import AfterModel
from undolog_adapters.langgraph import UndoLogMiddleware
from undolog_adapters.semantic_kernel import install, undolog_session
from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool
from undolog_core.errors import ContractChanged

RAN: list[Any] = []
UNDONE: list[Any] = []


@compensation("fa_unbook")
def fa_unbook(ctx: Any) -> None:
    UNDONE.append(ctx.result)


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("fa_unbook"))
def fa_book(day: str) -> dict[str, str]:
    """Book a slot."""
    RAN.append(("book", day))
    return {"booking": day}


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("fa_unbook"))
def fa_charge(amount: float) -> str:
    """Charge the card (always declined)."""
    RAN.append(("charge", amount))
    raise RuntimeError("card declined")


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("fa_unbook"))
def fa_confirm(day: str) -> dict[str, str]:
    """Book a slot once the customer confirms (a LangGraph interrupt)."""
    answer = interrupt({"confirm": day})
    RAN.append(("confirm", day, answer))
    return {"booking": f"{day}-{answer}"}


SCRIPTS: dict[str, Any] = {
    "book": [[("fa_book", {"day": "mon"})]],
    "charge": [[("fa_charge", {"amount": 5.0})]],
    "confirm": [[("fa_confirm", {"day": "tue"})]],
    "extra": [[("fa_book", {"day": "wed", "note": "x"})]],
    "wrongtype": [[("fa_book", {"day": 7})]],
    "null": [[("fa_book", {"day": None})]],
}
TOOLS = [fa_book, fa_charge, fa_confirm]


def _cfg() -> dict[str, Any]:
    return {"configurable": {"thread_id": "fa-" + uuid.uuid4().hex[:10]}}


def _user(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def _last_tool_message(out: Any) -> ToolMessage:
    return [m for m in out["messages"] if isinstance(m, ToolMessage)][-1]


def _graph(undolog: Any, *before: Any) -> Any:
    return create_agent(ScriptedChatModel(scripts=SCRIPTS), TOOLS, checkpointer=InMemorySaver(),
                        middleware=[*before, UndoLogMiddleware(undolog, tools=TOOLS, compensations=[fa_unbook])])


async def _turn(graph: Any, mode: str, value: Any, c: dict[str, Any]) -> Any:
    return graph.invoke(value, c) if mode == "sync" else await graph.ainvoke(value, c)


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_lg_a_halt_elsewhere_between_the_turns_check_and_a_known_threads_call_refuses_it(
        db: Any, undolog: Any, mode: str) -> None:
    """Halted by another UndoLog (another process, the CLI) after the turn's check: the call of the known thread
    (short path) is refused with the halted refusal, the tool does not run and nothing is written."""
    other = db.open(migrate=False)
    hook = AfterModel(lambda tid: other.sessions.set_state(tid, "halted", allowed=("active",)))
    graph, c = _graph(undolog, hook), _cfg()
    tid = c["configurable"]["thread_id"]
    await _turn(graph, mode, _user("book"), c)
    RAN.clear()
    hook.armed = True
    msg = _last_tool_message(await _turn(graph, mode, _user("book"), c))
    assert not hook.armed
    assert msg.status == "error" and msg.response_metadata["undolog"] == {"refused": "session_halted"}
    assert RAN == []
    assert [e["state"] for e in undolog.sessions.effects(tid)] == ["committed"]
    assert undolog.sessions.get(tid).state == "halted"


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_lg_a_known_threads_compensable_tool_that_raises_is_failed_and_its_plan_undone(
        undolog: Any, mode: str) -> None:
    """The tool raises on the short path: its effect is marked failed, the earlier booking compensated (the tool's raw
    value handed to its compensation) after the failed call's own, the session rolled back, and the model reads the failure and the rollback."""
    graph, c = _graph(undolog), _cfg()
    tid = c["configurable"]["thread_id"]
    UNDONE.clear()
    await _turn(graph, mode, _user("book"), c)
    msg = _last_tool_message(await _turn(graph, mode, _user("charge"), c))
    assert msg.status == "error" and "card declined" in str(msg.content)
    assert msg.response_metadata["undolog"]["failed"] is True
    assert UNDONE == [None, {"booking": "mon"}]  # newest first: the failed call's own compensation (no result) too
    assert [e["state"] for e in undolog.sessions.effects(tid)] == ["compensated", "compensated"]
    assert undolog.sessions.get(tid).state == "rolled_back"
    # The next turn opens the thread's next session; the short path runs there.
    msg = _last_tool_message(await _turn(graph, mode, _user("book"), c))
    assert msg.status == "success" and msg.response_metadata["undolog"]["session_id"] == f"{tid}#2"


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_lg_an_interrupt_inside_a_known_threads_compensable_tool_passes_and_the_call_runs_once_on_resume(
        undolog: Any, mode: str) -> None:
    """A LangGraph interrupt inside the tool, on the short path (a later turn of a known thread), is control flow:
    the graph pauses, the effect is released (not failed, not rolled back); on resume the same call id re-runs the
    tool once and the same effect is committed."""
    graph, c = _graph(undolog), _cfg()
    tid = c["configurable"]["thread_id"]
    await _turn(graph, mode, _user("book"), c)
    RAN.clear()
    await _turn(graph, mode, _user("confirm"), c)
    assert graph.get_state(c).interrupts[0].value == {"confirm": "tue"}
    first = undolog.sessions.effects(tid)
    assert [e["state"] for e in first] == ["committed", "released"]
    assert undolog.sessions.get(tid).state == "active" and RAN == []
    msg = _last_tool_message(await _turn(graph, mode, Command(resume="yes"), c))
    assert msg.status == "success" and msg.response_metadata["undolog"]["effect_id"] == first[1]["effect_id"]
    assert RAN == [("confirm", "tue", "yes")]
    effects = undolog.sessions.effects(tid)
    assert [e["state"] for e in effects] == ["committed", "committed"]
    assert effects[1]["result_snapshot"] == {"booking": "tue-yes"}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("script", ["extra", "wrongtype", "null"])
async def test_lg_bad_arguments_on_a_known_threads_compensable_call_are_refused_with_nothing_written(
        undolog: Any, mode: str, script: str) -> None:
    """An argument the contract does not name, a number for a string, a null for a required string: refused as
    invalid, the tool not run, nothing stored, the session still active."""
    graph, c = _graph(undolog), _cfg()
    tid = c["configurable"]["thread_id"]
    await _turn(graph, mode, _user("book"), c)
    RAN.clear()
    msg = _last_tool_message(await _turn(graph, mode, _user(script), c))
    assert msg.status == "error" and msg.response_metadata["undolog"] == {"refused": "arguments_invalid"}
    assert RAN == []
    assert [e["state"] for e in undolog.sessions.effects(tid)] == ["committed"]
    assert undolog.sessions.get(tid).state == "active"


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_lg_a_thread_resumed_by_a_new_process_keeps_its_session(db: Any, undolog: Any, mode: str) -> None:
    """The same thread id (the same checkpointer) continued by a new UndoLog and middleware (a restarted process), and
    the first one closed: the new process's calls go into the thread's session, and a rollback there undoes both
    processes' calls, newest first."""
    saver = InMemorySaver()
    first = create_agent(ScriptedChatModel(scripts=SCRIPTS), TOOLS, checkpointer=saver,
                         middleware=[UndoLogMiddleware(undolog, tools=TOOLS, compensations=[fa_unbook])])
    c = _cfg()
    tid = c["configurable"]["thread_id"]
    await _turn(first, mode, _user("book"), c)
    undolog.close()
    again = db.open(migrate=False)
    second = create_agent(ScriptedChatModel(scripts=SCRIPTS), TOOLS, checkpointer=saver,
                          middleware=[UndoLogMiddleware(again, tools=TOOLS, compensations=[fa_unbook])])
    for _ in range(2):
        msg = _last_tool_message(await _turn(second, mode, _user("book"), c))
        assert msg.status == "success" and msg.response_metadata["undolog"]["session_id"] == tid
    assert [e["state"] for e in again.sessions.effects(tid)] == ["committed"] * 3
    UNDONE.clear()
    assert again.rollback(tid).complete
    assert UNDONE == [{"booking": "mon"}] * 3


# ------------------------------------------------------------------------------------------ Semantic Kernel

SK_RAN: list[Any] = []


class Till:
    @kernel_function(name="book", description="Book a number of slots.")
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("fa_unbook"))
    def book(self, day: str, count: int, price: float, paid: bool) -> str:
        SK_RAN.append((day, count, price, paid))
        return f"booked {count} on {day}"


async def _sk(kernel: Any, sid: str, call_id: str, **args: Any) -> str:
    chat = ScriptedChat(ai_model_id="scripted", turns=[[call(call_id, "till-book", **args)]])
    history = ChatHistory()
    history.add_user_message("book")
    with undolog_session(sid):
        await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
    return str(history.messages[-1].items[0].result) if history.messages else ""


def _sk_kernel(undolog: Any) -> Any:
    kernel = Kernel()
    kernel.add_plugin(Till(), plugin_name="till")
    install(kernel, undolog, compensations=[fa_unbook])
    return kernel


GOOD = {"day": "mon", "count": 2, "price": 9.5, "paid": True}


@pytest.mark.parametrize("bad", [
    {"count": True}, {"count": "2"}, {"count": 2.5}, {"paid": 1}, {"day": None}, {"day": 5}, {"paid": "true"},
    {"count": {"n": 2}}, {"day": ["mon"]},
])
async def test_sk_a_later_call_whose_argument_has_another_json_type_is_refused_with_nothing_written(
        undolog: Any, bad: dict[str, Any]) -> None:
    """On a later COMPENSABLE call (the session in the store: the engine asked directly, the exact-type copy tried
    first), an argument whose JSON type is not the schema's (a bool for an integer, a numeric string, a float with a
    fraction, an int for a boolean, a null, an object or a list) is refused, the function does not run and nothing is
    stored."""
    kernel = _sk_kernel(undolog)
    sid = "fa-sk-" + uuid.uuid4().hex[:8]
    await _sk(kernel, sid, "g1", **GOOD)
    SK_RAN.clear()
    text = await _sk(kernel, sid, "b1", **{**GOOD, **bad})
    assert SK_RAN == [], (bad, SK_RAN)
    assert "refused" in text.lower() or "invalid" in text.lower(), text
    assert len(undolog.sessions.effects(sid)) == 1


async def test_sk_an_int_for_a_number_is_taken_as_the_contracts_model_takes_it(undolog: Any) -> None:
    """An integer for a number is valid JSON Schema: the call runs, and what is stored is what the general path
    (the contract's model) stores for it, the same on both databases."""
    kernel = _sk_kernel(undolog)
    sid = "fa-sk-" + uuid.uuid4().hex[:8]
    await _sk(kernel, sid, "g1", **GOOD)
    SK_RAN.clear()
    await _sk(kernel, sid, "i1", **{**GOOD, "price": 9})
    assert len(SK_RAN) == 1 and SK_RAN[0][2] == 9
    spec = undolog.registry.tools["till-book"]
    effects = undolog.sessions.effects(sid)
    assert [e["state"] for e in effects] == ["committed", "committed"]
    assert effects[1]["args_snapshot"] == spec.snapshot(spec.validate({**GOOD, "price": 9}))


async def test_sk_a_halt_elsewhere_refuses_a_later_call_of_a_known_session(db: Any, undolog: Any) -> None:
    """A conversation whose session this filter already knows (its later calls ask the engine directly) is halted by
    another UndoLog: the next COMPENSABLE call is refused as halted, the function does not run, nothing is stored;
    the same call id asked again after the halt gets the stored result of the call that ran, never a second run."""
    kernel = _sk_kernel(undolog)
    sid = "fa-sk-" + uuid.uuid4().hex[:8]
    await _sk(kernel, sid, "h1", **GOOD)
    other = db.open(migrate=False)
    other.sessions.set_state(sid, "halted", allowed=("active",))
    SK_RAN.clear()
    text = await _sk(kernel, sid, "h2", **GOOD)
    assert SK_RAN == [] and "halted" in text.lower(), text
    text = await _sk(kernel, sid, "h1", **GOOD)
    assert SK_RAN == [] and "booked 2 on mon" in text, text
    assert [e["state"] for e in undolog.sessions.effects(sid)] == ["committed"]


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("fa_unbook"))
def fa_route(day: str, tool_call_id: Annotated[str, InjectedToolCallId]) -> Command:
    """Book a slot and answer with a Command (a state update with the tool's message)."""
    RAN.append(("route", day))
    return Command(update={"messages": [ToolMessage(content=f"routed {day}", tool_call_id=tool_call_id)]})


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_lg_a_known_threads_compensable_tool_answering_with_a_command(undolog: Any, mode: str) -> None:
    """A COMPENSABLE tool that returns a ``Command`` on the short path: the Command reaches the graph (its message is
    in the state), the effect is committed, and a rollback runs its compensation."""
    tools = [fa_book, fa_route]
    graph = create_agent(ScriptedChatModel(scripts={**SCRIPTS, "route": [[("fa_route", {"day": "fri"})]]}), tools,
                         checkpointer=InMemorySaver(),
                         middleware=[UndoLogMiddleware(undolog, tools=tools, compensations=[fa_unbook])])
    c = _cfg()
    tid = c["configurable"]["thread_id"]
    await _turn(graph, mode, _user("book"), c)
    RAN.clear()
    msg = _last_tool_message(await _turn(graph, mode, _user("route"), c))
    assert msg.content == "routed fri" and RAN == [("route", "fri")]
    effects = undolog.sessions.effects(tid)
    assert [e["state"] for e in effects] == ["committed", "committed"], effects
    UNDONE.clear()
    assert undolog.rollback(tid).complete
    assert len(UNDONE) == 2 and UNDONE[1] == {"booking": "mon"}


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_lg_a_contract_changed_between_turns_is_refused_with_nothing_run(undolog: Any, mode: str) -> None:
    """The tool's contract is classified again (another schema and a reason) while the thread's session runs (an
    edited tool in a rebuilt agent): the known thread's next call of it, on the short path, neither runs nor writes anything
    (``ContractChanged``, raised as the general path raises it), and after ``revalidate`` it runs under the new revision."""
    ran: list[Any] = []

    def make(extra: bool) -> Any:
        if extra:
            @lc_tool
            def fa_slot(day: str, hour: int = 9) -> str:
                """Book a slot at an hour."""
                ran.append((day, hour))
                return f"slot {day} {hour}"
        else:
            @lc_tool
            def fa_slot(day: str) -> str:  # type: ignore[misc]
                """Book a slot."""
                ran.append((day,))
                return f"slot {day}"
        return fa_slot

    from undolog_adapters.langgraph import UndoLogPolicy

    tiers = {"fa_slot": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=lambda ctx: None)}
    old = make(False)
    graph = create_agent(ScriptedChatModel(scripts={"slot": [[("fa_slot", {"day": "mon"})]]}), [old],
                         checkpointer=InMemorySaver(), middleware=[UndoLogMiddleware(undolog, tools=[old], tiers=tiers)])
    c = _cfg()
    tid = c["configurable"]["thread_id"]
    await _turn(graph, mode, _user("slot"), c)
    assert ran == [("mon",)]
    # The edited tool, classified again (a reason given): a new contract revision.
    edited = {"fa_slot": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=lambda ctx: None, reason="edited")}
    UndoLogMiddleware(undolog, tools=[make(True)], tiers=edited)
    assert len(undolog.registry.history("fa_slot")) == 2
    ran.clear()
    with pytest.raises(ContractChanged):  # as run_logged's prepare raises it (not a refusal the model reads)
        await _turn(graph, mode, _user("slot"), c)
    assert ran == [], ran
    assert [e["state"] for e in undolog.sessions.effects(tid)] == ["committed"]
    undolog.sessions.revalidate(tid, actor="ana")
    msg = _last_tool_message(await _turn(graph, mode, _user("slot"), c))
    assert msg.status == "success" and ran == [("mon",)]
    effects = undolog.sessions.effects(tid)
    assert [e["state"] for e in effects] == ["committed", "committed"]
    assert effects[1]["tool_revision"] == 2, effects[1]


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_lg_a_session_completed_elsewhere_after_the_turns_check_moves_the_call_on(
        db: Any, undolog: Any, mode: str) -> None:
    """Completed by another UndoLog after the turn's check: the known thread's call (a new plan) runs in the thread's
    next session, nothing is added to the completed one."""
    other = db.open(migrate=False)
    hook = AfterModel(lambda tid: other.sessions.set_state(tid, "completed", allowed=("active",)))
    graph, c = _graph(undolog, hook), _cfg()
    tid = c["configurable"]["thread_id"]
    await _turn(graph, mode, _user("book"), c)
    hook.armed = True
    msg = _last_tool_message(await _turn(graph, mode, _user("book"), c))
    assert not hook.armed
    assert msg.status == "success" and msg.response_metadata["undolog"]["session_id"] == f"{tid}#2"
    assert [e["state"] for e in undolog.sessions.effects(tid)] == ["committed"]
    assert undolog.sessions.get(tid).state == "completed"


async def test_sk_a_contract_changed_between_calls_is_refused_and_runs_after_revalidate(undolog: Any) -> None:
    """The function's contract is classified again (a new revision) while the conversation's session runs: its next
    COMPENSABLE call (the engine asked directly) is refused as changed, nothing runs and nothing is stored; after
    ``revalidate`` it runs under the new revision."""
    from undolog_adapters._common import UndoLogPolicy
    from undolog_adapters.semantic_kernel import UndoLogFilter

    kernel = _sk_kernel(undolog)
    sid = "fa-sk-" + uuid.uuid4().hex[:8]
    await _sk(kernel, sid, "c1", **GOOD)
    edited = UndoLogFilter(undolog, tiers={"till-book": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=fa_unbook,
                                                                       reason="edited")})
    edited.classify(kernel.get_function("till", "book"))
    assert len(undolog.registry.history("till-book")) == 2
    SK_RAN.clear()
    text = await _sk(kernel, sid, "c2", **GOOD)
    assert SK_RAN == [] and "changed" in text.lower(), text
    assert len(undolog.sessions.effects(sid)) == 1
    undolog.sessions.revalidate(sid, actor="ana")
    await _sk(kernel, sid, "c3", **GOOD)
    assert len(SK_RAN) == 1
    effects = undolog.sessions.effects(sid)
    assert [e["state"] for e in effects] == ["committed", "committed"] and effects[1]["tool_revision"] == 2


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("action", ["halt", "rollback"])
async def test_lg_an_interrupted_call_resumed_after_a_halt_or_rollback_elsewhere_never_runs(
        db: Any, undolog: Any, mode: str, action: str) -> None:
    """A known thread's COMPENSABLE call paused by an interrupt inside its tool (released), then the session halted or
    rolled back by another UndoLog: the resume re-issues the same call id, which is refused (the tool never runs, the
    model reads the refusal) and the released effect is not run again."""
    other = db.open(migrate=False)
    other.register(fa_book, fa_charge, fa_confirm, fa_unbook)
    graph, c = _graph(undolog), _cfg()
    tid = c["configurable"]["thread_id"]
    await _turn(graph, mode, _user("book"), c)
    await _turn(graph, mode, _user("confirm"), c)
    assert graph.get_state(c).interrupts
    if action == "halt":
        other.sessions.set_state(tid, "halted", allowed=("active",))
    else:
        assert other.rollback(tid).complete
    RAN.clear()
    msg = _last_tool_message(await _turn(graph, mode, Command(resume="yes"), c))
    assert RAN == [], RAN
    assert msg.status == "error" and msg.response_metadata["undolog"].get("refused"), msg
    states = [e["state"] for e in undolog.sessions.effects(tid)]
    assert "committed" not in states[1:] and len(states) == 2, states
