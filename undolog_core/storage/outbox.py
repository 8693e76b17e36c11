"""The outbox's statements: claiming undelivered events for a consumer, once, whichever process gets there first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa

from . import schema as t
from .base import Store, utcnow


class OutboxSQL(Store):
    def drain_outbox(self, handle: Callable[[Any, Sequence[Any]], None], make: Callable[..., Any], *,
                     limit: int) -> int:
        """Claim up to ``limit`` undelivered rows (skipping those another process holds, on PostgreSQL), turn each
        into ``make(outbox_id, event_type, payload, created_at, risk_tags)``, hand them to ``handle`` inside the
        claiming transaction, and mark them delivered in it."""
        o, a = t.outbox, t.approval_requests
        with self.tx() as conn:
            q = sa.select(o).where(o.c.delivered_at.is_(None)).order_by(o.c.outbox_id).limit(limit)
            rows = conn.execute(self.for_update(q, skip_locked=True)).all()
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
                events.append(make(int(r.outbox_id), str(r.event_type), payload, r.created_at, risk_tags))
            handle(conn, events)
            conn.execute(o.update().where(o.c.outbox_id.in_([e.outbox_id for e in events]))
                         .values(delivered_at=utcnow()))
        return len(events)
