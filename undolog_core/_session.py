"""Sessions: the unit that calls are logged under and rolled back as."""

from __future__ import annotations

import builtins
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import _schema as t
from ._audit import append_event
from ._engine import SessionCache
from ._saga import RollbackReport
from ._store import utcnow
from ._tools import ToolTier
from .errors import ApprovalPending, InvalidSessionState, SessionNotFound

SAFE = ToolTier.SAFE

if TYPE_CHECKING:
    import datetime as dt

    from ._undolog import UndoLog


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    agent_id: str | None
    state: str
    tool_calls_total: int
    created_by: str | None
    halted_reason: str | None
    on_failure: str
    pinned_revisions: dict[str, int]
    created_at: dt.datetime
    updated_at: dt.datetime

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["created_at"] = self.created_at.isoformat()
        d["updated_at"] = self.updated_at.isoformat()
        return d


def _session_record(row: Any) -> SessionRecord:
    return SessionRecord(
        row.session_id, row.agent_id, row.state, int(row.tool_calls_total), row.created_by, row.halted_reason,
        row.on_failure, dict(row.pinned_revisions or {}), row.created_at, row.updated_at,
    )


class Session:
    """One agent run. Use it as ``async with`` (or ``with``); leave it open to resume it later by id.

    Example:
        >>> async with undolog.session(agent_id="support-bot") as s:
        ...     await s.call(search_knowledge_base, query="refund policy")
    """

    def __init__(self, undolog: UndoLog, cache: SessionCache) -> None:
        self._u = undolog
        self._sc = cache
        self.id = cache.session_id
        self._driver = undolog.driver
        self._by_fn = undolog.registry.by_fn

    @property
    def state(self) -> str:
        return self._u.sessions.get(self.id).state

    # -- calls -------------------------------------------------------------------------------------

    async def call(self, tool: Any, /, *, call_id: str | None = None, **kwargs: Any) -> Any:
        """Run one tool call through its tier; returns the tool's result.

        Raises:
            ApprovalPending: an IRREVERSIBLE call awaits a person; re-issue it with the same ``call_id``.
        """
        spec = self._by_fn.get(tool) if not isinstance(tool, str) else None
        return await self._driver.call_async(self.id, spec or tool, kwargs, call_id=call_id, cache=self._sc)

    def call_sync(self, tool: Any, /, *, call_id: str | None = None, **kwargs: Any) -> Any:
        """The sync twin of :meth:`call`, for sync agents (CrewAI tools); no event loop per call."""
        spec = self._by_fn.get(tool) if not isinstance(tool, str) else None
        return self._driver.call_sync(self.id, spec or tool, kwargs, call_id=call_id, cache=self._sc)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def rollback(self, *, actor: str = "undolog") -> RollbackReport:
        """Undo every compensable effect of the session, newest first."""
        self._u.engine.flush_counts(self.id)
        return await self._u.saga.rollback(self.id, actor=actor, reason="requested")

    def rollback_sync(self, *, actor: str = "undolog") -> RollbackReport:
        self._u.engine.flush_counts(self.id)
        return self._u.saga.rollback_sync(self.id, actor=actor, reason="requested")

    def complete(self) -> None:
        """End the session: it accepts no more calls and stays in the log as ``completed``."""
        self._u.engine.flush_counts(self.id)
        self._u.sessions.set_state(self.id, "completed", allowed=("active",))

    def revalidate(self, *, actor: str) -> dict[str, Any]:
        return self._u.sessions.revalidate(self.id, actor=actor)

    def resume(self, *, actor: str, reason: str | None = None) -> SessionRecord:
        return self._u.sessions.resume(self.id, actor=actor, reason=reason)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._u.engine.flush_counts(self.id)
        if exc is not None and self._should_rollback(exc):
            await self._driver.arollback_noting(self.id, exc, f"session left by {type(exc).__name__}: {exc}")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._u.engine.flush_counts(self.id)
        if exc is not None and self._should_rollback(exc):
            self._driver.rollback_noting(self.id, exc, f"session left by {type(exc).__name__}: {exc}")

    def _should_rollback(self, exc: BaseException) -> bool:
        # Waiting for a person is not a failure; a halted session is for a person to resolve.
        if isinstance(exc, ApprovalPending):
            return False
        rec = self._u.sessions.get(self.id)
        return rec.on_failure == "rollback" and rec.state in ("active", "awaiting_approval")


