"""Tools and compensations the server tests load with ``--app tests.support.demo_app:register``."""

from __future__ import annotations

from typing import Any

from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool

# What the compensations did, for assertions (one server process per test run).
UNDONE: list[dict[str, Any]] = []


@undolog_tool(tier=ToolTier.SAFE)
def search_kb(query: str) -> list[str]:
    """Search the knowledge base."""
    return [f"doc about {query}"]


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_refund_email"))
def send_refund_email(user_id: str, amount: float) -> dict[str, Any]:
    """Send a refund email."""
    return {"sent_to": user_id, "amount": amount}


@compensation("cancel_refund_email")
def cancel_refund_email(ctx: Any) -> None:
    UNDONE.append({"compensation": "cancel_refund_email", "args": dict(ctx.args), "key": ctx.idempotency_key})


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Deletes every record of the user", risk_tags=["pii"])
def delete_user_account(user_id: str) -> dict[str, Any]:
    """Delete a user account."""
    return {"deleted": user_id}


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Moves money out", risk_tags=["billing"])
def wire_money(to: str, amount: float) -> dict[str, Any]:
    """Wire money."""
    return {"wired": amount, "to": to}


TOOLS = [search_kb, send_refund_email, cancel_refund_email, delete_user_account, wire_money]


def register(undolog: Any) -> None:
    undolog.register(*TOOLS)


def make_undolog() -> Any:
    """The app's UndoLog factory (the `--app module:factory` form every `undolog` command takes)."""
    from undolog_core import UndoLog

    u = UndoLog.open()
    u.register(*TOOLS)
    return u
