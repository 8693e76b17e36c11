"""Semantic Kernel adapter: real kernels, auto function calling and ChatCompletionAgent, scripted model."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from semantic_kernel import Kernel
from semantic_kernel.agents import ChatCompletionAgent, ChatHistoryAgentThread
from semantic_kernel.connectors.ai.function_choice_behavior import FunctionChoiceBehavior
from semantic_kernel.contents import ChatHistory, FunctionResultContent
from semantic_kernel.exceptions import KernelInvokeException
from semantic_kernel.filters import FilterTypes
from semantic_kernel.functions import kernel_function

from examples import support_backend
from examples.semantic_kernel_support import support
from examples.semantic_kernel_support.llm import ScriptedChat, auto_settings, call
from undolog_adapters.semantic_kernel import (
    PLACEHOLDER_KEY,
    UndoLogFilter,
    install,
    invoke,
    resume,
    resume_agent,
    undolog_session,
)
from undolog_core import ApprovalPending, CompensationDescriptor, ToolTier, compensation, errors, undolog_tool
from undolog_core.storage import schema as schema
from undolog_core.testing import internals

ROOT = Path(__file__).resolve().parents[2]

SEARCH = call("c1", "support-search_knowledge_base", query="refund policy")
REFUND_U1 = call("c2", "support-send_refund_email", user_id="u1", amount=42.5)
REFUND_U2 = call("c3", "support-send_refund_email", user_id="u2", amount=10.0)
DELETE_U1 = call("c4", "support-delete_user_account", user_id="u1")


@pytest.fixture(autouse=True)
def backend():
    support.BACKEND.reset()
    return support.BACKEND


@pytest.fixture
def ul(undolog):
    undolog.register(*support.COMPENSATIONS)
    return undolog


def new_kernel(ul, **kw):
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    flt = install(kernel, ul, **kw)
    return kernel, flt


async def chat_turns(kernel, turns, session_id="chat-1"):
    chat = ScriptedChat(ai_model_id="scripted", turns=turns)
    history = ChatHistory()
    history.add_user_message("help u1")
    with undolog_session(session_id):
        reply = await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
    return chat, history, reply


def results(history):
    return [str(i.result) for m in history.messages for i in m.items if isinstance(i, FunctionResultContent)]


def test_install_refuses_a_kernel_with_an_unclassified_function(ul):
    class Bank:
        @kernel_function(name="transfer", description="Transfer money")
        def transfer(self, amount: int) -> str:
            return "done"

    kernel = Kernel()
    kernel.add_plugin(Bank(), plugin_name="bank")
    with pytest.raises(errors.ToolNotClassified, match="bank-transfer"):
        install(kernel, ul)


async def test_unclassified_function_is_refused_at_call_time(ul):
    ran = []

    class Bank:
        @kernel_function(name="transfer", description="Transfer money")
        def transfer(self, amount: int) -> str:
            ran.append(amount)
            return "done"

    kernel = Kernel()
    kernel.add_plugin(Bank(), plugin_name="bank")
    install(kernel, ul, strict=False)
    _, history, reply = await chat_turns(kernel, [[call("b1", "bank-transfer", amount=5)]])
    assert ran == [] and "has no tier" in results(history)[0]
    with pytest.raises(errors.ToolNotClassified):
        await invoke(kernel, plugin_name="bank", function_name="transfer", amount=5)
    assert ran == []


async def test_tiers_by_plugin_function_name(ul):
    ran = []

    class Bank:
        @kernel_function(name="balance", description="Read a balance")
        def balance(self, account: str) -> str:
            ran.append(account)
            return "100"

    kernel = Kernel()
    kernel.add_plugin(Bank(), plugin_name="bank")
    install(kernel, ul, tiers={"bank-balance": "safe"})
    _, history, reply = await chat_turns(kernel, [[call("b1", "bank-balance", account="a1")]])
    assert ran == ["a1"] and "100" in reply.content
    assert ul.tool_spec("bank-balance").tier.value == "safe"


async def test_each_call_is_intercepted_once(ul, backend, monkeypatch):
    kernel, _ = new_kernel(ul)
    seen = []
    # The filters decide on the loop: a SAFE call in memory (checked by its contract, then the engine's
    # note_safe_in, which the driver's safe() ends with too), a logged one by the engine's intercept_spec (through the
    # driver's adecide for a session's first logged call, directly for the others).
    real, real_safe = ul.engine.intercept_spec, ul.engine.note_safe_in

    def counting(session_id, spec, args, call_id=None, match_digest=False, wait=True):
        seen.append((spec.name, call_id))
        return real(session_id, spec, args, call_id, match_digest, wait)

    def counting_safe(cache, spec, args):
        seen.append((spec.name, "safe"))
        return real_safe(cache, spec, args)

    monkeypatch.setattr(ul.engine, "intercept_spec", counting)
    monkeypatch.setattr(ul.engine, "note_safe_in", counting_safe)
    _, history, reply = await chat_turns(kernel, [[SEARCH], [REFUND_U1]])
    assert seen == [("support-search_knowledge_base", "safe"), ("support-send_refund_email", "c2")]
    assert [m["status"] for m in backend.outbox] == ["sent"]
    assert "Refunds are confirmed" in reply.content and "msg-1" in reply.content
    report = ul.rollback("chat-1")
    assert [s.tool_name for s in report.steps] == ["support-send_refund_email"]
    assert [m["status"] for m in backend.outbox] == ["cancelled"]


async def test_parallel_calls_in_one_turn_are_each_gated(ul, backend):
    kernel, _ = new_kernel(ul)
    _, history, reply = await chat_turns(kernel, [[SEARCH, REFUND_U1, DELETE_U1]])
    # The loop stops for the deletion; its siblings ran once.
    assert [m["status"] for m in backend.outbox] == ["sent"] and "u1" in backend.accounts
    assert len(ul.approvals.pending(session_id="chat-1")) == 1


async def test_irreversible_pauses_the_loop_and_resumes_after_approval(ul, backend):
    kernel, _ = new_kernel(ul)
    chat, history, reply = await chat_turns(kernel, [[REFUND_U1], [DELETE_U1]])
    assert "u1" in backend.accounts
    placeholder = [i for i in reply.items if isinstance(i, FunctionResultContent)][0]
    request_id = placeholder.metadata[PLACEHOLDER_KEY]
    assert f"awaiting approval, request {request_id}" in str(placeholder.result)

    with pytest.raises(ApprovalPending):
        await resume(kernel, history, chat, ul, session_id="chat-1")
    assert "u1" in backend.accounts

    # The history survives a process boundary.
    history = ChatHistory.restore_chat_history(history.serialize())
    ul.approvals.approve(request_id, approver="ana")
    reply = await resume(kernel, history, chat, ul, session_id="chat-1")
    assert "u1" not in backend.accounts
    assert "'deleted': 'u1'" in reply.content and "awaiting approval" not in reply.content
    assert ul.approvals.get(request_id).state == "approved"

    # Re-dispatching the same call replays it instead of deleting twice.
    with undolog_session("chat-1"):
        again = await kernel.invoke_function_call(
            [i for m in history.messages for i in m.items if getattr(i, "id", None) == "c4"][0],
            history, function_behavior=FunctionChoiceBehavior.Auto())
    assert again is None and "'deleted': 'u1'" in results(history)[-1]


async def test_modified_approval_runs_the_approvers_arguments(ul, backend):
    kernel, _ = new_kernel(ul)
    chat, history, reply = await chat_turns(kernel, [[DELETE_U1]])
    request = ul.approvals.pending(session_id="chat-1")[0]
    ul.approvals.modify(request.approval_request_id, approver="ana", args={"user_id": "u2"})
    reply = await resume(kernel, history, chat, ul)
    assert sorted(backend.accounts) == ["u1"]
    assert "'deleted': 'u2'" in reply.content


async def test_rejected_approval_tells_the_model(ul, backend):
    kernel, _ = new_kernel(ul)
    chat, history, _ = await chat_turns(kernel, [[DELETE_U1]])
    request = ul.approvals.pending(session_id="chat-1")[0]
    ul.approvals.reject(request.approval_request_id, approver="ana", reason="keeps the data")
    reply = await resume(kernel, history, chat, ul)
    assert "u1" in backend.accounts
    assert "rejected by ana: keeps the data" in reply.content


async def test_timed_out_approval_tells_the_model(ul, backend):
    kernel, _ = new_kernel(ul)
    chat, history, _ = await chat_turns(kernel, [[DELETE_U1]])
    request = ul.approvals.pending(session_id="chat-1")[0]
    ul.approvals.expire([request.approval_request_id], now=dt.datetime.now(dt.UTC) + dt.timedelta(days=60))
    reply = await resume(kernel, history, chat, ul)
    assert "u1" in backend.accounts and "timed out" in reply.content


def _push_deadline_into_the_past(ul, request_id):
    # The deadline passes with nobody calling expire(): the resume must find out by itself.
    r = schema.approval_requests
    with internals(ul).write() as conn:
        conn.execute(r.update().where(r.c.approval_request_id == request_id)
                     .values(timeout_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=5)))


@pytest.mark.storage
async def test_resume_reports_a_request_past_its_deadline_as_timed_out(ul, backend):
    kernel, _ = new_kernel(ul)
    chat, history, _ = await chat_turns(kernel, [[DELETE_U1]])
    [request] = ul.approvals.list(state="pending", session_id="chat-1")
    _push_deadline_into_the_past(ul, request.approval_request_id)
    reply = await resume(kernel, history, chat, ul)
    assert "u1" in backend.accounts
    assert "timed out" in reply.content and "awaiting approval" not in reply.content
    assert ul.approvals.list(session_id="chat-1")[0].state == "timed_out"


async def test_decision_from_another_thread(db, ul, backend):
    kernel, _ = new_kernel(ul)
    chat, history, _ = await chat_turns(kernel, [[DELETE_U1]])

    def approver():
        other = db.open()
        try:
            other.approvals.approve(other.approvals.pending()[0].approval_request_id, approver="ops")
        finally:
            other.close()

    t = threading.Thread(target=approver)
    t.start()
    t.join()
    reply = await resume(kernel, history, chat, ul)
    assert "u1" not in backend.accounts and "'deleted': 'u1'" in reply.content


async def test_decision_from_another_process(db, ul, backend):
    kernel, _ = new_kernel(ul)
    chat, history, _ = await chat_turns(kernel, [[DELETE_U1]])
    script = textwrap.dedent(
        """
        from undolog_core import UndoLog
        ul = UndoLog.open()
        ul.approvals.modify(ul.approvals.pending()[0].approval_request_id, approver="cli", args={"user_id": "u2"})
        ul.close()
        """
    )
    subprocess.run([sys.executable, "-c", script], env={**os.environ, **db.env}, cwd=ROOT, check=True, timeout=60)
    reply = await resume(kernel, history, chat, ul)
    assert sorted(backend.accounts) == ["u1"] and "'deleted': 'u2'" in reply.content


async def test_kernel_invoke_raises_approval_pending_then_runs_once_approved(ul, backend):
    kernel, _ = new_kernel(ul)
    with undolog_session("inv-1"):
        with pytest.raises(ApprovalPending) as pending:
            await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="u1")
        with pytest.raises(KernelInvokeException) as wrapped:
            await kernel.invoke(plugin_name="support", function_name="delete_user_account", user_id="u1")
        assert isinstance(wrapped.value.__cause__, ApprovalPending)
        assert wrapped.value.__cause__.approval_request_id == pending.value.approval_request_id
        assert "u1" in backend.accounts
        ul.approvals.approve(pending.value.approval_request_id, approver="ana")
        result = await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="u1")
        assert result.value == {"deleted": "u1"}
        again = await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="u1")
        assert again.value == {"deleted": "u1"}


async def test_kernel_invoke_rejected(ul, backend):
    kernel, _ = new_kernel(ul)
    with undolog_session("inv-2"):
        with pytest.raises(ApprovalPending) as pending:
            await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="u1")
        ul.approvals.reject(pending.value.approval_request_id, approver="ana", reason="no")
        with pytest.raises(errors.ApprovalRejected):
            await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="u1")
    assert "u1" in backend.accounts


async def test_failure_under_auto_calling_rolls_back(ul, backend):
    backend.mail_down_for.add("u2")
    kernel, _ = new_kernel(ul)
    _, history, reply = await chat_turns(kernel, [[REFUND_U1], [REFUND_U2]])
    assert [m["status"] for m in backend.outbox] == ["cancelled"]
    assert "mail server refused" in reply.content and "rolled the session back" in reply.content
    assert ul.sessions.get("chat-1").state == "rolled_back"
    # The model reads what failed and what was undone, not SK's bare error text.
    failure = results(history)[-1]
    assert failure.startswith("support-send_refund_email failed: MailServerDown: mail server refused")
    assert "undone: support-send_refund_email" in failure and "An error occurred" not in failure


@pytest.fixture
def raised(monkeypatch):
    """The exception objects the support plugin's mail server raised, to compare by identity."""
    seen = []

    class Recorded(support.MailServerDown):
        def __init__(self, *a):
            super().__init__(*a)
            seen.append(self)

    monkeypatch.setattr(support_backend, "MailServerDown", Recorded)
    return seen


