"""The saga orchestrator: walks a session's undo stack LIFO and records each compensation's outcome."""

from __future__ import annotations

import asyncio
import contextvars
import datetime as dt
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import _schema as t
from ._audit import append_event
from ._engine import jsonable, owner_alive
from ._faults import FaultPoint, fault
from ._store import utcnow
from .errors import (
    CompensationNotFound,
    CompensationVersionMismatch,
    InvalidSessionState,
    SessionNotFound,
)

if TYPE_CHECKING:
    from ._undolog import UndoLog


@dataclass(frozen=True)
class CompensationContext:
    """What a compensation receives.

    Attributes:
        args: the argument snapshot of the call being undone.
        result: its result snapshot, or None when it failed or its outcome is unknown.
        idempotency_key: ``undo-{undo_id}``; stable across retries and recovery.
        attempt: 1 for the first try.
    """

    args: dict[str, Any]
    result: Any
    idempotency_key: str
    attempt: int
    effect_id: str
    session_id: str
    tool_name: str
    undo_id: int
    effect_state: str


@dataclass(frozen=True)
class RollbackStep:
    undo_id: int
    effect_id: str
    tool_name: str
    compensation_name: str
    outcome: str  # compensated | compensation_failed | already_compensated
    attempts: int
    error: str | None = None


@dataclass
class RollbackReport:
    """What a rollback did, step by step, newest effect first."""

    session_id: str
    steps: list[RollbackStep] = field(default_factory=list)
    already_rolled_back: bool = False
    complete: bool = False
    halted_reason: str | None = None
    kept_irreversible: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "already_rolled_back": self.already_rolled_back,
            "complete": self.complete,
            "halted_reason": self.halted_reason,
            "kept_irreversible": self.kept_irreversible,
            "steps": [s.__dict__ for s in self.steps],
        }


@dataclass
class _Entry:
    undo_id: int
    effect_id: str
    tool_name: str
    compensation_name: str
    compensation_version: int
    args: dict[str, Any]
    result: Any
    effect_state: str
    attempts: int
    fn: Callable[..., Any]
    seen_state: str = "armed"
    seen_owner: str | None = None


