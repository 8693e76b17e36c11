"""The support-agent demo on Semantic Kernel: refund, then an account deletion that waits for a person.

Run offline with ``python -m examples.semantic_kernel_support`` (``--reject`` for the other ending).
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid

from semantic_kernel import Kernel
from semantic_kernel.agents import ChatCompletionAgent, ChatHistoryAgentThread
from semantic_kernel.connectors.ai.function_choice_behavior import FunctionChoiceBehavior

from undolog_adapters.semantic_kernel import install, resume_agent, undolog_session
from undolog_core import UndoLog

from .llm import ScriptedChat, call
from .support import BACKEND, COMPENSATIONS, SupportPlugin

TICKET = "Ada (u1) was double charged 42.50 and wants a refund, then her account deleted."

TURNS = [
    [call("c1", "support-search_knowledge_base", query="refund policy")],
    [call("c2", "support-send_refund_email", user_id="u1", amount=42.5)],
    [call("c3", "support-delete_user_account", user_id="u1")],
]


def build_agent(ul: UndoLog, turns: list) -> ChatCompletionAgent:
    """A kernel with the support plugin and UndoLog's filters, and an agent on a scripted model."""
    kernel = Kernel()
    kernel.add_plugin(SupportPlugin(), plugin_name="support")
    install(kernel, ul)
    return ChatCompletionAgent(kernel=kernel, name="support", instructions="Resolve the ticket.",
                               service=ScriptedChat(ai_model_id="scripted-support", turns=turns),
                               function_choice_behavior=FunctionChoiceBehavior.Auto())


async def run(ul: UndoLog, reject: bool) -> int:
    agent = build_agent(ul, TURNS)
    thread = ChatHistoryAgentThread(thread_id=f"chat-{uuid.uuid4().hex[:8]}")
    print(f"ticket: {TICKET}")
    # The chat thread is the UndoLog session.
    with undolog_session(thread.id):
        first = await agent.get_response(messages=TICKET, thread=thread)
    print(f"\n[turn 1] session {thread.id}; the loop stopped with: {first.message.content or first.message.items[-1]}")
    print(f"  outbox: {[(m['message_id'], m['status']) for m in BACKEND.outbox]}")
    pending = ul.approvals.pending(session_id=thread.id)
    if not pending:
        print("expected the account deletion to wait for approval")
        return 1
    request = pending[0]
    print(f"  waiting for a person: request {request.approval_request_id}: {request.tool_name}"
          f"({request.proposed_args}) because {request.reason!r}")
    if reject:
        ul.approvals.reject(request.approval_request_id, approver="ana", reason="the customer asked to keep her data")
        print("\n[approver] ana rejected the deletion")
    else:
        ul.approvals.approve(request.approval_request_id, approver="ana")
        print("\n[approver] ana approved the deletion")
    second = await resume_agent(agent, thread, ul, session_id=thread.id)
    print(f"\n[resumed] agent: {second.message.content}")
    if reject:
        report = ul.rollback(thread.id)
        print(f"\n[operator] rolled the ticket back: {[(s.tool_name, s.outcome) for s in report.steps]}")
    print(f"\naccounts left: {sorted(BACKEND.accounts)}")
    print(f"outbox: {[(m['message_id'], m['user_id'], m['status']) for m in BACKEND.outbox]}")
    deleted = "u1" not in BACKEND.accounts
    return 1 if deleted == reject else 0


def main(reject: bool = False, database_url: str | None = None, undolog: UndoLog | None = None) -> int:
    """Run the demo; returns the process exit code.

    Example:
        >>> from examples.semantic_kernel_support.demo import main   # doctest: +SKIP
        >>> main()
        0
    """
    BACKEND.reset()
    workdir = tempfile.mkdtemp(prefix="undolog-sk-demo-")
    # With UNDOLOG_DATABASE_URL (and UNDOLOG_SCHEMA) set, UndoLog.open(None) uses them.
    url = database_url or (None if os.environ.get("UNDOLOG_DATABASE_URL") else f"sqlite:///{workdir}/undolog.db")
    ul = undolog or UndoLog.open(url)
    try:
        ul.register(*COMPENSATIONS)
        return asyncio.run(run(ul, reject))
    finally:
        if undolog is None:
            ul.close()
