"""Sessions: the unit that calls are logged under and rolled back as."""

from __future__ import annotations

import builtins
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from ._saga import RollbackReport
from ._session_record import SessionCache
from ._tools import ToolTier
from .errors import ApprovalPending, InvalidSessionState, SessionNotFound
from .limits import check_identity, clean_text
from .storage.base import utcnow
from .storage.records import SessionRecord, SessionState, StateChange

SAFE = ToolTier.SAFE

if TYPE_CHECKING:
    from ._driver import CallDriver
    from ._engine import Engine
    from ._registry import Registry
    from ._saga import Saga
    from .storage import Storage


class SessionHost(Protocol):
    """What a ``Session`` uses of the UndoLog that opened it (the facade satisfies it; no import of it here)."""

    engine: Engine
    saga: Saga
    driver: CallDriver
    registry: Registry
    sessions: SessionService


class Session:
    """One agent run. Use it as ``async with`` (or ``with``); leave it open to resume it later by id.

    Example:
        >>> async with undolog.session(agent_id="support-bot") as s:
        ...     await s.call(search_knowledge_base, query="refund policy")
    """

    def __init__(self, undolog: SessionHost, cache: SessionCache) -> None:
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
        self._u.engine.flush_counts(self.id, self._sc)
        return await self._u.saga.rollback(self.id, actor=actor, reason="requested")

    def rollback_sync(self, *, actor: str = "undolog") -> RollbackReport:
        self._u.engine.flush_counts(self.id, self._sc)
        return self._u.saga.rollback_sync(self.id, actor=actor, reason="requested")

    def complete(self) -> None:
        """End the session: it accepts no more calls and stays in the log as ``completed``."""
        engine = self._u.engine
        # One durable statement where the hot path has it (the counts and the state together).
        if engine.end_session(self.id, SessionState.COMPLETED, (SessionState.ACTIVE.value,)):
            engine.note_state(self.id, SessionState.COMPLETED.value)
            return
        engine.flush_counts(self.id, self._sc)
        self._u.sessions.set_state(self.id, SessionState.COMPLETED, allowed=(SessionState.ACTIVE,))

    def revalidate(self, *, actor: str) -> dict[str, Any]:
        return self._u.sessions.revalidate(self.id, actor=actor)

    def resume(self, *, actor: str, reason: str | None = None) -> SessionRecord:
        return self._u.sessions.resume(self.id, actor=actor, reason=reason)

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._u.engine.flush_counts(self.id, self._sc)
        if exc is not None and self._should_rollback(exc):
            await self._driver.arollback_noting(self.id, exc, f"session left by {type(exc).__name__}: {exc}")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._u.engine.flush_counts(self.id, self._sc)
        if exc is not None and self._should_rollback(exc):
            self._driver.rollback_noting(self.id, exc, f"session left by {type(exc).__name__}: {exc}")

    def _should_rollback(self, exc: BaseException) -> bool:
        # Waiting for a person is not a failure; a halted session is for a person to resolve.
        if isinstance(exc, ApprovalPending) or not self._driver.failure_rollbacks:
            return False
        rec = self._u.sessions.get(self.id)
        return rec.on_failure == "rollback" and rec.state in ("active", "awaiting_approval")


class SessionService:
    """Read and resolve sessions (used by the CLI and the server too).

    Example:
        >>> undolog.sessions.resume("ticket-1042", actor="ana", reason="checked the refund by hand")
        SessionRecord(session_id='ticket-1042', ..., state=<SessionState.ACTIVE: 'active'>, ...)
    """

    def __init__(
        self,
        storage: Storage,
        *,
        flush_marks: Callable[[], None],
        current_pins: Callable[[], Mapping[str, int]],
        note_state: Callable[[str, str], None],
        note_pins: Callable[[str, Mapping[str, int]], None],
        persist: Callable[[str | None], None] | None = None,
    ) -> None:
        """Args:
            storage: the sessions' statements.
            flush_marks: writes this process's deferred commit marks, so a read sees every call that ran.
            current_pins: the contract revision of each tool loaded in this process.
            note_state: ``(session_id, state)``, keeps the in-memory session caches in step with the states
                written here.
            note_pins: the same for a session's pinned revisions.
            persist: writes a session this process started and has not written yet (every one, given None), so
                a read finds it (``Engine.persist``).
        """
        self._storage = storage
        self._flush_marks = flush_marks
        self._current_pins = current_pins
        self._note_state = note_state
        self._note_pins = note_pins
        self._persist = persist or (lambda session_id: None)

    def _changed(self, changes: Iterable[StateChange]) -> None:
        for change in changes:
            self._note_state(change.session_id, change.state.value)

    def get(self, session_id: str) -> SessionRecord:
        self._persist(session_id)
        rec = self._storage.sessions.get_session(session_id)
        if rec is None:
            raise SessionNotFound(session_id)
        return rec

    def list(
        self,
        *,
        state: str | None = None,
        agent_id: str | None = None,
        created_by: str | None = None,
        limit: int = 200,
        offset: int = 0,
    ) -> builtins.list[SessionRecord]:
        """Sessions newest first, optionally of one state, agent or creator; ``offset`` pages (a state no session
        can be in finds none).

        Example:
            >>> undolog.sessions.list(state="halted", agent_id="support-bot", limit=50)
        """
        if state and state not in [s.value for s in SessionState]:
            return []
        self._persist(None)
        return self._storage.sessions.list_sessions(state=SessionState(state) if state else None, agent_id=agent_id,
                                           created_by=created_by, limit=limit, offset=offset)

    def effects(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The session's timeline: every logged effect, oldest first, with its undo entry."""
        self.get(session_id)
        self._flush_marks()
        return self._storage.sessions.session_effects(session_id)

    def set_state(self, session_id: str, state: str, *, allowed: tuple[str, ...]) -> None:
        """Move the session to ``state`` if it is in one of ``allowed``.

        Raises:
            InvalidSessionState: it is in another state.
        """
        target = SessionState(state)
        self._persist(session_id)
        if not self._storage.sessions.set_session_state(
            session_id, target, allowed=[SessionState(a) for a in allowed], now=utcnow()
        ):
            cur = self.get(session_id).state
            raise InvalidSessionState(f"session {session_id!r} is {cur}; it cannot become {target}")
        self._note_state(session_id, target.value)

    def resume(self, session_id: str, *, actor: str, reason: str | None = None) -> SessionRecord:
        """A person looked at a halted session and lets it go on (audited)."""
        check_identity("actor", actor)
        reason = clean_text(reason) if reason is not None else None
        self._persist(session_id)
        self._changed(self._storage.sessions.resume_session(session_id, actor=actor, reason=reason, now=utcnow()))
        return self.get(session_id)

    def revalidate(self, session_id: str, *, actor: str) -> dict[str, Any]:
        """Pin the session to the contracts registered in this process now (audited); returns what changed.

        A process with no tools loaded (the CLI without ``--app``) pins every tool to its newest stored revision.
        """
        check_identity("actor", actor)
        self._persist(session_id)
        changed, pins = self._storage.sessions.revalidate_session(
            session_id, actor=actor, current=self._current_pins(), now=utcnow()
        )
        self._note_pins(session_id, pins)
        return dict(changed)


__all__ = ["Session", "SessionRecord", "SessionService"]