async def test_failure_under_kernel_invoke_rolls_back_and_reraises_the_users_exception(ul, backend, raised):
    backend.mail_down_for.add("u2")
    kernel, _ = new_kernel(ul)
    with undolog_session("inv-3"):
        await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u1", amount=1.0)
        with pytest.raises(support.MailServerDown) as failed:
            await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u2", amount=1.0)
    # The very exception the tool raised, not a wrapper; the rollback ran and is noted on it.
    assert failed.value is raised[0] and type(failed.value) is type(raised[0])
    assert failed.value.__cause__ is None
    assert str(failed.value) == "mail server refused the message to u2"
    assert failed.value.undolog_rollback.complete
    [note] = failed.value.__notes__
    assert note.startswith("undolog: UndoLog rolled the session back (undone: support-send_refund_email)")
    assert [m["status"] for m in backend.outbox] == ["cancelled"]
    assert ul.sessions.get("inv-3").state == "rolled_back"


async def test_plain_kernel_invoke_wraps_only_what_sk_wraps(ul, backend, raised):
    # SK's own KernelInvokeException still wraps; its cause is the user's exception, annotated.
    backend.mail_down_for.add("u1")
    kernel, _ = new_kernel(ul)
    with undolog_session("inv-4"), pytest.raises(KernelInvokeException) as wrapped:
        await kernel.invoke(plugin_name="support", function_name="send_refund_email", user_id="u1", amount=1.0)
    assert wrapped.value.__cause__ is raised[0]
    assert "rolled the session back" in raised[0].__notes__[0]


