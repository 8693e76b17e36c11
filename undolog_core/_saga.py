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

    def _plan(
        self, session_id: str, only_effect: str | None = None, *, actor: str = "undolog", reason: str | None = None
    ) -> RollbackReport | list[_Entry]:
        """What to compensate, newest first; for a session rollback, the durable intent is written here too.

        Everything that can refuse the rollback (a call still running, a compensation missing) is checked before
        the intent is written, so a refused rollback changes nothing. ``only_effect`` (recovery of one in-doubt
        call) writes no intent and leaves the session's state alone.
        """
        self._u.engine.flush_marks()
        store = self._u.store
        engine = self._u.engine
        u, e = t.undo_stack, t.effect_log
        with store.tx() as conn:
            sess = conn.execute(
                store.for_update(sa.select(t.sessions).where(t.sessions.c.session_id == session_id))
            ).first()
            if sess is None:
                raise SessionNotFound(session_id)
            if sess.state == "rolled_back" and only_effect is None:
                return RollbackReport(session_id, already_rolled_back=True, complete=True)
            intent = None
            if only_effect is None:
                intent = conn.execute(
                    sa.select(t.rollbacks).where(t.rollbacks.c.session_id == session_id)
                ).first()
                if intent is not None and intent.owner != engine.owner and owner_alive(
                    intent.owner, intent.lease_until, rolling=session_id
                ):
                    raise InvalidSessionState(f"session {session_id!r} is being rolled back right now")
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
                    engine.halt(conn, session_id, err.message)
                    if intent is not None:  # halted for a person: recovery must not take it up again
                        conn.execute(t.rollbacks.delete().where(t.rollbacks.c.session_id == session_id))
                    mismatch: Exception | None = err
                    break
                entries.append(
                    _Entry(r.undo_id, r.effect_id, r.tool_name, r.compensation_name, r.compensation_version,
                           r.args_snapshot, r.result_snapshot if r.effect_state == "committed" else None,
                           r.effect_state, r.attempts, fn, r.state, r.owner)
                )
            else:
                mismatch = None
                if only_effect is None:
                    self._write_intent(conn, session_id, intent, actor, reason)
        if mismatch is not None:
            raise mismatch
        if only_effect is None:
            fault(FaultPoint.ROLLBACK_REQUESTED)
        return entries

    def _write_intent(self, conn: Any, session_id: str, intent: Any, actor: str, reason: str | None) -> None:
        """The rollback is requested, durably, before its first compensation: from here on the session takes no
        call, and a crash at any point of the walk is finished by ``recover()``."""
        engine = self._u.engine
        now = utcnow()
        lease = now + dt.timedelta(seconds=self._u.lease_seconds)
        if intent is None:
            conn.execute(t.rollbacks.insert().values(session_id=session_id, actor=actor, reason=reason,
                                                     owner=engine.owner, lease_until=lease, requested_at=now))
        else:  # taking over a rollback whose walker is gone (or our own, left by an error)
            conn.execute(t.rollbacks.update().where(t.rollbacks.c.session_id == session_id)
                         .values(owner=engine.owner, lease_until=lease))
        conn.execute(
            t.sessions.update()
            .where(t.sessions.c.session_id == session_id, t.sessions.c.state.notin_(("rolled_back", "rolling_back")))
            .values(state="rolling_back", updated_at=now)
        )
        engine.rolling(session_id)

    def _end_intent(self, conn: Any, session_id: str) -> None:
        conn.execute(t.rollbacks.delete().where(t.rollbacks.c.session_id == session_id))

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
            # The walk stops here, halted for a person; a later rollback resumes where it stopped.
            self._end_intent(conn, session_id)
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
            self._end_intent(conn, session_id)
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
            walk = _Walk(self, session_id, actor, reason, progress, only_effect)
            plan = walk.start()
            if isinstance(plan, RollbackReport):
                return plan
            try:
                for entry in plan:
                    walk.claim(entry)
                    error: str | None = None
                    for n in range(self.max_attempts):
                        try:
                            _call_sync(entry.fn, walk.context(entry))
                            fault(FaultPoint.AFTER_COMPENSATION)
                            error = None
                            break
                        except Exception as exc:  # noqa: BLE001 - recorded, retried, then halts the session
                            error = walk.attempt_failed(entry, exc)
                            if n + 1 < self.max_attempts:
                                time.sleep(self.backoff_seconds * (2**n))
                    if not walk.step_done(entry, error):
                        return walk.report
                return walk.finish()
            finally:
                walk.close()

    async def rollback(
        self,
        session_id: str,
        *,
        reason: str | None = None,
        actor: str = "undolog",
        progress: Callable[[int, int, RollbackStep], None] | None = None,
    ) -> RollbackReport:
        """The async twin of :meth:`rollback_sync`: the same walk, awaiting async compensations on this loop."""
        lock = self._lock_for(session_id)
        # A task must not block its event loop on a thread lock: poll for it instead.
        while not lock.acquire(blocking=False):
            await asyncio.sleep(0.005)
        # The walk's durable steps run in a worker thread: the loop never waits on the store.
        step = asyncio.to_thread
        try:
            walk = _Walk(self, session_id, actor, reason, progress, None)
            plan = await step(walk.start)
            if isinstance(plan, RollbackReport):
                return plan
            try:
                for entry in plan:
                    await step(walk.claim, entry)
                    error: str | None = None
                    for n in range(self.max_attempts):
                        try:
                            out = entry.fn(walk.context(entry))
                            if inspect.isawaitable(out):
                                await out
                            fault(FaultPoint.AFTER_COMPENSATION)
                            error = None
                            break
                        except Exception as exc:  # noqa: BLE001 - recorded, retried, then halts the session
                            error = await step(walk.attempt_failed, entry, exc)
                            if n + 1 < self.max_attempts:
                                await asyncio.sleep(self.backoff_seconds * (2**n))
                    if not await step(walk.step_done, entry, error):
                        return walk.report
                return await step(walk.finish)
            finally:
                walk.close()
        finally:
            lock.release()

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


