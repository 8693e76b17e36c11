"""The customer-support plugin and a fake back end (email outbox, account store) that keeps state.

Each kernel function carries its tier with ``@undolog_tool`` under ``@kernel_function``; UndoLog
registers it under SK's ``plugin-function`` name (``support-delete_user_account``).
"""

from __future__ import annotations

from typing import Annotated, Any

from semantic_kernel.functions import kernel_function

from examples.support_backend import KNOWLEDGE_BASE, MailServerDown, SupportBackend  # noqa: F401 - re-exported
from undolog_core import CompensationDescriptor, ToolTier, compensation, current_call, undolog_tool

BACKEND = SupportBackend()
BACKEND.reset()


class SupportPlugin:
    """The support tools, one kernel function per tier."""

    @kernel_function(name="search_knowledge_base", description="Search the support knowledge base.")
    @undolog_tool(tier=ToolTier.SAFE)
    def search_knowledge_base(self, query: Annotated[str, "what to look for"]) -> list[str]:
        return BACKEND.search(query)

    @kernel_function(name="send_refund_email", description="Email the user that a refund is on its way.")
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_refund_email"))
    def send_refund_email(self, user_id: str, amount: float) -> dict[str, Any]:
        call = current_call()
        key = call.idempotency_key if call else None
        return BACKEND.send_refund(user_id, amount, key)

    @kernel_function(name="delete_user_account", description="Delete the user's account and data. Cannot be undone.")
    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Deletes every record of the user", risk_tags=["pii"])
    def delete_user_account(self, user_id: str) -> dict[str, Any]:
        return BACKEND.delete(user_id)


@compensation("cancel_refund_email")
def cancel_refund_email(ctx: Any) -> None:
    """Recall the refund email (idempotent: recalling twice is fine)."""
    BACKEND.recall(ctx.result)


COMPENSATIONS = [cancel_refund_email]
