"""The fake back end the CrewAI and Semantic Kernel examples share: a mail outbox and an account store.

It keeps state so a run can show what happened and what was undone. Each example keeps its own instance.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KNOWLEDGE_BASE = {
    "refund": "Refunds are confirmed by email and reach the card within 5 business days.",
    "delete": "Account deletion removes every record of the user and cannot be undone.",
    "password": "Passwords are reset from the login page.",
}


class MailServerDown(RuntimeError):
    """The fake mail server refuses a message (used to show a rollback)."""


class TooLateToRecall(RuntimeError):
    """The email left the outbox: it can no longer be recalled (the compensation fails, honestly)."""


@dataclass
class SupportBackend:
    """Stands in for the mail service and the account database; state survives between calls.

    An email waits in the outbox (status ``sent``) for ``delivery_delay`` seconds of ``clock`` and is then
    ``delivered``; only a waiting email can be recalled. ``delivery_delay=None`` (the demos') never delivers.
    ``check_undo`` freezes the clock, so the check never races the delivery.

    Example:
        >>> backend = SupportBackend(delivery_delay=5.0, clock=lambda: 1_800_000_000.0)
    """

    accounts: dict[str, dict[str, Any]] = field(default_factory=dict)
    outbox: list[dict[str, Any]] = field(default_factory=list)
    mail_down_for: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    delivery_delay: float | None = None
    clock: Callable[[], float] = time.time

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

    @staticmethod
    def search(query: str) -> list[str]:
        q = query.lower()
        return [text for key, text in KNOWLEDGE_BASE.items() if key in q] or ["No article matches."]

    def send_refund(self, user_id: str, amount: float, key: str | None) -> dict[str, Any]:
        with self.lock:
            if user_id in self.mail_down_for:
                raise MailServerDown(f"mail server refused the message to {user_id}")
            if user_id not in self.accounts:
                raise KeyError(f"no account {user_id}")
            # The idempotency key makes a retried send land once.
            for m in self.outbox:
                if key and m["idempotency_key"] == key:
                    return {"message_id": m["message_id"], "status": m["status"]}
            message_id = f"msg-{len(self.outbox) + 1}"
            deliver_at = None if self.delivery_delay is None else self.clock() + self.delivery_delay
            self.outbox.append({"message_id": message_id, "user_id": user_id, "amount": amount,
                                "status": "sent", "idempotency_key": key, "deliver_at": deliver_at})
        return {"message_id": message_id, "status": "sent"}

    def deliver(self) -> None:
        """Deliver every waiting email whose delay has passed (delivery is computed when the outbox is looked at)."""
        now = self.clock()
        for m in self.outbox:
            if m["status"] == "sent" and m.get("deliver_at") is not None and m["deliver_at"] <= now:
                m["status"] = "delivered"

    def recall(self, result: dict[str, Any] | None) -> None:
        """Recall a refund email (idempotent: recalling twice is fine; nothing sent is nothing to recall);
        :class:`TooLateToRecall` once it was delivered."""
        message_id = (result or {}).get("message_id")
        with self.lock:
            self.deliver()
            for m in self.outbox:
                if m["message_id"] == message_id:
                    if m["status"] == "delivered":
                        raise TooLateToRecall(f"{message_id} was delivered: it cannot be recalled")
                    m["status"] = "cancelled"

    def delete(self, user_id: str) -> dict[str, Any]:
        with self.lock:
            if user_id not in self.accounts:
                raise KeyError(f"no account {user_id}")
            del self.accounts[user_id]
        return {"deleted": user_id}
