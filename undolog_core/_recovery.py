"""Crash recovery: reconcile effects whose owner is gone, and take over interrupted rollbacks."""

from __future__ import annotations

import datetime as dt
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa

from . import _schema as t
from ._engine import jsonable, owner_alive
from ._faults import FaultPoint, fault
from ._saga import run_coro_blocking
from ._store import utcnow
from .errors import UndoLogError

if TYPE_CHECKING:
    from ._undolog import UndoLog


@dataclass(frozen=True)
class ProbeContext:
    """What a probe receives: an idempotent status check for one call.

    A probe returns False/None when the call did not happen, True when it did, or the call's result.
    """

    args: dict[str, Any]
    idempotency_key: str
    effect_id: str
    session_id: str
    tool_name: str


@dataclass
class RecoveryReport:
    reconciled: list[dict[str, Any]] = field(default_factory=list)
    rollbacks_resumed: list[str] = field(default_factory=list)
    dead_lettered: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    left_alive: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Recovery:
    dead_letter_after = 3

    def __init__(self, undolog: UndoLog) -> None:
        self._u = undolog

    def _dead(
        self, owner: str | None, lease: dt.datetime | None, effect_id: str | None = None, undo_id: int | None = None,
        rolling: str | None = None,
    ) -> bool:
        return not owner_alive(owner, lease, effect_id=effect_id, undo_id=undo_id, rolling=rolling)

    def recover(self, progress: Callable[[int, int, str], None] | None = None) -> RecoveryReport:
        """Finish what crashed processes left in flight. Safe to run from several processes at once.

        Example:
            >>> report = undolog.recover()
            >>> report.reconciled
            [{'effect_id': '...', 'tool_name': 'send_refund_email', 'outcome': 'compensated'}]
        """
        report = RecoveryReport()
        self._u.engine.flush_marks()
        store = self._u.store
        e, u = t.effect_log, t.undo_stack
        with store.read() as conn:
            q = sa.select(e.c.seq, e.c.effect_id, e.c.session_id, e.c.tool_name, e.c.tier, e.c.state, e.c.owner,
                          e.c.lease_until).where(e.c.state.in_(("pending", "running"))).order_by(e.c.seq)
            cursor = None
            if not store.is_postgres:  # see _schema: SQLite reads what was written since the cursor
                cursor = conn.execute(
                    sa.select(t.recovery_cursor.c.effect_seq, t.recovery_cursor.c.version)
                    .where(t.recovery_cursor.c.cursor_id == 1)
                ).one()
                newest = conn.execute(sa.select(sa.func.coalesce(sa.func.max(e.c.seq), 0))).scalar_one()
                q = q.where(e.c.seq > cursor.effect_seq)
            effects = conn.execute(q).all()
            undos = conn.execute(
                sa.select(u.c.undo_id, u.c.effect_id, u.c.session_id, u.c.owner, u.c.lease_until)
                .where(u.c.state == "compensating")
            ).all()
            intents = conn.execute(sa.select(t.rollbacks)).all()
        if cursor is not None:
            # Everything up to the oldest effect still in flight (or up to the newest row) has been seen settled.
            # Effects reconciled below are settled too, but stay ahead of the cursor until the next pass: a
            # re-read of a few rows, never a missed one.
            upto = effects[0].seq - 1 if effects else newest
            self._advance(cursor, upto)
        dead_effects = [r for r in effects if self._dead(r.owner, r.lease_until, r.effect_id)]
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
            if not self._claim_intent(ri):
                continue
            try:
                self._u.saga.rollback_sync(ri.session_id, actor=ri.actor,
                                           reason=f"{ri.reason or 'requested'} (interrupted, resumed by recovery)")
                report.rollbacks_resumed.append(ri.session_id)
            except UndoLogError as exc:
                report.errors.append(f"session {ri.session_id}: {exc.message}")
            if progress:
                progress(done, total, f"rollback {ri.session_id}")
        for ru in stray_undos:
            done += 1
            outcome = self._finish_stray(ru, report)
            if outcome:
                report.reconciled.append({"effect_id": ru.effect_id, "tool_name": outcome[0], "outcome": outcome[1]})
            if progress:
                progress(done, total, f"undo {ru.undo_id}: {outcome[1] if outcome else 'skipped'}")
        for r in dead_effects:
            done += 1
            if r.session_id in with_intent:
                continue  # a requested rollback covers it (above, or by its live walker)
            settled = self._reconcile(r, report)
            if settled:
                report.reconciled.append({"effect_id": r.effect_id, "tool_name": r.tool_name, "outcome": settled})
            if progress:
                progress(done, total, f"{r.tool_name} {r.effect_id}: {settled or 'skipped'}")
        return report

    def _claim_intent(self, r: Any) -> bool:
        """Compare-and-swap the rollback's owner: of several recoverers, one walks it."""
        now = utcnow()
        rb = t.rollbacks
        with self._u.store.tx() as conn:
            res = conn.execute(
                rb.update().where(rb.c.session_id == r.session_id, _same(rb.c.owner, r.owner))
                .values(owner=self._u.engine.owner, lease_until=now + dt.timedelta(seconds=self._u.lease_seconds))
            )
            return res.rowcount == 1

    def _finish_stray(self, r: Any, report: RecoveryReport) -> tuple[str, str] | None:
        """Finish the one compensation that was interrupted, and halt the session for a person."""
        try:
            out = self._u.saga.rollback_sync(r.session_id, actor="undolog:recovery",
                                             reason=f"recovery of {r.effect_id}", only_effect=r.effect_id)
        except UndoLogError as exc:
            report.errors.append(f"undo entry {r.undo_id}: {exc.message}")
            return None
        if not out.steps:
            return None
        step = out.steps[-1]
        if step.outcome == "compensated":
            with self._u.store.tx() as conn:
                self._u.engine.halt(conn, r.session_id,
                                    f"recovered after a crash: the compensation of {step.tool_name} ({r.effect_id}) "
                                    "was finished; review, then resume or roll back")
        return step.tool_name, step.outcome

    def _advance(self, cursor: Any, upto: int) -> None:
        if upto <= cursor.effect_seq:
            return
        rc = t.recovery_cursor
        with self._u.store.tx() as conn:
            # Compare-and-swap on the version: a claim that moved the cursor back meanwhile wins.
            conn.execute(
                rc.update().where(rc.c.cursor_id == 1, rc.c.version == cursor.version)
                .values(effect_seq=upto, version=rc.c.version + 1)
            )

    def _claim_effect(self, r: Any) -> bool:
        """Compare-and-swap the owner; on PostgreSQL SKIP LOCKED keeps racing recoverers from waiting on each other."""
        store = self._u.store
        e = t.effect_log
        now = utcnow()
        with store.tx() as conn:
            row = conn.execute(
                store.for_update(
                    sa.select(e.c.effect_id).where(e.c.effect_id == r.effect_id, e.c.state == r.state,
                                                   _same(e.c.owner, r.owner)),
                    skip_locked=True,
                )
            ).first()
            if row is None:
                return False
            res = conn.execute(
                e.update().where(e.c.effect_id == r.effect_id, e.c.state == r.state, _same(e.c.owner, r.owner))
                .values(owner=self._u.engine.owner, lease_until=now + dt.timedelta(seconds=self._u.lease_seconds))
            )
            if res.rowcount != 1:
                return False
        self._u.engine._inflight.add(r.effect_id)
        self._u.engine._ensure_renewer()
        return True

    def _reconcile(self, r: Any, report: RecoveryReport) -> str | None:
        spec = self._u.registry.tools.get(r.tool_name)
        if spec is None:
            report.errors.append(
                f"effect {r.effect_id}: tool {r.tool_name!r} is not registered here; load the app (--app) to recover it"
            )
            return None
        if r.tier == "compensable" and spec.probe is None:
            assert spec.compensation is not None
            if spec.compensation.name not in self._u.registry.compensations:
                report.errors.append(
                    f"effect {r.effect_id}: compensation {spec.compensation.name!r} is not registered here; "
                    "nothing was changed"
                )
                return None
        if not self._claim_effect(r):
            return None
        fault(FaultPoint.DURING_RECOVERY)
        try:
            return self._reconcile_claimed(r, spec)
        except Exception as exc:  # noqa: BLE001 - counted toward the dead letter, never lost
            return self._attempt_failed(r, f"{type(exc).__name__}: {exc}", report)
        finally:
            self._u.engine._inflight.discard(r.effect_id)

    def _reconcile_claimed(self, r: Any, spec: Any) -> str:
        store = self._u.store
        e = t.effect_log
        with store.read() as conn:
            row = conn.execute(sa.select(e).where(e.c.effect_id == r.effect_id)).one()
        verdict: Any = None
        if spec.probe is not None:
            ctx = ProbeContext(dict(row.args_snapshot), f"do-{r.effect_id}", r.effect_id, r.session_id, r.tool_name)
            verdict = spec.probe(ctx)
            if inspect.isawaitable(verdict):
                verdict = run_coro_blocking(verdict)
            if verdict is not None and verdict is not False:
                result = None if verdict is True else jsonable(verdict)
                self._set(r.effect_id, state="committed", result_snapshot=result)
                return "committed"
        now = utcnow()
        if r.tier == "irreversible":
            if spec.probe is not None:
                # The probe says it never happened: the approved call may run once when re-issued.
                self._set(r.effect_id, state="approved")
                return "not_run"
            self._set(r.effect_id, state="unknown", error="interrupted mid-run; no probe to tell whether it happened")
            with store.tx() as conn:
                self._u.engine.halt(conn, r.session_id,
                                    f"{r.tool_name} ({r.effect_id}) was interrupted mid-run: outcome unknown", now=now)
            return "unknown"
        # COMPENSABLE, no proof it happened: compensate (a compensation tolerates "never happened").
        report = self._u.saga.rollback_sync(r.session_id, actor="undolog:recovery",
                                            reason=f"recovery of {r.effect_id}", only_effect=r.effect_id)
        if not report.steps or report.steps[-1].outcome != "compensated":
            raise UndoLogError(report.halted_reason or "compensation did not complete")
        with store.tx() as conn:
            self._u.engine.halt(
                conn, r.session_id,
                f"recovered after a crash: {r.tool_name} ({r.effect_id}) was compensated; review, then resume or "
                "roll back", now=now,
            )
        return "compensated"

    def _set(self, effect_id: str, **values: Any) -> None:
        with self._u.store.tx() as conn:
            conn.execute(
                t.effect_log.update().where(t.effect_log.c.effect_id == effect_id)
                .values(owner=None, lease_until=None, updated_at=utcnow(), **values)
            )

    def _attempt_failed(self, r: Any, error: str, report: RecoveryReport) -> str | None:
        e = t.effect_log
        with self._u.store.tx() as conn:
            attempts = conn.execute(sa.select(e.c.recovery_attempts).where(e.c.effect_id == r.effect_id)).scalar_one() + 1
            if attempts >= self.dead_letter_after:
                conn.execute(
                    e.update().where(e.c.effect_id == r.effect_id).values(
                        state="dead_letter", recovery_attempts=attempts, owner=None, lease_until=None,
                        error=f"recovery failed {attempts} times; last: {error}", updated_at=utcnow(),
                    )
                )
                self._u.engine.halt(conn, r.session_id,
                                    f"{r.tool_name} ({r.effect_id}) is in the dead letter after {attempts} failed recoveries")
                report.dead_lettered.append(r.effect_id)
                return "dead_letter"
            # Release the claim (owner cleared) so the next recover() tries again.
            conn.execute(
                e.update().where(e.c.effect_id == r.effect_id).values(
                    recovery_attempts=attempts, owner=None, lease_until=None, error=f"recovery attempt failed: {error}",
                    updated_at=utcnow(),
                )
            )
        report.errors.append(f"effect {r.effect_id}: recovery attempt {attempts} failed: {error}")
        return None


def _same(col: Any, value: Any) -> Any:
    return col.is_(None) if value is None else col == value
