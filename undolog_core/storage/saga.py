"""The saga's statements: the rollback intent, the undo entries of a session, each step's claim and outcome."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..states import EFFECT
from . import schema as t
from .base import utcnow
from .calls import CallsSQL


class SagaSQL(CallsSQL):
    def undo_compensated(self, undo_id: int, effect_id: str, *, in_flight: bool = False) -> None:
        """The entry and its effect ``compensated``. ``in_flight``: the effect was in flight when the walk read it
        (recovery of an abandoned call); it becomes ``compensated`` only if it still is, so a late finish of its
        own process recorded meanwhile (``record_late_finish``: ``unknown``) stands."""
        now = utcnow()
        e = t.effect_log
        move = "recover_compensated" if in_flight else "compensate"
        with self.tx() as conn:
            self.undo.compensated_in(conn, undo_id, now)
            conn.execute(
                e.update().where(e.c.effect_id == effect_id, EFFECT.guard(move, e.c.state))
                .values(state="compensated", owner=None, lease_until=None, updated_at=now)
            )

    def kept_irreversible_in(self, conn: Connection, session_id: str) -> list[Any]:
        """The IRREVERSIBLE calls of the session that ran: a rollback cannot take them back, and says so."""
        e = t.effect_log
        return list(conn.execute(
            sa.select(e.c.effect_id, e.c.tool_name)
            .where(e.c.session_id == session_id, e.c.tier == "irreversible", e.c.state == "committed")
        ).all())

    def unsettled_requests_in(self, conn: Connection, session_id: str) -> list[Any]:
        r = t.approval_requests
        return list(conn.execute(
            sa.select(r.c.approval_request_id, r.c.effect_id)
            .where(r.c.session_id == session_id, r.c.state.in_([s.value for s in t.OPEN_REQUEST_STATES]))
        ).all())