async def test_irreversible_failure_under_kernel_invoke_reraises_the_users_exception(ul, backend):
    kernel, _ = new_kernel(ul)
    with undolog_session("inv-5"):
        await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u1", amount=1.0)
        with pytest.raises(ApprovalPending) as pending:
            await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="ghost")
        ul.approvals.approve(pending.value.approval_request_id, approver="ana")
        with pytest.raises(KeyError, match="no account ghost") as failed:
            await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="ghost")
    assert type(failed.value) is KeyError and failed.value.undolog_rollback.complete
    assert "rolled the session back (undone: support-send_refund_email)" in failed.value.__notes__[0]
    assert [m["status"] for m in backend.outbox] == ["cancelled"]


async def test_failure_with_continue_policy_is_noted_and_not_rolled_back(ul, backend, raised):
    backend.mail_down_for.add("u2")
    kernel, _ = new_kernel(ul)
    ul.session(agent_id="semantic-kernel", session_id="inv-6", on_failure="continue")
    with undolog_session("inv-6"):
        await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u1", amount=1.0)
        with pytest.raises(support.MailServerDown) as failed:
            await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u2", amount=1.0)
    assert failed.value is raised[0] and failed.value.undolog_rollback is None
    assert "keeps its earlier steps (policy: continue)" in failed.value.__notes__[0]
    assert [m["status"] for m in backend.outbox] == ["sent"]


