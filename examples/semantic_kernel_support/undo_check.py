"""``check_undo`` on the Semantic Kernel support agent: its refund emails, through a real kernel with UndoLog's
filters and a scripted chat service (auto function calling).

From the repository root:

    undolog check-undo examples.semantic_kernel_support.undo_check:refunds \\
        --snapshot examples.semantic_kernel_support.undo_check:snapshot \\
        --reset examples.semantic_kernel_support.undo_check:reset
"""

from __future__ import annotations

from typing import Any

from examples.support_backend_check import backend_snapshot, freeze

from .llm import call
from .support import BACKEND, COMPENSATIONS

TURNS = [
    [call("c1", "support-search_knowledge_base", query="refund policy")],
    [call("c2", "support-send_refund_email", user_id="u1", amount=42.5)],
    [call("c3", "support-send_refund_email", user_id="u2", amount=10.0)],
    [call("c4", "support-delete_user_account", user_id="u1")],
]


async def refunds(undolog: Any, run: Any) -> Any:
    from semantic_kernel.agents import ChatHistoryAgentThread

    from undolog_adapters.semantic_kernel import undolog_session

    from .demo import TICKET, build_agent

    undolog.register(*COMPENSATIONS)
    agent = build_agent(undolog, TURNS)
    # run.id in the thread id (the UndoLog session): runs never replay each other's stored results.
    thread = ChatHistoryAgentThread(thread_id=f"chat-{run.id}")
    with undolog_session(thread.id):
        return await agent.get_response(messages=TICKET, thread=thread)


def snapshot() -> dict[str, Any]:
    return backend_snapshot(BACKEND)


def reset() -> None:
    # The outbox's delay runs on a frozen clock: a refund email is recalled before it can be delivered.
    freeze(BACKEND)
    BACKEND.reset()
