"""The customer-support tools and a fake back end (email outbox, account store) that keeps state.

The three tools are the three tiers: searching the knowledge base is SAFE, a refund email can be
cancelled before it leaves the outbox (COMPENSABLE), and deleting an account cannot be undone
(IRREVERSIBLE, so a person approves it first).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from undolog_core import CompensationDescriptor, ToolTier, compensation, current_call, undolog_tool

KNOWLEDGE_BASE = {
    "refund": "Refunds are confirmed by email and reach the card within 5 business days.",
    "delete": "Account deletion removes every record of the user and cannot be undone.",
    "password": "Passwords are reset from the login page.",
}


class MailServerDown(RuntimeError):
    """The fake mail server refuses a message (used to show a rollback)."""


@dataclass
class SupportBackend:
    """Stands in for the mail service and the account database; state survives between calls."""

    accounts: dict[str, dict[str, Any]] = field(default_factory=dict)
    outbox: list[dict[str, Any]] = field(default_factory=list)
    mail_down_for: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.accounts = {
                "u1": {"user_id": "u1", "name": "Ada", "email": "ada@example.com"},
                "u2": {"user_id": "u2", "name": "Bob", "email": "bob@example.com"},
            }
            self.outbox = []
            self.mail_down_for = set()

    def sent(self) -> list[dict[str, Any]]:
        return [m for m in self.outbox if m["status"] == "sent"]


BACKEND = SupportBackend()
BACKEND.reset()


@undolog_tool(tier=ToolTier.SAFE)
def search_knowledge_base(query: str) -> list[str]:
    """Search the support knowledge base; returns the matching articles."""
    q = query.lower()
    return [text for key, text in KNOWLEDGE_BASE.items() if key in q] or ["No article matches."]


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_refund_email"))
def send_refund_email(user_id: str, amount: float) -> dict[str, Any]:
    """Email the user that a refund of `amount` is on its way."""
    call = current_call()
    key = call.idempotency_key if call else None
    with BACKEND.lock:
        if user_id in BACKEND.mail_down_for:
            raise MailServerDown(f"mail server refused the message to {user_id}")
        if user_id not in BACKEND.accounts:
            raise KeyError(f"no account {user_id}")
        # The idempotency key makes a retried send land once.
        for m in BACKEND.outbox:
            if key and m["idempotency_key"] == key:
                return {"message_id": m["message_id"], "status": m["status"]}
        message_id = f"msg-{len(BACKEND.outbox) + 1}"
        BACKEND.outbox.append({"message_id": message_id, "user_id": user_id, "amount": amount,
                               "status": "sent", "idempotency_key": key})
    return {"message_id": message_id, "status": "sent"}


@compensation("cancel_refund_email")
def cancel_refund_email(ctx: Any) -> None:
    """Recall the refund email (idempotent: recalling twice is fine)."""
    message_id = (ctx.result or {}).get("message_id")
    with BACKEND.lock:
        for m in BACKEND.outbox:
            if m["message_id"] == message_id:
                m["status"] = "cancelled"


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Deletes every record of the user", risk_tags=["pii"])
def delete_user_account(user_id: str) -> dict[str, Any]:
    """Delete the user's account and all their data. Cannot be undone."""
    with BACKEND.lock:
        if user_id not in BACKEND.accounts:
            raise KeyError(f"no account {user_id}")
        del BACKEND.accounts[user_id]
    return {"deleted": user_id}


TOOLS = [search_knowledge_base, send_refund_email, delete_user_account]
COMPENSATIONS = [cancel_refund_email]
