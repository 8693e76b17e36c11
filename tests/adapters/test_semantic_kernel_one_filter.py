"""Semantic Kernel: no silent path with one filter or two, and a resumed turn that does not repeat what was done.

Most SK code registers one filter, ``kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, f)``. Under automatic
function calling that used to leave the model reading SK's generic "An error occurred while invoking the function"
instead of UndoLog's texts, and resume() then did nothing (the approved deletion never ran; nothing raised).
Real kernels, SK's own auto function calling, a scripted chat service.
"""

from __future__ import annotations

import warnings

import pytest
from semantic_kernel import Kernel
from semantic_kernel.contents import AuthorRole, ChatHistory, ChatMessageContent, FunctionResultContent
from semantic_kernel.filters import FilterTypes

from examples.semantic_kernel_support import support
from examples.semantic_kernel_support.llm import ScriptedChat, auto_settings, call
from undolog_adapters.semantic_kernel import UndoLogFilter, install, resume, undolog_session
from undolog_core import errors

pytestmark = pytest.mark.reads_store

REFUND_U1 = call("c2", "support-send_refund_email", user_id="u1", amount=42.5)
REFUND_U2 = call("c3", "support-send_refund_email", user_id="u2", amount=10.0)
DELETE_U1 = call("c4", "support-delete_user_account", user_id="u1")
# The same task again, with the new call ids a model mints on every message.
AGAIN = [call("r2", "support-send_refund_email", user_id="u1", amount=42.5),
         call("r4", "support-delete_user_account", user_id="u1")]


@pytest.fixture(autouse=True)
def backend():
    support.BACKEND.reset()
    return support.BACKEND


@pytest.fixture
def ul(undolog):
    undolog.register(*support.COMPENSATIONS)
    return undolog


def one_filter_kernel(ul):
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, UndoLogFilter(ul))  # the one-liner, nothing else
    return kernel


class ObedientChat(ScriptedChat):
    """Ends its turn when told a call awaits approval, as UndoLog's text asks and a real model does (with one filter
    SK's loop is not stopped for it)."""

    async def _inner_get_chat_message_contents(self, chat_history, settings):
        last = [i for m in chat_history.messages for i in m.items if isinstance(i, FunctionResultContent)][-1:]
        if last and "awaiting approval" in str(last[0].result):
            return [ChatMessageContent(role=AuthorRole.ASSISTANT, content="The deletion needs a person's approval.")]
        return await super()._inner_get_chat_message_contents(chat_history, settings)


async def turn(kernel, turns, session_id="chat-1"):
    chat = ObedientChat(ai_model_id="scripted", turns=turns)
    history = ChatHistory()
    history.add_user_message("help u1")
    with undolog_session(session_id):
        reply = await chat.get_chat_message_content(history, auto_settings(), kernel=kernel)
    return chat, history, reply


def results(history):
    return [str(i.result) for m in history.messages for i in m.items if isinstance(i, FunctionResultContent)]


async def test_one_filter_the_model_reads_awaiting_approval_and_resume_runs_the_approved_call(ul, backend):
    kernel = one_filter_kernel(ul)
    chat, history, _ = await turn(kernel, [[REFUND_U1], [DELETE_U1]])
    [request] = ul.approvals.pending(session_id="chat-1")
    seen = results(history)
    assert f"awaiting approval, request {request.approval_request_id}" in seen[1]  # before: SK's generic error
    assert "An error occurred" not in seen[1] and "u1" in backend.accounts

    ul.approvals.approve(request.approval_request_id, approver="ana")
    reply = await resume(kernel, history, chat, ul, session_id="chat-1")
    assert "u1" not in backend.accounts  # before: the approved deletion never ran, nothing raised
    assert "'deleted': 'u1'" in reply.content
    assert [m["status"] for m in backend.outbox] == ["sent"]


async def test_one_filter_a_rejection_reaches_the_model(ul, backend):
    kernel = one_filter_kernel(ul)
    chat, history, _ = await turn(kernel, [[DELETE_U1]])
    [request] = ul.approvals.pending(session_id="chat-1")
    ul.approvals.reject(request.approval_request_id, approver="ana", reason="keeps the data")
    reply = await resume(kernel, history, chat, ul, session_id="chat-1")
    assert "u1" in backend.accounts and "rejected by ana: keeps the data" in reply.content
    assert ul.sessions.get("chat-1").state == "halted"


