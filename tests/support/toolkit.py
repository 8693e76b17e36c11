"""A small fake outside world (a mail outbox and an account store that keep state) and tools over it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from undolog_core import CompensationDescriptor, ToolTier, compensation, current_call, undolog_tool


@dataclass
class World:
    """Stands in for the services a user's tools would call; tests read its state."""

    outbox: dict[str, dict[str, Any]] = field(default_factory=dict)
    accounts: dict[str, dict[str, Any]] = field(default_factory=lambda: {"u1": {"name": "Ana"}, "u2": {"name": "Bo"}})
    calls: list[tuple[str, Any]] = field(default_factory=list)
    fail_send: int = 0          # fail the next N sends
    fail_cancel: int = 0        # fail the next N cancels
    lock: threading.Lock = field(default_factory=threading.Lock)

    def log(self, what: str, detail: Any) -> None:
        with self.lock:
            self.calls.append((what, detail))

    def count(self, what: str) -> int:
        return sum(1 for w, _ in self.calls if w == what)


def make_tools(world: World) -> dict[str, Any]:
    @undolog_tool(tier=ToolTier.SAFE)
    def search_knowledge_base(query: str) -> list[str]:
        world.log("search", query)
        return [f"article about {query}"]

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cancel_refund_email"))
    def send_refund_email(user_id: str, amount: int) -> dict[str, Any]:
        """Send a refund confirmation email."""
        key = current_call().idempotency_key  # type: ignore[union-attr]
        world.log("send", (user_id, amount, key))
        if world.fail_send:
            world.fail_send -= 1
            world.outbox[key] = {"user_id": user_id, "amount": amount, "state": "half-sent"}
            raise RuntimeError("smtp exploded")
        world.outbox[key] = {"user_id": user_id, "amount": amount, "state": "queued"}
        return {"message_id": key, "user_id": user_id}

    @compensation("cancel_refund_email")
    def cancel_refund_email(ctx: Any) -> None:
        world.log("cancel", (ctx.args["user_id"], ctx.idempotency_key, ctx.attempt, ctx.result))
        if world.fail_cancel:
            world.fail_cancel -= 1
            raise RuntimeError("mail server unreachable")
        for msg in world.outbox.values():
            if msg["user_id"] == ctx.args["user_id"] and msg["state"] != "recalled":
                msg["state"] = "recalled"

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="unlock_account")
    async def lock_account(user_id: str) -> dict[str, Any]:
        world.log("lock", user_id)
        world.accounts[user_id]["locked"] = True
        return {"locked": user_id}

    @compensation("unlock_account")
    async def unlock_account(ctx: Any) -> None:
        world.log("unlock", (ctx.args["user_id"], ctx.idempotency_key))
        world.accounts[ctx.args["user_id"]]["locked"] = False

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Deletes every record of the user", risk_tags=["pii"])
    def delete_user_account(user_id: str) -> dict[str, Any]:
        world.log("delete", (user_id, current_call().idempotency_key))  # type: ignore[union-attr]
        world.accounts.pop(user_id, None)
        return {"deleted": user_id}

    @undolog_tool(risk_level="high", reason="Moves money out", risk_tags=["billing"])
    def wire_transfer(to: str, cents: int) -> dict[str, Any]:
        world.log("wire", (to, cents))
        return {"sent": cents}

    return {f.__name__: f for f in (search_knowledge_base, send_refund_email, cancel_refund_email, lock_account,
                                    unlock_account, delete_user_account, wire_transfer)}


def setup(undolog: Any, world: World | None = None) -> tuple[World, dict[str, Any]]:
    world = world or World()
    tools = make_tools(world)
    undolog.register(*tools.values())
    return world, tools