@pytest.mark.parametrize("known", [False, True], ids=["first-logged-call", "later-logged-call"])
async def test_gate_failure_fails_closed(ul, backend, monkeypatch, known):
    """The gate's failure stops the call, whether the session's first logged call (decided through the driver's
    adecide) or a later one (the engine asked directly)."""
    kernel, _ = new_kernel(ul)
    if known:
        await chat_turns(kernel, [[REFUND_U2]])
        backend.outbox.clear()

    def broken(*a, **kw):
        raise RuntimeError("database unreachable")

    monkeypatch.setattr(ul.engine, "intercept_spec", broken)
    with pytest.raises(RuntimeError, match="database unreachable"):
        await chat_turns(kernel, [[REFUND_U1]])
    assert backend.outbox == []


async def test_a_filter_inside_the_gate_cannot_change_the_approved_call(ul, backend):
    # An auto filter registered after UndoLog's runs inside it, after the gate: its edit would delete
    # an account nobody approved.
    kernel, _ = new_kernel(ul)

    async def editor(context, next):
        if "user_id" in context.arguments:
            context.arguments["user_id"] = "u2"
        await next(context)

    kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, editor)
    chat, history, _ = await chat_turns(kernel, [[DELETE_U1]])
    [request] = ul.approvals.pending(session_id="chat-1")
    assert request.proposed_args == {"user_id": "u1"}
    ul.approvals.approve(request.approval_request_id, approver="ana")
    reply = await resume(kernel, history, chat, ul)
    assert sorted(backend.accounts) == ["u1", "u2"]  # neither the approved nor the edited call ran
    assert "arguments were changed after UndoLog's gate" in reply.content


async def test_function_filter_order_keeps_the_runner_innermost(ul, backend):
    seen = []

    async def edit_amount(context, next):
        seen.append(dict(context.arguments))
        context.arguments["amount"] = 1.0
        await next(context)

    # Added before install: it runs outside UndoLog's runner, so UndoLog gates and logs the edited call.
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, edit_amount)
    install(kernel, ul)
    with undolog_session("inv-9"):
        await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u1", amount=42.5)
    assert seen and [m["amount"] for m in backend.outbox] == [1.0]
    [effect] = ul.sessions.effects("inv-9")
    assert effect["args_snapshot"]["amount"] == 1.0
    # Added after install, it would run between UndoLog's check and the tool: every call is refused.
    kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, edit_amount)
    with undolog_session("inv-9"), pytest.raises(errors.ConfigurationError, match="inside UndoLog"):
        await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u2", amount=3.0)
    assert len(backend.outbox) == 1


async def test_auto_filter_alone_refuses_to_run(ul, backend):
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    flt = UndoLogFilter(ul)
    kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, flt.auto_filter)
    with pytest.raises(errors.ConfigurationError):
        await chat_turns(kernel, [[REFUND_U1]])
    assert backend.outbox == []


async def test_session_defaults_to_the_filter_and_can_be_fixed(ul):
    kernel, flt = new_kernel(ul)
    await invoke(kernel, plugin_name="support", function_name="send_refund_email", user_id="u1", amount=1.0)
    ul.engine.flush_counts(flt.session_id)  # call counters are written lazily
    assert ul.sessions.get(flt.session_id).tool_calls_total >= 1
    kernel2, flt2 = new_kernel(ul, session_id="thread-9")
    assert flt2.session_id == "thread-9"
    with undolog_session("other"):
        assert flt2.session_id == "other"


async def test_chat_completion_agent_pause_and_resume(ul, backend):
    kernel, _ = new_kernel(ul)
    agent = ChatCompletionAgent(kernel=kernel, name="support", instructions="help",
                                service=ScriptedChat(ai_model_id="scripted", turns=[[SEARCH], [DELETE_U1]]),
                                function_choice_behavior=FunctionChoiceBehavior.Auto())
    thread = ChatHistoryAgentThread(thread_id="thread-1")
    with undolog_session(thread.id):
        first = await agent.get_response(messages="delete u1", thread=thread)
    assert "awaiting approval" in str(first.message.items[-1].result)
    request = ul.approvals.pending(session_id="thread-1")[0]
    assert request.tool_name == "support-delete_user_account"
    ul.approvals.approve(request.approval_request_id, approver="ana")
    second = await resume_agent(agent, thread, ul, session_id=thread.id)
    assert "u1" not in backend.accounts
    assert "'deleted': 'u1'" in second.message.content and "awaiting approval" not in second.message.content


def test_demo_runs_offline_both_ways(db, capsys):
    from examples.semantic_kernel_support.demo import main

    for reject in (False, True):
        u = db.open()
        try:
            assert main(reject=reject, undolog=u) == 0
        finally:
            u.close()
    out = capsys.readouterr().out
    assert "ana approved" in out and "ana rejected" in out


def test_running_as_a_module(db):
    # No bound on how long it took (no timed tests): on a loaded 2-core machine the run alone took over 60 s.
    proc = subprocess.run([sys.executable, "-m", "examples.semantic_kernel_support"], env={**os.environ, **db.env},
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ana approved" in proc.stdout



class _Notes:
    @kernel_function(name="add_note", description="Add a note to a ticket.")
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("sk_drop_note"))
    def add_note(self, ticket: str, text: str, pinned: bool = False, weight: float = 1.0) -> str:
        NOTES.append((ticket, text, pinned, weight))
        return f"noted {ticket}"


NOTES: list[tuple[str, str, bool, float]] = []


@compensation("sk_drop_note")
def sk_drop_note(ctx):
    return None


@pytest.mark.parametrize("args", [{"ticket": "T1", "text": "hi", "pinned": True, "weight": 2.5},
                                  {"ticket": "T1", "text": "hi", "pinned": False, "weight": 2},
                                  {"ticket": "T1", "text": "hi"}])
