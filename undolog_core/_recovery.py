"""Crash recovery: reconcile effects whose owner is gone, and finish interrupted rollbacks."""

from __future__ import annotations

import datetime as dt
import enum
import inspect
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from . import _observe as obs
from ._faults import FaultPoint, fault
from ._leases import Leases, owner_alive
from ._saga import Saga, _call_sync, _Entry, run_coro_blocking
from ._tools import ToolTier
from .errors import EffectNotFound, SelfDecisionForbidden, UndoLogError
from .limits import check_identity, clean_text, safe_result
from .storage.audit import PendingEvent
from .storage.base import utcnow
from .storage.effects import RESOLUTIONS, LateFinish, Resolution
from .storage.schema import IN_FLIGHT, EffectState, SessionState, UndoState

if TYPE_CHECKING:
    from ._registry import Registry
    from .storage import Storage as RecoveryStore


@dataclass(frozen=True)
class ProbeContext:
    """What a probe receives: an idempotent status check for one call.

    A probe has three answers: ``False`` when the call did not happen, ``True`` (or the call's result) when it
    did, and ``None`` when it cannot tell. "Cannot tell" is settled as if there were no probe; "did not happen"
    settles the call as not run only once the original request can no longer land (see :func:`probe_answer`).
    """

    args: dict[str, Any]
    idempotency_key: str
    effect_id: str
    session_id: str
    tool_name: str
    #: The ownership epoch of this recovery's claim (the fencing token; see ``CallContext.epoch``): above the
    #: epoch of the process that ran the call, so an upstream told of it refuses that process's late write.
    epoch: int = 1


class ProbeAnswer(enum.StrEnum):
    """What a probe said about one call, as its audit event records it."""

    HAPPENED = "happened"
    NOT_HAPPENED = "not_happened"
    CANT_TELL = "cant_tell"


def probe_answer(verdict: Any) -> tuple[ProbeAnswer, Any]:
    """A probe's return value as (answer, the call's result or None).

    Only an explicit ``False`` says "did not happen": ``None`` is a probe that cannot tell, which must never
    settle a call as not run (a COMPENSABLE call whose undo was dropped on a guess, or an IRREVERSIBLE one run
    again).

    Example:
        >>> probe_answer({"id": 7})
        (<ProbeAnswer.HAPPENED: 'happened'>, {'id': 7})
        >>> probe_answer(None)[0]
        <ProbeAnswer.CANT_TELL: 'cant_tell'>
    """
    if verdict is None:
        return ProbeAnswer.CANT_TELL, None
    if verdict is False:
        return ProbeAnswer.NOT_HAPPENED, None
    return ProbeAnswer.HAPPENED, None if verdict is True else safe_result(verdict)


def _probe_event(row: Any, answer: ProbeAnswer, settled: str) -> PendingEvent:
    """The audit event of one probe's answer, on the effect it was asked about."""
    return PendingEvent(subject=f"effect:{row.effect_id}", action="effect.probe", actor="undolog:recovery",
                        payload={"effect_id": row.effect_id, "session_id": row.session_id,
                                 "tool_name": row.tool_name, "answer": answer.value, "settled": settled})


@dataclass
class RecoveryReport:
    reconciled: list[dict[str, Any]] = field(default_factory=list)
    rollbacks_resumed: list[str] = field(default_factory=list)
    dead_lettered: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    left_alive: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


#: How many in-doubt effects one claim transaction takes.
RECOVER_BATCH = 250


