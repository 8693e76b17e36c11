"""``store.sessions``: the sessions table (``undolog_sessions``) and a session's rollback intent
(``undolog_rollbacks``, one row per session at most, written together with the session's ``rolling_back`` state):
creating and counting, the writable-session guard of a call, halting, resuming, re-pinning, the state changes of
the table in ``undolog_core/states.py``, reads for people."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from ..errors import InvalidEffectState, InvalidSessionState, SessionNotFound
from ..states import SESSION
from . import schema as t
from .audit import AuditSQL
from .base import Store, utcnow
from .outbox import OutboxSQL
from .records import SessionRecord, StateChange
from .schema import WRITABLE, RequestState, SessionState

_S = t.sessions
# A halt: the session stops for a person (not once it ended), and the desk is told through the outbox. With bound
# values, built once: ``halt_in`` runs them, and recovery's one-statement record of a compensation as CTEs.
HALT = _S.update().where(_S.c.session_id == sa.bindparam("sid"), SESSION.guard("halt", _S.c.state)).values(
    state=SessionState.HALTED.value, halted_reason=sa.bindparam("why"), updated_at=sa.bindparam("now"))
HALTED_OUTBOX = t.outbox.insert().values(event_type="session.halted", payload=sa.bindparam("payload"),
                                         created_at=sa.bindparam("now"), attempts=0)


def _session_record(row: Any) -> SessionRecord:
    return SessionRecord(
        row.session_id, row.agent_id, SessionState(row.state), int(row.tool_calls_total), row.created_by,
        row.halted_reason, row.on_failure, dict(row.pinned_revisions or {}), row.created_at, row.updated_at,
    )


def _same(col: Any, value: Any) -> Any:
    return col.is_(None) if value is None else col == value


class SessionsSQL:
    """``store.sessions``: sessions as rows (``contract.SessionsRepository``); one method per unit of work,
    ``*_in`` methods join the caller's transaction.

    Example:
        >>> storage.sessions.get_session("ticket-1042").state
        <SessionState.ACTIVE: 'active'>
    """

    def __init__(self, store: Store, *, audit: AuditSQL, outbox: OutboxSQL) -> None:
        self._store = store
        self._audit = audit
        self._outbox = outbox

    # -- reads ---------------------------------------------------------------------------------------

    def lock_session_in(self, conn: Connection, session_id: str) -> Any:
        """The session row (None if there is none), locked for the rest of the transaction (PostgreSQL; SQLite's
        writer lock does it): resume, revalidate and the saga's rollback each start from it."""
        return conn.execute(
            self._store.for_update(sa.select(t.sessions).where(t.sessions.c.session_id == session_id))
        ).first()

    def get_session(self, session_id: str) -> SessionRecord | None:
        with self._store.read() as conn:
            row = conn.execute(sa.select(t.sessions).where(t.sessions.c.session_id == session_id)).first()
        return None if row is None else _session_record(row)

    def list_sessions(
        self,
        *,
        state: SessionState | None = None,
        agent_id: str | None = None,
        created_by: str | None = None,
        limit: int = 200,
        offset: int = 0,
    ) -> builtins.list[SessionRecord]:
        """Sessions newest first (ties by id, so pages do not overlap), optionally of one state, agent or creator."""
        q = sa.select(t.sessions).order_by(t.sessions.c.created_at.desc(), t.sessions.c.session_id)
        q = q.limit(limit).offset(offset)
        if state:
            q = q.where(t.sessions.c.state == state)
        if agent_id:
            q = q.where(t.sessions.c.agent_id == agent_id)
        if created_by:
            q = q.where(t.sessions.c.created_by == created_by)
        with self._store.read() as conn:
            return [_session_record(r) for r in conn.execute(q)]

    def session_effects(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """Every logged effect of the session, oldest first, with its undo entry's name, state and error."""
        e, u = t.effect_log, t.undo_stack
        with self._store.read() as conn:
            rows = conn.execute(
                sa.select(e, u.c.undo_id, u.c.compensation_name, u.c.state.label("undo_state"),
                          u.c.attempts.label("undo_attempts"), u.c.last_error.label("undo_error"))
                .select_from(e.outerjoin(u, u.c.undo_id == e.c.seq))
                .where(e.c.session_id == session_id).order_by(e.c.created_at, e.c.seq)
            ).all()
        return [dict(r._mapping) for r in rows]

    # -- writes --------------------------------------------------------------------------------------

    def set_session_state(
        self, session_id: str, state: SessionState, *, allowed: Iterable[SessionState], now: dt.datetime
    ) -> bool:
        """Move the session to ``state`` if it is in one of ``allowed``; False when it was not (or does not exist)."""
        # Only the moves the state table (``states.SESSION``) has: a session in another state of ``allowed`` is
        # not moved (False), and nothing is written when none is left.
        target = SessionState(state).value
        legal = [SessionState(s).value for s in allowed if SESSION.legal(SessionState(s).value, target)]
        if not legal:
            return False
        guard = SESSION.guard_between(legal, target, t.sessions.c.state)
        with self._store.tx() as conn:
            res = conn.execute(
                t.sessions.update().where(t.sessions.c.session_id == session_id, guard)
                .values(state=state, updated_at=now)
            )
            return bool(res.rowcount == 1)

    def refresh_changes_in(self, conn: Connection, session_id: str, now: dt.datetime) -> builtins.list[StateChange]:
        """``refresh_awaiting_in`` as the state changes it made (none, or one)."""
        changed = self.refresh_awaiting_in(conn, session_id, now)
        return [] if changed is None else [StateChange(session_id, SessionState(changed))]

    def resume_session(
        self, session_id: str, *, actor: str, reason: str | None, now: dt.datetime
    ) -> builtins.list[StateChange]:
        """Un-halt the session (event ``session.resume``); the state changes for the caches, in order.

        Raises:
            SessionNotFound: no such session.
            InvalidSessionState: it is not halted.
        """
        with self._store.tx() as conn:
            row = self.lock_session_in(conn, session_id)
            if row is None:
                raise SessionNotFound(session_id)
            if row.state != SessionState.HALTED:
                raise InvalidSessionState(f"session {session_id!r} is {row.state}, not halted; nothing to resume")
            conn.execute(
                t.sessions.update().where(t.sessions.c.session_id == session_id,
                                          SESSION.guard("resume", t.sessions.c.state))
                .values(state=SessionState.ACTIVE, halted_reason=None, updated_at=now)
            )
            refreshed = self.refresh_changes_in(conn, session_id, now)
            self._audit.append_event_in(conn, subject=f"session:{session_id}", action="session.resume", actor=actor,
                                 payload={"was_halted_because": row.halted_reason, "reason": reason}, now=now)
        return [StateChange(session_id, SessionState.ACTIVE), *refreshed]

    def revalidate_session(
        self, session_id: str, *, actor: str, current: Mapping[str, int], now: dt.datetime
    ) -> tuple[dict[str, dict[str, int | None]], dict[str, int]]:
        """Re-pin the session (event ``session.revalidate``); returns (what changed, the new pins).

        ``current`` empty: pin every tool to its newest revision in the registry (a process with no tools loaded).

        Raises:
            SessionNotFound: no such session.
        """
        with self._store.tx() as conn:
            row = self.lock_session_in(conn, session_id)
            if row is None:
                raise SessionNotFound(session_id)
            old = {k: int(v) for k, v in (row.pinned_revisions or {}).items()}
            pins = dict(current)
            if not pins:
                pins = dict(old)
                reg = t.tool_registry
                latest = conn.execute(
                    sa.select(reg.c.tool_name, sa.func.max(reg.c.revision)).group_by(reg.c.tool_name)
                ).all()
                pins.update({n: int(r) for n, r in latest})
            changed: dict[str, dict[str, int | None]] = {
                k: {"from": old.get(k), "to": v} for k, v in pins.items() if old.get(k) != v
            }
            conn.execute(
                t.sessions.update().where(t.sessions.c.session_id == session_id)
                .values(pinned_revisions=pins, updated_at=now)
            )
            self._audit.append_event_in(conn, subject=f"session:{session_id}", action="session.revalidate",
                                 actor=actor, payload={"changed": changed}, now=now)
        return changed, pins

    # -- the call path: creating, counting, the writable guard, halting ------------------------------

    def get_or_create_session(self, session_id: str, *, create: bool, values: Mapping[str, Any]) -> Any:
        """The session's row; with ``create``, made first when missing (a concurrent creator's row wins)."""
        with self._store.tx() as conn:
            row = conn.execute(sa.select(_S).where(_S.c.session_id == session_id)).first()
            if row is None and create:
                try:
                    with conn.begin_nested():
                        conn.execute(_S.insert().values(session_id=session_id, **values))
                except IntegrityError:
                    pass  # another process created it between our read and our insert: use theirs
                row = conn.execute(sa.select(_S).where(_S.c.session_id == session_id)).one()
            return row

    def add_call_count(self, session_id: str, n: int, *, missing: Mapping[str, Any]) -> None:
        """Add ``n`` calls counted in memory; a session known only from SAFE calls is recorded with ``missing``."""
        with self._store.tx(fast=True) as conn:
            res = conn.execute(
                _S.update().where(_S.c.session_id == session_id).values(tool_calls_total=_S.c.tool_calls_total + n)
            )
            if res.rowcount == 0:
                now = utcnow()
                conn.execute(_S.insert().values(session_id=session_id, state=SessionState.ACTIVE.value,
                                                tool_calls_total=n, created_at=now, updated_at=now, **missing))

    def guard_in(self, conn: Connection, session_id: str, count: int, pins: dict[str, int] | None) -> Any:
        """Inside a write: flush the counted calls (and new pins) and prove the session accepts writes.

        Returns None when it does, else the session's ``state`` and ``halted_reason`` (a session that vanished
        from the store is an error).
        """
        values: dict[str, Any] = {"tool_calls_total": _S.c.tool_calls_total + count}
        if pins is not None:
            values["pinned_revisions"] = pins
        res = conn.execute(
            _S.update().where(_S.c.session_id == session_id, _S.c.state.in_(WRITABLE)).values(**values)
        )
        if res.rowcount == 1:
            return None
        row = conn.execute(sa.select(_S.c.state, _S.c.halted_reason).where(_S.c.session_id == session_id)).first()
        if row is None:
            raise InvalidEffectState(f"session {session_id!r} vanished from the store")
        return row

    def halt_in(self, conn: Connection, session_id: str, reason: str, now: dt.datetime) -> None:
        """The session stops for a person (not once it ended), and the desk is told through the outbox."""
        conn.execute(HALT, {"sid": session_id, "why": reason, "now": now})
        self._outbox.write_in(conn, [("session.halted", {"session_id": session_id, "reason": reason})], now=now)

    def refresh_awaiting_in(self, conn: Connection, session_id: str, now: dt.datetime) -> str | None:
        """A session is ``awaiting_approval`` exactly while one of its requests is pending; returns the new state
        when it changed."""
        r = t.approval_requests
        pending = conn.execute(
            sa.select(sa.func.count()).select_from(r)
            .where(r.c.session_id == session_id, r.c.state == RequestState.PENDING.value)
        ).scalar_one()
        move = "await_approval" if pending else "approval_settled"
        target = SESSION.target(move)
        res = conn.execute(
            _S.update().where(_S.c.session_id == session_id, SESSION.guard(move, _S.c.state))
            .values(state=target, updated_at=now)
        )
        return target if res.rowcount else None

    def await_approval_in(self, conn: Connection, session_id: str, now: dt.datetime) -> None:
        """A request of the session was raised: it waits for a person (``await_approval``)."""
        conn.execute(_S.update().where(_S.c.session_id == session_id, SESSION.guard("await_approval", _S.c.state))
                     .values(state=SessionState.AWAITING_APPROVAL.value, updated_at=now))

    def halt_session(self, session_id: str, reason: str) -> None:
        with self._store.tx() as conn:
            self.halt_in(conn, session_id, reason, utcnow())

    # -- the rollback intent (``undolog_rollbacks``): requested with the session ``rolling_back`` ----------

    def rollback_intent_in(self, conn: Connection, session_id: str) -> Any:
        return conn.execute(sa.select(t.rollbacks).where(t.rollbacks.c.session_id == session_id)).first()

    def write_intent_in(self, conn: Connection, session_id: str, *, exists: bool, actor: str, reason: str | None,
                        owner: str, lease_until: dt.datetime, now: dt.datetime) -> None:
        """The rollback is requested (or taken over), and the session takes no call from now on."""
        if not exists:
            conn.execute(t.rollbacks.insert().values(session_id=session_id, actor=actor, reason=reason,
                                                     owner=owner, lease_until=lease_until, requested_at=now))
        else:
            conn.execute(t.rollbacks.update().where(t.rollbacks.c.session_id == session_id)
                         .values(owner=owner, lease_until=lease_until))
        conn.execute(
            t.sessions.update()
            .where(t.sessions.c.session_id == session_id, SESSION.guard("request_rollback", t.sessions.c.state))
            .values(state="rolling_back", updated_at=now)
        )

    def end_intent_in(self, conn: Connection, session_id: str, *, owner: str | None = None) -> None:
        """The session's rollback intent ends (``owner``: only if that owner holds it)."""
        q = t.rollbacks.delete().where(t.rollbacks.c.session_id == session_id)
        conn.execute(q if owner is None else q.where(t.rollbacks.c.owner == owner))

    def mark_rolled_back_in(self, conn: Connection, session_id: str, now: dt.datetime) -> None:
        conn.execute(t.sessions.update().where(t.sessions.c.session_id == session_id,
                                               SESSION.guard("rolled_back", t.sessions.c.state))
                     .values(state="rolled_back", updated_at=now))
        self.end_intent_in(conn, session_id)

    def claim_intent(self, session_id: str, seen_owner: str | None, owner: str, lease_until: dt.datetime) -> bool:
        """Compare-and-swap a rollback's owner: of several recoverers, one walks it."""
        rb = t.rollbacks
        with self._store.tx() as conn:
            res = conn.execute(rb.update().where(rb.c.session_id == session_id, _same(rb.c.owner, seen_owner))
                               .values(owner=owner, lease_until=lease_until))
            return bool(res.rowcount == 1)

    def renew_intents_in(self, conn: Connection, owner: str, session_ids: Sequence[str],
                         until: dt.datetime) -> None:
        """Extend the lease of the rollback intents ``owner`` still holds."""
        rb = t.rollbacks
        conn.execute(rb.update().where(rb.c.session_id.in_(list(session_ids)), rb.c.owner == owner)
                     .values(lease_until=until))
