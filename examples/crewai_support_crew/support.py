"""The customer-support tools and a fake back end (email outbox, account store) that keeps state.

The three tools are the three tiers: searching the knowledge base is SAFE, a refund email can be
cancelled before it leaves the outbox (COMPENSABLE), and deleting an account cannot be undone
(IRREVERSIBLE, so a person approves it first).
"""

from __future__ import annotations

from typing import Any

from examples.support_backend import KNOWLEDGE_BASE, MailServerDown, SupportBackend  # noqa: F401 - re-exported
from undolog_core import CompensationDescriptor, ToolTier, compensation, current_call, undolog_tool

BACKEND = SupportBackend()
BACKEND.reset()


@undolog_tool(tier=ToolTier.SAFE)
def search_knowledge_base(query: str) -> list[str]:
    """Search the support knowledge base; returns the matching articles."""
    return BACKEND.search(query)


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_refund_email"))
def send_refund_email(user_id: str, amount: float) -> dict[str, Any]:
    """Email the user that a refund of `amount` is on its way."""
    call = current_call()
    key = call.idempotency_key if call else None
    return BACKEND.send_refund(user_id, amount, key)


@compensation("cancel_refund_email")
def cancel_refund_email(ctx: Any) -> None:
    """Recall the refund email (idempotent: recalling twice is fine)."""
    BACKEND.recall(ctx.result)


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Deletes every record of the user", risk_tags=["pii"])
def delete_user_account(user_id: str) -> dict[str, Any]:
    """Delete the user's account and all their data. Cannot be undone."""
    return BACKEND.delete(user_id)


TOOLS = [search_knowledge_base, send_refund_email, delete_user_account]
COMPENSATIONS = [cancel_refund_email]