class _Walk:
    """One rollback's walk, shared by the sync and the async driver: they differ only in how a compensation is
    called and how they wait between attempts. Every durable step (intent, claim, attempt, outcome, end) is here."""

    def __init__(self, saga: Saga, session_id: str, actor: str, reason: str | None,
                 progress: Callable[[int, int, RollbackStep], None] | None, only_effect: str | None) -> None:
        self.saga = saga
        self.session_id = session_id
        self.actor = actor
        self.reason = reason
        self.progress = progress
        self.only_effect = only_effect
        self.report = RollbackReport(session_id)
        self.total = 0
        self.attempt = 0
        self.claimed: _Entry | None = None

    def start(self) -> RollbackReport | list[_Entry]:
        plan = self.saga._plan(self.session_id, self.only_effect, actor=self.actor, reason=self.reason)
        if not isinstance(plan, RollbackReport):
            self.total = len(plan)
        return plan

    def claim(self, entry: _Entry) -> None:
        if self.report.steps:
            fault(FaultPoint.BETWEEN_COMPENSATIONS)
        self.saga._claim(entry)
        self.claimed = entry
        self.attempt = entry.attempts
        fault(FaultPoint.DURING_ROLLBACK)

    def context(self, entry: _Entry) -> CompensationContext:
        self.attempt += 1
        return self.saga._ctx(self.session_id, entry, self.attempt)

    def attempt_failed(self, entry: _Entry, exc: Exception) -> str:
        error = f"{type(exc).__name__}: {exc}"
        self.saga._attempted(entry, error)
        return error

    def step_done(self, entry: _Entry, error: str | None) -> bool:
        ok = self.saga._record(self.session_id, entry, error, self.report, self.attempt)
        self.claimed = None
        if self.progress:
            self.progress(len(self.report.steps), self.total, self.report.steps[-1])
        return ok

    def finish(self) -> RollbackReport:
        if self.only_effect is None:
            self.saga._finish(self.session_id, self.report, self.actor, self.reason)
        return self.report

    def close(self) -> None:
        """However the walk ended, this process no longer works on it: an entry or an intent left behind (an
        error, a cancelled task) counts as abandoned, so recovery or the next rollback takes it over."""
        engine = self.saga._u.engine
        if self.claimed is not None:
            engine._compensating.discard(self.claimed.undo_id)
        if self.only_effect is None:
            engine.rolling(self.session_id, done=True)


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