async def test_the_call_let_through_runs_whether_or_not_validation_changed_its_arguments(ul, args):
    # The inner filter compares the call it runs with the arguments let through, as JSON values: those the gate was
    # asked about when validation kept them (weight=2.5; weight=2, equal to 2.0), else the validated ones (the
    # defaults filled in), converted.
    NOTES.clear()
    ul.register(sk_drop_note)
    kernel = Kernel()
    kernel.add_plugin(_Notes(), plugin_name="notes")
    install(kernel, ul)
    _, history, _ = await chat_turns(kernel, [[call("c9", "notes-add_note", **args)]])
    assert NOTES == [("T1", "hi", args.get("pinned", False), args.get("weight", 1.0))], results(history)
    [effect] = ul.sessions.effects("chat-1")
    assert effect["state"] == "committed"


# -- the session is written by its first logged call, not by the first sight of the kernel run ------------------


async def test_a_safe_only_kernel_run_writes_nothing_and_its_count_keeps_the_agent_id(db, ul, backend):
    from tests.test_overhead_statements import StatementCounter, wire_transactions

    kernel, _ = new_kernel(ul, agent_id="support-bot")
    before = {s.session_id for s in ul.sessions.list()}
    counter = StatementCounter(ul)  # before the hot path takes a connection: traced from the first
    try:
        counter.mark("start")
        _, history, reply = await chat_turns(kernel, [[SEARCH], [call("c9", "support-search_knowledge_base",
                                                                       query="refund")]], session_id="chat-safe")
        counter.mark("end")
        window = counter.window("start", "end")
    finally:
        counter.close()
    assert "Refunds are confirmed" in reply.content and len(results(history)) == 2
    done, left_open = wire_transactions(window)
    statements = [e for e in window if e.level == "wire" and e.kind == "stmt"]
    # At most one read (the session looked up once, for its state and pins), no transaction, no write.
    assert len(statements) <= 1 and not [t for t in done if len(t) > 1] and not left_open, statements
    if not internals(ul).is_postgres:  # sqlite3's trace shows the text; libpq's only that one statement was executed
        assert all(e.text.startswith("SELECT") for e in statements)
    assert {s.session_id for s in ul.sessions.list()} == before
    with pytest.raises(errors.SessionNotFound):
        ul.sessions.get("chat-safe")
    # What UndoLog's close writes: the SAFE calls' count, on a session row that keeps the filter's agent id.
    internals(ul).flush()
    rec = db.open().sessions.get("chat-safe")
    assert (rec.agent_id, rec.tool_calls_total, rec.state) == ("support-bot", 2, "active")


async def test_a_safe_run_then_a_logged_call_creates_the_session_once_with_the_agent_id(ul, backend):
    kernel, _ = new_kernel(ul, agent_id="support-bot")
    await chat_turns(kernel, [[SEARCH]], session_id="chat-mixed")
    with pytest.raises(errors.SessionNotFound):
        ul.sessions.get("chat-mixed")
    await chat_turns(kernel, [[REFUND_U1]], session_id="chat-mixed")
    rec = ul.sessions.get("chat-mixed")
    assert rec.agent_id == "support-bot" and rec.tool_calls_total >= 1  # the SAFE call rode along with the write
    assert [m["status"] for m in backend.outbox] == ["sent"]
    assert [e["tool_name"] for e in ul.sessions.effects("chat-mixed")] == ["support-send_refund_email"]


async def test_a_session_halted_by_another_process_refuses_logged_calls_through_the_filter(db, ul, backend):
    other = db.open()
    other.register(*support.COMPENSATIONS)
    other.session(agent_id="elsewhere", session_id="chat-halted")
    other.sessions.set_state("chat-halted", "halted", allowed=("active",))
    kernel, _ = new_kernel(ul)
    _, history, _ = await chat_turns(kernel, [[SEARCH], [REFUND_U1]], session_id="chat-halted")
    searched, refused = results(history)
    # The core's contract (README, "a halted session refuses COMPENSABLE and IRREVERSIBLE calls; SAFE calls still
    # run"), the same through the filter whether or not the session was read before.
    assert "Refunds are confirmed" in searched
    assert "halted" in refused and backend.outbox == []
    rec = ul.sessions.get("chat-halted")
    assert (rec.state, rec.agent_id) == ("halted", "elsewhere")  # read, never re-created nor overwritten
    assert ul.sessions.effects("chat-halted") == []


async def test_a_resumed_session_keeps_its_pins_for_safe_calls(db, ul, backend):
    # Another process started the session under another contract of the SAFE tool; this process's filter, seeing
    # the session for the first time, must not run the SAFE call under its own (changed) contract.
    other = db.open()

    @undolog_tool(tier=ToolTier.SAFE, name="support-search_knowledge_base")
    def older_search(query: str, limit: int = 3) -> list[str]:
        return []

    other.register(older_search)
    other.session(agent_id="elsewhere", session_id="chat-pinned")
    kernel, _ = new_kernel(ul)
    _, history, _ = await chat_turns(kernel, [[SEARCH]], session_id="chat-pinned")
    [answer] = results(history)
    assert "UndoLog refused" in answer and "changed since session 'chat-pinned'" in answer, answer


# -- a SAFE call is decided by the inner filter, right before the function runs -----------------------------------


class _Lookup:
    @kernel_function(name="lookup", description="Look an order up.")
    @undolog_tool(tier=ToolTier.SAFE)
    def lookup(self, order_id: str, weight: float = 1.0) -> str:
        LOOKED_UP.append((order_id, weight))
        if order_id == "boom":
            raise LookupError("the order service is down")
        return f"order {order_id}: shipped"