async def test_one_filter_a_failure_tells_the_model_what_was_rolled_back(ul, backend):
    backend.mail_down_for.add("u1")
    kernel = one_filter_kernel(ul)
    _, history, _ = await turn(kernel, [[REFUND_U2], [REFUND_U1]])
    seen = results(history)
    assert "An error occurred" not in seen[1]  # before: SK's generic text, the rollback untold
    assert "send_refund_email failed: MailServerDown" in seen[1] and "rolled back" in seen[1]
    assert [m["status"] for m in backend.outbox] == ["cancelled"]


async def test_one_filter_a_plain_invoke_still_raises_approval_pending(ul, backend):
    from undolog_adapters.semantic_kernel import invoke
    from undolog_core import ApprovalPending

    kernel = one_filter_kernel(ul)
    with undolog_session("chat-2"), pytest.raises(ApprovalPending):
        await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="u1")


@pytest.mark.parametrize("filters", ["one", "two"])
async def test_a_resumed_turn_that_repeats_the_task_replays_what_was_done(ul, backend, filters):
    if filters == "two":
        kernel = Kernel()
        kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
        install(kernel, ul)
    else:
        kernel = one_filter_kernel(ul)
    # The model asks for the refund, then the deletion (which waits); after the approval it starts its task over.
    chat, history, _ = await turn(kernel, [[REFUND_U1], [DELETE_U1], AGAIN])
    [request] = ul.approvals.pending(session_id="chat-1")
    ul.approvals.approve(request.approval_request_id, approver="ana")
    reply = await resume(kernel, history, chat, ul, session_id="chat-1")
    seen = results(history)
    assert [m["status"] for m in backend.outbox] == ["sent"]  # before: a second refund
    assert "u1" not in backend.accounts
    assert "replayed: it did not run again" in seen[-2] and "msg-1" in seen[-2]
    assert "replayed" in seen[-1] and "'deleted': 'u1'" in seen[-1]  # before: a second approval request
    assert not ul.approvals.pending(session_id="chat-1") and "Final summary" in reply.content


def test_tiers_keyed_by_bare_names_raise_at_install_naming_the_kernels_names(ul):
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    with pytest.raises(errors.ConfigurationError) as raised:
        install(kernel, ul, tiers={"delete_user_account": "irreversible"}, strict=False)
    first = str(raised.value).splitlines()[0]
    assert "'delete_user_account' -> 'support-delete_user_account'" in first
    assert "support-send_refund_email" in first


async def test_tiers_keyed_by_bare_names_are_found_at_the_first_call_with_add_filter(ul):
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, UndoLogFilter(ul, tiers={"search_knowledge_base": "safe"}))
    _, history, _ = await turn(kernel, [[call("s1", "support-search_knowledge_base", query="refund")]])
    # Before: nothing said, and every call refused for want of a tier.
    assert "tiers= names no function of this kernel" in results(history)[0]


def test_some_unmatched_tiers_warn_at_once_with_the_kernels_names(ul):
    kernel = Kernel()
    kernel.add_plugin(support.SupportPlugin(), plugin_name="support")
    with pytest.warns(UserWarning, match=r"\['search_knowledge_base'\] match no function") as caught:
        UndoLogFilter(ul, tiers={"search_knowledge_base": "safe", "support-delete_user_account": "irreversible"},
                      kernel=kernel)
    assert "support-search_knowledge_base" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        UndoLogFilter(ul, tiers={"support-search_knowledge_base": "safe"}, kernel=kernel)  # all match: silent


def test_the_auto_invocation_path_read_is_the_installed_sks():
    # _under_auto_invocation reads these two SK functions by name: a Semantic Kernel that renames them fails here.
    import inspect

    from semantic_kernel.functions.kernel_function import KernelFunction

    assert "_inner_auto_function_invoke_handler" in inspect.getsource(Kernel)
    assert inspect.iscoroutinefunction(KernelFunction.invoke)
    assert "context.function.invoke(" in inspect.getsource(Kernel._inner_auto_function_invoke_handler)
    assert list(inspect.signature(Kernel._inner_auto_function_invoke_handler).parameters) == ["self", "context"]
