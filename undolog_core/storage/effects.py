"""``store.effects``: the effect log (``undolog_effect_log``), one row per logged call: the general pre-write,
re-issues and claims, the commit mark's general path, failures, late finishes, a person's resolution, lease
renewals, and recovery's reads and claims of what is in flight. The hot path's two statements (pre-write and commit
mark) are per database, in ``sqlite.py`` and ``postgres.py``; so is how recovery finds the effects in flight
(``SQLiteEffects``, ``PostgresEffects``).

A transaction that moves an effect and, with it, its undo entry, its session or an audit event writes those
through their repositories' ``*_in`` methods (``store.undo``, ``store.sessions``, ``store.audit``), which
``EffectsSQL`` receives explicitly. Every state change is a move of ``states.EFFECT``."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from ..errors import EffectNotFound, InvalidEffectState
from ..states import EFFECT
from . import schema as t
from .audit import AuditSQL
from .base import Store, utcnow
from .pool import IntegrityConflict
from .schema import IN_FLIGHT, EffectState, SessionState
from .sessions import SessionsSQL
from .undo import UndoSQL

_E = t.effect_log
_S = t.sessions


@dataclass(frozen=True)
class FailureRollback:
    """The rollback a failure's caller will run if the session's policy asks for it: requested with the failure."""

    actor: str
    reason: str
    owner: str
    lease_until: dt.datetime


#: The states a take-over leaves a call in (recovery compensated it, settled it ``unknown``, sent an IRREVERSIBLE
#: call back to ``approved`` on its probe's word, dead-lettered it, or is deciding right now: in flight under
#: another owner). A commit mark of the call's own process that finds one of them is a late finish.
LATE_FINISH_STATES = frozenset(EFFECT.sources("late_finish"))


@dataclass(frozen=True)
class LateFinish:
    """A late finish recorded (``EffectsSQL.record_late_finish``): whose session halted, which tool, and the state
    the take-over had left the effect in."""

    session_id: str
    tool_name: str
    state_before: str


#: What a person may resolve an ``unknown`` effect as (``undolog effects resolve --as``), and the transition of
#: the state table (``states.EFFECT``) each one is.
RESOLUTIONS = {"committed": "resolve_committed", "compensated": "resolve_compensated",
               "not_happened": "resolve_not_happened"}


@dataclass(frozen=True)
class Resolution:
    """A person's settlement of an ``unknown`` effect (``UndoLog.resolve_effect``), as recorded.

    ``event_id``: its audit event (``effect.resolved``). The session is not resumed by it: ``session_state`` is
    the state it is in (usually ``halted``), for the person to resume or roll back next.
    """

    effect_id: str
    session_id: str
    tool_name: str
    resolved_as: str
    state: str
    undo_state: str | None
    session_state: str
    actor: str
    reason: str
    event_id: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class FailedRow(NamedTuple):
    """A failure recorded: its session, the session's policy, and whether the policy's rollback was requested."""

    session_id: str
    on_failure: str
    intent: bool


@dataclass(frozen=True)
class InFlight:
    """What recovery has to look at: effects in flight, undo entries being compensated, rollbacks requested."""

    effects: list[Any]
    undos: list[Any]
    intents: list[Any]


#: How long recovery waits for the lock of an in-flight effect's row that SKIP LOCKED passed over (seconds; PostgreSQL
#: only): long enough for a killed process's backend to be rolled back on a loaded machine, short enough that a
#: ``recover()`` never hangs on a row a live transaction keeps.
CLAIM_LOCK_WAIT = 3.0

#: The transition of the state table (``states.EFFECT``) that each of recovery's verdicts is.
_SETTLED_BY = {EffectState.COMMITTED: "commit", EffectState.UNKNOWN: "recover_unknown",
               EffectState.APPROVED: "recover_not_run",
               # A probe's "did not happen" once the request can no longer land: recorded failed, as not run.
               EffectState.FAILED: "fail"}

# An effect recovery compensated, only while it is in flight: a late finish of its own process
# (``record_late_finish``) may have made it ``unknown`` meanwhile, and that record stands. Recovery's one-statement
# record runs it as a CTE (``store.recovery``).
RECOVER_COMPENSATED = _E.update().where(_E.c.effect_id == sa.bindparam("eid"),
                                        EFFECT.guard("recover_compensated", _E.c.state)).values(
    state=EffectState.COMPENSATED.value, owner=None, lease_until=None, updated_at=sa.bindparam("now"))


def _same(col: Any, value: Any) -> Any:
    return col.is_(None) if value is None else col == value


class EffectsSQL:
    """``store.effects``: the effect log (``contract.EffectsRepository``); ``*_in`` methods join the caller's
    transaction. Built per database (``SQLiteEffects``, ``PostgresEffects``: how recovery finds what is in flight).

    Example:
        >>> storage.effects.effect_by_call("ticket-1042", "call-7").state
        'committed'
    """

    def __init__(self, store: Store, *, sessions: SessionsSQL, undo: UndoSQL, audit: AuditSQL) -> None:
        self._store = store
        self._sessions = sessions
        self._undo = undo
        self._audit = audit

    # -- effects: the general pre-write, re-issues, claims ----------------------------------------------

    def insert_effect_in(self, conn: Connection, values: Mapping[str, Any]) -> int:
        """An effect row; its seq (the undo entry's id). A COMPENSABLE effect's undo entry is armed by
        ``store.undo.arm_in`` in the same transaction (the hot path's pre-write writes both in one statement)."""
        try:
            key = conn.execute(_E.insert(), dict(values)).inserted_primary_key
        except IntegrityError as exc:  # the same call id again: the whole transaction is rolled back by the caller
            raise IntegrityConflict(str(exc.orig)) from exc
        assert key is not None
        return int(key[0])

    def call_exists(self, session_id: str, call_id: str) -> bool:
        """Whether the session logged a call ``call_id`` (one read on the (session_id, call_id) index)."""
        with self._store.read() as conn:
            return conn.execute(
                sa.select(_E.c.effect_id).where(_E.c.session_id == session_id, _E.c.call_id == call_id)
            ).first() is not None

    def sessions_with_call(self, session_ids: Sequence[str], call_id: str) -> set[str]:
        """Those of ``session_ids`` that logged a call ``call_id``: one read on the (session_id, call_id) index."""
        with self._store.read() as conn:
            return {str(r[0]) for r in conn.execute(
                sa.select(_E.c.session_id).where(_E.c.session_id.in_(list(session_ids)), _E.c.call_id == call_id)
            )}

    def effect_by_call(self, session_id: str, call_id: str) -> Any:
        """The effect row of the session's call ``call_id``, or None."""
        with self._store.read() as conn:
            return conn.execute(
                sa.select(_E).where(_E.c.session_id == session_id, _E.c.call_id == call_id)
            ).first()

    def session_of_client_key(self, call_id: str) -> str | None:
        """The session holding the call with this client-keyed id (``ck:...``, unique across sessions), or None.
        The index's own predicate is repeated so that SQLite reads the partial index."""
        with self._store.read() as conn:
            sid = conn.execute(sa.select(_E.c.session_id).where(
                _E.c.call_id == call_id, sa.text(t.CLIENT_KEY_PREDICATE))).scalar()
        return None if sid is None else str(sid)

    def session_of_effect(self, effect_id: str) -> str | None:
        """The session an effect belongs to, or None when there is no such effect."""
        with self._store.read() as conn:
            sid = conn.execute(sa.select(_E.c.session_id).where(_E.c.effect_id == effect_id)).scalar()
        return None if sid is None else str(sid)

    def effect_state_in(self, conn: Connection, effect_id: str) -> str | None:
        """The effect's state as the caller's transaction sees it (None: no such effect)."""
        state = conn.execute(sa.select(_E.c.state).where(_E.c.effect_id == effect_id)).scalar()
        return None if state is None else str(state)

    def request_of_effect_in(self, conn: Connection, effect_id: str) -> Any:
        """The approval request of an IRREVERSIBLE effect (id, state, decision, approved arguments), or None."""
        r = t.approval_requests
        return conn.execute(
            sa.select(r.c.approval_request_id, r.c.state, r.c.decision_reason, r.c.decided_by, r.c.approved_args)
            .where(r.c.effect_id == effect_id)
        ).first()

    def claim_effect_in(self, conn: Connection, effect_id: str, *, from_state: str, to_state: str, owner: str,
                        lease_until: dt.datetime, now: dt.datetime) -> int:
        """Compare-and-swap an effect into flight (an approved call claimed to run, a released call re-claimed);
        its new ownership epoch (the fencing token, one more than before), or 0 when another caller won."""
        # The claim is the state table's: an approved call claimed to run, a released one claimed back.
        move = {(EffectState.APPROVED.value, EffectState.RUNNING.value): "claim_run",
                (EffectState.RELEASED.value, EffectState.PENDING.value): "reclaim",
                (EffectState.RELEASED.value, EffectState.RUNNING.value): "reclaim_approved"}[(from_state, to_state)]
        epoch = conn.execute(
            _E.update().where(_E.c.effect_id == effect_id, _E.c.state == from_state, EFFECT.guard(move, _E.c.state))
            .values(state=to_state, owner=owner, lease_until=lease_until, updated_at=now, epoch=_E.c.epoch + 1)
            .returning(_E.c.epoch)
        ).scalar()
        return int(epoch or 0)

    def back_in_flight_in(self, conn: Connection, seq: int) -> None:
        """The effect ``seq`` is in flight again (a released call re-claimed, an approved call claimed): where the
        database finds effects in flight by a cursor, it is moved back (per database)."""
        raise NotImplementedError

    def effects_in_flight_in(self, conn: Connection) -> tuple[list[Any], tuple[Any, int] | None]:
        """The effects in flight as ``conn`` sees them, and the cursor to advance past what was seen settled (None:
        no cursor; per database)."""
        raise NotImplementedError

    def advance_cursor(self, cursor: Any, upto: int) -> None:
        """Move recovery's cursor to ``upto`` (per database; nothing where there is no cursor)."""
        raise NotImplementedError

    def release_effect(self, effect_id: str) -> str | None:
        """Hand an in-flight call back without an outcome; returns the state it had (None: no such effect)."""
        now = utcnow()
        with self._store.tx() as conn:
            state = self.effect_state_in(conn, effect_id)
            if state in IN_FLIGHT:
                conn.execute(_E.update().where(_E.c.effect_id == effect_id, EFFECT.guard("release", _E.c.state))
                             .values(state=EffectState.RELEASED.value, released_from=state, owner=None,
                                     lease_until=None, updated_at=now))
            return state

    # -- IRREVERSIBLE --------------------------------------------------------------------------------

    def find_irreversible(self, session_id: str, tool_name: str, call_id: str | None, digest: str) -> Any:
        """The same call again (by call id), or, without one, the same action still waiting or approved."""
        e, r = _E, t.approval_requests
        q = sa.select(e, r.c.approval_request_id, r.c.state.label("req_state"), r.c.approved_args,
                      r.c.approved_digest, r.c.timeout_at, r.c.decision_reason, r.c.decided_by, r.c.decided_at,
                      r.c.action_digest).select_from(e.outerjoin(r, r.c.effect_id == e.c.effect_id))
        with self._store.read() as conn:
            if call_id is not None:
                return conn.execute(q.where(e.c.session_id == session_id, e.c.call_id == call_id)).first()
            return conn.execute(
                q.where(
                    e.c.session_id == session_id,
                    e.c.tool_name == tool_name,
                    e.c.state.in_((EffectState.AWAITING_APPROVAL.value, EffectState.APPROVED.value)),
                    sa.or_(e.c.args_digest == digest, r.c.approved_digest == digest),
                ).order_by(e.c.created_at)
            ).first()

    # -- kickoffs (framework runs a continuation replays) -----------------------------------------------

    def kickoff_to_continue(self, session_id: str) -> str | None:
        """The kickoff a continuation of this session continues: the last one that raised an approval request,
        else the last one that logged any call; None when no call of the session recorded a kickoff."""
        e = _E
        with self._store.read() as conn:
            for gated in (True, False):
                q = sa.select(e.c.kickoff_id).where(e.c.session_id == session_id, e.c.kickoff_id.is_not(None))
                if gated:
                    q = q.where(e.c.tier == "irreversible")
                found = conn.execute(q.order_by(e.c.seq.desc()).limit(1)).scalar()
                if found is not None:
                    return str(found)
        return None

    def kickoff_effects(self, session_id: str, kickoff_id: str) -> list[Any]:
        """The committed effects a kickoff logged, in the order they were logged: (effect_id, tool_name, tier,
        args_digest, approved_digest, result_snapshot)."""
        e, r = _E, t.approval_requests
        with self._store.read() as conn:
            return list(conn.execute(
                sa.select(e.c.effect_id, e.c.tool_name, e.c.tier, e.c.args_digest, r.c.approved_digest,
                          e.c.result_snapshot)
                .select_from(e.outerjoin(r, r.c.effect_id == e.c.effect_id))
                .where(e.c.session_id == session_id, e.c.kickoff_id == kickoff_id,
                       e.c.state == EffectState.COMMITTED.value)
                .order_by(e.c.seq)
            ).all())

    def effects_of_calls(self, session_id: str, call_ids: Sequence[str]) -> list[Any]:
        """The committed effects of these calls of the session (a resumed conversation's history), in the order they
        were logged; the columns of :meth:`kickoff_effects`."""
        e, r = _E, t.approval_requests
        found: list[Any] = []
        with self._store.read() as conn:
            for start in range(0, len(call_ids), 500):  # (bounded IN lists)
                found.extend(conn.execute(
                    sa.select(e.c.seq, e.c.effect_id, e.c.tool_name, e.c.tier, e.c.args_digest, r.c.approved_digest,
                              e.c.result_snapshot)
                    .select_from(e.outerjoin(r, r.c.effect_id == e.c.effect_id))
                    .where(e.c.session_id == session_id, e.c.call_id.in_(list(call_ids[start:start + 500])),
                           e.c.state == EffectState.COMMITTED.value)
                ).all())
        return sorted(found, key=lambda row: row.seq)

    def recent_effects_in(self, conn: Connection, session_id: str, n: int) -> list[Any]:
        """The session's last ``n`` logged calls, oldest first (the approval request's context)."""
        rows = conn.execute(
            sa.select(_E.c.tool_name, _E.c.tier, _E.c.state, _E.c.args_snapshot, _E.c.created_at)
            .where(_E.c.session_id == session_id).order_by(_E.c.created_at.desc()).limit(n)
        ).all()
        return list(reversed(rows))

    # -- outcomes ------------------------------------------------------------------------------------

    def mark_committed(self, effect_id: str, text: str, now: dt.datetime, *, fast: bool,
                       owner: str | None = None) -> str | None:
        """The commit mark's general path; None when written, else the effect's state (or "" when it is gone).

        ``owner``: only while the call is still this owner's (the fence of ``HotPath.owner``); a call another
        process took over answers its state (in flight: being recovered now), see ``record_late_finish``."""
        fence = () if owner is None else (_E.c.owner == owner,)
        with self._store.tx(fast=fast) as conn:
            res = conn.execute(
                _E.update().where(_E.c.effect_id == effect_id, EFFECT.guard("commit", _E.c.state), *fence)
                .values(state=EffectState.COMMITTED.value, result_snapshot=json.loads(text), owner=None,
                        lease_until=None, updated_at=now)
            )
            if res.rowcount == 1:
                return None
            return self.effect_state_in(conn, effect_id) or ""

    def record_late_finish(self, effect_id: str, text: str, now: dt.datetime) -> LateFinish | None:
        """A call that finished after another process took it over, recorded in one transaction: the effect
        ``unknown`` (its result kept, the reason in ``error``), its session halted, and an audit event
        ``effect.finished_late`` with the result. None when the effect is in no state a take-over leaves
        (nothing recorded).

        Recovery's own records of that effect (compensated, settled) apply only while it is in flight, so
        whichever commits second, the effect ends ``unknown`` with this finish recorded.
        """
        with self._store.tx() as conn:
            row = conn.execute(self._store.for_update(
                sa.select(_E.c.state, _E.c.session_id, _E.c.tool_name).where(_E.c.effect_id == effect_id))).first()
            if row is None or row.state not in LATE_FINISH_STATES:
                return None
            before = str(row.state)
            what = ("finished after compensation" if before == EffectState.COMPENSATED.value
                    else f"finished after it was taken over (it was {before})")
            result = json.loads(text)
            conn.execute(_E.update().where(_E.c.effect_id == effect_id, _E.c.state == before,
                                           EFFECT.guard("late_finish", _E.c.state)).values(
                state=EffectState.UNKNOWN.value, result_snapshot=result, owner=None, lease_until=None,
                error=f"{what}: the tool's side effect happened after another process took the call over; "
                      "a person decides",
                updated_at=now))
            self._sessions.halt_in(conn, row.session_id, f"{row.tool_name} ({effect_id}) {what}: its side effect happened "
                                               "after its compensation; check the tool, settle it (undolog effects "
                                               f"resolve {effect_id}), then resume or roll back", now)
            self._audit.append_event_in(conn, subject=f"effect:{effect_id}", action="effect.finished_late",
                                 actor="undolog", now=now,
                                 payload={"effect_id": effect_id, "session_id": row.session_id,
                                          "tool_name": row.tool_name, "what": what, "state_before": before,
                                          "result": result})
        return LateFinish(str(row.session_id), str(row.tool_name), before)

    def resolve_effect(self, effect_id: str, resolved_as: str, *, actor: str, reason: str,
                       principal: str | None, now: dt.datetime) -> Resolution:
        """A person settles an ``unknown`` effect, in one transaction: the effect moves (``RESOLUTIONS``), its undo
        entry follows (``compensated``: no rollback runs it again; ``not_happened``: an armed entry is dropped, as
        when recovery's probe says a call did not happen; ``committed``: left as it is, so an armed entry is still
        compensated by a rollback and one that already ran is not run again), and the immutable audit event
        ``effect.resolved`` records who, why and what it was before. The session is left as it is (not resumed).

        Raises:
            EffectNotFound: no such effect.
            InvalidEffectState: it is not ``unknown`` (nothing was written).
        """
        e = _E
        transition = RESOLUTIONS[resolved_as]
        with self._store.tx(urgent=True) as conn:
            row = conn.execute(self._store.for_update(
                sa.select(_E.c.state, _E.c.session_id, _E.c.tool_name, _E.c.tier, _E.c.error)
                .where(_E.c.effect_id == effect_id))).first()
            if row is None:
                raise EffectNotFound(effect_id)
            if row.state not in EFFECT.sources(transition):
                raise InvalidEffectState(
                    f"effect {effect_id} is {row.state}, not unknown: only a call whose outcome is unknown is resolved "
                    "by a person (see it with 'undolog sessions show SESSION')", effect_id=effect_id)
            values: dict[str, Any] = {"state": EFFECT.target(transition), "owner": None, "lease_until": None,
                                      "updated_at": now}
            if resolved_as == "not_happened":
                values["error"] = f"resolved by {actor}: it did not happen ({reason})"
            res = conn.execute(e.update().where(e.c.effect_id == effect_id, EFFECT.guard(transition, e.c.state))
                               .values(**values))
            if res.rowcount != 1:  # (the row is locked: only a store without row locks could get here)
                raise InvalidEffectState(f"effect {effect_id} changed while it was being resolved; look again",
                                         effect_id=effect_id)
            if resolved_as == "compensated":
                self._undo.resolve_compensated_in(conn, effect_id, now)
            elif resolved_as == "not_happened":
                self._undo.drop_armed_in(conn, effect_id)
            undo_state = self._undo.state_of_effect_in(conn, effect_id)
            session_state = conn.execute(sa.select(_S.c.state).where(_S.c.session_id == row.session_id)).scalar()
            event_id = self._audit.append_event_in(
                conn, subject=f"effect:{effect_id}", action="effect.resolved", actor=actor, now=now,
                payload={"effect_id": effect_id, "session_id": row.session_id, "tool_name": row.tool_name,
                         "resolved_as": resolved_as, "reason": reason, "state_before": row.state,
                         "error_before": row.error, "state": values["state"], "undo_state": undo_state,
                         "principal": principal})
        return Resolution(effect_id, str(row.session_id), str(row.tool_name), resolved_as, str(values["state"]),
                          None if undo_state is None else str(undo_state), str(session_state), actor, reason,
                          int(event_id))

    def mark_failed(self, effect_id: str, error: str, now: dt.datetime, nothing_happened: bool = False,
                    rollback: FailureRollback | None = None) -> tuple[str | None, Any]:
        """Record a failure: (None, the session's policy row) when written, else (its state or "", None).

        ``nothing_happened``: the tool said, by its contract, that it changed nothing (an MCP ``isError``): its
        armed undo entry is dropped in the same transaction, so no rollback calls a compensation for it.

        ``rollback``: the caller will roll the session back if its policy says so; then, in this same transaction,
        the rollback is requested (the intent, the session ``rolling_back``), so that a process that dies between
        the failure and its rollback leaves an intent that ``recover()`` finishes, never a session that carries on
        as if nothing had failed. The row's ``intent`` says whether it was written.
        """
        with self._store.tx() as conn:
            res = conn.execute(
                _E.update().where(_E.c.effect_id == effect_id, EFFECT.guard("fail", _E.c.state))
                .values(state=EffectState.FAILED.value, error=error, owner=None, lease_until=None, updated_at=now)
            )
            if res.rowcount != 1:
                return self.effect_state_in(conn, effect_id) or "", None
            if nothing_happened:
                self._undo.drop_armed_in(conn, effect_id)
            q = (sa.select(_E.c.session_id, _S.c.on_failure, _S.c.state)
                 .select_from(_E.join(_S, _S.c.session_id == _E.c.session_id)).where(_E.c.effect_id == effect_id))
            if rollback is not None and self._store.is_postgres:
                # As a rollback's plan does: one request of a session's rollback at a time (SQLite: the write lock).
                q = q.with_for_update(of=_S)
            row = conn.execute(q).one()
            intent = rollback is not None and row.on_failure == "rollback" and row.state != SessionState.ROLLED_BACK
            if intent and conn.execute(
                sa.select(t.rollbacks.c.session_id).where(t.rollbacks.c.session_id == row.session_id)
            ).first() is not None:
                intent = False  # requested already (by a person, or by a sibling call's failure): that one walks
            if intent:
                assert rollback is not None
                self._sessions.write_intent_in(conn, row.session_id, exists=False, actor=rollback.actor,
                                     reason=rollback.reason, owner=rollback.owner,
                                     lease_until=rollback.lease_until, now=now)
            return None, FailedRow(str(row.session_id), str(row.on_failure), intent)

    # -- leases --------------------------------------------------------------------------------------

    def renew_leases(self, owner: str, effects: list[str], undos: list[int], rolling: list[str],
                     until: dt.datetime) -> None:
        """Extend, on the fast engine in one transaction, the leases ``owner`` still holds: its effects in
        flight, its undo entries being compensated (``store.undo``) and its rollback intents (``store.sessions``)."""
        with self._store.tx(fast=True) as conn:
            if effects:
                conn.execute(_E.update().where(_E.c.effect_id.in_(effects), _E.c.owner == owner)
                             .values(lease_until=until))
            if undos:
                self._undo.renew_in(conn, owner, undos, until)
            if rolling:
                self._sessions.renew_intents_in(conn, owner, rolling, until)

    # -- the saga: a compensation recorded, what a rollback cannot take back -----------------------------

    def undo_compensated(self, undo_id: int, effect_id: str, *, in_flight: bool = False) -> None:
        """The entry and its effect ``compensated``. ``in_flight``: the effect was in flight when the walk read it
        (recovery of an abandoned call); it becomes ``compensated`` only if it still is, so a late finish of its
        own process recorded meanwhile (``record_late_finish``: ``unknown``) stands."""
        now = utcnow()
        e = t.effect_log
        move = "recover_compensated" if in_flight else "compensate"
        with self._store.tx() as conn:
            self._undo.compensated_in(conn, undo_id, now)
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

    # -- recovery: what is in flight, claims of in-doubt effects ---------------------------------------

    def in_flight(self) -> InFlight:
        """Everything in flight: effects (found the way each database finds them, see ``effects_in_flight_in``),
        undo entries being compensated, rollbacks requested."""
        with self._store.read() as conn:
            effects, seen_up_to = self.effects_in_flight_in(conn)
            undos = self._undo.compensating_in(conn)
            intents = list(conn.execute(sa.select(t.rollbacks)).all())
        if seen_up_to is not None:
            self.advance_cursor(*seen_up_to)
        return InFlight(effects, undos, intents)

    def in_flight_q(self) -> Any:
        """The SELECT of the effects in flight, in seq order (a statement, not run: each database narrows it)."""
        e = t.effect_log
        return (sa.select(e.c.seq, e.c.effect_id, e.c.session_id, e.c.tool_name, e.c.tier, e.c.state, e.c.owner,
                          e.c.lease_until).where(e.c.state.in_(IN_FLIGHT)).order_by(e.c.seq))

    def claim_in_doubt(self, effect_id: str, seen_state: str, seen_owner: str | None, owner: str,
                       lease_until: dt.datetime) -> bool:
        """Compare-and-swap an in-doubt effect's owner; on PostgreSQL SKIP LOCKED keeps racing recoverers from
        waiting on each other."""
        e = t.effect_log
        same = (e.c.effect_id == effect_id, e.c.state == seen_state, _same(e.c.owner, seen_owner))
        with self._store.tx() as conn:
            locked = conn.execute(self._store.for_update(sa.select(e.c.effect_id).where(*same), skip_locked=True)).first()
            if locked is None and self._store.is_postgres:
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
                row = conn.execute(self._store.for_update(still_same)).first()
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
             .where(self._store.one_of(e.c.effect_id, list(want))).order_by(e.c.seq))
        with self._store.tx() as conn:
            rows = [r for r in conn.execute(self._store.for_update(q, skip_locked=True)).all()
                    if (r.state, r.owner) == want[r.effect_id] and eligible(r)]
            if rows:
                conn.execute(e.update().where(self._store.one_of(e.c.effect_id, [r.effect_id for r in rows]))
                             .values(owner=owner, lease_until=lease_until, epoch=e.c.epoch + 1))
        return rows

    def effect(self, effect_id: str) -> Any:
        """The effect row. Raises ``NoResultFound`` when there is no such effect."""
        with self._store.read() as conn:
            return conn.execute(sa.select(t.effect_log).where(t.effect_log.c.effect_id == effect_id)).one()

    def settle_in(self, conn: Connection, effect_id: str, state: EffectState, *, result: Any = None,
                  error: str | None = None, now: dt.datetime) -> None:
        """Recovery's verdict on an effect in flight (``committed`` with its ``result``, ``unknown``, ``approved``,
        ``failed``), its owner gone; nothing when it is no longer in a state the verdict's move leaves."""
        values: dict[str, Any] = {"state": state.value, "owner": None, "lease_until": None, "updated_at": now}
        if state is EffectState.COMMITTED:
            values["result_snapshot"] = result
        if error is not None:
            values["error"] = error
        conn.execute(_E.update().where(_E.c.effect_id == effect_id, EFFECT.guard(_SETTLED_BY[state], _E.c.state))
                     .values(**values))

    def attempt_failed_in(self, conn: Connection, effect_id: str, error: str, *, dead_letter_after: int,
                          now: dt.datetime) -> int:
        """Count a failed recovery attempt and release the claim; at ``dead_letter_after`` the effect is
        ``dead_letter``. Returns the attempts so far."""
        attempts = int(conn.execute(sa.select(_E.c.recovery_attempts).where(_E.c.effect_id == effect_id))
                       .scalar_one()) + 1
        if attempts >= dead_letter_after:
            conn.execute(_E.update().where(_E.c.effect_id == effect_id, EFFECT.guard("dead_letter", _E.c.state))
                         .values(state=EffectState.DEAD_LETTER.value, recovery_attempts=attempts, owner=None,
                                 lease_until=None, error=f"recovery failed {attempts} times; last: {error}",
                                 updated_at=now))
        else:
            conn.execute(_E.update().where(_E.c.effect_id == effect_id).values(
                recovery_attempts=attempts, owner=None, lease_until=None, error=f"recovery attempt failed: {error}",
                updated_at=now))
        return attempts