class SessionService:
    """Read and resolve sessions (used by the CLI and the server too)."""

    def __init__(self, undolog: UndoLog) -> None:
        self._u = undolog

    def get(self, session_id: str) -> SessionRecord:
        with self._u.store.read() as conn:
            row = conn.execute(sa.select(t.sessions).where(t.sessions.c.session_id == session_id)).first()
        if row is None:
            raise SessionNotFound(session_id)
        return _session_record(row)

    def list(
        self,
        *,
        state: str | None = None,
        agent_id: str | None = None,
        created_by: str | None = None,
        limit: int = 200,
        offset: int = 0,
    ) -> builtins.list[SessionRecord]:
        """Sessions newest first, optionally of one state, agent or creator; ``offset`` pages.

        Example:
            >>> undolog.sessions.list(state="halted", agent_id="support-bot", limit=50)
        """
        q = sa.select(t.sessions).order_by(t.sessions.c.created_at.desc(), t.sessions.c.session_id)
        q = q.limit(limit).offset(offset)
        if state:
            q = q.where(t.sessions.c.state == state)
        if agent_id:
            q = q.where(t.sessions.c.agent_id == agent_id)
        if created_by:
            q = q.where(t.sessions.c.created_by == created_by)
        with self._u.store.read() as conn:
            return [_session_record(r) for r in conn.execute(q)]

    def effects(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The session's timeline: every logged effect, oldest first, with its undo entry."""
        self.get(session_id)
        self._u.engine.flush_marks()
        e, u = t.effect_log, t.undo_stack
        with self._u.store.read() as conn:
            rows = conn.execute(
                sa.select(e, u.c.undo_id, u.c.compensation_name, u.c.state.label("undo_state"),
                          u.c.attempts.label("undo_attempts"), u.c.last_error.label("undo_error"))
                .select_from(e.outerjoin(u, u.c.undo_id == e.c.seq))
                .where(e.c.session_id == session_id).order_by(e.c.created_at, e.c.seq)
            ).all()
        return [dict(r._mapping) for r in rows]

    def set_state(self, session_id: str, state: str, *, allowed: tuple[str, ...]) -> None:
        with self._u.store.tx() as conn:
            res = conn.execute(
                t.sessions.update().where(t.sessions.c.session_id == session_id, t.sessions.c.state.in_(allowed))
                .values(state=state, updated_at=utcnow())
            )
            if res.rowcount != 1:
                cur = self.get(session_id).state
                raise InvalidSessionState(f"session {session_id!r} is {cur}; it cannot become {state}")
        sc = self._u.engine.cached(session_id)
        if sc is not None:
            sc.state = state

    def resume(self, session_id: str, *, actor: str, reason: str | None = None) -> SessionRecord:
        """A person looked at a halted session and lets it go on (audited)."""
        now = utcnow()
        with self._u.store.tx() as conn:
            row = conn.execute(
                self._u.store.for_update(sa.select(t.sessions).where(t.sessions.c.session_id == session_id))
            ).first()
            if row is None:
                raise SessionNotFound(session_id)
            if row.state != "halted":
                raise InvalidSessionState(f"session {session_id!r} is {row.state}, not halted; nothing to resume")
            conn.execute(
                t.sessions.update().where(t.sessions.c.session_id == session_id)
                .values(state="active", halted_reason=None, updated_at=now)
            )
            self._u.engine.refresh_awaiting(conn, session_id, now=now)
            append_event(conn, self._u.store, subject=f"session:{session_id}", action="session.resume", actor=actor,
                         payload={"was_halted_because": row.halted_reason, "reason": reason}, now=now)
        sc = self._u.engine.cached(session_id)
        if sc is not None:
            sc.state = "active"
        return self.get(session_id)

    def revalidate(self, session_id: str, *, actor: str) -> dict[str, Any]:
        """Pin the session to the contracts registered in this process now (audited); returns what changed."""
        now = utcnow()
        current = self._u.engine.current_pins()
        with self._u.store.tx() as conn:
            row = conn.execute(
                self._u.store.for_update(sa.select(t.sessions).where(t.sessions.c.session_id == session_id))
            ).first()
            if row is None:
                raise SessionNotFound(session_id)
            old = {k: int(v) for k, v in (row.pinned_revisions or {}).items()}
            if not current:
                current = dict(old)
                reg = t.tool_registry
                latest = conn.execute(
                    sa.select(reg.c.tool_name, sa.func.max(reg.c.revision)).group_by(reg.c.tool_name)
                ).all()
                current.update({n: int(r) for n, r in latest})
            changed = {k: {"from": old.get(k), "to": v} for k, v in current.items() if old.get(k) != v}
            conn.execute(
                t.sessions.update().where(t.sessions.c.session_id == session_id)
                .values(pinned_revisions=current, updated_at=now)
            )
            append_event(conn, self._u.store, subject=f"session:{session_id}", action="session.revalidate",
                         actor=actor, payload={"changed": changed}, now=now)
        sc = self._u.engine.cached(session_id)
        if sc is not None:
            sc.pins = dict(current)
        return changed


__all__ = ["Session", "SessionRecord", "SessionService"]
