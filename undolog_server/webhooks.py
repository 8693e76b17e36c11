"""Signed webhooks fed from the core's outbox, with retries, a delivery log and escalation.

The engine only writes outbox rows in its own transactions; everything here runs in
the server's background loops, so a slow or dead receiver can delay notifications but
never an approval, a call or a rollback.

Signing and verifying live in :mod:`undolog_core.webhooks` (stdlib only, so receivers need not
install the server); they are re-exported here.

Signature: ``UndoLog-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>." + body)>``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from undolog_core import OutboxEvent
from undolog_core.webhooks import SIGNATURE_HEADER, sign, verify_signature

from .storage import NotificationPolicy, WebhookTarget, utcnow

if TYPE_CHECKING:
    from .state import ServerState

__all__ = ["SIGNATURE_HEADER", "EVENT_TYPES", "WebhookDispatcher", "route", "sign", "verify_signature"]

log = logging.getLogger("undolog.server.webhooks")

EVENT_TYPES = (
    "approval.requested",
    "approval.decided",
    "approval.timed_out",
    "approval.expired",
    "approval.escalated",
    "session.halted",
    "session.rolled_back",
)


def route(
    event_type: str,
    risk_tags: Sequence[str],
    targets: Sequence[WebhookTarget],
    policies: Sequence[NotificationPolicy],
) -> list[WebhookTarget]:
    """Pick the targets that hear of an event.

    A notification policy matching one of the request's risk tags (or ``*``) names the
    targets; without a matching policy every target subscribed to the event type hears it.
    """
    wanting = [t for t in targets if t.wants(event_type)]
    matching = [p for p in policies if p.risk_tag == "*" or p.risk_tag in risk_tags]
    named = {n for p in matching for n in p.notify}
    if not matching or not named:
        return wanting
    return [t for t in wanting if t.name in named]


class WebhookDispatcher:
    """Fans outbox events out into deliveries and sends due deliveries.

    What to send to whom, and when to retry, is decided here; the rows live in :class:`.store.ServerStore`
    and the outbox is read through the core's public ``undolog.outbox``.

    Args:
        state: The server state (UndoLog, store, settings).
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state

    # ---- fan-out (sync, in a worker thread) -----------------------------------------------------

    def fan_out(self, limit: int = 200) -> int:
        """Turn undelivered outbox events into delivery rows, once, whichever server gets there first.

        Returns:
            How many outbox events were handled.
        """
        store = self.state.store
        targets = store.targets()
        policies = store.policies()
        now = utcnow()

        def handle(conn: Any, events: Sequence[OutboxEvent]) -> None:
            for e in events:
                envelope = {
                    "id": f"evt_{e.outbox_id}",
                    "type": e.event_type,
                    "created_at": (e.created_at or now).isoformat(),
                    "data": e.payload,
                }
                chosen = route(e.event_type, e.risk_tags, targets, policies)
                store.enqueue(conn, f"outbox:{e.outbox_id}", e.event_type, _body(envelope), [t.target_id for t in chosen])

        return self.state.undolog.outbox.drain(handle, limit=limit)

    # ---- escalation (sync) ----------------------------------------------------------------------

    def escalate(self) -> int:
        """Escalate pending requests left undecided longer than their policy allows.

        Returns:
            How many escalations were sent.
        """
        store = self.state.store
        policies = [p for p in store.policies() if p.escalate_after_seconds and p.escalate_to]
        if not policies:
            return 0
        targets = {t.name: t for t in store.targets() if t.active}
        now = utcnow()
        sent = 0
        pending = self.state.views.pending_approvals()
        if not pending:
            return 0
        done = store.escalated([a["approval_request_id"] for a in pending])
        for a in pending:
            age = (now - a["created_at"]).total_seconds()
            for p in policies:
                if p.risk_tag != "*" and p.risk_tag not in a["risk_tags"]:
                    continue
                if age < (p.escalate_after_seconds or 0) or (a["approval_request_id"], p.risk_tag) in done:
                    continue
                envelope = {
                    "id": f"esc_{a['approval_request_id']}_{p.risk_tag}",
                    "type": "approval.escalated",
                    "created_at": now.isoformat(),
                    "data": {
                        "approval_request_id": a["approval_request_id"],
                        "session_id": a["session_id"],
                        "tool_name": a["tool_name"],
                        "risk_tags": a["risk_tags"],
                        "risk_tag": p.risk_tag,
                        "pending_seconds": round(age, 3),
                        "timeout_at": a["timeout_at"].isoformat(),
                    },
                }
                chosen = [targets[n].target_id for n in p.escalate_to if n in targets]
                if store.escalate_once(
                    a["approval_request_id"],
                    p.risk_tag,
                    f"escalation:{a['approval_request_id']}:{p.risk_tag}",
                    _body(envelope),
                    chosen,
                ):
                    sent += 1
        return sent

    # ---- delivery -------------------------------------------------------------------------------

    def claim_due(self, limit: int = 50) -> list[dict[str, Any]]:
        """Lease due deliveries so no other server sends them at the same time."""
        return self.state.store.claim_due(limit, time.time() + self.state.settings.webhook_timeout + 10)

    def record(self, delivery_id: str, attempts: int, status_code: int | None, error: str | None) -> None:
        """Store one attempt's outcome and schedule the retry with exponential backoff."""
        s = self.state.settings
        ok = status_code is not None and 200 <= status_code < 300
        if ok:
            self.state.store.record_attempt(
                delivery_id, attempts=attempts, status_code=status_code, error=error, status="delivered"
            )
        elif attempts >= s.webhook_max_attempts:
            self.state.store.record_attempt(
                delivery_id, attempts=attempts, status_code=status_code, error=error, status="failed"
            )
        else:
            delay = min(s.webhook_backoff_base * 2 ** (attempts - 1), s.webhook_backoff_max)
            # Jitter spreads retries of many deliveries to one recovering receiver.
            self.state.store.record_attempt(
                delivery_id,
                attempts=attempts,
                status_code=status_code,
                error=error,
                next_attempt_at=time.time() + delay * random.uniform(0.8, 1.2),
            )

    async def deliver_due(self, client: httpx.AsyncClient) -> int:
        """Send every due delivery once (concurrently), wait for all and record the outcomes.

        Returns:
            How many deliveries were attempted.
        """
        tasks = await self.start_due(client, set())
        if tasks:
            await asyncio.gather(*tasks)
        return len(tasks)

    async def start_due(
        self, client: httpx.AsyncClient, inflight: set[asyncio.Task[None]], max_inflight: int = 64
    ) -> list[asyncio.Task[None]]:
        """Claim due deliveries and start sending them without waiting for the answers.

        A receiver that stalls holds only its own requests open (each until ``webhook_timeout``);
        the loop keeps claiming and sending everything else meanwhile, so one slow target never
        delays the others' events.

        Args:
            client: The HTTP client.
            inflight: Tasks still sending; started tasks are added and remove themselves when done.
            max_inflight: Ceiling of concurrent sends for this process.

        Returns:
            The tasks started now.
        """
        room = max_inflight - len(inflight)
        if room <= 0:
            return []
        rows = await asyncio.to_thread(self.claim_due, room)
        if not rows:
            return []
        targets = {t.target_id: t for t in await asyncio.to_thread(self.state.store.targets)}
        started = []
        for r in rows:
            task = asyncio.create_task(self._send(client, r, targets.get(r["target_id"])), name="undolog-webhook-send")
            inflight.add(task)
            task.add_done_callback(inflight.discard)
            started.append(task)
        return started

    async def _send(self, client: httpx.AsyncClient, row: dict[str, Any], target: WebhookTarget | None) -> None:
        attempts = int(row["attempts"]) + 1
        if target is None:
            await asyncio.to_thread(self.record, row["delivery_id"], self.state.settings.webhook_max_attempts, None, "target removed")
            return
        body = row["payload"].encode()
        ts = int(time.time())
        headers = {
            "Content-Type": "application/json",
            "User-Agent": "undolog-webhooks/1",
            "UndoLog-Event": row["event_type"],
            "UndoLog-Delivery": row["delivery_id"],
            SIGNATURE_HEADER: sign(target.secret, ts, body),
        }
        status: int | None = None
        error: str | None = None
        try:
            resp = await client.post(target.url, content=body, headers=headers, timeout=self.state.settings.webhook_timeout)
            status = resp.status_code
            if not 200 <= status < 300:
                error = f"receiver answered {status}"
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"[:500]
        await asyncio.to_thread(self.record, row["delivery_id"], attempts, status, error)


def _body(envelope: dict[str, Any]) -> str:
    """The exact JSON body sent (and signed) for an event."""
    return json.dumps(envelope, separators=(",", ":"), sort_keys=True, default=str)
