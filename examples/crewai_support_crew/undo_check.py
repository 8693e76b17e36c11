"""``check_undo`` on the support crew: its refund emails, through a real CrewAI crew with UndoLog's wrapped tools.

From the repository root:

    undolog check-undo examples.crewai_support_crew.undo_check:refunds \\
        --snapshot examples.crewai_support_crew.undo_check:snapshot \\
        --reset examples.crewai_support_crew.undo_check:reset

The crew refunds Ada (u1) and Bob (u2), then asks to delete Ada's account: the deletion is IRREVERSIBLE, so the
checked part ends before it.
"""

from __future__ import annotations

from typing import Any

from examples.support_backend_check import backend_snapshot, freeze

from .support import BACKEND, COMPENSATIONS, TOOLS

STEPS = [
    {"tool": "search_knowledge_base", "args": {"query": "refund policy"}},
    {"tool": "send_refund_email", "args": {"user_id": "u1", "amount": 42.5}},
    {"tool": "send_refund_email", "args": {"user_id": "u2", "amount": 10.0}},
    {"tool": "delete_user_account", "args": {"user_id": "u1"}},
]


def refunds(undolog: Any, run: Any) -> Any:
    from undolog_adapters.crewai import wrap_tools

    from .demo import TICKET, build_crew

    tools = wrap_tools(TOOLS, undolog=undolog, compensations=COMPENSATIONS, agent_id="support-crew")
    # run.id in the session id: each run is a session of its own and never replays another's stored results.
    return tools.kickoff(build_crew(tools, STEPS), inputs={"ticket": TICKET}, session_id=f"crew-{run.id}")


def snapshot() -> dict[str, Any]:
    return backend_snapshot(BACKEND)


def reset() -> None:
    # The outbox's delay runs on a frozen clock: a refund email is recalled before it can be delivered.
    freeze(BACKEND)
    BACKEND.reset()