LOOKED_UP: list[tuple[str, float]] = []


def _lookup_kernel(ul, *, before=(), after=()):
    """A kernel with the SAFE lookup tool; ``before``: FUNCTION_INVOCATION filters added before install (they run
    outside UndoLog's inner filter); ``after``: AUTO_FUNCTION_INVOCATION filters added after it (they run inside
    UndoLog's auto filter, between it and the function)."""
    LOOKED_UP.clear()
    kernel = Kernel()
    kernel.add_plugin(_Lookup(), plugin_name="shop")
    for f in before:
        kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, f)
    install(kernel, ul)
    for f in after:
        kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, f)
    return kernel


async def test_a_safe_call_is_validated_and_converted_against_its_contract_both_ways(ul):
    seen = []

    async def outer(context, next):  # runs around UndoLog's inner filter: sees the arguments it let through
        await next(context)
        seen.append(dict(context.arguments))

    kernel = _lookup_kernel(ul, before=[outer])
    _, history, _ = await chat_turns(kernel, [[call("k1", "shop-lookup", order_id="A-1", weight=2)],
                                             [call("k2", "shop-lookup", order_id=5)]], session_id="chat-safe")
    ok, refused = results(history)
    assert ok == "order A-1: shipped" and "UndoLog refused shop-lookup" in refused, refused
    # (The refused call went through the outer filter too, as under a plain invoke: UndoLog refused it innermost.)
    assert LOOKED_UP == [("A-1", 2.0)] and seen == [{"order_id": "A-1", "weight": 2.0}, {"order_id": 5}]
    assert type(seen[0]["weight"]) is float  # the contract's conversion (a number is a float), not the model's int
    with undolog_session("chat-safe"), pytest.raises(errors.ArgumentsInvalid):
        await invoke(kernel, plugin_name="shop", function_name="lookup", order_id=["A-1"])
    assert LOOKED_UP == [("A-1", 2.0)]
    internals(ul).flush()
    assert ul.sessions.get("chat-safe").tool_calls_total == 1  # the call that ran, counted once; refusals are not


async def test_a_safe_call_edited_after_the_auto_gate_is_validated_as_it_runs(ul):
    # A SAFE call is checked innermost, after every other filter: an edit is validated (and runs when valid), never
    # slips past the check. (Before, the check ran in the auto filter and any edit made after it was refused.)
    async def edit(context, next):
        context.arguments["order_id"] = context.arguments["order_id"].upper() if context.arguments[
            "order_id"] != "bad" else 7
        await next(context)

    kernel = _lookup_kernel(ul, after=[edit])
    _, history, _ = await chat_turns(kernel, [[call("k1", "shop-lookup", order_id="a-1")],
                                             [call("k2", "shop-lookup", order_id="bad")]])
    ok, refused = results(history)
    assert ok == "order A-1: shipped" and "UndoLog refused shop-lookup" in refused, refused
    assert LOOKED_UP == [("A-1", 1.0)]


async def test_a_safe_call_whose_arguments_object_is_replaced_after_the_auto_gate_is_still_checked(ul):
    # The auto filter hands a SAFE call to the inner filter by its KernelArguments object. A filter between the two
    # that puts another object in the call does not slip it past the check: the inner filter decides it as under a
    # plain invoke (validated, pinned, counted; a refusal raised, which SK turns into its own error text), and the
    # hand-over left behind is removed.
    from semantic_kernel.functions import KernelArguments

    async def replace(context, next):
        order_id = context.arguments["order_id"]
        context.arguments = KernelArguments(order_id=order_id.upper() if order_id != "bad" else 7)
        await next(context)

    kernel = _lookup_kernel(ul, after=[replace])
    _, history, _ = await chat_turns(kernel, [[call("k1", "shop-lookup", order_id="a-1")],
                                             [call("k2", "shop-lookup", order_id="bad")]], session_id="chat-swap")
    ok, refused = results(history)
    assert ok == "order A-1: shipped" and "invalid arguments for tool 'shop-lookup'" in refused, refused
    assert LOOKED_UP == [("A-1", 1.0)]
    undolog_filter = next(f for _, f in kernel.function_invocation_filters).__self__
    assert undolog_filter._safe_calls == {}
    internals(ul).flush()
    assert ul.sessions.get("chat-swap").tool_calls_total == 1


async def test_a_safe_functions_own_exception_goes_on_untouched(ul):
    kernel = _lookup_kernel(ul)
    with undolog_session("chat-boom"), pytest.raises(KernelInvokeException) as raised:
        await invoke(kernel, plugin_name="shop", function_name="lookup", order_id="boom")
    cause = raised.value.__cause__
    assert type(cause) is LookupError and str(cause) == "the order service is down"
    assert not getattr(cause, "__notes__", None) and not hasattr(cause, "undolog_rollback")
    _, history, _ = await chat_turns(kernel, [[call("k1", "shop-lookup", order_id="boom")]], session_id="chat-boom")
    assert "the order service is down" in results(history)[0]  # SK's own text of it, as without UndoLog
    assert [o for o, _ in LOOKED_UP] == ["boom", "boom"]


