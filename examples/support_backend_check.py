"""``check_undo``'s snapshot of the fake back end the CrewAI and Semantic Kernel examples share.

What a correct ``cancel_refund_email`` restores: the accounts, and the emails still on their way. A cancelled
email is left out: the cancellation is the compensation's trace, on purpose.
"""

from __future__ import annotations

from typing import Any

from examples.support_backend import SupportBackend

FROZEN_NOW = 1_800_000_000.0  # the outbox's clock during a check: a queued email is never delivered mid-check


def freeze(backend: SupportBackend, delay: float = 5.0) -> None:
    """The outbox holds mail for ``delay`` seconds of a clock that does not move: the recall never races the
    delivery, whatever the machine's load."""
    backend.delivery_delay, backend.clock = delay, lambda: FROZEN_NOW


def backend_snapshot(backend: SupportBackend) -> dict[str, Any]:
    with backend.lock:
        backend.deliver()
        return {
            "accounts": sorted(backend.accounts),
            "emails": {m["message_id"]: {"user_id": m["user_id"], "amount": m["amount"], "status": m["status"]}
                       for m in backend.outbox if m["status"] != "cancelled"},
        }