class Recovery:
    """Finishes what crashed processes left in flight; its collaborators are explicit (storage, registry, saga,
    leases, and the engine's deferred marks)."""

    dead_letter_after = 3

    def __init__(self, store: RecoveryStore, registry: Registry, saga: Saga, leases: Leases, *,
                 flush_marks: Callable[[], None], note_state: Callable[[str, str], None]) -> None:
        self._store = store
        self._registry = registry
        self._saga = saga
        self._leases = leases
        self._flush_marks = flush_marks
        self._note_state = note_state

    def _dead(
        self, owner: str | None, lease: dt.datetime | None, effect_id: str | None = None, undo_id: int | None = None,
        rolling: str | None = None,
    ) -> bool:
        return not owner_alive(owner, lease, effect_id=effect_id, undo_id=undo_id, rolling=rolling)

    def recover(self, progress: Callable[[int, int, str], None] | None = None, *,
                sessions: Collection[str] | None = None, take_over: Collection[str] = ()) -> RecoveryReport:
        """Finish what crashed processes left in flight. Safe to run from several processes at once.

        ``sessions`` limits it to those sessions (the undo-check harness recovers only its own runs).
        ``take_over``: effect ids a person has decided to take over although their owner still runs on this host
        (a process stopped for good: ``undolog recover --take-over EFFECT``). If that process finishes the call
        after all, its finish is recorded (``OutcomeConflict``), the effect ``unknown``.

        Example:
            >>> report = undolog.recover()
            >>> report.reconciled
            [{'effect_id': '...', 'tool_name': 'send_refund_email', 'outcome': 'compensated'}]
        """
        with obs.span("undolog.recover", {}) as sp:
            report = self._recover(progress, sessions, frozenset(take_over))
            sp.set_attributes({"undolog.reconciled": len(report.reconciled), "undolog.left_alive": report.left_alive,
                               "undolog.rollbacks_resumed": len(report.rollbacks_resumed),
                               "undolog.dead_lettered": len(report.dead_lettered), "undolog.errors": len(report.errors)})
            if report.errors or report.dead_lettered:
                obs.failed(sp, "; ".join(report.errors) or "dead-lettered effects", error_type="recovery_incomplete")
        if report.reconciled or report.rollbacks_resumed or report.errors or report.dead_lettered:
            obs.recovery_log.info(
                "recovery: %d reconciled, %d rollback(s) resumed, %d dead-lettered, %d error(s), %d live call(s) left "
                "alone", len(report.reconciled), len(report.rollbacks_resumed), len(report.dead_lettered),
                len(report.errors), report.left_alive)
        return report

    def _recover(self, progress: Callable[[int, int, str], None] | None,
                 sessions: Collection[str] | None = None, take_over: frozenset[str] = frozenset()) -> RecoveryReport:
        report = RecoveryReport()
        self._flush_marks()
        seen = self._store.effects.in_flight()
        effects, undos, intents = seen.effects, seen.undos, seen.intents
        if sessions is not None:
            only = set(sessions)
            effects = [r for r in effects if r.session_id in only]
            undos = [r for r in undos if r.session_id in only]
            intents = [r for r in intents if r.session_id in only]
        if take_over:
            # A person's decision, never a default: the named effects are taken over whoever owns them.
            missing = sorted(take_over - {r.effect_id for r in effects})
            for effect_id in missing:
                report.errors.append(f"effect {effect_id}: not in flight; nothing to take over")
        dead_effects = [r for r in effects
                        if r.effect_id in take_over or self._dead(r.owner, r.lease_until, r.effect_id)]
        report.left_alive = len(effects) - len(dead_effects)
        # A requested rollback whose walker is gone is finished: the whole session, as was asked.
        dead_intents = [r for r in intents if self._dead(r.owner, r.lease_until, rolling=r.session_id)]
        with_intent = {r.session_id for r in intents}
        # An entry left `compensating` outside a requested rollback was recovery compensating one in-doubt call:
        # that call alone is finished, never the session around it. When its effect is still in flight, the
        # effect's own reconciliation below takes the entry up.
        in_flight = {r.effect_id for r in effects}
        stray_undos = [r for r in undos if r.session_id not in with_intent and r.effect_id not in in_flight
                       and self._dead(r.owner, r.lease_until, undo_id=r.undo_id)]
        total = len(dead_effects) + len(dead_intents) + len(stray_undos)
        done = 0
        for ri in dead_intents:
            done += 1
            if not self._store.sessions.claim_intent(ri.session_id, ri.owner, self._leases.owner, self._leases.until()):
                continue
            try:
                self._saga.rollback_sync(ri.session_id, actor=ri.actor,
                                         reason=f"{ri.reason or 'requested'} (interrupted, resumed by recovery)")
                report.rollbacks_resumed.append(ri.session_id)
                obs.recovery_log.info("recovery: resumed the interrupted rollback of session %s", ri.session_id,
                                      extra=obs.ids(ri.session_id))
            except UndoLogError as exc:
                report.errors.append(f"session {ri.session_id}: {exc.message}")
                obs.recovery_log.warning("recovery: could not resume the rollback of session %s: %s", ri.session_id,
                                         exc.message, extra=obs.ids(ri.session_id))
            if progress:
                progress(done, total, f"rollback {ri.session_id}")
        for ru in stray_undos:
            done += 1
            finished = self._finish_stray(ru, report)
            if finished:
                report.reconciled.append({"effect_id": ru.effect_id, "tool_name": finished[0],
                                          "outcome": finished[1]})
                obs.recovery_log.info("recovery: finished the interrupted compensation of %s: %s (session %s, "
                                      "effect %s)", finished[0], finished[1], ru.session_id, ru.effect_id,
                                      extra=obs.ids(ru.session_id, ru.effect_id))
            if progress:
                progress(done, total, f"undo {ru.undo_id}: {finished[1] if finished else 'skipped'}")
        todo = [r for r in dead_effects if not (r.session_id in with_intent and r.tier == ToolTier.COMPENSABLE)]
        done += len(dead_effects) - len(todo)  # a requested rollback compensates those (above, or its live walker)
        # The common case, COMPENSABLE calls of a crashed process, in batches: one claim per batch instead of a
        # claim, a plan and an undo claim per effect. Whatever the batch path cannot finish (another tier, an
        # entry already being compensated, a missing compensation, a failing one) goes through _reconcile.
        compensable = [r for r in todo if r.tier == ToolTier.COMPENSABLE]
        # effect id -> the owner _reconcile's claim must expect (the crashed one, or this one if a batch took it)
        slow: dict[str, str | None] = {r.effect_id: r.owner for r in todo if r.tier != ToolTier.COMPENSABLE}
        for i in range(0, len(compensable), RECOVER_BATCH):
            left, done = self._recover_batch(compensable[i:i + RECOVER_BATCH], report, progress, done, total)
            slow.update(left)
        for r in (SimpleNamespace(**{**r._mapping, "owner": slow[r.effect_id]}) for r in todo
                  if r.effect_id in slow):
            done += 1
            with obs.span(f"undolog.reconcile {r.tool_name}", {
                    obs.A_TOOL_NAME: r.tool_name, obs.A_TIER: str(r.tier), obs.A_SESSION: r.session_id,
                    obs.A_EFFECT: r.effect_id}) as sp:
                settled = self._reconcile(r, report)
                sp.set_attribute(obs.A_OUTCOME, settled or "skipped")
            if settled:
                report.reconciled.append({"effect_id": r.effect_id, "tool_name": r.tool_name, "outcome": settled})
                log = obs.recovery_log.error if settled == "dead_letter" else obs.recovery_log.info
                log("recovery: %s (session %s, effect %s) in flight after a crash: %s", r.tool_name, r.session_id,
                    r.effect_id, settled, extra=obs.ids(r.session_id, r.effect_id))
            if progress:
                progress(done, total, f"{r.tool_name} {r.effect_id}: {settled or 'skipped'}")
        return report

    def settle_in_doubt(self, effect_id: str, *, original_gone: bool = True, told_when_gone: bool = True) -> str | None:
        """Settle now, as recovery would after a crash, a call of this process whose outcome its caller cannot tell
        (the connection to the tool was lost mid-call, or it timed out): its probe decides when it has one; else a
        COMPENSABLE call is compensated (a compensation tolerates "never happened") and an IRREVERSIBLE one, or one
        whose compensation needs the result it never got, becomes ``unknown``; the session halts for a person.

        ``original_gone``: the original request can no longer land (its connection closed, its process gone, or
        the tool confirmed the cancel). While it still may (False), a probe's "did not happen" settles nothing:
        the effect stays in flight, held by this process, and the answer is ``settling``; call this again once
        it can no longer land (a process that ends first leaves it to ``recover()``).

        ``told_when_gone``: the caller learns when the original can no longer land and will call this again then
        (an MCP connection that ends). When it never will (an HTTP upstream with no cancel it vouches for: after a
        read timeout the upstream may finish the request at any time), an IRREVERSIBLE call's "did not happen
        (yet)" cannot tell: it becomes ``unknown`` and its session halts for a person, never ``approved`` again.

        Returns the outcome (``committed``, ``compensated``, ``unknown``, ``not_run``, ``settling``), or None when
        the effect was no longer in flight.

        Example:
            >>> undolog.driver.in_doubt(effect_id)   # what the call driver does for ``unknown_on`` exceptions
            'compensated'
        """
        row = self._store.effects.effect(effect_id)
        if row.state not in IN_FLIGHT:
            return None
        report = RecoveryReport()
        outcome = self._reconcile(row, report, original_gone=original_gone, told_when_gone=told_when_gone)
        if outcome is None and report.errors:
            raise UndoLogError("; ".join(report.errors))
        return outcome

    def probe_late_finish(self, effect_id: str, late: LateFinish) -> str | None:
        """A late finish was recorded for ``effect_id`` (``effect.finished_late``): ask the tool's probe, if it has
        one, and record its answer as an audit event on the effect (``effect.probe``, settled ``nothing``). It
        informs the person who resolves the effect; it settles nothing (no second compensation, no commit: the
        effect stays ``unknown``). Returns the answer (``happened``, ``not_happened``, ``cant_tell``, or
        ``error`` when the probe raised), or None when the tool has no probe here.

        Example:
            >>> undolog.engine.on_late_finish(effect_id, late)   # what the engine does after recording one
            'happened'
        """
        spec = self._registry.tools.get(late.tool_name)
        if spec is None or spec.probe is None:
            return None
        row = self._store.effects.effect(effect_id)
        ctx = ProbeContext(dict(row.args_snapshot or {}), f"do-{effect_id}", effect_id, late.session_id,
                           late.tool_name, int(row.epoch))
        payload: dict[str, Any] = {"effect_id": effect_id, "session_id": late.session_id, "tool_name": late.tool_name,
                                   "after": "late_finish", "settled": "nothing: a person resolves it"}
        try:
            verdict = spec.probe(ctx)
            if inspect.isawaitable(verdict):
                verdict = run_coro_blocking(verdict)
            answer, result = probe_answer(verdict)  # the result made safe, as any result
            said = answer.value
            payload["answer"] = said
            if result is not None:
                payload["result"] = result
        except Exception as exc:  # noqa: BLE001 - recorded: the person sees the probe could not be asked
            said = "error"
            payload["answer"] = said
            payload["error"] = clean_text(f"{type(exc).__name__}: {exc}")
        self._store.recovery.note_event(PendingEvent(subject=f"effect:{effect_id}", action="effect.probe",
                                            actor="undolog:late-finish", payload=payload))
        obs.recovery_log.warning("late finish: the probe of %s (session %s, effect %s) says %s; a person resolves it",
                                 late.tool_name, late.session_id, effect_id, said,
                                 extra=obs.ids(late.session_id, effect_id))
        return said

    def resolve(self, effect_id: str, outcome: str, *, actor: str, reason: str,
                principal: str | None = None) -> Resolution:
        """A person settles an ``unknown`` effect: ``committed`` (it happened and stands; a rollback still
        compensates it if its undo entry is armed), ``compensated`` (it is undone: no rollback runs its
        compensation), or ``not_happened`` (recorded ``failed``, its armed undo entry dropped). Audited
        (``effect.resolved``: who, why, what it was); the session is not resumed.

        ``principal``: the person's principal reference (the desk's ``key:<id>``); the principal that created the
        effect's session is refused (:class:`SelfDecisionForbidden`, audited), as for approvals.

        Raises:
            EffectNotFound: no such effect.
            InvalidEffectState: it is not ``unknown``.
            SelfDecisionForbidden: the decider created the effect's session.
        """
        if outcome not in RESOLUTIONS:
            raise UndoLogError(f"an effect is resolved as one of {', '.join(RESOLUTIONS)}, not {outcome!r}; "
                               "pick the one the external system shows")
        check_identity("actor", actor)
        if not isinstance(reason, str) or not reason.strip():
            raise UndoLogError("a resolution needs a reason (--reason TEXT): what the external system showed")
        reason = clean_text(reason)
        session_id = self._store.effects.session_of_effect(effect_id)
        if session_id is None:
            raise EffectNotFound(effect_id)
        session = self._store.sessions.get_session(session_id)
        creator = session.created_by if session is not None else None
        who = principal or actor
        # As for approvals: only principal references (``key:<id>``) are compared, never free-text names.
        if creator and creator.startswith("key:") and who == creator:
            self._store.audit.append_event(subject=f"effect:{effect_id}", action="effect.resolve_refused", actor=actor,
                                     payload={"effect_id": effect_id, "attempted": outcome, "principal": who,
                                              "why": SelfDecisionForbidden.code})
            raise SelfDecisionForbidden(None, who, effect_id=effect_id)
        done = self._store.effects.resolve_effect(effect_id, outcome, actor=actor, reason=reason, principal=principal,
                                          now=utcnow())
        obs.recovery_log.warning("resolved: %s (session %s, effect %s) as %s by %s: %s", done.tool_name,
                                 done.session_id, effect_id, outcome, actor, reason,
                                 extra=obs.ids(done.session_id, effect_id))
        return done

    def _batchable(self, row: Any) -> bool:
        """Whether the batch path can finish this claimed-to-be row: its entry armed and unowned (no earlier
        recovery left it half compensated) and its compensation loaded here at the version logged."""
        spec = self._registry.tools.get(row.tool_name)
        comp = self._registry.compensations.get(row.compensation_name)
        return (spec is not None and comp is not None and comp[1] == row.compensation_version
                and not spec.compensation_needs_result  # an unseen result: a person decides (_reconcile)
                and row.undo_state == UndoState.ARMED and row.undo_owner is None)

    def _recover_batch(self, batch: list[Any], report: RecoveryReport,
                       progress: Callable[[int, int, str], None] | None, done: int,
                       total: int) -> tuple[dict[str, str | None], int]:
        """Reconcile a batch of dead COMPENSABLE effects; returns ({effect id: its owner now} of the effects left to
        ``_reconcile``, done).

        One transaction claims the batch; the probes run; one transaction records what the probes proved and
        claims the undo entries of the rest; then each compensation runs and its outcome is committed on its
        own, with the session's halt, before the next one starts. That last commit is per compensation on
        purpose: a crash then re-runs at most the one compensation it interrupted (with the same ``undo-{id}``
        key), as everywhere else.
        """
        leases = self._leases
        claimed = self._store.effects.claim_in_doubt_batch([(r.effect_id, r.state, r.owner) for r in batch], leases.owner,
                                                   leases.until(), self._batchable)
        got = {c.effect_id for c in claimed}
        left = {r.effect_id: r.owner for r in batch if r.effect_id not in got}
        if not claimed:
            return left, done
        leases.inflight.update(got)
        leases.start()
        committed: list[tuple[str, Any]] = []
        events: list[PendingEvent] = []  # each probe's answer, recorded with what it settled
        undo: list[Any] = []
        mine: set[int] = set()
        try:
            for c in claimed:
                fault(FaultPoint.DURING_RECOVERY)
                spec = self._registry.tools[c.tool_name]
                if spec.probe is not None:
                    ctx = ProbeContext(dict(c.args_snapshot), f"do-{c.effect_id}", c.effect_id, c.session_id,
                                       c.tool_name, int(c.epoch) + 1)
                    try:
                        verdict = spec.probe(ctx)
                        if inspect.isawaitable(verdict):
                            verdict = run_coro_blocking(verdict)
                    except Exception:  # noqa: BLE001 - the effect goes the one-by-one way, which counts attempts
                        left[c.effect_id] = leases.owner
                        continue
                    # The probe's answer is the call's result: stored made safe, as any result is (a cyclic
                    # or very deep answer raised here and wedged every recover() behind it).
                    answer, result = probe_answer(verdict)
                    if answer is ProbeAnswer.HAPPENED:
                        committed.append((c.effect_id, result))
                        events.append(_probe_event(c, answer, "committed"))
                        continue
                    if answer is ProbeAnswer.NOT_HAPPENED:
                        left[c.effect_id] = leases.owner  # settled as not run, one by one (_reconcile)
                        continue
                    events.append(_probe_event(c, answer, "compensated"))
                undo.append(c)
            mine = self._store.recovery.settle_and_claim_undos(committed, [c.undo_id for c in undo], leases.owner,
                                                      leases.until(), events=events)
            for effect_id, _ in committed:
                leases.inflight.discard(effect_id)
                done += 1
                self._reconciled(report, claimed, effect_id, "committed")
                if progress:
                    progress(done, total, f"{self._tool_of(claimed, effect_id)} {effect_id}: committed")
            leases.compensating.update(mine)
            last = max((c.undo_id for c in undo if c.undo_id in mine), default=None)
            for c in undo:
                if c.undo_id not in mine:
                    left[c.effect_id] = leases.owner
                    continue
                fault(FaultPoint.DURING_ROLLBACK)
                outcome = self._compensate_claimed(c, report, durable=c.undo_id == last)
                leases.compensating.discard(c.undo_id)
                leases.inflight.discard(c.effect_id)
                done += 1
                if outcome:
                    self._reconciled(report, claimed, c.effect_id, outcome)
                if progress:
                    progress(done, total, f"{c.tool_name} {c.effect_id}: {outcome or 'skipped'}")
        finally:
            # Whatever is still ours is either done or handed to _reconcile, which claims it by this owner. An
            # undo entry claimed and not recorded (a write failed: the database went away mid-batch) is no longer
            # being compensated here either: counted as ours it would stay "being rolled back right now" to every
            # later recover(), its lease renewed for as long as this process lives.
            leases.inflight.difference_update(got)
            leases.compensating.difference_update(mine)
        return left, done

    @staticmethod
    def _tool_of(rows: list[Any], effect_id: str) -> str:
        return next(str(r.tool_name) for r in rows if r.effect_id == effect_id)

    def _reconciled(self, report: RecoveryReport, rows: list[Any], effect_id: str, outcome: str) -> None:
        """Report and log one outcome of the batch path, as the one-by-one path does."""
        row = next(r for r in rows if r.effect_id == effect_id)
        report.reconciled.append({"effect_id": effect_id, "tool_name": row.tool_name, "outcome": outcome})
        log = obs.recovery_log.error if outcome == "dead_letter" else obs.recovery_log.info
        log("recovery: %s (session %s, effect %s) in flight after a crash: %s", row.tool_name, row.session_id,
            effect_id, outcome, extra=obs.ids(row.session_id, effect_id))

    def _compensate_claimed(self, c: Any, report: RecoveryReport, *, durable: bool) -> str | None:
        """Run one claimed compensation with the saga's retries; on success record it and halt the session
        (``durable``: wait for the disk; the batch's last record does, see ``compensated_in_recovery``)."""
        fn, _ = self._registry.compensations[c.compensation_name]
        # The undo entry's arguments, as the saga gives them: what was stored with it (a gateway's capture) too.
        entry = _Entry(c.undo_id, c.effect_id, c.tool_name, c.compensation_name, c.compensation_version,
                       dict(c.undo_args), None, c.state, c.attempts, fn, UndoState.COMPENSATING.value,
                       self._leases.owner)
        error: str | None = None
        for n in range(self._saga.max_attempts):
            try:
                _call_sync(fn, self._saga._ctx(c.session_id, entry, c.attempts + n + 1))
                fault(FaultPoint.AFTER_COMPENSATION)
                error = None
                break
            except Exception as exc:  # noqa: BLE001 - recorded, retried, then halts the session
                error = clean_text(f"{type(exc).__name__}: {exc}")  # stored as text: never a surrogate or a NUL
                self._store.undo.undo_attempt_failed(c.undo_id, error)
                if n + 1 < self._saga.max_attempts:
                    time.sleep(self._saga.backoff_seconds * (2**n))
        if error is None:
            self._store.recovery.compensated_in_recovery(
                c.undo_id, c.effect_id, c.session_id,
                f"recovered after a crash: {c.tool_name} ({c.effect_id}) was compensated; review, then resume or "
                "roll back", durable=durable)
            self._note_state(c.session_id, SessionState.HALTED)
            obs.recovery_log.log(obs.crash_level(), "halt: session %s halted: recovered after a crash: %s (%s) was compensated",
                                     c.session_id, c.tool_name, c.effect_id, extra=obs.ids(c.session_id))
            return "compensated"
        why = self._saga._failed(c.session_id, entry, error)
        self._leases.inflight.discard(c.effect_id)
        return self._attempt_failed(c, f"UndoLogError: {why}", report)

    def _halt(self, session_id: str, reason: str) -> None:
        self._store.sessions.halt_session(session_id, reason)
        self._note_state(session_id, SessionState.HALTED)
        obs.recovery_log.log(obs.crash_level(), "halt: session %s halted: %s", session_id, reason,
                             extra=obs.ids(session_id))

    def _finish_stray(self, r: Any, report: RecoveryReport) -> tuple[str, str] | None:
        """Finish the one compensation that was interrupted, and halt the session for a person."""
        try:
            out = self._saga.rollback_sync(r.session_id, actor="undolog:recovery",
                                           reason=f"recovery of {r.effect_id}", only_effect=r.effect_id)
        except UndoLogError as exc:
            report.errors.append(f"undo entry {r.undo_id}: {exc.message}")
            return None
        if not out.steps:
            return None
        step = out.steps[-1]
        if step.outcome == "compensated":
            self._halt(r.session_id, f"recovered after a crash: the compensation of {step.tool_name} "
                                     f"({r.effect_id}) was finished; review, then resume or roll back")
        return step.tool_name, step.outcome

    def _reconcile(self, r: Any, report: RecoveryReport, *, original_gone: bool = True,
                   told_when_gone: bool = True) -> str | None:
        spec = self._registry.tools.get(r.tool_name)
        if spec is None:
            report.errors.append(
                f"effect {r.effect_id}: tool {r.tool_name!r} is not registered here; load the app (--app) to recover it"
            )
            return None
        if r.tier == ToolTier.COMPENSABLE and spec.probe is None:
            assert spec.compensation is not None
            if spec.compensation.name not in self._registry.compensations:
                report.errors.append(
                    f"effect {r.effect_id}: compensation {spec.compensation.name!r} is not registered here; "
                    "nothing was changed"
                )
                return None
        if not self._store.effects.claim_in_doubt(r.effect_id, r.state, r.owner, self._leases.owner, self._leases.until()):
            return None
        self._leases.inflight.add(r.effect_id)
        self._leases.start()
        fault(FaultPoint.DURING_RECOVERY)
        outcome: str | None = None
        try:
            outcome = self._reconcile_claimed(r, spec, original_gone, told_when_gone)
            return outcome
        except Exception as exc:  # noqa: BLE001 - counted toward the dead letter, never lost
            return self._attempt_failed(r, f"{type(exc).__name__}: {exc}", report)
        finally:
            if outcome != "settling":  # held (and its lease renewed) until its original can no longer land
                self._leases.inflight.discard(r.effect_id)

    def _reconcile_claimed(self, r: Any, spec: Any, original_gone: bool = True, told_when_gone: bool = True) -> str:
        row = self._store.effects.effect(r.effect_id)
        answer = None
        not_yet = False  # its probe says "not yet" while its request may still land, and nobody will say when not
        if spec.probe is not None:
            ctx = ProbeContext(dict(row.args_snapshot), f"do-{r.effect_id}", r.effect_id, r.session_id, r.tool_name,
                               int(row.epoch))
            verdict = spec.probe(ctx)
            if inspect.isawaitable(verdict):
                verdict = run_coro_blocking(verdict)
            answer, result = probe_answer(verdict)  # the result made safe, as any result
            if answer is ProbeAnswer.HAPPENED:
                self._store.recovery.settle_effect(r.effect_id, EffectState.COMMITTED, result=result,
                                          event=_probe_event(r, answer, "committed"))
                return "committed"
            if answer is ProbeAnswer.NOT_HAPPENED and not original_gone and not told_when_gone \
                    and r.tier == ToolTier.IRREVERSIBLE:
                # Re-approving it would let the retry run it a second time once the original lands: a person decides.
                not_yet = True
            elif answer is ProbeAnswer.NOT_HAPPENED:
                if not original_gone:
                    # It has not happened yet, and the request may still land: settling it now would undo what is
                    # about to happen (or let it run twice). Held here until the original can no longer land.
                    self._store.recovery.settle_effect(r.effect_id, None, event=_probe_event(r, answer, "settling"))
                    return "settling"
                if r.tier == ToolTier.IRREVERSIBLE:
                    # The approved call may run once when re-issued.
                    self._store.recovery.settle_effect(r.effect_id, EffectState.APPROVED,
                                              event=_probe_event(r, answer, "not_run"))
                    return "not_run"
                # COMPENSABLE: nothing to undo; its undo entry goes, no compensation runs, the session goes on.
                self._store.recovery.settle_effect(r.effect_id, EffectState.FAILED, drop_undo=True,
                                          error="it did not happen (its probe said so once the request could no "
                                                "longer land): nothing to undo",
                                          event=_probe_event(r, answer, "not_run"))
                return "not_run"
        if r.tier == ToolTier.COMPENSABLE and not original_gone and not told_when_gone \
                and answer is not ProbeAnswer.NOT_HAPPENED:
            # Its answer was lost, nothing proves it happened, and its request may still land at any time with
            # nobody to say when it cannot (an HTTP upstream after a read timeout): compensating now would undo
            # before the call lands (the undo a no-op, then the call stands). A person decides.
            self._store.recovery.settle_effect(
                r.effect_id, EffectState.UNKNOWN,
                error="its answer was lost and its request may still land; "
                      + ("it has no probe" if answer is None else "its probe could not tell")
                      + ": a person resolves it",
                halt=(r.session_id, f"{r.tool_name} ({r.effect_id}): its answer was lost and its request may still "
                                    f"land: outcome unknown; check the tool, settle it (undolog effects resolve "
                                    f"{r.effect_id}), then resume or roll back"),
                event=_probe_event(r, answer, "unknown") if answer is not None else None,
            )
            self._note_state(r.session_id, SessionState.HALTED)
            return "unknown"
        if r.tier == ToolTier.IRREVERSIBLE:
            self._store.recovery.settle_effect(
                r.effect_id, EffectState.UNKNOWN,
                error="interrupted mid-run; no probe to tell whether it happened" if answer is None
                else "its answer was lost and its probe says it has not happened yet, but its request may still land"
                if not_yet else "interrupted mid-run; its probe could not tell whether it happened",
                halt=(r.session_id, f"{r.tool_name} ({r.effect_id}) was interrupted mid-run: outcome unknown; "
                                    f"check the tool, settle it (undolog effects resolve {r.effect_id}), then "
                                    "resume or roll back"),
                event=_probe_event(r, answer, "unknown") if answer is not None else None,
            )
            self._note_state(r.session_id, SessionState.HALTED)
            obs.recovery_log.log(obs.crash_level(), "halt: session %s halted: %s (%s) was interrupted mid-run, outcome unknown",
                                     r.session_id, r.tool_name, r.effect_id, extra=obs.ids(r.session_id, r.effect_id))
            return "unknown"
        if spec.compensation_needs_result:
            # Its undo is built from the result, which nobody saw: a person decides.
            self._store.recovery.settle_effect(
                r.effect_id, EffectState.UNKNOWN,
                error="outcome unknown, and its compensation needs the result it never returned",
                halt=(r.session_id, f"{r.tool_name} ({r.effect_id}): outcome unknown and its compensation needs "
                                    f"its result; check the tool, settle it (undolog effects resolve {r.effect_id}), "
                                    "then resume or roll back"),
                event=_probe_event(r, answer, "unknown") if answer is not None else None,
            )
            self._note_state(r.session_id, SessionState.HALTED)
            return "unknown"
        # COMPENSABLE, no proof it happened: compensate (a compensation tolerates "never happened").
        if answer is not None:
            self._store.recovery.note_event(_probe_event(r, answer, "compensated"))
        report = self._saga.rollback_sync(r.session_id, actor="undolog:recovery",
                                          reason=f"recovery of {r.effect_id}", only_effect=r.effect_id)
        if not report.steps or report.steps[-1].outcome != "compensated":
            raise UndoLogError(report.halted_reason or "compensation did not complete")
        self._halt(r.session_id, f"recovered after a crash: {r.tool_name} ({r.effect_id}) was compensated; "
                                 "review, then resume or roll back")
        return "compensated"

    def _attempt_failed(self, r: Any, error: str, report: RecoveryReport) -> str | None:
        # Stored as text, often a probe's or a compensation's exception: a lone surrogate or a NUL in it must not
        # fail the count, or the call would never reach the dead letter (every recover() failing on it again).
        error = clean_text(error)
        attempts = self._store.recovery.recovery_attempt_failed(
            r.effect_id, r.session_id, error, dead_letter_after=self.dead_letter_after,
            halt_reason=f"{r.tool_name} ({r.effect_id}) is in the dead letter after {{attempts}} failed recoveries",
        )
        if attempts >= self.dead_letter_after:
            self._note_state(r.session_id, SessionState.HALTED)
            report.dead_lettered.append(r.effect_id)
            return "dead_letter"
        report.errors.append(f"effect {r.effect_id}: recovery attempt {attempts} failed: {error}")
        obs.recovery_log.warning("recovery: attempt %d for %s (session %s, effect %s) failed: %s", attempts,
                                 r.tool_name, r.session_id, r.effect_id, error, extra=obs.ids(r.session_id, r.effect_id))
        return None