class Saga:
    """Rollback of sessions.

    Example:
        >>> report = undolog.rollback(session_id)
        >>> [s.outcome for s in report.steps]
        ['compensated', 'compensated']
    """

    max_attempts = 3
    backoff_seconds = 0.05

    def __init__(self, undolog: UndoLog) -> None:
        self._u = undolog
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def _lock_for(self, session_id: str) -> threading.Lock:
        # One walk per session in this process; across processes the claims' compare-and-swap decides.
        with self._locks_guard:
            return self._locks.setdefault(session_id, threading.Lock())

    # -- planning --------------------------------------------------------------------------------

    def _plan(self, session_id: str, only_effect: str | None = None) -> RollbackReport | list[_Entry]:
        self._u.engine.flush_marks()
        store = self._u.store
        u, e = t.undo_stack, t.effect_log
        with store.tx() as conn:
            sess = conn.execute(
                store.for_update(sa.select(t.sessions).where(t.sessions.c.session_id == session_id))
            ).first()
            if sess is None:
                raise SessionNotFound(session_id)
            if sess.state == "rolled_back" and only_effect is None:
                return RollbackReport(session_id, already_rolled_back=True, complete=True)
            q = (
                sa.select(u, e.c.tool_name, e.c.state.label("effect_state"), e.c.result_snapshot,
                          e.c.owner.label("effect_owner"), e.c.lease_until.label("effect_lease"))
                .select_from(e.join(u, u.c.undo_id == e.c.seq))
                .where(e.c.session_id == session_id, u.c.state != "compensated")
                .order_by(u.c.undo_id.desc())
            )
            if only_effect is not None:
                q = q.where(e.c.effect_id == only_effect)
            rows = conn.execute(q).all()
            entries: list[_Entry] = []
            for r in rows:
                if r.effect_id == only_effect:
                    pass  # recovery holds this effect's claim itself
                elif r.effect_state in ("pending", "running") and owner_alive(
                    r.effect_owner, r.effect_lease, effect_id=r.effect_id
                ):
                    raise InvalidSessionState(
                        f"session {session_id!r}: call {r.effect_id} ({r.tool_name}) is still running; "
                        "roll back after it ends"
                    )
                if r.state == "compensating" and owner_alive(r.owner, r.lease_until, undo_id=r.undo_id):
                    raise InvalidSessionState(f"session {session_id!r} is being rolled back right now")
                comp = self._u.registry.compensations.get(r.compensation_name)
                if comp is None:
                    # Checked for every entry before anything runs: a missing compensation changes nothing.
                    raise CompensationNotFound(r.compensation_name)
                fn, version = comp
                if version != r.compensation_version:
                    err = CompensationVersionMismatch(r.compensation_name, r.compensation_version, version)
                    self._u.engine.halt(conn, session_id, err.message)
                    mismatch: Exception | None = err
                    break
                entries.append(
                    _Entry(r.undo_id, r.effect_id, r.tool_name, r.compensation_name, r.compensation_version,
                           r.args_snapshot, r.result_snapshot if r.effect_state == "committed" else None,
                           r.effect_state, r.attempts, fn, r.state, r.owner)
                )
            else:
                mismatch = None
        if mismatch is not None:
            raise mismatch
        return entries

    def _claim(self, entry: _Entry) -> None:
        """Compare-and-swap on what the plan saw: two rollbacks of one session never run a compensation twice."""
        now = utcnow()
        u = t.undo_stack
        owner_is = u.c.owner.is_(None) if entry.seen_owner is None else u.c.owner == entry.seen_owner
        with self._u.store.tx() as conn:
            res = conn.execute(
                u.update()
                .where(u.c.undo_id == entry.undo_id, u.c.state == entry.seen_state, owner_is)
                .values(state="compensating", owner=self._u.engine.owner,
                        lease_until=now + dt.timedelta(seconds=self._u.lease_seconds), updated_at=now)
            )
            if res.rowcount != 1:
                raise InvalidSessionState(
                    f"undo entry {entry.undo_id} ({entry.compensation_name}) was taken by a concurrent rollback"
                )
        self._u.engine._compensating.add(entry.undo_id)
        self._u.engine._ensure_renewer()

    def _ctx(self, session_id: str, entry: _Entry, attempt: int) -> CompensationContext:
        return CompensationContext(
            args=dict(entry.args), result=entry.result, idempotency_key=f"undo-{entry.undo_id}", attempt=attempt,
            effect_id=entry.effect_id, session_id=session_id, tool_name=entry.tool_name, undo_id=entry.undo_id,
            effect_state=entry.effect_state,
        )

    def _attempted(self, entry: _Entry, error: str) -> None:
        with self._u.store.tx() as conn:
            conn.execute(
                t.undo_stack.update().where(t.undo_stack.c.undo_id == entry.undo_id)
                .values(attempts=t.undo_stack.c.attempts + 1, last_error=error, updated_at=utcnow())
            )

    def _succeeded(self, entry: _Entry) -> None:
        now = utcnow()
        with self._u.store.tx() as conn:
            conn.execute(
                t.undo_stack.update().where(t.undo_stack.c.undo_id == entry.undo_id)
                .values(state="compensated", attempts=t.undo_stack.c.attempts + 1, owner=None, lease_until=None,
                        updated_at=now)
            )
            conn.execute(
                t.effect_log.update().where(t.effect_log.c.effect_id == entry.effect_id)
                .values(state="compensated", owner=None, lease_until=None, updated_at=now)
            )
        self._u.engine._compensating.discard(entry.undo_id)

    def _failed(self, session_id: str, entry: _Entry, error: str) -> str:
        now = utcnow()
        why = (f"compensation {entry.compensation_name} of {entry.tool_name} (effect {entry.effect_id}) failed "
               f"after {self.max_attempts} attempts: {error}")
        with self._u.store.tx() as conn:
            conn.execute(
                t.undo_stack.update().where(t.undo_stack.c.undo_id == entry.undo_id)
                .values(state="compensation_failed", owner=None, lease_until=None, updated_at=now)
            )
            self._u.engine.halt(conn, session_id, why, now=now)
        self._u.engine._compensating.discard(entry.undo_id)
        return why

    def _finish(self, session_id: str, report: RollbackReport, actor: str, reason: str | None) -> None:
        now = utcnow()
        with self._u.store.tx() as conn:
            kept = conn.execute(
                sa.select(t.effect_log.c.effect_id, t.effect_log.c.tool_name).where(
                    t.effect_log.c.session_id == session_id, t.effect_log.c.tier == "irreversible",
                    t.effect_log.c.state == "committed",
                )
            ).all()
            report.kept_irreversible = [f"{k.tool_name} ({k.effect_id})" for k in kept]
            r = t.approval_requests
            waiting = conn.execute(
                sa.select(r.c.approval_request_id, r.c.effect_id).where(
                    r.c.session_id == session_id, r.c.state.in_(("pending", "approved", "auto_approved"))
                )
            ).all()
            for w in waiting:
                self._u.approvals.cancel(conn, w.approval_request_id, w.effect_id, "session rolled back", now)
            conn.execute(
                t.sessions.update().where(t.sessions.c.session_id == session_id)
                .values(state="rolled_back", updated_at=now)
            )
            payload = jsonable({"session_id": session_id, "reason": reason, "steps": [s.__dict__ for s in report.steps],
                                "kept_irreversible": report.kept_irreversible})
            append_event(conn, self._u.store, subject=f"session:{session_id}", action="session.rollback", actor=actor,
                         payload=payload, outbox=[("session.rolled_back", payload)], now=now)
        sc = self._u.engine.cached(session_id)
        if sc is not None:
            sc.state = "rolled_back"
        report.complete = True

    # -- the walk, sync and async ----------------------------------------------------------------

    def rollback_sync(
        self,
        session_id: str,
        *,
        reason: str | None = None,
        actor: str = "undolog",
        progress: Callable[[int, int, RollbackStep], None] | None = None,
        only_effect: str | None = None,
    ) -> RollbackReport:
        lock = self._lock_for(session_id)
        with lock:
            return self._rollback_sync(session_id, reason=reason, actor=actor, progress=progress,
                                       only_effect=only_effect)

    def _rollback_sync(
        self,
        session_id: str,
        *,
        reason: str | None,
        actor: str,
        progress: Callable[[int, int, RollbackStep], None] | None,
        only_effect: str | None,
    ) -> RollbackReport:
        plan = self._plan(session_id, only_effect)
        if isinstance(plan, RollbackReport):
            return plan
        report = RollbackReport(session_id)
        for i, entry in enumerate(plan):
            self._claim(entry)
            fault(FaultPoint.DURING_ROLLBACK)
            error: str | None = None
            attempt = entry.attempts
            for n in range(self.max_attempts):
                attempt += 1
                try:
                    _call_sync(entry.fn, self._ctx(session_id, entry, attempt))
                    fault(FaultPoint.AFTER_COMPENSATION)
                    error = None
                    break
                except Exception as exc:  # noqa: BLE001 - recorded, retried, then halts the session
                    error = f"{type(exc).__name__}: {exc}"
                    self._attempted(entry, error)
                    if n + 1 < self.max_attempts:
                        time.sleep(self.backoff_seconds * (2**n))
            if not self._record(session_id, entry, error, report, attempt):
                if progress:
                    progress(i + 1, len(plan), report.steps[-1])
                return report
            if progress:
                progress(i + 1, len(plan), report.steps[-1])
            if i + 1 < len(plan):
                fault(FaultPoint.BETWEEN_COMPENSATIONS)
        if only_effect is None:
            self._finish(session_id, report, actor, reason)
        return report

    async def rollback(
        self,
        session_id: str,
        *,
        reason: str | None = None,
        actor: str = "undolog",
        progress: Callable[[int, int, RollbackStep], None] | None = None,
    ) -> RollbackReport:
        lock = self._lock_for(session_id)
        # A task must not block its event loop on a thread lock: poll for it instead.
        while not lock.acquire(blocking=False):
            await asyncio.sleep(0.005)
        try:
            return await self._rollback_async(session_id, reason=reason, actor=actor, progress=progress)
        finally:
            lock.release()

    async def _rollback_async(
        self,
        session_id: str,
        *,
        reason: str | None,
        actor: str,
        progress: Callable[[int, int, RollbackStep], None] | None,
    ) -> RollbackReport:
        plan = self._plan(session_id)
        if isinstance(plan, RollbackReport):
            return plan
        report = RollbackReport(session_id)
        for i, entry in enumerate(plan):
            self._claim(entry)
            fault(FaultPoint.DURING_ROLLBACK)
            error: str | None = None
            attempt = entry.attempts
            for n in range(self.max_attempts):
                attempt += 1
                try:
                    out = entry.fn(self._ctx(session_id, entry, attempt))
                    if inspect.isawaitable(out):
                        await out
                    fault(FaultPoint.AFTER_COMPENSATION)
                    error = None
                    break
                except Exception as exc:  # noqa: BLE001 - recorded, retried, then halts the session
                    error = f"{type(exc).__name__}: {exc}"
                    self._attempted(entry, error)
                    if n + 1 < self.max_attempts:
                        await asyncio.sleep(self.backoff_seconds * (2**n))
            if not self._record(session_id, entry, error, report, attempt):
                if progress:
                    progress(i + 1, len(plan), report.steps[-1])
                return report
            if progress:
                progress(i + 1, len(plan), report.steps[-1])
            if i + 1 < len(plan):
                fault(FaultPoint.BETWEEN_COMPENSATIONS)
        self._finish(session_id, report, actor, reason)
        return report

    def _record(self, session_id: str, entry: _Entry, error: str | None, report: RollbackReport, attempt: int) -> bool:
        if error is None:
            self._succeeded(entry)
            report.steps.append(RollbackStep(entry.undo_id, entry.effect_id, entry.tool_name, entry.compensation_name,
                                             "compensated", attempt))
            return True
        why = self._failed(session_id, entry, error)
        report.steps.append(RollbackStep(entry.undo_id, entry.effect_id, entry.tool_name, entry.compensation_name,
                                         "compensation_failed", attempt, error))
        report.halted_reason = why
        return False

    def halt_unrolled(self, session_id: str, why: str, error: BaseException) -> None:
        """The policy asked for a rollback that could not run (a call still in flight, a missing compensation):
        the session must not carry on as if nothing failed, so it halts for a person."""
        try:
            with self._u.store.tx() as conn:
                self._u.engine.halt(conn, session_id, f"{why}; the rollback could not run: {error}")
        except Exception as exc:  # noqa: BLE001 - the caller is already raising the user's exception
            error.add_note(f"undolog: could not halt session {session_id} either: {exc}")

    def undo_plan(self, session_id: str) -> list[dict[str, Any]]:
        """Which compensations would run, in order, if the session rolled back now."""
        u, e = t.undo_stack, t.effect_log
        with self._u.store.read() as conn:
            rows = conn.execute(
                sa.select(u.c.undo_id, u.c.compensation_name, u.c.compensation_version, u.c.state, e.c.tool_name,
                          e.c.effect_id, e.c.state.label("effect_state"))
                .select_from(e.join(u, u.c.undo_id == e.c.seq))
                .where(e.c.session_id == session_id, u.c.state != "compensated")
                .order_by(u.c.undo_id.desc())
            ).all()
        return [dict(r._mapping) for r in rows]


def _call_sync(fn: Callable[..., Any], ctx: Any) -> Any:
    out = fn(ctx)
    if inspect.isawaitable(out):
        return run_coro_blocking(out)
    return out


def run_coro_blocking(coro: Any) -> Any:
    """Run a coroutine from sync code, even when this thread already has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}
    # The worker thread runs in a copy of the caller's context, so current_call() still answers in the tool.
    ctx = contextvars.copy_context()

    def runner() -> None:
        try:
            box["v"] = ctx.run(asyncio.run, coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["e"] = exc

    th = threading.Thread(target=runner)
    th.start()
    th.join()
    if "e" in box:
        raise box["e"]
    return box.get("v")
