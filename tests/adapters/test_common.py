"""What the three adapters share: one tier vocabulary, the same compensations=, guarded imports.

Each adapter is driven for real (a CrewAI crew, a Semantic Kernel kernel, a LangGraph graph, each with a
scripted model); the test then rolls the session back and checks the compensation given in ``tiers=``
really ran.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from crewai.hooks import clear_all_global_hooks
from crewai.tools import tool as crewai_tool
from langchain_core.tools import tool as lc_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import tools_condition
from semantic_kernel import Kernel
from semantic_kernel.contents import ChatHistory
from semantic_kernel.functions import kernel_function

import undolog_adapters.crewai as crewai_adapter
import undolog_adapters.langgraph as langgraph_adapter
import undolog_adapters.semantic_kernel as sk_adapter
from examples.crewai_support_crew.demo import build_crew
from examples.semantic_kernel_support.llm import ScriptedChat, auto_settings, call
from examples.support_agent.model import ScriptedChatModel
from undolog_adapters._common import UndoLogPolicy, policy_of, refusal_text, tier_of
from undolog_core import CompensationDescriptor, ToolTier, compensation, errors

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _no_global_crewai_hooks() -> Any:
    clear_all_global_hooks()
    yield
    clear_all_global_hooks()


def _undo_log() -> tuple[list[str], Any, Any]:
    """A compensation twice over: once declared with @compensation, once a plain function."""
    undone: list[str] = []

    @compensation("release_slot")
    def release_slot(ctx: Any) -> None:
        undone.append(f"declared:{ctx.args['day']}")

    def unbook_slot(ctx: Any) -> None:
        undone.append(f"plain:{ctx.args['day']}")

    return undone, release_slot, unbook_slot


# ------------------------------------------------------------------------------------------ the vocabulary


@pytest.mark.parametrize("value", ["safe", "low", "SAFE", ToolTier.SAFE, {"tier": "safe"}, {"risk_level": "low"},
                                   UndoLogPolicy("low")])
def test_one_vocabulary_for_a_tier(value: Any) -> None:
    assert policy_of(value).resolved_tier is ToolTier.SAFE


def test_the_dict_form_carries_compensation_reason_and_tags() -> None:
    p = policy_of({"tier": "high", "reason": "erases data", "risk_tags": ["pii"]})
    assert (p.resolved_tier, p.reason, tuple(p.risk_tags)) == (ToolTier.IRREVERSIBLE, "erases data", ("pii",))
    assert tier_of("medium") is ToolTier.COMPENSABLE


@pytest.mark.parametrize("value, match", [
    ("dangerous", "unknown tier"),
    ({"tier": "safe", "compensate": "x"}, "unknown key"),
    ({"reason": "no tier"}, "needs 'tier'"),
    ({"tier": "safe", "risk_level": "high"}, "contradicts"),
    ({"tier": "high", "risk_tags": "pii"}, "list of strings"),
    (42, "a tier must be"),
])
def test_a_bad_tier_is_refused_where_it_is_given(value: Any, match: str) -> None:
    with pytest.raises(errors.InvalidDeclaration, match=match):
        policy_of(value)


def test_every_adapter_exports_the_same_policy_class() -> None:
    assert langgraph_adapter.UndoLogPolicy is UndoLogPolicy
    assert crewai_adapter.UndoLogPolicy is UndoLogPolicy
    assert sk_adapter.UndoLogPolicy is UndoLogPolicy


def test_a_rejection_reads_the_same_everywhere() -> None:
    text = refusal_text("delete_user_account", errors.ApprovalRejected("r-1", "open chargeback", "ana"))
    assert "delete_user_account was NOT run" in text and "rejected by ana: open chargeback" in text
    assert "do not retry" in text


# ------------------------------------------------------------------------------------------ CrewAI


@pytest.mark.parametrize("form", ["dict", "policy"])
def test_crewai_registers_the_compensations_given_in_tiers(undolog: Any, form: str) -> None:
    undone, release_slot, unbook_slot = _undo_log()

    @crewai_tool("book_slot")
    def book_slot(day: str) -> str:
        """Book a call-back slot."""
        return f"b-{day}"

    @crewai_tool("hold_room")
    def hold_room(day: str) -> str:
        """Hold a meeting room."""
        return f"r-{day}"

    if form == "dict":
        tiers: dict[str, Any] = {"book_slot": {"tier": "compensable", "compensation": release_slot},
                                 "hold_room": {"tier": "compensable", "compensation": unbook_slot}}
    else:
        tiers = {"book_slot": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=release_slot),
                 "hold_room": UndoLogPolicy("medium", compensation=unbook_slot)}
    tools = crewai_adapter.wrap_tools([book_slot, hold_room], undolog=undolog, tiers=tiers)
    crew = build_crew(tools, [{"tool": "book_slot", "args": {"day": "mon"}},
                              {"tool": "hold_room", "args": {"day": "tue"}}])
    run = tools.kickoff(crew, inputs={"ticket": "book"})
    report = undolog.rollback(run.session_id)
    assert [s.outcome for s in report.steps] == ["compensated", "compensated"]
    assert undone == ["plain:tue", "declared:mon"]  # newest first


def test_a_compensation_missing_in_process_names_the_in_process_fix(undolog: Any) -> None:
    @crewai_tool("book_slot")
    def book_slot(day: str) -> str:
        """Book a call-back slot."""
        return f"b-{day}"

    # Found when the adapter is built (issue 33), not at the first rollback: nothing ran on a missing undo.
    with pytest.raises(errors.ConfigurationError) as missing:
        crewai_adapter.wrap_tools([book_slot], undolog=undolog,
                                  tiers={"book_slot": {"tier": "compensable", "compensation": "release_slot"}})
    assert "book_slot -> 'release_slot'" in missing.value.message
    assert "compensations=[...]" in missing.value.message and "undolog.register(" in missing.value.message


# ------------------------------------------------------------------------------------------ Semantic Kernel


class _Calendar:
    @kernel_function(name="book_slot", description="Book a call-back slot")
    def book_slot(self, day: str) -> str:
        return f"b-{day}"

    @kernel_function(name="hold_room", description="Hold a meeting room")
    def hold_room(self, day: str) -> str:
        return f"r-{day}"


async def _sk_run(kernel: Kernel, session_id: str) -> None:
    chat = ScriptedChat(ai_model_id="scripted", turns=[[call("k1", "cal-book_slot", day="mon")],
                                                       [call("k2", "cal-hold_room", day="tue")]])
    history = ChatHistory()
    history.add_user_message("book")
    with sk_adapter.undolog_session(session_id):
        await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)


async def test_semantic_kernel_registers_the_compensations_given_in_tiers(undolog: Any) -> None:
    undone, release_slot, unbook_slot = _undo_log()
    kernel = Kernel()
    kernel.add_plugin(_Calendar(), plugin_name="cal")
    sk_adapter.install(kernel, undolog, tiers={
        "cal-book_slot": {"tier": "compensable", "compensation": release_slot},
        "cal-hold_room": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=unbook_slot),
    })
    await _sk_run(kernel, "sk-1")
    report = undolog.rollback("sk-1")
    assert [s.outcome for s in report.steps] == ["compensated", "compensated"]
    assert undone == ["plain:tue", "declared:mon"]


async def test_semantic_kernel_install_takes_compensations(undolog: Any) -> None:
    undone, release_slot, unbook_slot = _undo_log()
    kernel = Kernel()
    kernel.add_plugin(_Calendar(), plugin_name="cal")
    sk_adapter.install(kernel, undolog, compensations=[release_slot, unbook_slot], tiers={
        "cal-book_slot": {"tier": "compensable", "compensation": "release_slot"},
        "cal-hold_room": UndoLogPolicy("compensable", compensation=CompensationDescriptor.new("unbook_slot")),
    })
    await _sk_run(kernel, "sk-2")
    undolog.rollback("sk-2")
    assert undone == ["plain:tue", "declared:mon"]


# ------------------------------------------------------------------------------------------ LangGraph


def test_langgraph_takes_the_dict_form_too(undolog: Any) -> None:
    undone, release_slot, unbook_slot = _undo_log()

    @lc_tool
    def book_slot(day: str) -> str:
        """Book a call-back slot."""
        return f"b-{day}"

    @lc_tool
    def hold_room(day: str) -> str:
        """Hold a meeting room."""
        return f"r-{day}"

    node = langgraph_adapter.UndoLogToolNode([book_slot, hold_room], undolog=undolog, tiers={
        "book_slot": {"tier": "compensable", "compensation": release_slot},
        "hold_room": {"risk_level": "medium", "compensation": unbook_slot},
    })
    model = ScriptedChatModel(scripts={"book": [[("book_slot", {"day": "mon"})], [("hold_room", {"day": "tue"})]]})
    g = StateGraph(MessagesState)
    g.add_node("agent", lambda s: {"messages": [model.invoke(s["messages"])]})
    g.add_node("tools", node)
    g.add_edge(START, "agent")
    g.add_conditional_edges("agent", tools_condition)
    g.add_edge("tools", "agent")
    g.compile(checkpointer=InMemorySaver()).invoke({"messages": [{"role": "user", "content": "book it"}]},
                                                   {"configurable": {"thread_id": "lg-1"}})
    report = langgraph_adapter.rollback("lg-1", undolog=undolog)
    assert [s.outcome for s in report.steps] == ["compensated", "compensated"]
    assert undone == ["plain:tue", "declared:mon"]


# ------------------------------------------------------------------------------------------ guarded imports


@pytest.mark.parametrize("module, hidden, extra", [
    ("undolog_adapters.langgraph", ["langgraph", "langchain_core"], "langgraph"),
    ("undolog_adapters.crewai", ["crewai"], "crewai"),
    ("undolog_adapters.semantic_kernel", ["semantic_kernel"], "semantic-kernel"),
])
def test_an_adapter_without_its_framework_names_the_extra(module: str, hidden: list[str], extra: str) -> None:
    # None in sys.modules makes every import of that package fail, as if it were not installed.
    code = (f"import sys\nfor name in {hidden!r}: sys.modules[name] = None\n"
            f"try:\n    import {module}\nexcept ImportError as exc:\n    print(exc)\nelse:\n    print('imported')")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"pip install 'undolog[{extra}]'" in out.stdout and module in out.stdout
