"""Reading the outbox: the events the core writes beside each approval event, for a notifier to fan out.

The core writes outbox rows in its own transactions (see ``_audit``); something outside the core (the
approval desk's webhooks) turns them into notifications. This is the one public way to do that, so the
consumer never touches the core's tables.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import _schema as t
from ._store import utcnow

if TYPE_CHECKING:
    from ._undolog import UndoLog


@dataclass(frozen=True)
class OutboxEvent:
    """One undelivered outbox row.

    Attributes:
        outbox_id: Increasing id (the order the events were written in).
        event_type: ``approval.requested``, ``approval.decided``, ``approval.timed_out``, ``session.halted``,
            ``session.rolled_back``.
        payload: The event's data.
        created_at: When the event was written.
        risk_tags: The risk tags of the approval request the event is about (from the payload, else the
            request), for routing; empty for session events.
    """

    outbox_id: int
    event_type: str
    payload: dict[str, Any]
    created_at: dt.datetime | None
    risk_tags: list[str] = field(default_factory=list)


class OutboxService:
    """Hand undelivered outbox events to a consumer, once, whichever process gets there first.

    Example:
        >>> def fan_out(conn, events):          # runs inside the claiming transaction
        ...     for e in events:
        ...         my_store.enqueue(conn, e)   # the consumer's own rows, committed with the claim
        >>> undolog.outbox.drain(fan_out, limit=200)
    """

    def __init__(self, undolog: UndoLog) -> None:
        self._u = undolog

    def drain(self, handle: Callable[[Connection, Sequence[OutboxEvent]], None], *, limit: int = 200) -> int:
        """Claim up to ``limit`` undelivered events, pass them to ``handle`` and mark them delivered.

        ``handle`` runs inside the claiming transaction and receives its connection, so the consumer's own
        writes (delivery rows) commit atomically with the claim: an event is handed over exactly once, or
        not at all if ``handle`` raises. On PostgreSQL, rows another process is draining are skipped, not
        waited for.

        Args:
            handle: ``handle(conn, events)``; it may write on ``conn`` but must not commit it.
            limit: Most events claimed at once.

        Returns:
            How many events were handed over.
        """
        o, a = t.outbox, t.approval_requests
        store = self._u.store
        with store.tx() as conn:
            q = sa.select(o).where(o.c.delivered_at.is_(None)).order_by(o.c.outbox_id).limit(limit)
            rows = conn.execute(store.for_update(q, skip_locked=True)).all()
            if not rows:
                return 0
            events = []
            for r in rows:
                payload = dict(r.payload or {})
                tags = payload.get("risk_tags")
                if isinstance(tags, list):
                    risk_tags = [str(x) for x in tags]
                elif rid := payload.get("approval_request_id"):
                    got = conn.execute(sa.select(a.c.risk_tags).where(a.c.approval_request_id == rid)).scalar()
                    risk_tags = [str(x) for x in (got or [])]
                else:
                    risk_tags = []
                events.append(OutboxEvent(int(r.outbox_id), str(r.event_type), payload, r.created_at, risk_tags))
            handle(conn, events)
            conn.execute(
                o.update().where(o.c.outbox_id.in_([e.outbox_id for e in events])).values(delivered_at=utcnow())
            )
        return len(events)
