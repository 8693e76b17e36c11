"""The mark queue: commit marks the engine could not write durably at once (fast mode's, or a mark a dropped
connection held back), written in batches by a flusher thread or by the first reader; and the late finishes, a
call that returned after another process took it over, recorded (never lost) when its fenced mark lands nowhere.
The engine (``_engine.Engine``) holds one and binds its ``complete`` as its own (``engine.complete``)."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from . import _faults
from ._faults import FaultPoint, fault
from ._leases import LazyLoop, Leases
from ._observe import engine_log, ids
from .errors import DatabaseUnavailable, EffectNotFound, InvalidEffectState, OutcomeConflict
from .limits import result_text
from .storage.base import from_epoch, utcnow
from .storage.effects import LATE_FINISH_STATES, LateFinish
from .storage.hotpath import HotPath
from .storage.pool import WouldBlock
from .storage.schema import EffectState, SessionState

if TYPE_CHECKING:
    from ._sessions_table import SessionTable
    from .storage import Storage

_T = TypeVar("_T")

MARK_FLUSH_SECONDS = 0.05
#: Pauses between the commit mark's attempts after the database dropped the connection (None: the last attempt,
#: after which the mark is deferred). About a second in all: a caller told "done" by a deferred mark that later finds
#: its call taken over can only learn of it at its next call, so the mark is worth a short wait.
MARK_RETRY_PAUSES: tuple[float | None, ...] = (0.05, 0.2, 0.75, None)


def on_a_fresh_connection(write: Callable[[], _T]) -> _T:
    """``write()``, asked again after each of ``MARK_RETRY_PAUSES`` while the database does not answer: a dropped
    connection (a restart, ``pg_terminate_backend``) takes the pool's other connections with it, so a moment, then a
    fresh one. The last ``DatabaseUnavailable`` is raised; any other error at once."""
    for pause in MARK_RETRY_PAUSES:
        try:
            return write()
        except DatabaseUnavailable:
            if pause is None:
                raise
            time.sleep(pause)
    raise AssertionError("unreachable: the last pause is None")


def missing_or_moved(effect_id: str, state: str, target: str) -> None:
    """Raise the error of an effect that was not found (``state`` empty) or is in ``state``, not one that can
    become ``target``."""
    if not state:
        raise EffectNotFound(effect_id)
    raise InvalidEffectState(f"effect {effect_id} is {state}; it cannot become {target}")


class MarkQueue:
    """The deferred commit marks of this process (oldest first) and the late finishes they may turn out to be.

    ``UndoLog.engine`` holds one (``engine.mark_queue``): ``complete`` (bound as ``engine.complete``) writes a
    commit mark by the hot path's one statement, queues fast mode's here, or writes durably one the hot path could
    not (``mark_durably``); readers in this process write the queue first (``flush``, bound as ``engine.flush_marks``).

    Example:
        >>> undolog.engine.mark_queue.flush()    # every queued mark written now
    """

    def __init__(self, store: Storage, hot: HotPath, leases: Leases, table: SessionTable, *,
                 fast_commit_mark: bool = False) -> None:
        self.store = store
        self.hot = hot
        self.leases = leases
        self._inflight = leases.inflight
        self.fast_commit_mark = fast_commit_mark
        # The session table, told when a late finish halts a session (the session's record follows the store).
        self._table = table
        # Deferred commit marks (fast mode, or a mark a dropped connection held back) wait here for the flusher (a
        # batch, not fsynced, once the oldest queued mark is MARK_FLUSH_SECONDS old, unless a reader or the
        # session's end wrote them first). Their effects stay in flight (leased) until written. Never rebound: the
        # engine's gate appends to the same deque (``Engine._marks``) on fast mode's every call.
        self.queue: collections.deque[tuple[str, str, float]] = collections.deque()  # (effect, result, epoch s)
        self._marks_lock = threading.Lock()
        self.flusher = LazyLoop("undolog-marks", MARK_FLUSH_SECONDS, self._flush_due_marks)
        #: Asked after a late finish is recorded, ``(effect_id, late)``: the tool's probe, its answer recorded as an
        #: audit event on the effect, settling nothing (the facade binds recovery's ``probe_late_finish``); the
        #: answer (``happened``, ``not_happened``, ``cant_tell``, ``error``) or None without a probe.
        self.on_late_finish: Callable[[str, LateFinish], str | None] | None = None

    def complete(self, effect_id: str, result: Any, *, wait: bool = True) -> None:
        """Record success: the effect becomes ``committed`` with its result snapshot (bound as ``engine.complete``:
        the hot path's one statement, fast mode's queued mark, or ``mark_durably``).

        ``wait=False`` raises ``WouldBlock`` (nothing written) instead of waiting for a connection or a lock.
        """
        if _faults._armed is not None:
            fault(FaultPoint.AFTER_TOOL)
        text = result_text(result)
        now = time.time()
        if self.fast_commit_mark:
            self.queue.append((effect_id, text, now))
            if _faults._armed is not None:
                fault(FaultPoint.AFTER_MARK_QUEUED)
            self.flusher.ensure()
            return
        try:
            if self.hot.mark(effect_id, text, now, fast=False, wait=wait):
                self._inflight.discard(effect_id)
                return
        except DatabaseUnavailable:
            if not wait:
                raise WouldBlock() from None  # nothing written: asked again with wait=True (in a thread), below
            # A dropped connection (a server restart, pg_terminate_backend) is asked again below on a fresh one:
            # deferred at once, a mark that then finds the call taken over could only tell a caller already
        if not wait:
            raise WouldBlock()  # not in flight any more: the precise error needs a transaction, in a thread
        self.mark_durably(effect_id, text, now)

    def mark_durably(self, effect_id: str, text: str, now: float) -> None:
        """The commit mark the hot path did not write (the database dropped the connection, or the call is not in
        flight here any more), written by a transaction of its own, asked again on a fresh connection while the
        database does not answer, and deferred (queued) after the last attempt. A call taken over meanwhile is a
        late finish (``OutcomeConflict``); one that is not in flight raises why."""
        try:
            state = on_a_fresh_connection(lambda: self.store.effects.mark_committed(
                effect_id, text, from_epoch(now), fast=self.fast_commit_mark, owner=self.leases.owner))
        except DatabaseUnavailable:
            self.defer(effect_id, text, now)  # still in flight: not discarded from _inflight
            return
        except BaseException:
            self._inflight.discard(effect_id)
            raise
        try:
            if state in LATE_FINISH_STATES:
                self._finished_late(effect_id, text, now)
                return
            if state == EffectState.COMMITTED.value:
                return  # taken over, and its probe proved the call happened: the caller's "done" agrees
        finally:
            self._inflight.discard(effect_id)
        if state is not None:
            missing_or_moved(effect_id, state, EffectState.COMMITTED)

    def defer(self, effect_id: str, text: str, now: float) -> None:
        """The database did not answer the commit mark: the tool ran, and its result must not be lost. The mark
        waits in the deferred queue (as in fast mode), retried until the database answers, fenced by owner like the
        durable mark; the effect stays in flight and leased meanwhile (it must not leave ``_inflight``), and if
        this process dies first, recovery reconciles it through the probe."""
        self.queue.append((effect_id, text, now))
        self.flusher.ensure()

    def _finished_late(self, effect_id: str, text: str, now: float) -> None:
        """The tool returned, but another process had taken the call over (recovery claimed it and compensated it,
        or settled it ``unknown``, or is doing so now): recorded, never lost, never re-compensated. The effect
        becomes ``unknown`` with the finish (and its result) in the audit trail, the session halts, and the caller
        gets ``OutcomeConflict``. A probe that proved the call ``committed`` already agrees: nothing to record.

        A database that still does not answer after the retries: the finish waits in the deferred queue (its
        fenced mark lands nowhere, so the flush records the late finish) and the caller gets
        ``DatabaseUnavailable``, never a "done" for a call the log says was compensated."""
        try:
            late = self._record_late_finish(effect_id, text)
        except DatabaseUnavailable:
            self.defer(effect_id, text, now)
            raise
        if late is None:
            return
        answer = self._late_recorded(effect_id, late)
        raise OutcomeConflict(effect_id, late.tool_name, late.session_id, late.state_before, probe=answer)

    def _record_late_finish(self, effect_id: str, text: str) -> LateFinish | None:
        """``store.effects.record_late_finish``, asked again on a fresh connection while the database does not answer (as
        the commit mark is): a late finish lost to one cut connection left an effect ``compensated`` whose side
        effect happened after its undo (the history checker's seed 3 on PostgreSQL, a foreign-looking worker whose
        connections were cut while recovery took its call over)."""
        return on_a_fresh_connection(lambda: self.store.effects.record_late_finish(effect_id, text, utcnow()))

    def _late_recorded(self, effect_id: str, late: LateFinish, *, deferred: bool = False) -> str | None:
        """After a late finish is recorded: the session cache halted, the error logged, and the tool's probe asked
        (``on_late_finish``, bound by the facade to recovery's) for the person who decides; its answer."""
        self._table.note_state(late.session_id, SessionState.HALTED)
        engine_log.error(
            "late finish: %s (session %s, effect %s) finished after another process took it over (it was %s): "
            "recorded, effect unknown, session halted%s", late.tool_name, late.session_id, effect_id,
            late.state_before, " (a deferred commit mark: its caller had been answered)" if deferred else "",
            extra=ids(late.session_id, effect_id))
        if self.on_late_finish is None:
            return None
        try:
            return self.on_late_finish(effect_id, late)
        except Exception:  # noqa: BLE001 - the finish is recorded; a probe that fails informs nobody, and says so
            engine_log.exception("late finish: the probe of %s (effect %s) failed", late.tool_name, effect_id,
                                 extra=ids(late.session_id, effect_id))
            return None

    def flush(self) -> None:
        """Write the deferred commit marks now (fast mode); readers in this process call it first."""
        if not self.queue:
            return
        self.with_queued(lambda batch: (None, self.hot.mark_many(batch) if batch else 0))

    def with_queued(self, write: Callable[[list[tuple[str, str, float]]], tuple[_T, int]]) -> _T:
        """``write(batch)`` of every deferred mark queued now, taken under the marks lock (one writer at a time, in
        queue order); written, their effects leave the in-flight set; if ``write`` raises, they go back to the
        front of the queue, still in flight, and the error goes on.

        ``write`` answers (its result, how many marks landed). The marks are fenced by this process's owner, so
        fewer landed when a call was taken over meanwhile: each such mark is recorded as a late finish
        (:meth:`_deferred_finished_late`), after the lock is let go."""
        with self._marks_lock:
            batch: list[tuple[str, str, float]] = []
            while self.queue:
                batch.append(self.queue.popleft())
            try:
                result, landed = write(batch)
            except BaseException:
                self.queue.extendleft(reversed(batch))
                raise
            for effect_id, _, _ in batch:
                self._inflight.discard(effect_id)
        if landed < len(batch):
            self._deferred_finished_late(batch)
        return result

    def _deferred_finished_late(self, batch: list[tuple[str, str, float]]) -> None:
        """Some deferred marks of ``batch`` did not land: their calls were taken over after they ran here (a stall
        past the lease, ``recover --take-over``). Each is recorded as ``_finished_late`` records a late finish
        (``unknown``, the session halted, ``effect.finished_late`` audited, the probe asked); the call's caller
        had its answer when the mark was queued (fast mode), so the halt is what tells it, at its next call. Marks
        that landed, or whose call a probe already proved ``committed``, are left alone."""
        for effect_id, text, queued in batch:
            try:
                late = self._record_late_finish(effect_id, text)
            except DatabaseUnavailable:
                # Back in the queue, never dropped: its fenced mark lands nowhere again, and the next flush (the
                # flusher's, a reader's, stop()'s) records the late finish once the database answers.
                engine_log.warning("late finish: the database did not answer recording the deferred mark of effect "
                                   "%s; queued again", effect_id, extra=ids(None, effect_id))
                self.queue.append((effect_id, text, queued))
                self.flusher.ensure()
                continue
            except Exception:  # noqa: BLE001 - the next mark's record must still be tried; this one is logged
                engine_log.exception("late finish: could not record the deferred mark of effect %s", effect_id,
                                     extra=ids(None, effect_id))
                continue
            if late is not None:
                self._late_recorded(effect_id, late, deferred=True)

    def _flush_before_stop(self) -> None:
        """The last flush, asked again on a fresh connection while the database does not answer: what is still
        queued when the process ends is lost (a commit mark, or a late finish whose record met a cut connection).
        Still unwritten after the retries: raised, and each effect is named in the log for recovery to settle."""
        for pause in MARK_RETRY_PAUSES:
            try:
                self.flush()
                if not self.queue:
                    return
                error: DatabaseUnavailable | None = None
            except DatabaseUnavailable as exc:
                error = exc
            if pause is None:
                for effect_id, _, _ in list(self.queue):
                    engine_log.error("closing: the commit mark of effect %s could not be written (the database did "
                                     "not answer); recover() settles it", effect_id, extra=ids(None, effect_id))
                raise error or DatabaseUnavailable("the last commit marks", "the database did not answer")
            time.sleep(pause)

    def _flush_due_marks(self) -> float:
        """The flusher's step: the queued marks written once the oldest is ``MARK_FLUSH_SECONDS`` old (each mark is
        written within that period of being queued, as with a batch every period); how long until the next check.

        Not on a fixed beat: a beat that fell inside a session split its marks into two batches, where the
        session's end writes them all in one a moment later (1.6-1.8 batches per session of ten calls on a loaded
        machine, each batch a statement and its commit)."""
        try:
            queued = self.queue[0][2]
        except IndexError:
            return MARK_FLUSH_SECONDS  # a mark queued from now on is due one period after it is queued, or later
        wait = queued + MARK_FLUSH_SECONDS - time.time()
        if wait > 0.001:
            return wait
        self.flush()
        return MARK_FLUSH_SECONDS

    def stop(self) -> None:
        """The last flush (see ``_flush_before_stop``), then the flusher stopped; raised when marks stayed unwritten."""
        try:
            self._flush_before_stop()
        finally:
            self.flusher.stop()

