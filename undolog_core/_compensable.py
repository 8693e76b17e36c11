"""The COMPENSABLE path and a logged call's later steps: the durable pre-write (the hot path's one statement, or
the general transaction with its undo entry), a re-issued call's answer (its stored result, or a released call
claimed again: either tier), ``release`` and the failure's record. The engine (``_engine.Engine``) holds one
(``engine.compensable``) and binds its entry points under its own names (no frame of the engine's own)."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING, Any

from . import _clock, _faults
from ._decisions import (
    COMPENSABLE,
    IRREVERSIBLE,
    KICKOFF,
    Completed,
    Decision,
    Execute,
    FailureRecord,
    _new,
    _set_attr,
)
from ._faults import FaultPoint, fault
from ._json import canonical_json, canonical_text, sha256_hex
from ._leases import Leases, owner_alive
from ._mark_queue import MarkQueue, missing_or_moved
from ._session_record import SessionCache
from ._sessions_table import SessionTable
from ._tools import ToolSpec
from .errors import (
    ApprovalCancelled,
    ApprovalRejected,
    ApprovalTimedOut,
    CallIdConflict,
    CallRunning,
    EffectNotFound,
    InvalidEffectState,
    OutcomeUnknown,
    SessionClosed,
    SessionHalted,
)
from .limits import clean_text
from .storage.base import from_epoch, new_id, utcnow
from .storage.effects import FailureRollback
from .storage.hotpath import SessionRow
from .storage.pool import IntegrityConflict, WouldBlock
from .storage.schema import IN_FLIGHT, EffectState, RequestState, SessionState

if TYPE_CHECKING:
    from .storage import Storage

# What a pre-write carries to the session's row when no SAFE call was counted since its last write.
_NO_COUNT = (0, 0)


class CompensablePath:
    """The pre-write before a COMPENSABLE call runs, a re-issue's answer, and the end of a call that did not commit.

    It calls the session table's public methods (``table``: the session's record, its guard inside a write, its
    counts given back) and reads its records directly on the hot path (``_sessions``, never rebound there).

    Example:
        >>> calls = undolog.engine.compensable                                          # doctest: +SKIP
        >>> d = calls.intercept_compensable("thread-1", spec, values, values, "c-1")   # doctest: +SKIP
        >>> d.idempotency_key.startswith("do-")                                        # doctest: +SKIP
        True
    """

    def __init__(self, store: Storage, table: SessionTable, queue: MarkQueue, leases: Leases) -> None:
        self.store = store
        self.table = table
        self.hot = table.hot
        self.leases = leases
        self.lease_seconds = leases.lease_seconds
        self._inflight = leases.inflight
        # The table's records, read directly on the hot path (an attribute, not the table's: one read fewer).
        self._sessions = table.records
        self.flush_marks = queue.flush

    # -- COMPENSABLE -------------------------------------------------------------------------------

    def intercept_compensable(
        self,
        session_id: str,
        spec: ToolSpec,
        values: dict[str, Any],
        args_json: Any,
        call_id: str | None,
        args_text: str | None = None,
        wait: bool = True,
    ) -> Decision:
        sc = self._sessions.get(session_id)
        start = None
        if sc is None or not sc.persisted:
            start = sc.start if sc is not None else None
            if start is None:
                if not wait:
                    raise WouldBlock()
                sc = self.table.ensure_session(session_id)
        assert sc is not None
        # The tool's pinned revision is this one (the common case), or _check_pin pins it or refuses the call.
        pin = None if sc.pins.get(spec.name) == spec.revision else spec if sc.check_pin(spec) else None
        if pin is not None:
            if not wait:
                raise WouldBlock()
            if start is not None:  # a tool registered since the session started: the general path, row first
                sc, start = self.table.ensure_session(session_id), None
        # Before anything is taken or counted as running here: a hook that stops the call at this point (what
        # check_undo does) leaves nothing to give back.
        if _faults._armed is not None:  # a call per point costs more than the test, on every COMPENSABLE call
            fault(FaultPoint.BEFORE_PREWRITE, session_id, spec.name)
        effect_id = new_id()
        if args_text is None:
            args_text = canonical_text(args_json)
        digest = sha256_hex(args_text)
        now = _clock.now()  # the pre-write's lease starts here: on UndoLog's clock, as every lease
        # SAFE calls counted since the session's last write ride with this one, and the logged calls carried with
        # them; with none, the carried ones wait for a write that flushes (a run of COMPENSABLE calls).
        safe, carried = sc.take_flush() if sc.dirty else _NO_COUNT
        comp = spec.compensation
        assert comp is not None
        self._inflight.add(effect_id)
        try:
            # With ``start``, the session's row is written by this same statement.
            kickoff = KICKOFF.get()
            written = pin is None and kickoff is None and self.hot.prewrite(
                session_id, safe + carried, effect_id, call_id or effect_id, spec.name, spec.revision, args_text,
                digest, self.leases.owner, now, now + self.lease_seconds, comp.name, comp.version, wait, start,
            )
            if written:
                if start is not None:  # the session's row went in with this call
                    self.table.remember(SessionRow(session_id, SessionState.ACTIVE.value, start["pinned_revisions"],
                                             start["on_failure"]), write=wait)
                next(sc.carried)  # this call rides along with the session's next flushing write
                if sc.gone:  # evicted meanwhile (see _evict): the record goes back, with this count
                    self.table.come_back(sc)
            elif not wait:
                raise WouldBlock()  # refused: the precise error needs more reads, in a thread
            else:
                if start is not None:  # its id was in the store already (nothing written): read it, as before
                    sc = self.table.ensure_session(session_id)
                # Pinning a newly registered tool, or the session refused the write: the general path
                # does the same transaction and raises the precise error.
                self._prewrite_core(sc, spec, safe + carried + 1, pin, effect_id, call_id, args_json, digest,
                                    from_epoch(now), kickoff)
        except IntegrityConflict:
            self._inflight.discard(effect_id)
            self.table.give_back(sc, safe, carried)
            if call_id is None:
                raise
            if not wait:
                raise WouldBlock() from None  # nothing was written; the re-issue is read in a thread
            return self._existing(session_id, spec, call_id, digest)
        except (SessionHalted, SessionClosed) as refused:
            self._inflight.discard(effect_id)
            self.table.give_back(sc, safe, carried)
            # A framework re-running a call that already ran gets its result, even on a halted session:
            # telling the model "refused" would be a lie about what happened.
            if call_id is not None and self.store.effects.call_exists(session_id, call_id):
                try:
                    return self._existing(session_id, spec, call_id, digest)
                except InvalidEffectState:
                    # No result to give (the call was undone by the rollback, or failed, or never finished): it
                    # does not run again, and the session's own refusal says why (a LangGraph resume re-issuing
                    # a call its interrupt released before a rollback made elsewhere).
                    raise refused from None
            raise
        except BaseException:
            self._inflight.discard(effect_id)
            self.table.give_back(sc, safe, carried)
            raise
        if not self.leases.loop._started:  # (its renewing loop is running already: the common case, without a call)
            self.leases.start()
        sc.recent.append((spec.name, "compensable", args_json, "pending"))
        if _faults._armed is not None:
            fault(FaultPoint.AFTER_PREWRITE, session_id, spec.name, effect_id)
        d = _new(Execute)  # (execute_now, inline: a frame fewer on every COMPENSABLE call)
        _set_attr(d, "__dict__", {"effect_id": effect_id, "args": values, "idempotency_key": "do-" + effect_id,
                                  "tier": COMPENSABLE, "tool_name": spec.name, "call_id": call_id,
                                  "session_id": session_id, "approval_request_id": None, "decision": None})
        return d

    def _prewrite_core(
        self, sc: SessionCache, spec: ToolSpec, count: int, pin: ToolSpec | None, effect_id: str,
        call_id: str | None, args_json: Any, digest: str, now: dt.datetime, kickoff_id: str | None = None,
    ) -> None:
        assert spec.compensation is not None
        with self.store.tx() as conn:
            self.table.guard(conn, sc, count, pin=pin)
            seq = self.store.effects.insert_effect_in(conn, {
                "effect_id": effect_id, "session_id": sc.session_id, "call_id": call_id or effect_id,
                "tool_name": spec.name, "tool_revision": spec.revision, "tier": COMPENSABLE.value,
                "state": EffectState.PENDING.value, "args_snapshot": args_json, "args_digest": digest,
                "owner": self.leases.owner, "lease_until": now + dt.timedelta(seconds=self.lease_seconds),
                "recovery_attempts": 0, "created_at": now, "updated_at": now, "kickoff_id": kickoff_id,
            })
            self.store.undo.arm_in(
                conn, undo_id=seq, effect_id=effect_id, session_id=sc.session_id,
                compensation_name=spec.compensation.name, compensation_version=spec.compensation.version,
                args_snapshot=args_json, now=now)

    def _existing(self, session_id: str, spec: ToolSpec, call_id: str, digest: str) -> Decision:
        """The same call_id again: the same decision or the stored result, never a second execution."""
        self.flush_marks()
        row = self.store.effects.effect_by_call(session_id, call_id)
        if row is None:
            raise InvalidEffectState(f"call {call_id!r} conflicted but cannot be found")
        if row.tool_name != spec.name:
            raise CallIdConflict(session_id, call_id, f"for tool {row.tool_name!r}, not {spec.name!r}")
        if row.args_digest != digest:
            raise CallIdConflict(session_id, call_id, "with different arguments")
        if row.state == EffectState.RELEASED:
            return self.reclaim(self.table.written_record(session_id), row, spec)
        return self.replay(row)

    def reclaim(self, sc: SessionCache, row: Any, spec: ToolSpec) -> Decision:
        """A call released by a framework's control flow (a LangGraph interrupt) is run again by its re-issue.

        Only while the session still accepts calls and, for an IRREVERSIBLE call, while its approval still stands:
        a session rolled back or halted since the release (a rejection of another request halts it), or a request
        cancelled meanwhile, refuses the re-issue like any other call.
        """
        now = utcnow()
        args_json = row.args_snapshot
        request_id, decision = None, None  # (for an IRREVERSIBLE call: its request, and how it was decided)
        added, lost = row.effect_id not in self._inflight, False  # (a loser leaves it alone: see Gate._claim_run)
        self._inflight.add(row.effect_id)
        try:
            with self.store.tx() as conn:
                self.table.guard(conn, sc, 0, pin=None)
                if row.tier == IRREVERSIBLE:
                    req = self.store.effects.request_of_effect_in(conn, row.effect_id)
                    self._check_still_approved(req, row)
                    if req is not None:
                        request_id, decision = req.approval_request_id, "approve"
                    if req is not None and req.approved_args is not None:
                        args_json = req.approved_args  # a modify: what the person approved runs, nothing else
                        if canonical_json(req.approved_args) != canonical_json(row.args_snapshot):
                            decision = "modify"  # (the adapter tells the model its call was changed)
                epoch = self.store.effects.claim_effect_in(
                    conn, row.effect_id, from_state=EffectState.RELEASED.value,
                    to_state=row.released_from or EffectState.PENDING.value, owner=self.leases.owner,
                    lease_until=now + dt.timedelta(seconds=self.lease_seconds), now=now,
                )
                if not epoch:
                    lost = True
                    raise InvalidEffectState(f"call {row.call_id!r} was re-claimed by another caller")
                self.store.effects.back_in_flight_in(conn, row.seq)
        except BaseException:
            if added and not lost:
                self._inflight.discard(row.effect_id)
            raise
        self.leases.start()
        args = spec.checked(args_json)
        return Execute(row.effect_id, args, f"do-{row.effect_id}", spec.tier, spec.name, row.call_id, row.session_id,
                       request_id, decision, epoch=epoch)

    @staticmethod
    def _check_still_approved(req: Any, row: Any) -> None:
        if req is None or req.state in (RequestState.APPROVED, RequestState.AUTO_APPROVED):
            return
        if req.state == RequestState.CANCELLED:
            raise ApprovalCancelled(req.approval_request_id, req.decision_reason)
        if req.state == RequestState.REJECTED:
            raise ApprovalRejected(req.approval_request_id, req.decision_reason, req.decided_by)
        if req.state == RequestState.TIMED_OUT:
            raise ApprovalTimedOut(req.approval_request_id)
        raise InvalidEffectState(f"call {row.call_id!r}: its approval request is {req.state}")

    def release(self, effect_id: str) -> None:
        """Give an in-flight call back without an outcome, for a framework's control-flow exception.

        The tool raised something like LangGraph's ``GraphInterrupt``: it did not fail, it will be re-run.
        The effect stays on the undo stack (it may have half-happened) and recovery leaves it alone; the re-issued
        call (same call_id) runs it again under the same effect id and idempotency key, if the session and its
        approval still allow it then.
        """
        try:
            state = self.store.effects.release_effect(effect_id)
        finally:
            self._inflight.discard(effect_id)
        if state is None:
            raise EffectNotFound(effect_id)
        if state not in IN_FLIGHT:
            raise InvalidEffectState(f"effect {effect_id} is {state}; only an in-flight call can be released")

    def replay(self, row: Any) -> Decision:
        if row.state == EffectState.COMMITTED:
            return Completed(row.effect_id, row.result_snapshot, row.tool_name)
        if row.state in IN_FLIGHT:
            if row.owner == self.leases.owner and row.effect_id in self._inflight:
                raise CallRunning(f"call {row.call_id!r} ({row.tool_name}) is running right now",
                                  effect_id=row.effect_id)
            if not owner_alive(row.owner, row.lease_until, effect_id=row.effect_id):
                raise InvalidEffectState(
                    f"call {row.call_id!r} ({row.tool_name}) was interrupted by a crash; run `undolog recover` "
                    "before re-issuing it"
                )
            raise CallRunning(f"call {row.call_id!r} ({row.tool_name}) is running in another process",
                              effect_id=row.effect_id)
        if row.state == EffectState.UNKNOWN:
            raise OutcomeUnknown(row.effect_id)
        raise InvalidEffectState(
            f"call {row.call_id!r} ({row.tool_name}) already ended as {row.state}"
            + (f": {row.error}" if row.error else "")
        )


    def record_failure(self, effect_id: str, error: BaseException | str, *, nothing_happened: bool = False,
                       rollback: tuple[str, str] | None = None) -> FailureRecord:
        """Record failure only; returns the session and its on_failure policy for the caller (the driver).

        ``nothing_happened``: the tool reported, by its contract, that it changed nothing; its undo entry goes.

        ``rollback=(session_id, reason)``: the caller rolls the session back next if its policy says so; the
        rollback is then requested in the failure's own transaction, owned by this process (``rollback_requested``
        says whether it was), so a crash between the two leaves it to ``recover()``. The caller's walk takes the
        intent over; whatever becomes of it, the caller ends with ``leases.rolling.discard(session_id)``.
        """
        # The error is stored as text: a lone surrogate or a NUL in it must not lose the failure.
        text = clean_text(error if isinstance(error, str) else f"{type(error).__name__}: {error}")
        self.flush_marks()
        request = None
        if rollback is not None:
            # Counted as walked here before the intent exists: recovery elsewhere must not take it over meanwhile.
            self.leases.rolling.add(rollback[0])
            self.leases.start()
            request = FailureRollback("undolog", rollback[1], self.leases.owner, self.leases.until())
        try:
            state, row = self.store.effects.mark_failed(effect_id, text, utcnow(), nothing_happened, request)
        except BaseException:
            if rollback is not None:
                self.leases.rolling.discard(rollback[0])
            raise
        finally:
            self._inflight.discard(effect_id)
        if state is not None:
            if rollback is not None:
                self.leases.rolling.discard(rollback[0])
            missing_or_moved(effect_id, state, EffectState.FAILED)
        if rollback is not None and not row.intent:
            self.leases.rolling.discard(rollback[0])
        if _faults._armed is not None:
            fault(FaultPoint.AFTER_FAILURE_RECORDED)
        return FailureRecord(row.session_id, row.on_failure, row.intent)

