"""The audit trail's SQL: one global hash chain over ``undolog_approval_events`` and the outbox written beside it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .._tools import canonical_json, sha256_hex
from . import schema as t
from .base import Store, utcnow
from .records import StoredEvent

GENESIS_HASH = "0" * 64

#: One outbox item: (event type, JSON payload).
OutboxItem = tuple[str, Mapping[str, Any]]


@dataclass(frozen=True)
class PendingEvent:
    """One audit event to append with ``append_events_in`` (the arguments of ``append_event_in``)."""

    subject: str
    action: str
    actor: str
    payload: Mapping[str, Any]
    approval_request_id: str | None = None
    outbox: Sequence[OutboxItem] = ()


def event_hash(
    *,
    event_id: int,
    approval_request_id: str | None,
    subject: str,
    action: str,
    actor: str,
    payload: str,
    created_at: dt.datetime,
    prev_hash: str,
) -> str:
    """The hash of one event: every stored column but the hash itself, canonical JSON, SHA-256."""
    created = created_at.astimezone(dt.UTC).isoformat(timespec="microseconds")
    return sha256_hex(canonical_json([event_id, approval_request_id, subject, action, actor, payload, created, prev_hash]))


class AuditChainReader:
    """The chain as one read transaction sees it: the events in order, then the head (see ``AuditSQL.audit_chain``)."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def events(self) -> Iterator[StoredEvent]:
        e = t.approval_events
        for r in self._conn.execute(sa.select(e).order_by(e.c.event_id)).yield_per(1000):
            yield StoredEvent(int(r.event_id), r.approval_request_id, r.subject, r.action, r.actor, r.payload,
                              r.created_at, r.prev_hash, r.hash)

    def head(self) -> tuple[int, str]:
        """(last event id, last hash) of the chain head row."""
        h = self._conn.execute(sa.select(t.audit_head).where(t.audit_head.c.head_id == 1)).one()
        return int(h.last_event_id), str(h.last_hash)


class AuditSQL(Store):
    """Appending to the hash chain (inside the caller's transaction), the outbox, and the reads of verification.

    Example:
        >>> with storage.tx() as conn:
        ...     storage.append_event_in(conn, subject="policy", action="policy.set", actor="ana", payload={})
    """

    def append_event_in(
        self,
        conn: Connection,
        *,
        subject: str,
        action: str,
        actor: str,
        payload: Mapping[str, Any],
        approval_request_id: str | None = None,
        outbox: Iterable[OutboxItem] = (),
        now: dt.datetime | None = None,
    ) -> int:
        """Append one audit event (and its outbox rows) inside the caller's transaction; returns the event id.

        The head row is locked first, so two writers never fork the chain.
        """
        head = conn.execute(self.for_update(sa.select(t.audit_head).where(t.audit_head.c.head_id == 1))).one()
        event_id = int(head.last_event_id) + 1
        # Microseconds only: both databases keep exactly that, so the hash recomputes from what was stored.
        created_at = now or utcnow()
        body = canonical_json(dict(payload))
        h = event_hash(
            event_id=event_id,
            approval_request_id=approval_request_id,
            subject=subject,
            action=action,
            actor=actor,
            payload=body,
            created_at=created_at,
            prev_hash=head.last_hash,
        )
        conn.execute(
            t.approval_events.insert().values(
                event_id=event_id,
                approval_request_id=approval_request_id,
                subject=subject,
                action=action,
                actor=actor,
                payload=body,
                created_at=created_at,
                prev_hash=head.last_hash,
                hash=h,
            )
        )
        conn.execute(
            t.audit_head.update().where(t.audit_head.c.head_id == 1).values(last_event_id=event_id, last_hash=h)
        )
        self.write_outbox_in(conn, outbox, now=created_at)
        return event_id

    def append_events_in(self, conn: Connection, events: Sequence[PendingEvent], *,
                         now: dt.datetime | None = None) -> list[int]:
        """Append a batch of audit events (and their outbox rows) in order, inside the caller's transaction.

        The chain head is locked once for the whole batch and each hash is computed from the one before it, so
        a sweep of 500 timeouts queues once on the head instead of 500 times; the chain is the same as if the
        events had been appended one by one. Returns the event ids, in order.
        """
        if not events:
            return []
        created_at = now or utcnow()
        # The outbox rows first: they do not depend on the chain, so concurrent sweepers write them in parallel
        # and hold the chain head (until their commit) only for the events themselves.
        self.insert_many_in(conn, t.outbox, [{"event_type": et, "payload": dict(p), "created_at": created_at,
                                              "attempts": 0} for ev in events for et, p in ev.outbox])
        bodies = [canonical_json(dict(ev.payload)) for ev in events]
        head = conn.execute(self.for_update(sa.select(t.audit_head).where(t.audit_head.c.head_id == 1))).one()
        prev, event_id = str(head.last_hash), int(head.last_event_id)
        rows: list[dict[str, Any]] = []
        for ev, body in zip(events, bodies, strict=True):
            event_id += 1
            h = event_hash(event_id=event_id, approval_request_id=ev.approval_request_id, subject=ev.subject,
                           action=ev.action, actor=ev.actor, payload=body, created_at=created_at, prev_hash=prev)
            rows.append({"event_id": event_id, "approval_request_id": ev.approval_request_id, "subject": ev.subject,
                         "action": ev.action, "actor": ev.actor, "payload": body, "created_at": created_at,
                         "prev_hash": prev, "hash": h})
            prev = h
        self.insert_many_in(conn, t.approval_events, rows)
        conn.execute(
            t.audit_head.update().where(t.audit_head.c.head_id == 1).values(last_event_id=event_id, last_hash=prev)
        )
        return [int(r["event_id"]) for r in rows]

    def append_event(self, **kw: Any) -> int:
        """``append_event_in`` in a transaction of its own."""
        with self.tx() as conn:
            return self.append_event_in(conn, **kw)

    @staticmethod
    def write_outbox_in(conn: Connection, items: Iterable[OutboxItem], *, now: dt.datetime | None = None) -> None:
        """Queue outbox rows (webhooks) in the caller's transaction: they exist exactly when what they report does."""
        rows = [{"event_type": et, "payload": dict(p), "created_at": now or utcnow(), "attempts": 0} for et, p in items]
        if rows:
            conn.execute(t.outbox.insert(), rows)

    @contextmanager
    def audit_chain(self) -> Iterator[AuditChainReader]:
        """The whole chain and its head in one read transaction (what ``verify`` recomputes)."""
        with self.read() as conn:
            yield AuditChainReader(conn)
