"""CrewAI and Semantic Kernel the way their users write them: SK's own filter registration, SK's injected
parameters, and the CrewAI internals the adapter reads to learn the provider's call id (pinned to the installed
CrewAI, so a release that changes them fails here, by name)."""

from __future__ import annotations

import inspect
from typing import Annotated, Any

import pytest
from crewai.hooks import clear_all_global_hooks
from semantic_kernel import Kernel
from semantic_kernel.contents import ChatHistory
from semantic_kernel.filters import FilterTypes
from semantic_kernel.functions import KernelArguments, kernel_function

from examples.crewai_support_crew import support as crew_support
from examples.crewai_support_crew.demo import build_crew
from examples.semantic_kernel_support import support
from examples.semantic_kernel_support.llm import ScriptedChat, auto_settings, call
from tests.support.otel import in_memory_otel
from undolog_adapters import crewai as crewai_adapter
from undolog_adapters.semantic_kernel import UndoLogFilter, invoke, resume, undolog_session
from undolog_core import ApprovalPending, ToolTier, errors, undolog_tool

REFUND_U1 = call("m-2", "support-send_refund_email", user_id="u1", amount=42.5)
DELETE_U1 = call("m-4", "support-delete_user_account", user_id="u1")


@pytest.fixture(autouse=True)
def _backends() -> Any:
    support.BACKEND.reset()
    crew_support.BACKEND.reset()
    clear_all_global_hooks()
    yield
    clear_all_global_hooks()


@pytest.fixture
def otel(monkeypatch: pytest.MonkeyPatch) -> Any:
    with in_memory_otel(monkeypatch) as exported:
        yield exported


@pytest.fixture
def ul(undolog: Any) -> Any:
    undolog.register(*support.COMPENSATIONS)
    return undolog


# ------------------------------------------------------------------------------ SK: kernel.add_filter(...)


async def test_sk_filter_registered_with_kernels_own_add_filter(ul: Any) -> None:
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    undolog_filter = UndoLogFilter(ul)
    # SK's idiom, exactly as its docs register any filter object.
    kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, undolog_filter)
    kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, undolog_filter.auto_invocation)

    chat = ScriptedChat(ai_model_id="scripted", turns=[[REFUND_U1], [DELETE_U1]])
    history = ChatHistory()
    history.add_user_message("help u1")
    with undolog_session("idiom-1"):
        await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
    # The refund ran once under the model's own call id; the deletion waits for a person.
    assert [m["status"] for m in support.BACKEND.outbox] == ["sent"]
    [effect] = [e for e in ul.sessions.effects("idiom-1") if e["tool_name"] == "support-send_refund_email"]
    assert effect["call_id"] == "m-2"
    [request] = ul.approvals.pending(session_id="idiom-1")
    assert request.call_id == "m-4" and "u1" in support.BACKEND.accounts

    ul.approvals.approve(request.approval_request_id, approver="ana")
    reply = await resume(kernel, history, chat, ul, session_id="idiom-1")
    assert "u1" not in support.BACKEND.accounts and "'deleted': 'u1'" in reply.content
    report = ul.rollback("idiom-1")
    assert [s.tool_name for s in report.steps] == ["support-send_refund_email"]
    assert [m["status"] for m in support.BACKEND.outbox] == ["cancelled"]


async def test_sk_function_filter_alone_gates_kernel_invoke(ul: Any) -> None:
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, UndoLogFilter(ul, session_id="idiom-2"))
    with pytest.raises(ApprovalPending):
        await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="u1")
    assert "u1" in support.BACKEND.accounts


async def test_sk_filter_registered_with_the_decorator_form(ul: Any) -> None:
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    undolog_filter = UndoLogFilter(ul, session_id="idiom-3")
    kernel.filter(FilterTypes.FUNCTION_INVOCATION)(undolog_filter)
    await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u1", amount=5.0)
    assert [e["tool_name"] for e in ul.sessions.effects("idiom-3")] == ["support-send_refund_email"]


async def test_sk_auto_half_without_its_function_half_refuses_and_says_how(ul: Any) -> None:
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    undolog_filter = UndoLogFilter(ul)
    kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, undolog_filter.auto_invocation)
    chat = ScriptedChat(ai_model_id="scripted", turns=[[REFUND_U1]])
    history = ChatHistory()
    history.add_user_message("help")
    with pytest.raises(errors.ConfigurationError, match="add_filter\\(FilterTypes.FUNCTION_INVOCATION"):
        await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
    assert support.BACKEND.outbox == []


# ------------------------------------------------------------------------------ SK: injected parameters


