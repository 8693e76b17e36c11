"""Recovery's statements: what was in flight (an index on PostgreSQL, a cursor on SQLite), claims by
compare-and-swap, and each effect's settlement."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

from ..states import EFFECT, IN_FLIGHT, SESSION
from . import schema as t
from .audit import PendingEvent
from .base import utcnow
from .calls import CallsSQL
from .schema import EffectState, SessionState
from .undo import COMPENSATED


@dataclass(frozen=True)
class InFlight:
    """What recovery has to look at: effects in flight, undo entries being compensated, rollbacks requested."""

    effects: list[Any]
    undos: list[Any]
    intents: list[Any]


_u, _e, _s = t.undo_stack, t.effect_log, t.sessions
# The undo entry's own statement (``store.undo``'s), as a CTE below.
_UNDO_DONE = COMPENSATED
# Only while the effect is in flight: a late finish of its own process (``record_late_finish``) may have made it
# ``unknown`` meanwhile, and that record stands.
_EFFECT_DONE = _e.update().where(_e.c.effect_id == sa.bindparam("eid"),
                                 EFFECT.guard("recover_compensated", _e.c.state)).values(
    state=EffectState.COMPENSATED.value, owner=None, lease_until=None, updated_at=sa.bindparam("now"))
# halt_in's statement and outbox row, with bound values.
_HALT = _s.update().where(
    _s.c.session_id == sa.bindparam("sid"), SESSION.guard("halt", _s.c.state),
).values(state=SessionState.HALTED.value, halted_reason=sa.bindparam("why"), updated_at=sa.bindparam("now"))
_HALTED_OUTBOX = t.outbox.insert().values(event_type="session.halted", payload=sa.bindparam("payload"),
                                          created_at=sa.bindparam("now"), attempts=0)



def _after(stmt: Any, cte: Any) -> Any:
    """``stmt`` made to run after ``cte``: its WHERE reads the CTE's output (a one-time filter that is always true),
    so PostgreSQL runs the CTE's update first. Unordered, PostgreSQL runs a statement's data-modifying CTEs last
    one first: the session's row was locked before the effect's, the opposite of the call path's order (a late
    finish or a failure locks the effect, then halts the session), and CI saw that deadlock."""
    return stmt.where(sa.select(sa.func.count()).select_from(cte).scalar_subquery() >= 0)


# The rows are locked in the call path's order: the effect, its undo entry, then the session.
_EFFECT_DONE_CTE = _EFFECT_DONE.returning(_e.c.effect_id).cte("effect_done")
_UNDO_DONE_CTE = _after(_UNDO_DONE, _EFFECT_DONE_CTE).returning(_u.c.undo_id).cte("undo_done")
_HALTED_CTE = _after(_HALT, _UNDO_DONE_CTE).returning(_s.c.session_id).cte("halted")
_DONE_AS_ONE = _HALTED_OUTBOX.add_cte(_EFFECT_DONE_CTE, _UNDO_DONE_CTE, _HALTED_CTE)

# The same statement rendered once for psycopg, with the constants it binds: run on a raw autocommit connection.
_PG_DONE = _DONE_AS_ONE.compile(dialect=pg_psycopg.dialect())  # type: ignore[no-untyped-call]
_PG_DONE_AS_ONE = str(_PG_DONE)
_PG_DONE_PARAMS = dict(_PG_DONE.params)


#: How long recovery waits for the lock of an in-flight effect's row that SKIP LOCKED passed over (seconds; PostgreSQL
#: only): long enough for a killed process's backend to be rolled back on a loaded machine, short enough that a
#: ``recover()`` never hangs on a row a live transaction keeps.
CLAIM_LOCK_WAIT = 3.0

#: The transition of the state table (``states.EFFECT``) that each of recovery's verdicts is.
_SETTLED_BY = {EffectState.COMMITTED: "commit", EffectState.UNKNOWN: "recover_unknown",
               EffectState.APPROVED: "recover_not_run",
               # A probe's "did not happen" once the request can no longer land: recorded failed, as not run.
               EffectState.FAILED: "fail"}


def _same(col: Any, value: Any) -> Any:
    return col.is_(None) if value is None else col == value


class RecoverySQL(CallsSQL):
    def in_flight(self) -> InFlight:
        """Everything in flight: effects (found the way each database finds them, see ``effects_in_flight_in``),
        undo entries being compensated, rollbacks requested."""
        with self.read() as conn:
            effects, seen_up_to = self.effects_in_flight_in(conn)
            undos = self.undo.compensating_in(conn)
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

    def claim_in_doubt(self, effect_id: str, seen_state: str, seen_owner: str | None, owner: str,
                       lease_until: dt.datetime) -> bool:
        """Compare-and-swap an in-doubt effect's owner; on PostgreSQL SKIP LOCKED keeps racing recoverers from
        waiting on each other."""
        e = t.effect_log
        same = (e.c.effect_id == effect_id, e.c.state == seen_state, _same(e.c.owner, seen_owner))
        with self.tx() as conn:
            locked = conn.execute(self.for_update(sa.select(e.c.effect_id).where(*same), skip_locked=True)).first()
            if locked is None and self.is_postgres:
                locked = self._wait_for_row_lock(conn, sa.select(e.c.effect_id).where(*same))
            if locked is None:
                return False
            # A new owner, a new epoch: the fencing token its probe carries, above the stalled owner's.
            res = conn.execute(e.update().where(*same, e.c.state.in_(IN_FLIGHT)).values(
                owner=owner, lease_until=lease_until, epoch=e.c.epoch + 1))
            return bool(res.rowcount == 1)

    def _wait_for_row_lock(self, conn: Any, still_same: Any) -> Any:
        """SKIP LOCKED found nothing: the row changed (another recoverer took it), or someone holds its lock.

        The lock may belong to the backend of a process killed in mid-transaction (a lease renewal, say):
        PostgreSQL ends that transaction only once the backend notices its client is gone, milliseconds later,
        longer on a loaded machine, and the effect was then skipped and left in flight by a ``recover()`` run right
        after the kill. So, while the row is still as recovery saw it, wait for its lock (``CLAIM_LOCK_WAIT`` at
        most), holding no other lock (no deadlock), and compare again: a racing recoverer's claim commits and the
        row no longer matches; a dead backend's transaction is rolled back and the claim goes ahead. Past the
        wait, the effect is skipped as before (the next ``recover()`` looks again).
        """
        if conn.execute(still_same).first() is None:
            return None
        with conn.begin_nested() as wait:
            conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{int(CLAIM_LOCK_WAIT * 1000)}ms'")
            try:
                row = conn.execute(self.for_update(still_same)).first()
            except sa.exc.OperationalError as exc:
                if getattr(exc.orig, "sqlstate", None) != "55P03":  # lock_not_available: the wait ran out
                    raise
                wait.rollback()
                return None
            return row

    def claim_in_doubt_batch(self, seen: Sequence[tuple[str, str, str | None]], owner: str,
                             lease_until: dt.datetime, eligible: Callable[[Any], bool]) -> list[Any]:
        """Claim many in-doubt COMPENSABLE effects in ONE transaction; returns the rows claimed.

        ``seen`` is (effect_id, state, owner) as the scan saw each: an effect is claimed only if it is still so
        (the compare-and-swap of ``claim_in_doubt``, batched) and ``eligible(row)`` says the batch path can
        finish it (its undo entry armed and unowned, its compensation loaded here at the logged version).
        PostgreSQL locks the rows with SKIP LOCKED, so racing recoverers take disjoint sets. Each row carries the
        effect (``effect_id, seq, session_id, tool_name, state, args_snapshot``) and its undo entry (``undo_id,
        undo_args, compensation_name, compensation_version, attempts``).
        """
        e, u = t.effect_log, t.undo_stack
        want = {eid: (state, who) for eid, state, who in seen}
        q = (sa.select(e.c.effect_id, e.c.seq, e.c.session_id, e.c.tool_name, e.c.state, e.c.owner,
                       e.c.args_snapshot, e.c.epoch, u.c.args_snapshot.label("undo_args"), u.c.undo_id,
                       u.c.state.label("undo_state"), u.c.owner.label("undo_owner"),
                       u.c.compensation_name, u.c.compensation_version, u.c.attempts)
             .select_from(e.join(u, u.c.undo_id == e.c.seq))
             .where(self.one_of(e.c.effect_id, list(want))).order_by(e.c.seq))
        with self.tx() as conn:
            rows = [r for r in conn.execute(self.for_update(q, skip_locked=True)).all()
                    if (r.state, r.owner) == want[r.effect_id] and eligible(r)]
            if rows:
                conn.execute(e.update().where(self.one_of(e.c.effect_id, [r.effect_id for r in rows]))
                             .values(owner=owner, lease_until=lease_until, epoch=e.c.epoch + 1))
        return rows

    def settle_and_claim_undos(self, committed: Sequence[tuple[str, Any]], undo_ids: Sequence[int], owner: str,
                               lease_until: dt.datetime, *, events: Sequence[PendingEvent] = ()) -> set[int]:
        """After the probes of a batch, in one transaction: the effects a probe proved ``committed`` (with its
        result), the probes' answers (``events``, audit), and the undo entries about to be compensated claimed
        (``compensating``, this owner). Returns the undo ids claimed (an entry no longer ``armed`` is not)."""
        e = t.effect_log
        now = utcnow()
        with self.tx() as conn:
            if events:
                self.audit.append_events_in(conn, events, now=now)
            for effect_id, result in committed:
                conn.execute(e.update().where(e.c.effect_id == effect_id, EFFECT.guard("commit", e.c.state)).values(
                    state=EffectState.COMMITTED.value, result_snapshot=result, owner=None, lease_until=None,
                    updated_at=now))
            # Armed only (an entry a walk already claimed is its walk's).
            return self.undo.claim_armed_in(conn, undo_ids, owner, lease_until, now)

    def compensated_in_recovery(self, undo_id: int, effect_id: str, session_id: str, halt_reason: str, *,
                                durable: bool = True) -> None:
        """One compensation recovery ran, recorded in one transaction: the entry and the effect ``compensated``
        and the session halted for a person (a crash can never leave it writable with the effect undone).

        ``durable=False`` commits without waiting for the disk (the fast engine): a crashed process loses
        nothing so committed, only a power loss can, and then the next ``recover()`` runs the compensation again
        with the same ``undo-{id}`` key, as after a crash between a compensation and its record. Recovery
        commits the last record of each batch durably, which flushes the ones before it.
        """
        now = utcnow()
        reason = {"session_id": session_id, "reason": halt_reason}
        # Statements built once, values bound: a thousand records do not rebuild (and re-key) three statements each.
        params = {"uid": undo_id, "eid": effect_id, "sid": session_id, "why": halt_reason, "payload": reason,
                  "now": now}
        if self.is_postgres:  # one round trip: the four writes as data-modifying CTEs of one autocommit statement
            self.one_statement(_PG_DONE_AS_ONE, {**_PG_DONE_PARAMS, **params, "payload": json.dumps(reason)},
                               fast=not durable)
            return
        with self.tx(fast=not durable) as conn:
            for stmt in (_UNDO_DONE, _EFFECT_DONE, _HALT, _HALTED_OUTBOX):
                conn.execute(stmt, params)

    def effect(self, effect_id: str) -> Any:
        with self.read() as conn:
            return conn.execute(sa.select(t.effect_log).where(t.effect_log.c.effect_id == effect_id)).one()

    def settle_effect(self, effect_id: str, state: EffectState | None, *, result: Any = None,
                      error: str | None = None, halt: tuple[str, str] | None = None, drop_undo: bool = False,
                      event: PendingEvent | None = None) -> None:
        """Recovery's verdict on an effect, and (``halt`` = (session, reason)) the session halted for a person, in
        one transaction. ``drop_undo``: it did not happen, its armed undo entry goes. ``event``: the audit event of
        the probe's answer behind the verdict. ``state`` None records the event alone (the effect stays as it is).

        Only while the effect is in flight: a late finish recorded meanwhile (``record_late_finish``) stands."""
        now = utcnow()
        with self.tx() as conn:
            if state is not None:
                values: dict[str, Any] = {"state": state.value, "owner": None, "lease_until": None,
                                          "updated_at": now}
                if state is EffectState.COMMITTED:
                    values["result_snapshot"] = result
                if error is not None:
                    values["error"] = error
                conn.execute(t.effect_log.update().where(t.effect_log.c.effect_id == effect_id,
                                                         EFFECT.guard(_SETTLED_BY[state], t.effect_log.c.state))
                             .values(**values))
            if drop_undo:
                self.undo.drop_armed_in(conn, effect_id)
            if event is not None:
                self.audit.append_events_in(conn, [event], now=now)
            if halt is not None:
                self.sessions.halt_in(conn, halt[0], halt[1], now)

    def note_event(self, event: PendingEvent) -> None:
        """One audit event in a transaction of its own (a probe's answer that settles nothing by itself)."""
        with self.tx() as conn:
            self.audit.append_events_in(conn, [event])

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
                conn.execute(e.update().where(e.c.effect_id == effect_id, EFFECT.guard("dead_letter", e.c.state)).values(
                    state=EffectState.DEAD_LETTER.value, recovery_attempts=attempts, owner=None, lease_until=None,
                    error=f"recovery failed {attempts} times; last: {error}", updated_at=now))
                self.sessions.halt_in(conn, session_id, halt_reason.format(attempts=attempts), now)
            else:
                conn.execute(e.update().where(e.c.effect_id == effect_id).values(
                    recovery_attempts=attempts, owner=None, lease_until=None,
                    error=f"recovery attempt failed: {error}", updated_at=now))
            return attempts
