"""``store.recovery``: recovery's transactions that settle an effect together with its undo entry, its session and
the audit events of the probes behind them. A small service over the repositories, not one of its own: it writes
no statement of its own, each row through its table's repository (``store.effects``, ``store.undo``,
``store.sessions``, ``store.audit``), in one transaction per verdict so that a crash leaves either the whole
verdict or none of it. The one exception is ``compensated_in_recovery`` on PostgreSQL: the four writes of a
compensation's record as data-modifying CTEs of ONE statement (one round trip per compensation when recovery
compensates thousands), made from those repositories' own statements."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import psycopg as pg_psycopg

from . import schema as t
from .audit import AuditSQL, PendingEvent
from .base import Store, utcnow
from .effects import RECOVER_COMPENSATED, EffectsSQL
from .schema import EffectState
from .sessions import HALT, HALTED_OUTBOX, SessionsSQL
from .undo import COMPENSATED, UndoSQL

_u, _e, _s = t.undo_stack, t.effect_log, t.sessions
# The undo entry's own statement (``store.undo``'s), as a CTE below.
_UNDO_DONE = COMPENSATED
# The effect's own statement (``store.effects``'s), and ``store.sessions.halt_in``'s statement and outbox row, with
# bound values.
_EFFECT_DONE = RECOVER_COMPENSATED
_HALT = HALT
_HALTED_OUTBOX = HALTED_OUTBOX



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



class RecoverySQL:
    """``store.recovery`` (``contract.RecoveryService``): recovery's verdicts, each one transaction over the
    repositories it receives.

    Example:
        >>> storage.recovery.settle_effect(effect_id, EffectState.UNKNOWN, error="no probe", halt=(sid, "unknown"))
    """

    def __init__(self, store: Store, *, effects: EffectsSQL, undo: UndoSQL, sessions: SessionsSQL,
                 audit: AuditSQL) -> None:
        self._store = store
        self._effects = effects
        self._undo = undo
        self._sessions = sessions
        self._audit = audit

    def settle_and_claim_undos(self, committed: Sequence[tuple[str, Any]], undo_ids: Sequence[int], owner: str,
                               lease_until: dt.datetime, *, events: Sequence[PendingEvent] = ()) -> set[int]:
        """After the probes of a batch, in one transaction: the effects a probe proved ``committed`` (with its
        result), the probes' answers (``events``, audit), and the undo entries about to be compensated claimed
        (``compensating``, this owner). Returns the undo ids claimed (an entry no longer ``armed`` is not)."""
        now = utcnow()
        with self._store.tx() as conn:
            if events:
                self._audit.append_events_in(conn, events, now=now)
            for effect_id, result in committed:
                self._effects.settle_in(conn, effect_id, EffectState.COMMITTED, result=result, now=now)
            # Armed only (an entry a walk already claimed is its walk's).
            return self._undo.claim_armed_in(conn, undo_ids, owner, lease_until, now)

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
        if self._store.is_postgres:  # one round trip: the four writes as data-modifying CTEs of one statement
            self._store.one_statement(_PG_DONE_AS_ONE, {**_PG_DONE_PARAMS, **params, "payload": json.dumps(reason)},
                                      fast=not durable)
            return
        with self._store.tx(fast=not durable) as conn:
            for stmt in (_UNDO_DONE, _EFFECT_DONE, _HALT, _HALTED_OUTBOX):
                conn.execute(stmt, params)

    def settle_effect(self, effect_id: str, state: EffectState | None, *, result: Any = None,
                      error: str | None = None, halt: tuple[str, str] | None = None, drop_undo: bool = False,
                      event: PendingEvent | None = None) -> None:
        """Recovery's verdict on an effect, and (``halt`` = (session, reason)) the session halted for a person, in
        one transaction. ``drop_undo``: it did not happen, its armed undo entry goes. ``event``: the audit event of
        the probe's answer behind the verdict. ``state`` None records the event alone (the effect stays as it is).

        Only while the effect is in flight: a late finish recorded meanwhile (``record_late_finish``) stands."""
        now = utcnow()
        with self._store.tx() as conn:
            if state is not None:
                self._effects.settle_in(conn, effect_id, state, result=result, error=error, now=now)
            if drop_undo:
                self._undo.drop_armed_in(conn, effect_id)
            if event is not None:
                self._audit.append_events_in(conn, [event], now=now)
            if halt is not None:
                self._sessions.halt_in(conn, halt[0], halt[1], now)

    def note_event(self, event: PendingEvent) -> None:
        """One audit event in a transaction of its own (a probe's answer that settles nothing by itself)."""
        with self._store.tx() as conn:
            self._audit.append_events_in(conn, [event])

    def recovery_attempt_failed(self, effect_id: str, session_id: str, error: str, *, dead_letter_after: int,
                                halt_reason: str) -> int:
        """Count a failed attempt; at ``dead_letter_after`` the effect is dead-lettered and the session halted.
        Returns the attempts so far. Below the limit the claim is released, so the next recover() tries again."""
        now = utcnow()
        with self._store.tx() as conn:
            attempts = self._effects.attempt_failed_in(conn, effect_id, error, dead_letter_after=dead_letter_after,
                                                       now=now)
            if attempts >= dead_letter_after:
                self._sessions.halt_in(conn, session_id, halt_reason.format(attempts=attempts), now)
            return attempts
