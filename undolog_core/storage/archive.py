"""``store.archive``: the archive table (``undolog_archive``) that ``undolog gc`` fills: which sessions are settled,
and moving their effects and undo entries into it."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from ..states import SESSION
from . import schema as t
from .audit import AuditSQL, PendingEvent
from .base import Store
from .schema import EffectState, RequestState, SessionState, UndoState

#: Effects that may still run or be decided: a session holding one is never settled.
_LIVE_EFFECTS = (EffectState.PENDING, EffectState.RUNNING, EffectState.AWAITING_APPROVAL, EffectState.APPROVED,
                 EffectState.RELEASED)
_OPEN_REQUESTS = (RequestState.PENDING, RequestState.APPROVED, RequestState.AUTO_APPROVED)


@dataclass
class GcBatch:
    """What one gc transaction archived."""

    sessions: builtins.list[str] = field(default_factory=list)
    closed: builtins.list[str] = field(default_factory=list)
    effects: int = 0
    undo_entries: int = 0


def _jsonable_row(row: Mapping[Any, Any]) -> dict[str, Any]:
    return {str(k): (v.isoformat() if isinstance(v, dt.datetime) else v) for k, v in row.items()}


class ArchiveSQL:
    """``store.archive``: archiving the effect log and undo stack of settled sessions (``undolog gc``), and reading
    what was archived (``contract.ArchiveRepository``).

    Example:
        >>> ids = storage.archive.settled_sessions(cutoff, limit=500)
        >>> storage.archive.archive_sessions(ids, cutoff, run_id="...", actor="ana", now=utcnow())
    """

    def __init__(self, store: Store, *, audit: AuditSQL) -> None:
        self._store = store
        self._audit = audit

    def _settled(self, cutoff: dt.datetime) -> Any:
        """A session that nothing can change any more, idle since before ``cutoff``, with something to archive.

        Completed and rolled-back sessions are settled; an active one only when no call of it can still run or be
        decided, no rollback or compensation of it is under way, and none of its effects changed since the cutoff.
        Halted sessions wait for a person and are never settled.
        """
        s, e, u, r = t.sessions, t.effect_log, t.undo_stack, t.approval_requests
        archivable = sa.exists().where(e.c.session_id == s.c.session_id,
                                       ~sa.exists().where(r.c.effect_id == e.c.effect_id))
        quiet = sa.and_(
            s.c.state == SessionState.ACTIVE.value,
            ~sa.exists().where(e.c.session_id == s.c.session_id,
                               sa.or_(e.c.state.in_([x.value for x in _LIVE_EFFECTS]), e.c.updated_at >= cutoff)),
            ~sa.exists().where(u.c.session_id == s.c.session_id, u.c.state == UndoState.COMPENSATING.value),
            ~sa.exists().where(r.c.session_id == s.c.session_id, r.c.state.in_([x.value for x in _OPEN_REQUESTS])),
            ~sa.exists().where(t.rollbacks.c.session_id == s.c.session_id),
        )
        ended = s.c.state.in_((SessionState.COMPLETED.value, SessionState.ROLLED_BACK.value))
        return sa.and_(s.c.updated_at < cutoff, sa.or_(ended, quiet), archivable)

    def settled_sessions(self, cutoff: dt.datetime, *, limit: int,
                         after: str | None = None) -> builtins.list[str]:
        """Up to ``limit`` settled sessions (see ``_settled``) in id order, after ``after``."""
        s = t.sessions
        q = sa.select(s.c.session_id).where(self._settled(cutoff)).order_by(s.c.session_id).limit(limit)
        if after is not None:
            q = q.where(s.c.session_id > after)
        with self._store.read() as conn:
            return list(conn.execute(q).scalars().all())

    def archive_sessions(self, session_ids: Sequence[str], cutoff: dt.datetime, *, run_id: str, actor: str,
                         now: dt.datetime) -> GcBatch:
        """Move the effects and undo entries of those of ``session_ids`` still settled into ``undolog_archive``,
        in ONE transaction with the audit event (``gc.archive``) that records it.

        An active session is closed (``completed``) in the same transaction: once its effects are archived a
        re-issued call id could not be recognised any more, so the session must take no further call. Effects an
        approval request refers to stay (the request and its audit events point at them).
        """
        s, e, u, r, a = t.sessions, t.effect_log, t.undo_stack, t.approval_requests, t.archive
        batch = GcBatch()
        one_of = self._store.one_of
        with self._store.tx() as conn:
            rows = conn.execute(self._store.for_update(
                sa.select(s.c.session_id, s.c.state)
                .where(one_of(s.c.session_id, list(session_ids)), self._settled(cutoff))
                .order_by(s.c.session_id), skip_locked=True)).all()
            if not rows:
                return batch
            batch.sessions = [x.session_id for x in rows]
            batch.closed = [x.session_id for x in rows if x.state == SessionState.ACTIVE.value]
            if batch.closed:
                conn.execute(s.update().where(one_of(s.c.session_id, batch.closed),
                                              SESSION.guard("complete", s.c.state))
                             .values(state=SessionState.COMPLETED.value, updated_at=now))
            effects = conn.execute(
                sa.select(e).where(one_of(e.c.session_id, batch.sessions),
                                   ~sa.exists().where(r.c.effect_id == e.c.effect_id)).order_by(e.c.seq)
            ).all()
            seqs = [x.seq for x in effects]
            undos = conn.execute(sa.select(u).where(one_of(u.c.undo_id, seqs)).order_by(u.c.undo_id)).all()
            archived = [{"run_id": run_id, "kind": "undo", "session_id": x.session_id, "ref": str(x.undo_id),
                         "row": _jsonable_row(x._mapping), "archived_at": now} for x in undos]
            archived += [{"run_id": run_id, "kind": "effect", "session_id": x.session_id, "ref": x.effect_id,
                          "row": _jsonable_row(x._mapping), "archived_at": now} for x in effects]
            self._store.insert_many_in(conn, a, archived)
            if undos:
                conn.execute(u.delete().where(one_of(u.c.undo_id, [x.undo_id for x in undos])))
            if seqs:
                conn.execute(e.delete().where(one_of(e.c.seq, seqs)))
            batch.effects, batch.undo_entries = len(effects), len(undos)
            self._audit.append_events_in(conn, [PendingEvent(
                subject=f"gc:{run_id}", action="gc.archive", actor=actor,
                payload={"run_id": run_id, "idle_before": cutoff.isoformat(), "sessions": batch.sessions,
                         "closed": batch.closed, "effects": batch.effects, "undo_entries": batch.undo_entries,
                         "first_seq": seqs[0] if seqs else None, "last_seq": seqs[-1] if seqs else None},
            )], now=now)
        return batch

    def archived(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The archived rows of one session, oldest first: ``{"kind", "ref", "run_id", "archived_at", "row"}``."""
        a = t.archive
        with self._store.read() as conn:
            rows = conn.execute(sa.select(a).where(a.c.session_id == session_id).order_by(a.c.archive_id)).all()
        return [{"kind": x.kind, "ref": x.ref, "run_id": x.run_id, "archived_at": x.archived_at, "row": x.row}
                for x in rows]
