"""The audit trail: one global hash chain over undolog_approval_events, and the outbox written beside it."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import _schema as t
from ._store import Store, utcnow
from ._tools import canonical_json, sha256_hex

GENESIS_HASH = "0" * 64


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
    created = created_at.astimezone(dt.UTC).isoformat(timespec="microseconds")
    return sha256_hex(canonical_json([event_id, approval_request_id, subject, action, actor, payload, created, prev_hash]))


def append_event(
    conn: Connection,
    store: Store,
    *,
    subject: str,
    action: str,
    actor: str,
    payload: Mapping[str, Any],
    approval_request_id: str | None = None,
    outbox: Iterable[tuple[str, Mapping[str, Any]]] = (),
    now: dt.datetime | None = None,
) -> int:
    """Append one audit event (and its outbox rows) inside the caller's transaction; returns the event id."""
    head = conn.execute(store.for_update(sa.select(t.audit_head).where(t.audit_head.c.head_id == 1))).one()
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
    conn.execute(t.audit_head.update().where(t.audit_head.c.head_id == 1).values(last_event_id=event_id, last_hash=h))
    write_outbox(conn, outbox, now=created_at)
    return event_id


def write_outbox(
    conn: Connection, items: Iterable[tuple[str, Mapping[str, Any]]], *, now: dt.datetime | None = None
) -> None:
    rows = [
        {"event_type": et, "payload": dict(p), "created_at": now or utcnow(), "attempts": 0} for et, p in items
    ]
    if rows:
        conn.execute(t.outbox.insert(), rows)


@dataclass(frozen=True)
class AuditReport:
    """Result of ``undolog audit verify``."""

    ok: bool
    events_checked: int
    first_bad_event_id: int | None = None
    problem: str | None = None


def verify(store: Store) -> AuditReport:
    """Recompute the chain; any edit, deletion or reordering behind the triggers' back shows up here."""
    prev = GENESIS_HASH
    expected_id = 1
    count = 0
    with store.read() as conn:
        rows = conn.execute(sa.select(t.approval_events).order_by(t.approval_events.c.event_id)).yield_per(1000)
        for r in rows:
            count += 1
            if r.event_id != expected_id:
                return AuditReport(False, count, r.event_id, f"event {expected_id} is missing (found {r.event_id})")
            if r.prev_hash != prev:
                return AuditReport(False, count, r.event_id, "prev_hash does not match the previous event's hash")
            h = event_hash(
                event_id=r.event_id,
                approval_request_id=r.approval_request_id,
                subject=r.subject,
                action=r.action,
                actor=r.actor,
                payload=r.payload,
                created_at=r.created_at,
                prev_hash=r.prev_hash,
            )
            if h != r.hash:
                return AuditReport(False, count, r.event_id, "the event's content does not match its hash")
            prev = r.hash
            expected_id += 1
        head = conn.execute(sa.select(t.audit_head).where(t.audit_head.c.head_id == 1)).one()
    if head.last_event_id != expected_id - 1 or head.last_hash != prev:
        return AuditReport(False, count, head.last_event_id, "events after the last one found were removed")
    return AuditReport(True, count)
