"""The support agent's tools, one per tier, declared with ``@undolog_tool``.

They are built by ``make_tools(world)`` so each world (a demo run, a test) gets its own closures;
a fresh process rebuilds the same tools with the same names and contracts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from undolog_core import CompensationDescriptor, ToolTier, compensation, current_call, undolog_tool

from .world import SupportWorld, WorldError


@dataclass(frozen=True)
class SupportTools:
    search_knowledge_base: Any
    send_refund_email: Any
    cancel_refund_email: Any
    delete_user_account: Any

    @property
    def agent_tools(self) -> list[Any]:
        """The three tools the model may call (the compensation is UndoLog's, not the model's)."""
        return [self.search_knowledge_base, self.send_refund_email, self.delete_user_account]

    @property
    def all(self) -> list[Any]:
        return [*self.agent_tools, self.cancel_refund_email]


def make_tools(world: SupportWorld) -> SupportTools:
    """Build the tools over ``world``.

    Example:
        >>> tools = make_tools(SupportWorld(tmp / "world.sqlite"))   # doctest: +SKIP
        >>> undolog.register(*tools.all)                           # doctest: +SKIP
    """

    @undolog_tool(tier=ToolTier.SAFE)
    def search_knowledge_base(query: str) -> list[dict[str, str]]:
        """Search the support knowledge base; returns matching articles."""
        return world.search(query)

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_refund_email"))
    def send_refund_email(user_id: str, amount: float, order_id: str) -> dict[str, Any]:
        """Confirm a refund to the customer by email (queued, delivered a few seconds later)."""
        call = current_call()
        # The outbox de-duplicates on this key, so a retried send never mails the customer twice.
        return world.send_refund_email(user_id, amount, order_id, idempotency_key=call.idempotency_key if call else None)

    @compensation("cancel_refund_email")
    def cancel_refund_email(ctx: Any) -> None:
        """Recall the refund email while it is still queued; raises once it was delivered."""
        sent = ctx.result
        if not sent:
            # The send failed or its outcome is unknown: it was keyed "do-{effect_id}", so look it up.
            sent = world.find_by_key(f"do-{ctx.effect_id}")
            if sent is None:
                return  # nothing was queued, so there is nothing to take back
        world.recall(sent["message_id"])

    @undolog_tool(
        tier=ToolTier.IRREVERSIBLE,
        reason="Deletes every record of the customer; it cannot be undone",
        risk_tags=["pii", "account-deletion"],
    )
    def delete_user_account(user_id: str) -> dict[str, Any]:
        """Permanently delete a customer account (GDPR erasure)."""
        return world.delete_account(user_id)

    return SupportTools(search_knowledge_base, send_refund_email, cancel_refund_email, delete_user_account)


__all__ = ["SupportTools", "WorldError", "make_tools"]