async def test_a_tool_registered_again_is_routed_and_checked_by_its_new_contract(ul):
    kernel = _lookup_kernel(ul)
    await chat_turns(kernel, [[call("k1", "shop-lookup", order_id="A-1")]], session_id="chat-r1")
    assert LOOKED_UP == [("A-1", 1.0)]

    @undolog_tool(tier=ToolTier.SAFE, name="shop-lookup")
    def lookup_v2(order_id: str, region: str) -> str:
        return ""

    ul.register(lookup_v2)  # still SAFE, a new contract: the call without 'region' is refused, not run
    _, history, _ = await chat_turns(kernel, [[call("k2", "shop-lookup", order_id="A-2")]], session_id="chat-r2")
    assert "UndoLog refused shop-lookup" in results(history)[0] and "region" in results(history)[0]

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, name="shop-lookup", reason="now it deletes")
    def lookup_v3(order_id: str, weight: float = 1.0) -> str:
        return ""

    ul.register(lookup_v3)  # now IRREVERSIBLE: gated for a person under auto, and under a plain invoke
    _, history, _ = await chat_turns(kernel, [[call("k3", "shop-lookup", order_id="A-3")]], session_id="chat-r3")
    assert "awaiting approval" in results(history)[0]
    with undolog_session("chat-r4"), pytest.raises(ApprovalPending):
        await invoke(kernel, plugin_name="shop", function_name="lookup", order_id="A-4")
    assert LOOKED_UP == [("A-1", 1.0)]


async def test_a_safe_tool_with_a_retry_policy_is_retried_through_the_gate(ul):
    from undolog_core import RetryPolicy

    tries = []

    class Flaky:
        @kernel_function(name="quote", description="Quote a price.")
        def quote(self, sku: str) -> str:
            tries.append(sku)
            if len(tries) < 3:
                raise TimeoutError("the price service timed out")
            return f"{sku}: 12.50"

    kernel = Kernel()
    kernel.add_plugin(Flaky(), plugin_name="shop")
    install(kernel, ul, tiers={"shop-quote": {"tier": "safe", "retry": RetryPolicy(attempts=3, backoff=0.0)}})
    _, history, _ = await chat_turns(kernel, [[call("q1", "shop-quote", sku="S-1")]], session_id="chat-retry")
    assert results(history) == ["S-1: 12.50"] and tries == ["S-1"] * 3
    internals(ul).flush()
    assert ul.sessions.get("chat-retry").tool_calls_total == 1 and ul.sessions.effects("chat-retry") == []


async def test_a_safe_calls_arguments_of_other_types_than_exact_scalars_are_still_converted_and_checked(ul):
    # Exact str/int/float/bool/None values skip the JSON conversion (it would give them back unchanged); anything
    # else still takes it, and the contract's check follows either way: a str subclass runs as a plain str, a bool
    # for a number and a list for a string are refused (nothing runs).
    import enum

    class Order(enum.StrEnum):
        A1 = "A-1"

    kernel = _lookup_kernel(ul)
    with undolog_session("chat-kinds"):
        await invoke(kernel, plugin_name="shop", function_name="lookup", order_id=Order.A1, weight=2.5)
        assert LOOKED_UP == [("A-1", 2.5)] and type(LOOKED_UP[0][0]) is str
        for bad in ({"order_id": "A-2", "weight": True}, {"order_id": ["A-2"]}, {"order_id": None}):
            with pytest.raises(errors.ArgumentsInvalid):
                await invoke(kernel, plugin_name="shop", function_name="lookup", **bad)
        await invoke(kernel, plugin_name="shop", function_name="lookup", order_id="A-3", weight=3)
    assert LOOKED_UP == [("A-1", 2.5), ("A-3", 3.0)] and type(LOOKED_UP[1][1]) is float
    internals(ul).flush()
    assert ul.sessions.get("chat-kinds").tool_calls_total == 2


async def test_a_call_a_safe_function_makes_through_the_kernel_is_its_own(ul):
    # The auto gate's hand-over is taken by the call it was made for: a call the function itself makes through the
    # kernel is decided as a plain invoke (a refusal raises in the function), not as the model's call (answered).
    outcomes: list[str] = []

    class Nested:
        @kernel_function(name="lookup", description="Look an order up.")
        @undolog_tool(tier=ToolTier.SAFE)
        async def lookup(self, order_id: str) -> str:
            if order_id == "outer":
                try:
                    await kernel.invoke(plugin_name="shop", function_name="lookup", order_id=7)
                    outcomes.append("answered")
                except KernelInvokeException as exc:
                    outcomes.append(type(exc.__cause__).__name__)
            return f"order {order_id}: shipped"

    kernel = Kernel()
    kernel.add_plugin(Nested(), plugin_name="shop")
    install(kernel, ul)
    _, history, _ = await chat_turns(kernel, [[call("n1", "shop-lookup", order_id="outer")]], session_id="chat-nest")
    assert results(history) == ["order outer: shipped"] and outcomes == ["ArgumentsInvalid"]


def _safe_shop_kernel(ul):
    """A kernel with one SAFE function (``shop-lookup_order``) and UndoLog's filters installed: the frame counts'."""

    class Shop:
        @kernel_function(name="lookup_order", description="Look an order up.")
        @undolog_tool(tier=ToolTier.SAFE)
        def lookup_order(self, order_id: str) -> str:
            return f"order {order_id}: shipped"

    kernel = Kernel()
    kernel.add_plugin(Shop(), plugin_name="shop")
    install(kernel, ul)
    return kernel


