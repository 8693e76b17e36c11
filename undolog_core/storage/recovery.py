"""Recovery's statements: what was in flight (an index on PostgreSQL, a cursor on SQLite), claims by
compare-and-swap, and each effect's settlement."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import schema as t
from .base import utcnow
from .calls import CallsSQL
from .schema import IN_FLIGHT, EffectState, UndoState


@dataclass(frozen=True)
class InFlight:
    """What recovery has to look at: effects in flight, undo entries being compensated, rollbacks requested."""

    effects: list[Any]
    undos: list[Any]
    intents: list[Any]


def _same(col: Any, value: Any) -> Any:
    return col.is_(None) if value is None else col == value


class RecoverySQL(CallsSQL):
    def in_flight(self) -> InFlight:
        """Everything in flight: effects (found the way each database finds them, see ``effects_in_flight_in``),
        undo entries being compensated, rollbacks requested."""
        u = t.undo_stack
        with self.read() as conn:
            effects, seen_up_to = self.effects_in_flight_in(conn)
            undos = list(conn.execute(
                sa.select(u.c.undo_id, u.c.effect_id, u.c.session_id, u.c.owner, u.c.lease_until)
                .where(u.c.state == UndoState.COMPENSATING.value)
            ).all())
            intents = list(conn.execute(sa.select(t.rollbacks)).all())
        if seen_up_to is not None:
            self.advance_cursor(*seen_up_to)
        return InFlight(effects, undos, intents)

    def in_flight_q(self) -> Any:
        e = t.effect_log
        return (sa.select(e.c.seq, e.c.effect_id, e.c.session_id, e.c.tool_name, e.c.tier, e.c.state, e.c.owner,
                          e.c.lease_until).where(e.c.state.in_(IN_FLIGHT)).order_by(e.c.seq))

    if TYPE_CHECKING:  # per database (sqlite.py, postgres.py)
        def effects_in_flight_in(self, conn: Any) -> tuple[list[Any], tuple[Any, int] | None]: ...
        def advance_cursor(self, cursor: Any, upto: int) -> None: ...

    def claim_intent(self, session_id: str, seen_owner: str | None, owner: str, lease_until: dt.datetime) -> bool:
        """Compare-and-swap a rollback's owner: of several recoverers, one walks it."""
        rb = t.rollbacks
        with self.tx() as conn:
            res = conn.execute(rb.update().where(rb.c.session_id == session_id, _same(rb.c.owner, seen_owner))
                               .values(owner=owner, lease_until=lease_until))
            return bool(res.rowcount == 1)

    def claim_in_doubt(self, effect_id: str, seen_state: str, seen_owner: str | None, owner: str,
                       lease_until: dt.datetime) -> bool:
        """Compare-and-swap an in-doubt effect's owner; on PostgreSQL SKIP LOCKED keeps racing recoverers from
        waiting on each other."""
        e = t.effect_log
        same = (e.c.effect_id == effect_id, e.c.state == seen_state, _same(e.c.owner, seen_owner))
        with self.tx() as conn:
            if conn.execute(self.for_update(sa.select(e.c.effect_id).where(*same), skip_locked=True)).first() is None:
                return False
            res = conn.execute(e.update().where(*same).values(owner=owner, lease_until=lease_until))
            return bool(res.rowcount == 1)

    def effect(self, effect_id: str) -> Any:
        with self.read() as conn:
            return conn.execute(sa.select(t.effect_log).where(t.effect_log.c.effect_id == effect_id)).one()

    def settle_effect(self, effect_id: str, state: EffectState, *, result: Any = None, error: str | None = None,
                      halt: tuple[str, str] | None = None) -> None:
        """Recovery's verdict on an effect, and (``halt`` = (session, reason)) the session halted for a person."""
        now = utcnow()
        values: dict[str, Any] = {"state": state.value, "owner": None, "lease_until": None, "updated_at": now}
        if state is EffectState.COMMITTED:
            values["result_snapshot"] = result
        if error is not None:
            values["error"] = error
        with self.tx() as conn:
            conn.execute(t.effect_log.update().where(t.effect_log.c.effect_id == effect_id).values(**values))
            if halt is not None:
                self.halt_in(conn, halt[0], halt[1], now)

    def halt_session(self, session_id: str, reason: str) -> None:
        with self.tx() as conn:
            self.halt_in(conn, session_id, reason, utcnow())

    def recovery_attempt_failed(self, effect_id: str, session_id: str, error: str, *, dead_letter_after: int,
                                halt_reason: str) -> int:
        """Count a failed attempt; at ``dead_letter_after`` the effect is dead-lettered and the session halted.
        Returns the attempts so far. Below the limit the claim is released, so the next recover() tries again."""
        e = t.effect_log
        now = utcnow()
        with self.tx() as conn:
            attempts = int(conn.execute(sa.select(e.c.recovery_attempts).where(e.c.effect_id == effect_id))
                           .scalar_one()) + 1
            if attempts >= dead_letter_after:
                conn.execute(e.update().where(e.c.effect_id == effect_id).values(
                    state=EffectState.DEAD_LETTER.value, recovery_attempts=attempts, owner=None, lease_until=None,
                    error=f"recovery failed {attempts} times; last: {error}", updated_at=now))
                self.halt_in(conn, session_id, halt_reason.format(attempts=attempts), now)
            else:
                conn.execute(e.update().where(e.c.effect_id == effect_id).values(
                    recovery_attempts=attempts, owner=None, lease_until=None,
                    error=f"recovery attempt failed: {error}", updated_at=now))
            return attempts
