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
import uuid
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import httpx
import sqlalchemy as sa

from undolog_core import _schema as core
from undolog_core.webhooks import SIGNATURE_HEADER, sign, verify_signature

from .store import (
    NotificationPolicy,
    WebhookTarget,
    escalations,
    insert_ignore,
    utcnow,
    webhook_deliveries,
)

if TYPE_CHECKING:
    from .state import ServerState

__all__ = ["SIGNATURE_HEADER", "EVENT_TYPES", "WebhookDispatcher", "route", "sign", "verify_signature"]

log = logging.getLogger("undolog.server.webhooks")

EVENT_TYPES = (
    "approval.requested",
    "approval.decided",
    "approval.timed_out",
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
    """Fans outbox rows out into deliveries and sends due deliveries.

    Args:
        state: The server state (engine, store, settings).
    """

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.engine = state.engine

    # ---- fan-out (sync, in a worker thread) -----------------------------------------------------

    def fan_out(self, limit: int = 200) -> int:
        """Turn undelivered outbox rows into delivery rows, once, whichever server gets there first.

        Returns:
            How many outbox rows were handled.
        """
        o = core.outbox
        targets = self.state.store.targets()
        policies = self.state.store.policies()
        with self.engine.begin() as conn:
            q = sa.select(o).where(o.c.delivered_at.is_(None)).order_by(o.c.outbox_id).limit(limit)
            if conn.dialect.name == "postgresql":
                # Rows another server is fanning out are skipped, not waited for.
                q = q.with_for_update(skip_locked=True)
            rows = conn.execute(q).all()
            if not rows:
                return 0
            now = utcnow()
            for r in rows:
                payload = dict(r.payload or {})
                tags = self._risk_tags(conn, payload)
                envelope = {
                    "id": f"evt_{r.outbox_id}",
                    "type": r.event_type,
                    "created_at": (r.created_at or now).isoformat(),
                    "data": payload,
                }
                self._enqueue(conn, f"outbox:{r.outbox_id}", r.event_type, envelope, route(r.event_type, tags, targets, policies))
            conn.execute(
                o.update().where(o.c.outbox_id.in_([r.outbox_id for r in rows])).values(delivered_at=now)
            )
        return len(rows)

    @staticmethod
    def _risk_tags(conn: sa.Connection, payload: dict[str, Any]) -> list[str]:
        tags = payload.get("risk_tags")
        if isinstance(tags, list):
            return [str(t) for t in tags]
        rid = payload.get("approval_request_id")
        if rid:
            a = core.approval_requests
            got = conn.execute(sa.select(a.c.risk_tags).where(a.c.approval_request_id == rid)).scalar()
            return list(got or [])
        return []

    def _enqueue(
        self, conn: sa.Connection, event_id: str, event_type: str, envelope: dict[str, Any], targets: Iterable[WebhookTarget]
    ) -> int:
        body = json.dumps(envelope, separators=(",", ":"), sort_keys=True, default=str)
        now = utcnow()
        rows = [
            {
                "delivery_id": "dl_" + uuid.uuid4().hex[:20],
                "event_id": event_id,
                "target_id": t.target_id,
                "event_type": event_type,
                "payload": body,
                "status": "pending",
                "attempts": 0,
                "next_attempt_at": time.time(),
                "created_at": now,
            }
            for t in targets
        ]
        return insert_ignore(conn, webhook_deliveries, rows)

    # ---- escalation (sync) ----------------------------------------------------------------------

    def escalate(self) -> int:
        """Escalate pending requests left undecided longer than their policy allows.

        Returns:
            How many escalations were sent.
        """
        policies = [p for p in self.state.store.policies() if p.escalate_after_seconds and p.escalate_to]
        if not policies:
            return 0
        targets = {t.name: t for t in self.state.store.targets() if t.active}
        now = utcnow()
        sent = 0
        pending = self.state.views.pending_approvals()
        if not pending:
            return 0
        with self.engine.connect() as conn:
            done = {
                (r.approval_request_id, r.risk_tag)
                for r in conn.execute(
                    sa.select(escalations.c.approval_request_id, escalations.c.risk_tag).where(
                        escalations.c.approval_request_id.in_([a["approval_request_id"] for a in pending])
                    )
                )
            }
        for a in pending:
            age = (now - a["created_at"]).total_seconds()
            for p in policies:
                if p.risk_tag != "*" and p.risk_tag not in a["risk_tags"]:
                    continue
                if age < (p.escalate_after_seconds or 0) or (a["approval_request_id"], p.risk_tag) in done:
                    continue
                with self.engine.begin() as conn:
                    won = insert_ignore(
                        conn,
                        escalations,
                        [{"approval_request_id": a["approval_request_id"], "risk_tag": p.risk_tag, "escalated_at": now}],
                    )
                    if not won:
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
                    chosen = [targets[n] for n in p.escalate_to if n in targets]
                    self._enqueue(conn, f"escalation:{a['approval_request_id']}:{p.risk_tag}", "approval.escalated", envelope, chosen)
                    sent += 1
        return sent

    # ---- delivery -------------------------------------------------------------------------------

    def claim_due(self, limit: int = 50) -> list[dict[str, Any]]:
        """Lease due deliveries so no other server sends them at the same time."""
        d = webhook_deliveries
        now = time.time()
        lease = now + self.state.settings.webhook_timeout + 10
        with self.engine.begin() as conn:
            q = (
                sa.select(d.c.delivery_id, d.c.target_id, d.c.event_type, d.c.payload, d.c.attempts)
                .where(
                    d.c.status == "pending",
                    d.c.next_attempt_at <= now,
                    sa.or_(d.c.locked_until.is_(None), d.c.locked_until < now),
                )
                .order_by(d.c.next_attempt_at)
                .limit(limit)
            )
            if conn.dialect.name == "postgresql":
                q = q.with_for_update(skip_locked=True)
            rows = [dict(r._mapping) for r in conn.execute(q)]
            if rows:
                conn.execute(
                    d.update().where(d.c.delivery_id.in_([r["delivery_id"] for r in rows])).values(locked_until=lease)
                )
        return rows

    def record(self, delivery_id: str, attempts: int, status_code: int | None, error: str | None) -> None:
        """Store one attempt's outcome and schedule the retry with exponential backoff."""
        s = self.state.settings
        d = webhook_deliveries
        ok = status_code is not None and 200 <= status_code < 300
        values: dict[str, Any] = {"attempts": attempts, "last_status_code": status_code, "last_error": error, "locked_until": None}
        if ok:
            values.update(status="delivered", delivered_at=utcnow())
        elif attempts >= s.webhook_max_attempts:
            values.update(status="failed")
        else:
            delay = min(s.webhook_backoff_base * 2 ** (attempts - 1), s.webhook_backoff_max)
            # Jitter spreads retries of many deliveries to one recovering receiver.
            values.update(next_attempt_at=time.time() + delay * random.uniform(0.8, 1.2))
        with self.engine.begin() as conn:
            conn.execute(d.update().where(d.c.delivery_id == delivery_id).values(**values))

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
