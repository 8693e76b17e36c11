"""The sessions' SQL: reads for people, state changes, resuming and re-pinning (the last two audited). Halting and
the awaiting-approval refresh are the engine's (``CallsSQL.halt_in``, ``refresh_awaiting_in``)."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..errors import InvalidSessionState, SessionNotFound
from ..states import SESSION
from . import schema as t
from .base import Store
from .records import SessionRecord, StateChange
from .schema import SessionState

if TYPE_CHECKING:
    from .audit import AuditSQL


def _session_record(row: Any) -> SessionRecord:
    return SessionRecord(
        row.session_id, row.agent_id, SessionState(row.state), int(row.tool_calls_total), row.created_by,
        row.halted_reason, row.on_failure, dict(row.pinned_revisions or {}), row.created_at, row.updated_at,
    )


class SessionsSQL(Store):
    """Sessions as rows: one method per unit of work; ``*_in`` methods join the caller's transaction.

    Example:
        >>> storage.get_session("ticket-1042").state
        <SessionState.ACTIVE: 'active'>
    """

    audit: AuditSQL  # built by ``Storage``

    if TYPE_CHECKING:  # provided by CallsSQL in Storage
        def refresh_awaiting_in(self, conn: Connection, session_id: str, now: dt.datetime) -> str | None: ...

    # -- reads ---------------------------------------------------------------------------------------

    def lock_session_in(self, conn: Connection, session_id: str) -> Any:
        """The session row (None if there is none), locked for the rest of the transaction (PostgreSQL; SQLite's
        writer lock does it): resume, revalidate and the saga's rollback each start from it."""
        return conn.execute(
            self.for_update(sa.select(t.sessions).where(t.sessions.c.session_id == session_id))
        ).first()

    def get_session(self, session_id: str) -> SessionRecord | None:
        with self.read() as conn:
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
        with self.read() as conn:
            return [_session_record(r) for r in conn.execute(q)]

    def session_effects(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """Every logged effect of the session, oldest first, with its undo entry's name, state and error."""
        e, u = t.effect_log, t.undo_stack
        with self.read() as conn:
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
        with self.tx() as conn:
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
        with self.tx() as conn:
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
            self.audit.append_event_in(conn, subject=f"session:{session_id}", action="session.resume", actor=actor,
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
        with self.tx() as conn:
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
            self.audit.append_event_in(conn, subject=f"session:{session_id}", action="session.revalidate",
                                 actor=actor, payload={"changed": changed}, now=now)
        return changed, pins
