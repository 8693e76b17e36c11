"""The saga's statements: the rollback intent, the undo entries of a session, each step's claim and outcome."""

from __future__ import annotations

import datetime as dt
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..states import EFFECT, UNDO
from . import schema as t
from .base import utcnow
from .calls import CallsSQL


class SagaSQL(CallsSQL):
    def undo_entries_in(self, conn: Connection, session_id: str, only_effect: str | None) -> list[Any]:
        """The session's entries not compensated yet, newest first, with their effect's state and owner."""
        u, e = t.undo_stack, t.effect_log
        q = (
            sa.select(u, e.c.tool_name, e.c.state.label("effect_state"), e.c.result_snapshot,
                      e.c.owner.label("effect_owner"), e.c.lease_until.label("effect_lease"))
            .select_from(e.join(u, u.c.undo_id == e.c.seq))
            .where(e.c.session_id == session_id, u.c.state != "compensated")
            .order_by(u.c.undo_id.desc())
        )
        if only_effect is not None:
            q = q.where(e.c.effect_id == only_effect)
        return list(conn.execute(q).all())

    def claim_undo(self, undo_id: int, *, seen_state: str, seen_owner: str | None, owner: str,
                   lease_until: dt.datetime) -> bool:
        """Compare-and-swap on what the plan saw: two rollbacks of one session never run a compensation twice."""
        u = t.undo_stack
        owner_is = u.c.owner.is_(None) if seen_owner is None else u.c.owner == seen_owner
        with self.tx() as conn:
            res = conn.execute(
                u.update()
                .where(u.c.undo_id == undo_id, u.c.state == seen_state, UNDO.guard("claim", u.c.state), owner_is)
                .values(state="compensating", owner=owner, lease_until=lease_until, updated_at=utcnow())
            )
            return bool(res.rowcount == 1)

    def undo_attempt_failed(self, undo_id: int, error: str) -> None:
        with self.tx() as conn:
            conn.execute(
                t.undo_stack.update().where(t.undo_stack.c.undo_id == undo_id)
                .values(attempts=t.undo_stack.c.attempts + 1, last_error=error, updated_at=utcnow())
            )

    def undo_compensated(self, undo_id: int, effect_id: str, *, in_flight: bool = False) -> None:
        """The entry and its effect ``compensated``. ``in_flight``: the effect was in flight when the walk read it
        (recovery of an abandoned call); it becomes ``compensated`` only if it still is, so a late finish of its
        own process recorded meanwhile (``record_late_finish``: ``unknown``) stands."""
        now = utcnow()
        e, u = t.effect_log, t.undo_stack
        move = "recover_compensated" if in_flight else "compensate"
        with self.tx() as conn:
            conn.execute(
                u.update().where(u.c.undo_id == undo_id, UNDO.guard("compensated", u.c.state))
                .values(state="compensated", attempts=u.c.attempts + 1, owner=None, lease_until=None,
                        updated_at=now)
            )
            conn.execute(
                e.update().where(e.c.effect_id == effect_id, EFFECT.guard(move, e.c.state))
                .values(state="compensated", owner=None, lease_until=None, updated_at=now)
            )

    def undo_failed_in(self, conn: Connection, undo_id: int, now: dt.datetime) -> None:
        conn.execute(
            t.undo_stack.update().where(t.undo_stack.c.undo_id == undo_id, UNDO.guard("failed", t.undo_stack.c.state))
            .values(state="compensation_failed", owner=None, lease_until=None, updated_at=now)
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

    def undo_plan(self, session_id: str) -> list[dict[str, Any]]:
        """Which compensations would run, in order, if the session rolled back now."""
        u, e = t.undo_stack, t.effect_log
        with self.read() as conn:
            rows = conn.execute(
                sa.select(u.c.undo_id, u.c.compensation_name, u.c.compensation_version, u.c.state, e.c.tool_name,
                          e.c.effect_id, e.c.state.label("effect_state"))
                .select_from(e.join(u, u.c.undo_id == e.c.seq))
                .where(e.c.session_id == session_id, u.c.state != "compensated")
                .order_by(u.c.undo_id.desc())
            ).all()
        return [dict(r._mapping) for r in rows]