class _Tenancy:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bool]] = []

    @kernel_function(name="book_slot", description="Book a call-back slot")
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="release_slot_sk")
    def book_slot(self, day: str, kernel: Kernel,
                  tenant: Annotated[str, {"include_in_function_choices": False}] = "none") -> str:
        self.seen.append((day, tenant, isinstance(kernel, Kernel)))
        return f"booked {day} for {tenant}"


async def test_sk_injected_parameters_are_not_part_of_the_logged_call(ul: Any) -> None:
    undone: list[dict[str, Any]] = []

    def release_slot_sk(ctx: Any) -> None:
        undone.append(dict(ctx.args))

    plugin = _Tenancy()
    kernel = Kernel()
    kernel.add_plugin(plugin, plugin_name="cal")
    UndoLogFilter(ul, compensations=[release_slot_sk], session_id="inj-1").install(kernel)
    # The app passes the tenant; the model only the day. SK injects the kernel.
    out = await invoke(kernel, plugin_name="cal", function_name="book_slot",
                       arguments=KernelArguments(day="mon", tenant="acme"))
    assert str(out) == "booked mon for acme" and plugin.seen == [("mon", "acme", True)]
    [effect] = ul.sessions.effects("inj-1")
    assert effect["args_snapshot"] == {"day": "mon"}
    ul.rollback("inj-1")
    assert undone == [{"day": "mon"}]


# ------------------------------------------------------------------------------ CrewAI: the call id


def test_crewai_internals_the_call_id_is_read_from_are_still_there() -> None:
    """If this fails, CrewAI changed how it executes native tool calls: update ``_native_call_id``."""
    from crewai.agents.agent_executor import AgentExecutor
    from crewai.utilities import agent_utils

    for fn in (AgentExecutor._execute_single_native_tool_call, agent_utils.execute_single_native_tool_call):
        code = fn.__code__
        assert code.co_name in crewai_adapter._NATIVE_EXECUTORS, code.co_name
        assert {"call_id", "tool_call"} <= set(code.co_varnames), (code.co_name, code.co_varnames)
        assert "crewai" in code.co_filename
    # Nothing public hands the id to a tool or a hook (if that changes, use it instead of the frames).
    from crewai.hooks import ToolCallHookContext

    assert "call_id" not in inspect.signature(ToolCallHookContext.__init__).parameters


def test_crewai_native_call_id_reaches_undolog(undolog: Any) -> None:
    tools = crewai_adapter.wrap_tools(crew_support.TOOLS, undolog=undolog, compensations=crew_support.COMPENSATIONS)
    crew = build_crew(tools, [{"tool": "delete_user_account", "args": {"user_id": "u1"}}], native=True)
    run = tools.kickoff(crew, inputs={"ticket": "help u1"})
    [request] = run.pending_approvals
    # The scripted provider's id of the first tool call, scoped to the kickoff.
    assert request.call_id.startswith("crewai:") and request.call_id.endswith(":call_1"), request.call_id


def test_crewai_tool_arguments_are_exactly_what_the_model_sent(undolog: Any) -> None:
    tools = crewai_adapter.wrap_tools(crew_support.TOOLS, undolog=undolog, compensations=crew_support.COMPENSATIONS)
    crew = build_crew(tools, [{"tool": "send_refund_email", "args": {"user_id": "u1", "amount": 42.5}}])
    run = tools.kickoff(crew, inputs={"ticket": "help u1"})
    [effect] = undolog.sessions.effects(run.session_id)
    assert set(effect["args_snapshot"]) == {"user_id", "amount"}


# ------------------------------------------------------------------------------ traces through an adapter


async def test_sk_tool_span_carries_the_models_call_id(ul: Any, otel: Any) -> None:
    exporter, _ = otel
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    undolog_filter = UndoLogFilter(ul)
    kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, undolog_filter)
    kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, undolog_filter.auto_invocation)
    chat = ScriptedChat(ai_model_id="scripted", turns=[[REFUND_U1], [DELETE_U1]])
    history = ChatHistory()
    history.add_user_message("help u1")
    with undolog_session("idiom-ot"):
        await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
    # SK traces its own function calls too; UndoLog's spans are the ones with undolog.* attributes.
    ours = [(s.name, s.attributes["gen_ai.tool.call.id"], s.attributes.get("undolog.decision"))
            for s in exporter.get_finished_spans() if "undolog.tier" in (s.attributes or {})]
    assert ours == [("execute_tool support-send_refund_email", "m-2", None),
                    ("execute_tool support-delete_user_account", "m-4", "awaiting_approval")]
