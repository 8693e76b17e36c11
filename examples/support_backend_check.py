"""``check_undo``'s snapshot of the fake back end the CrewAI and Semantic Kernel examples share.

What a correct ``cancel_refund_email`` restores: the accounts, and the emails still on their way. A cancelled
email is left out: the cancellation is the compensation's trace, on purpose.
"""

from __future__ import annotations

from typing import Any

from examples.support_backend import SupportBackend


def backend_snapshot(backend: SupportBackend) -> dict[str, Any]:
    with backend.lock:
        return {
            "accounts": sorted(backend.accounts),
            "emails": {m["message_id"]: {"user_id": m["user_id"], "amount": m["amount"], "status": m["status"]}
                       for m in backend.outbox if m["status"] != "cancelled"},
        }
