"""The saga orchestrator: walks a session's undo stack LIFO and records each compensation's outcome."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import inspect
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from . import _observe as obs
from ._faults import FaultPoint, fault
from ._json import jsonable
from ._leases import Leases, owner_alive
from .errors import (
    CompensationNotFound,
    CompensationVersionMismatch,
    InvalidSessionState,
    SessionNotFound,
)
from .limits import check_identity, clean_text
from .storage.base import utcnow
from .storage.schema import IN_FLIGHT, EffectState, SessionState, UndoState

if TYPE_CHECKING:
    from ._registry import Registry
    from .storage import Storage as SagaStore


class ApprovalCanceller(Protocol):
    def cancel(self, conn: Any, request_id: str, effect_id: str, why: str, now: dt.datetime) -> None: ...


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
    # Run by the live process serving the session (its owner), for the requester (see ``_owners.py``).
    ran_by: str | None = None
    # A process served the session, but it was gone: the requester ran it against connections of its own.
    ran_without_live_upstream: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = {
            "session_id": self.session_id,
            "already_rolled_back": self.already_rolled_back,
            "complete": self.complete,
            "halted_reason": self.halted_reason,
            "kept_irreversible": self.kept_irreversible,
            "steps": [s.__dict__ for s in self.steps],
        }
        if self.ran_by is not None:
            out["ran_by"] = self.ran_by
        if self.ran_without_live_upstream:
            out["ran_without_live_upstream"] = True
        return out


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

    Its collaborators are explicit: the storage (every statement), the registry (the compensations), the leases
    (who this process is and what it is compensating), and two hooks into the engine's in-memory session cache.

    Example:
        >>> report = undolog.rollback(session_id)
        >>> [s.outcome for s in report.steps]
        ['compensated', 'compensated']
    """

    max_attempts = 3
    backoff_seconds = 0.05

    def __init__(
        self,
        store: SagaStore,
        registry: Registry,
        leases: Leases,
        approvals: ApprovalCanceller,
        *,
        flush_marks: Callable[[], None],
        note_state: Callable[[str, str], None],
        persist: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._registry = registry
        self._leases = leases
        self._approvals = approvals
        self._flush_marks = flush_marks
        # Writes a session this process started and has not written yet, so that a rollback finds it.
        self._persist = persist or (lambda session_id: None)
        self._note_state = note_state
        # session id -> [its lock, how many callers hold it or wait for it]: an entry lives only while it is in use
        # (a process that rolls back millions of sessions over its life keeps none of their locks).
        self._locks: dict[str, list[Any]] = {}
        self._locks_guard = threading.Lock()

    def _lock_for(self, session_id: str) -> threading.Lock:
        """The session's walk lock, counted as in use by the caller until it calls :meth:`_done_with`.

        One walk per session in this process; across processes the claims' compare-and-swap decides."""
        with self._locks_guard:
            entry = self._locks.get(session_id)
            if entry is None:
                entry = self._locks[session_id] = [threading.Lock(), 0]
            entry[1] += 1
            lock: threading.Lock = entry[0]
            return lock

    def _done_with(self, session_id: str) -> None:
        with self._locks_guard:
            entry = self._locks[session_id]
            entry[1] -= 1
            if entry[1] == 0:  # nobody holds or waits for it: a later caller makes a new one
                del self._locks[session_id]

    @contextlib.contextmanager
    def _walking(self, session_id: str) -> Iterator[None]:
        lock = self._lock_for(session_id)
        try:
            with lock:
                yield
        finally:
            self._done_with(session_id)

    # -- planning --------------------------------------------------------------------------------

    def _plan(
        self, session_id: str, only_effect: str | None = None, *, actor: str = "undolog", reason: str | None = None
    ) -> RollbackReport | list[_Entry]:
        """What to compensate, newest first; for a session rollback, the durable intent is written here too.

        Everything that can refuse the rollback (a call still running, a compensation missing) is checked before
        the intent is written, so a refused rollback changes nothing. ``only_effect`` (recovery of one in-doubt
        call) writes no intent and leaves the session's state alone.
        """
        self._persist(session_id)
        self._flush_marks()
        store = self._store
        leases = self._leases
        mismatch: Exception | None = None
        with store.tx() as conn:
            sess = store.sessions.lock_session_in(conn, session_id)
            if sess is None:
                raise SessionNotFound(session_id)
            if sess.state == SessionState.ROLLED_BACK and only_effect is None:
                return RollbackReport(session_id, already_rolled_back=True, complete=True)
            intent = None
            if only_effect is None:
                intent = store.sessions.rollback_intent_in(conn, session_id)
                if intent is not None and intent.owner != leases.owner and owner_alive(
                    intent.owner, intent.lease_until, rolling=session_id
                ):
                    raise InvalidSessionState(f"session {session_id!r} is being rolled back right now")
            entries: list[_Entry] = []
            for r in store.undo.undo_entries_in(conn, session_id, only_effect):
                if r.effect_id == only_effect:
                    pass  # recovery holds this effect's claim itself
                elif r.effect_state in IN_FLIGHT and owner_alive(r.effect_owner, r.effect_lease, effect_id=r.effect_id):
                    raise InvalidSessionState(
                        f"session {session_id!r}: call {r.effect_id} ({r.tool_name}) is still running; "
                        "roll back after it ends"
                    )
                if r.state == UndoState.COMPENSATING and owner_alive(r.owner, r.lease_until, undo_id=r.undo_id):
                    raise InvalidSessionState(f"session {session_id!r} is being rolled back right now")
                comp = self._registry.compensations.get(r.compensation_name)
                if comp is None:
                    # Checked for every entry before anything runs: a missing compensation changes nothing.
                    raise CompensationNotFound(r.compensation_name)
                fn, version = comp
                if version != r.compensation_version:
                    mismatch = CompensationVersionMismatch(r.compensation_name, r.compensation_version, version)
                    store.sessions.halt_in(conn, session_id, mismatch.message, utcnow())
                    if intent is not None:  # halted for a person: recovery must not take it up again
                        store.sessions.end_intent_in(conn, session_id)
                    break
                entries.append(
                    _Entry(r.undo_id, r.effect_id, r.tool_name, r.compensation_name, r.compensation_version,
                           r.args_snapshot, r.result_snapshot if r.effect_state == EffectState.COMMITTED else None,
                           r.effect_state, r.attempts, fn, r.state, r.owner)
                )
            if mismatch is None and only_effect is None:
                # The rollback is requested, durably, before its first compensation: from here on the session
                # takes no call, and a crash at any point of the walk is finished by recover().
                now = utcnow()
                store.sessions.write_intent_in(conn, session_id, exists=intent is not None, actor=actor, reason=reason,
                                      owner=leases.owner, lease_until=leases.until(), now=now)
        if mismatch is not None:
            self._note_state(session_id, SessionState.HALTED)
            obs.saga_log.warning("halt: session %s halted before its rollback: %s", session_id, mismatch,
                                 extra=obs.ids(session_id))
            raise mismatch
        if only_effect is None:
            leases.rolling.add(session_id)
            leases.start()
            self._note_state(session_id, SessionState.ROLLING_BACK)
            fault(FaultPoint.ROLLBACK_REQUESTED)
        return entries

    def _claim(self, entry: _Entry) -> None:
        if not self._store.undo.claim_undo(entry.undo_id, seen_state=entry.seen_state, seen_owner=entry.seen_owner,
                                      owner=self._leases.owner, lease_until=self._leases.until()):
            raise InvalidSessionState(
                f"undo entry {entry.undo_id} ({entry.compensation_name}) was taken by a concurrent rollback"
            )
        self._leases.compensating.add(entry.undo_id)
        self._leases.start()

    def _ctx(self, session_id: str, entry: _Entry, attempt: int) -> CompensationContext:
        return CompensationContext(
            args=dict(entry.args), result=entry.result, idempotency_key=f"undo-{entry.undo_id}", attempt=attempt,
            effect_id=entry.effect_id, session_id=session_id, tool_name=entry.tool_name, undo_id=entry.undo_id,
            effect_state=entry.effect_state,
        )

    def _attempted(self, entry: _Entry, error: str) -> None:
        self._store.undo.undo_attempt_failed(entry.undo_id, error)

    def _succeeded(self, entry: _Entry) -> None:
        self._store.effects.undo_compensated(entry.undo_id, entry.effect_id, in_flight=entry.effect_state in IN_FLIGHT)
        self._leases.compensating.discard(entry.undo_id)

    def _failed(self, session_id: str, entry: _Entry, error: str) -> str:
        now = utcnow()
        why = (f"compensation {entry.compensation_name} of {entry.tool_name} (effect {entry.effect_id}) failed "
               f"after {self.max_attempts} attempts: {error}")
        with self._store.tx() as conn:
            self._store.undo.undo_failed_in(conn, entry.undo_id, now)
            # The walk stops here, halted for a person; a later rollback resumes where it stopped.
            self._store.sessions.end_intent_in(conn, session_id)
            self._store.sessions.halt_in(conn, session_id, why, now)
        self._note_state(session_id, SessionState.HALTED)
        self._leases.compensating.discard(entry.undo_id)
        return why

    def _finish(self, session_id: str, report: RollbackReport, actor: str, reason: str | None) -> None:
        now = utcnow()
        store = self._store
        with store.tx() as conn:
            report.kept_irreversible = [f"{k.tool_name} ({k.effect_id})"
                                        for k in store.effects.kept_irreversible_in(conn, session_id)]
            for w in store.approvals.unsettled_requests_in(conn, session_id):
                self._approvals.cancel(conn, w.approval_request_id, w.effect_id, "session rolled back", now)
            store.sessions.mark_rolled_back_in(conn, session_id, now)
            payload = jsonable({"session_id": session_id, "reason": reason, "steps": [s.__dict__ for s in report.steps],
                                "kept_irreversible": report.kept_irreversible})
            store.audit.append_event_in(conn, subject=f"session:{session_id}", action="session.rollback", actor=actor,
                                  payload=payload, outbox=[("session.rolled_back", payload)], now=now)
        self._note_state(session_id, SessionState.ROLLED_BACK)
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
        check_identity("actor", actor)
        reason = _reason_text(reason)
        with self._walking(session_id), _rollback_span(session_id, actor, reason, only_effect) as rs:
            walk = _Walk(self, session_id, actor, reason, progress, only_effect)
            plan = walk.start()
            if isinstance(plan, RollbackReport):
                return plan
            try:
                for entry in plan:
                    walk.claim(entry)
                    error: str | None = None
                    with _compensation_span(session_id, entry) as cs:
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
                        _compensated(cs, walk.attempt, error)
                    if not walk.step_done(entry, error):
                        return _rolled(rs, walk.report)
                return _rolled(rs, walk.finish())
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
        check_identity("actor", actor)
        reason = _reason_text(reason)
        lock = self._lock_for(session_id)
        # A task must not block its event loop on a thread lock: poll for it instead.
        try:
            while not lock.acquire(blocking=False):
                await asyncio.sleep(0.005)
        except BaseException:  # cancelled while waiting
            self._done_with(session_id)
            raise
        # The walk's durable steps run in a worker thread: the loop never waits on the store.
        step = asyncio.to_thread
        try:
            with _rollback_span(session_id, actor, reason, None) as rs:
                walk = _Walk(self, session_id, actor, reason, progress, None)
                plan = await step(walk.start)
                if isinstance(plan, RollbackReport):
                    return plan
                try:
                    for entry in plan:
                        await step(walk.claim, entry)
                        error: str | None = None
                        with _compensation_span(session_id, entry) as cs:
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
                            _compensated(cs, walk.attempt, error)
                        if not await step(walk.step_done, entry, error):
                            return _rolled(rs, walk.report)
                    return _rolled(rs, await step(walk.finish))
                finally:
                    walk.close()
        finally:
            lock.release()
            self._done_with(session_id)

    def _record(self, session_id: str, entry: _Entry, error: str | None, report: RollbackReport, attempt: int) -> bool:
        if error is None:
            self._succeeded(entry)
            report.steps.append(RollbackStep(entry.undo_id, entry.effect_id, entry.tool_name, entry.compensation_name,
                                             "compensated", attempt))
            obs.saga_log.info("compensated: %s undid %s (session %s, effect %s, undo %s, attempt %s)",
                              entry.compensation_name, entry.tool_name, session_id, entry.effect_id, entry.undo_id,
                              attempt, extra=obs.ids(session_id, entry.effect_id))
            return True
        why = self._failed(session_id, entry, error)
        report.steps.append(RollbackStep(entry.undo_id, entry.effect_id, entry.tool_name, entry.compensation_name,
                                         "compensation_failed", attempt, error))
        report.halted_reason = why
        obs.count_compensation_failure(entry.compensation_name, entry.tool_name)
        obs.saga_log.error("compensation failed: %s could not undo %s (session %s, effect %s, undo %s): %s",
                           entry.compensation_name, entry.tool_name, session_id, entry.effect_id, entry.undo_id,
                           error, extra=obs.ids(session_id, entry.effect_id))
        obs.saga_log.warning("halt: session %s halted: %s", session_id, why,
                             extra=obs.ids(session_id, entry.effect_id))
        return False

    def halt_unrolled(self, session_id: str, why: str, error: BaseException) -> None:
        """The policy asked for a rollback that could not run (a call still in flight, a missing compensation):
        the session must not carry on as if nothing failed, so it halts for a person."""
        try:
            with self._store.tx() as conn:
                # A failure requests its policy's rollback with itself (``CompensablePath.record_failure``). A plan that
                # refused (a call still running, a compensation missing) compensated nothing: that request, ours,
                # ends with the halt, so that recovery does not roll back a session left for a person. A walk
                # that broke off (the database went away) keeps it: recovery finishes that walk, as it would any.
                if isinstance(error, (InvalidSessionState, CompensationNotFound)):
                    self._store.sessions.end_intent_in(conn, session_id, owner=self._leases.owner)
                self._store.sessions.halt_in(conn, session_id, clean_text(f"{why}; the rollback could not run: {error}"),
                                    utcnow())
            self._note_state(session_id, SessionState.HALTED)
            obs.saga_log.warning("halt: session %s halted: %s; the rollback could not run: %s", session_id, why,
                                 error, extra=obs.ids(session_id))
        except Exception as exc:  # noqa: BLE001 - the caller is already raising the user's exception
            error.add_note(f"undolog: could not halt session {session_id} either: {exc}")

    def undo_plan(self, session_id: str) -> list[dict[str, Any]]:
        """Which compensations would run, in order, if the session rolled back now."""
        return self._store.undo.undo_plan(session_id)


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
            what = f"effect {self.only_effect}" if self.only_effect else f"session {self.session_id}"
            obs.saga_log.info("rollback: %s, %d compensation(s) to run, by %s (%s)", what, len(plan), self.actor,
                              self.reason or "no reason given", extra=obs.ids(self.session_id, self.only_effect))
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
        error = clean_text(f"{type(exc).__name__}: {exc}")  # stored as text: never a surrogate or a NUL
        self.saga._attempted(entry, error)
        obs.saga_log.warning("compensation attempt %d of %s for %s failed (session %s, effect %s): %s", self.attempt,
                             entry.compensation_name, entry.tool_name, self.session_id, entry.effect_id, error,
                             extra=obs.ids(self.session_id, entry.effect_id))
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
            obs.saga_log.info("rollback: session %s rolled back (%d compensated; irreversible steps kept: %s)",
                              self.session_id, len(self.report.steps), ", ".join(self.report.kept_irreversible)
                              or "none", extra=obs.ids(self.session_id))
        return self.report

    def close(self) -> None:
        """However the walk ended, this process no longer works on it: an entry or an intent left behind (an
        error, a cancelled task) counts as abandoned, so recovery or the next rollback takes it over."""
        leases = self.saga._leases
        if self.claimed is not None:
            leases.compensating.discard(self.claimed.undo_id)
        if self.only_effect is None:
            leases.rolling.discard(self.session_id)


def _reason_text(reason: str | None) -> str | None:
    """A rollback's reason as stored (the intent, the audit event): often an exception's text (``Session`` left by
    one), which may hold a lone surrogate or a NUL; refused by the store, it would fail the very rollback it
    explains, and the halt after it."""
    return None if reason is None else clean_text(reason)


def _rollback_span(session_id: str, actor: str, reason: str | None, only_effect: str | None) -> Any:
    return obs.span("undolog.rollback", {obs.A_SESSION: session_id, "undolog.actor": actor,
                                         "undolog.reason": reason, obs.A_EFFECT: only_effect})


def _compensation_span(session_id: str, entry: _Entry) -> Any:
    return obs.span(f"undolog.compensate {entry.compensation_name}", {
        obs.A_COMPENSATION: entry.compensation_name, "undolog.compensation.version": entry.compensation_version,
        obs.A_TOOL_NAME: entry.tool_name, obs.A_SESSION: session_id, obs.A_EFFECT: entry.effect_id,
        "undolog.undo_id": entry.undo_id})


def _compensated(s: Any, attempts: int, error: str | None) -> None:
    s.set_attribute("undolog.attempts", attempts)
    s.set_attribute(obs.A_OUTCOME, "compensated" if error is None else "compensation_failed")
    if error is not None:
        obs.failed(s, error, error_type="compensation_failed")


def _rolled(s: Any, report: RollbackReport) -> RollbackReport:
    """Count the rollback and name its outcome on its span (a walk refused before it began is not counted)."""
    outcome = "complete" if report.complete else "halted"
    s.set_attribute(obs.A_OUTCOME, outcome)
    s.set_attribute("undolog.compensations", len(report.steps))
    obs.count_rollback(outcome)
    if not report.complete:
        obs.failed(s, report.halted_reason or "the rollback halted", error_type="rollback_halted")
    return report


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