async def test_a_routed_safe_call_runs_four_undolog_frames_and_a_dozen_builtin_calls(ul):
    """What a SAFE call under auto function calling costs UndoLog, counted (not timed): the two filters, the contract's
    as-is check and the engine's count; no frame of the driver in between, no filter list read (the inner filter's
    ``next`` is the function's own method), no key view or items loop over the arguments."""

    kernel = _safe_shop_kernel(ul)
    history = ChatHistory()
    ours = (f"{os.sep}undolog_core", f"{os.sep}undolog_adapters")
    frames: list[str] = []
    builtins: list[str] = []

    def profile(frame, event, arg):
        if frame.f_code.co_filename.rpartition(os.sep)[0].endswith(ours):
            if event == "call":
                frames.append(frame.f_code.co_name)
            elif event == "c_call":
                builtins.append(arg.__qualname__)

    for turn in range(2):  # the first turn reads the session (once per conversation); the second is counted
        history.add_user_message(f"turn {turn}")
        # (The scripted model asks for call k while the history holds k calls: one call a turn.)
        chat = ScriptedChat(ai_model_id="scripted", turns=[[call(f"k{i}", "shop-lookup_order", order_id="A-17")]
                                                           for i in range(turn + 1)])
        with undolog_session("chat-count"):
            if turn:
                sys.setprofile(profile)
            try:
                await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
            finally:
                sys.setprofile(None)
    assert results(history) == ["order A-17: shipped"] * 2
    # Before: the driver's safe_as_is frame too, the filter list read in the inner filter, and in the as-is check a
    # class look-up by method call, a key view compared with a set and an items loop (16 builtin calls).
    assert frames == ["auto_function_invocation", "function_invocation", "as_is_copy", "note_safe_in"], frames
    assert len(builtins) <= 12, builtins


async def test_a_new_conversations_first_safe_call_reads_its_session_in_few_undolog_frames(ul):
    """A conversation's first SAFE call reads its session once (a session halted elsewhere refuses, a resumed one keeps
    its pins) and makes the process's record of it: counted (not timed), as every new conversation pays it. No
    frame for the record's ring of recent calls (a lambda default factory before) nor for the ASCII agent id's
    encoding check (``encodes`` before)."""

    kernel = _safe_shop_kernel(ul)
    ours = (f"{os.sep}undolog_core", f"{os.sep}undolog_adapters")
    frames: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.rpartition(os.sep)[0].endswith(ours):
            frames.append(frame.f_code.co_name)

    for sid in ("chat-warm", "chat-new"):  # the first conversation learns the function; the second is counted
        history = ChatHistory()
        history.add_user_message("hi")
        chat = ScriptedChat(ai_model_id="scripted", turns=[[call("k0", "shop-lookup_order", order_id="A-17")]])
        with undolog_session(sid):
            if sid == "chat-new":
                sys.setprofile(profile)
            try:
                await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
            finally:
                sys.setprofile(None)
        assert results(history) == ["order A-17: shipped"]
    assert "<lambda>" not in frames and "encodes" not in frames, frames
    assert frames == ["auto_function_invocation", "function_invocation", "_cache", "look_up_session", "check_id",
                      "check_identity", "_new_record", "needs_trim", "as_is_copy", "note_safe_in"], frames


async def _later_logged_call_frames(ul, *, everything=False):
    """A conversation's third COMPENSABLE call (its session in the store, the function learnt): the Python frames of
    UndoLog's own modules run in it (not its storage's: they differ by database and are the lower bound's too), and
    the builtin calls they make. ``everything``: every frame of the step, named ``file:function``."""
    kernel, _ = new_kernel(ul)
    history = ChatHistory()
    ours = (f"{os.sep}undolog_core", f"{os.sep}undolog_adapters")
    frames: list[str] = []

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and (everything or path.rpartition(os.sep)[0].endswith(ours)):
            frames.append(f"{Path(path).stem}:{frame.f_code.co_name}" if everything else frame.f_code.co_name)

    for turn in range(3):
        history.add_user_message(f"turn {turn}")
        chat = ScriptedChat(ai_model_id="scripted", turns=[[call(f"r{i}", "support-send_refund_email", user_id="u1",
                                                                  amount=42.5)] for i in range(turn + 1)])
        with undolog_session("chat-logged"):
            if turn == 2:
                sys.setprofile(profile)
            try:
                await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
            finally:
                sys.setprofile(None)
    assert results(history)[-1] == "{'message_id': 'msg-3', 'status': 'sent'}", results(history)
    assert [e["state"] for e in ul.sessions.effects("chat-logged")] == ["committed"] * 3
    return frames


async def test_a_later_logged_call_runs_few_undolog_frames(ul):
    """A COMPENSABLE call in a conversation whose session is in the store (every logged call of a conversation but its
    first) costs UndoLog few Python frames, counted (not timed; inside an SK step each is cold): the auto filter asks
    the engine itself (no _intercept, no driver adecide with its spec look-up and session id check: the id was checked
    when the filter first saw it), a schema-declared contract's arguments of exact JSON types are their own values and
    snapshot (no args model, no two dumps), the lease loop is asked to start only when it is not running, and the
    inner filter runs the call without a coroutine of its own (no _run; the driver's run_async returns its coroutine),
    and the decision, the check that the call is the one let through and the outcome are not separate frames."""
    # (Less the two frames of the tool's own current_call(): the support plugin's function asks for its call.)
    frames = [f for f in await _later_logged_call_frames(ul) if f not in ("current_call", "call_context")]
    gone = {"_intercept", "session_id", "_call_id", "adecide", "_adecide", "spec", "spec_for", "validate", "valid",
            "values", "snapshot", "start", "ensure", "_run", "_unchanged", "execute_now", "_ok"}
    assert not gone & set(frames), frames
    # 36 before: the frames named above, and _of_kind twice.
    assert len(frames) <= 17, str(frames)
