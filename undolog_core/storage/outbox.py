"""``store.outbox``: the outbox table (``undolog_outbox``), written in the transaction of what it reports and claimed
by a consumer once, whichever process gets there first."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import schema as t
from .base import Store, utcnow

#: One outbox item: (event type, JSON payload).
OutboxItem = tuple[str, Mapping[str, Any]]

_O, _A = t.outbox, t.approval_requests
_UNDELIVERED = sa.select(_O).where(_O.c.delivered_at.is_(None)).order_by(_O.c.outbox_id)
_RISK_TAGS_OF = sa.select(_A.c.risk_tags).where(_A.c.approval_request_id == sa.bindparam("rid"))


def _rows(items: Iterable[OutboxItem], now: dt.datetime | None) -> list[dict[str, Any]]:
    created_at = now or utcnow()
    return [{"event_type": et, "payload": dict(p), "created_at": created_at, "attempts": 0} for et, p in items]


class OutboxSQL:
    """``store.outbox``: the one place outbox rows are written and claimed (``contract.OutboxRepository``).

    Example:
        >>> with storage.tx() as conn:
        ...     storage.outbox.write_in(conn, [("session.halted", {"session_id": "s1", "reason": "rejected"})])
        >>> storage.outbox.drain(lambda conn, events: None, OutboxEvent, limit=100)
        1
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    @staticmethod
    def write_in(conn: Connection, items: Iterable[OutboxItem], *, now: dt.datetime | None = None) -> None:
        """Queue outbox rows (webhooks) in the caller's transaction: they exist exactly when what they report does."""
        rows = _rows(items, now)
        if rows:
            conn.execute(_O.insert(), rows)

    def write_many_in(self, conn: Connection, items: Iterable[OutboxItem], *, now: dt.datetime | None = None) -> None:
        """``write_in`` for a batch (a sweep's hundreds of rows): one statement whatever the count on PostgreSQL
        (``Store.insert_many_in``)."""
        self._store.insert_many_in(conn, _O, _rows(items, now))

    def drain(self, handle: Callable[[Any, Sequence[Any]], None], make: Callable[..., Any], *, limit: int) -> int:
        """Claim up to ``limit`` undelivered rows (skipping those another process holds, on PostgreSQL), turn each
        into ``make(outbox_id, event_type, payload, created_at, risk_tags)``, hand them to ``handle`` inside the
        claiming transaction, and mark them delivered in it; returns how many were handed over.

        An exception from ``handle`` rolls the claim back: the rows stay undelivered for the next drain."""
        with self._store.tx() as conn:
            rows = conn.execute(self._store.for_update(_UNDELIVERED.limit(limit), skip_locked=True)).all()
            if not rows:
                return 0
            events = []
            for r in rows:
                payload = dict(r.payload or {})
                tags = payload.get("risk_tags")
                if isinstance(tags, list):
                    risk_tags = [str(x) for x in tags]
                elif rid := payload.get("approval_request_id"):
                    got = conn.execute(_RISK_TAGS_OF, {"rid": rid}).scalar()
                    risk_tags = [str(x) for x in (got or [])]
                else:
                    risk_tags = []
                events.append(make(int(r.outbox_id), str(r.event_type), payload, r.created_at, risk_tags))
            handle(conn, events)
            conn.execute(_O.update().where(_O.c.outbox_id.in_([e.outbox_id for e in events]))
                         .values(delivered_at=utcnow()))
        return len(events)
