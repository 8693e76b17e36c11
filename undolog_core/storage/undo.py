"""``store.undo``: the undo entries (``undolog_undo_stack``), one per COMPENSABLE effect, its ``undo_id`` the
effect's seq. This module is the one place an entry is written: armed with its effect's pre-write (``arm_in``),
claimed, compensated, failed, dropped, its lease renewed. The hot path's raw pre-writes arm the same row in their
one statement: PostgreSQL's from ``hotpath.ARM_FROM_E`` (in ``hotpath.py``, which ``postgres.py`` imports, since
this module's import of ``base`` would close a circle through ``base``'s lazy import of ``postgres``), SQLite's from
the trigger migration 0010 installed (``schema.SQLITE_PREWRITE_TRIGGER``); the conformance suite holds both equal
to ``arm_in``'s.

Every state change is guarded by the undo entry's machine in ``undolog_core/states.py`` (``UNDO``)."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..states import UNDO
from . import schema as t
from .base import Store, utcnow
from .schema import UndoState

_U = t.undo_stack
_E = t.effect_log

# An entry compensated (the saga's step, or recovery's one-statement record, which runs it as a CTE).
COMPENSATED = _U.update().where(_U.c.undo_id == sa.bindparam("uid"), UNDO.guard("compensated", _U.c.state)).values(
    state=UndoState.COMPENSATED.value, attempts=_U.c.attempts + 1, owner=None, lease_until=None,
    updated_at=sa.bindparam("now"))
# A gateway's capture, stored with the undo entry before the call is sent (put_undo_args). The entry is found by
# its id, the effect's seq (both primary keys): undo_stack has no index on effect_id.
_PUT_UNDO_ARGS = _U.update().where(
    _U.c.undo_id == sa.select(_E.c.seq).where(_E.c.effect_id == sa.bindparam("eid")).scalar_subquery(),
    _U.c.state == UndoState.ARMED.value,
).values(args_snapshot=sa.bindparam("args", type_=_U.c.args_snapshot.type), updated_at=sa.bindparam("now"))


class UndoSQL:
    """``store.undo``: the undo entries (``contract.UndoRepository``); ``*_in`` methods join the caller's
    transaction, the others run one of their own. It writes no other table: the transactions that move an entry
    and its effect together are ``store.effects``'s, which calls the ``*_in`` methods here.

    Example:
        >>> [e["compensation_name"] for e in storage.undo.undo_plan("ticket-1042")]
        ['cancel_refund']
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    # -- writes in the caller's transaction ------------------------------------------------------------

    def arm_in(self, conn: Connection, *, undo_id: int, effect_id: str, session_id: str, compensation_name: str,
               compensation_version: int, args_snapshot: Any, now: dt.datetime) -> None:
        """Arm a COMPENSABLE effect's entry (``undo_id``: the effect's seq) in the pre-write's transaction."""
        conn.execute(_U.insert(), {
            "undo_id": undo_id, "effect_id": effect_id, "session_id": session_id,
            "compensation_name": compensation_name, "compensation_version": compensation_version,
            "args_snapshot": args_snapshot, "state": UndoState.ARMED.value, "attempts": 0, "created_at": now,
            "updated_at": now,
        })

    def compensated_in(self, conn: Connection, undo_id: int, now: dt.datetime) -> None:
        """The entry ``compensated`` (its attempts counted, its owner gone), if the state table allows it."""
        conn.execute(COMPENSATED, {"uid": undo_id, "now": now})

    def undo_failed_in(self, conn: Connection, undo_id: int, now: dt.datetime) -> None:
        """The entry's compensation gave up (``compensation_failed``): a person decides."""
        conn.execute(
            _U.update().where(_U.c.undo_id == undo_id, UNDO.guard("failed", _U.c.state))
            .values(state=UndoState.COMPENSATION_FAILED.value, owner=None, lease_until=None, updated_at=now)
        )

    def drop_armed_in(self, conn: Connection, effect_id: str) -> None:
        """The effect did not happen: its entry goes if it is still armed (no rollback compensates it)."""
        conn.execute(_U.delete().where(_U.c.effect_id == effect_id, _U.c.state == UndoState.ARMED.value))

    def resolve_compensated_in(self, conn: Connection, effect_id: str, now: dt.datetime) -> None:
        """A person said the effect was compensated: its entry is ``compensated`` and no rollback runs it again."""
        conn.execute(_U.update().where(_U.c.effect_id == effect_id, UNDO.guard("resolve_compensated", _U.c.state))
                     .values(state=UndoState.COMPENSATED.value, owner=None, lease_until=None, updated_at=now))

    def claim_armed_in(self, conn: Connection, undo_ids: Sequence[int], owner: str, lease_until: dt.datetime,
                       now: dt.datetime) -> set[int]:
        """Claim the armed ones of ``undo_ids`` for ``owner`` (``compensating``); the ids claimed (an entry a walk
        claimed already is its walk's)."""
        if not undo_ids:
            return set()
        return set(conn.execute(
            _U.update().where(self._store.one_of(_U.c.undo_id, list(undo_ids)), _U.c.state == UndoState.ARMED.value,
                              UNDO.guard("claim", _U.c.state))
            .values(state=UndoState.COMPENSATING.value, owner=owner, lease_until=lease_until, updated_at=now)
            .returning(_U.c.undo_id)
        ).scalars().all())

    def renew_in(self, conn: Connection, owner: str, undo_ids: Sequence[int], until: dt.datetime) -> None:
        """Extend the lease of the entries ``owner`` still holds."""
        conn.execute(_U.update().where(_U.c.undo_id.in_(list(undo_ids)), _U.c.owner == owner)
                     .values(lease_until=until))

    # -- reads in the caller's transaction -------------------------------------------------------------

    def undo_entries_in(self, conn: Connection, session_id: str, only_effect: str | None) -> builtins.list[Any]:
        """The session's entries not compensated yet, newest first, with their effect's state and owner."""
        q = (
            sa.select(_U, _E.c.tool_name, _E.c.state.label("effect_state"), _E.c.result_snapshot,
                      _E.c.owner.label("effect_owner"), _E.c.lease_until.label("effect_lease"))
            .select_from(_E.join(_U, _U.c.undo_id == _E.c.seq))
            .where(_E.c.session_id == session_id, _U.c.state != UndoState.COMPENSATED.value)
            .order_by(_U.c.undo_id.desc())
        )
        if only_effect is not None:
            q = q.where(_E.c.effect_id == only_effect)
        return list(conn.execute(q).all())

    def compensating_in(self, conn: Connection) -> builtins.list[Any]:
        """Every entry being compensated (recovery's scan): undo_id, effect_id, session_id, owner, lease_until."""
        return list(conn.execute(
            sa.select(_U.c.undo_id, _U.c.effect_id, _U.c.session_id, _U.c.owner, _U.c.lease_until)
            .where(_U.c.state == UndoState.COMPENSATING.value)
        ).all())

    def state_of_effect_in(self, conn: Connection, effect_id: str) -> str | None:
        """The state of the effect's entry (None: it has none)."""
        state = conn.execute(sa.select(_U.c.state).where(_U.c.effect_id == effect_id)).scalar()
        return None if state is None else str(state)

    # -- units of work ---------------------------------------------------------------------------------

    def put_undo_args(self, effect_id: str, args: Any) -> bool:
        """Replace the stored arguments of an effect's armed undo entry (what its compensation is given): a gateway
        stores there what it captured before the call ran. False when the entry is not armed (or not there).

        Example:
            >>> store.undo.put_undo_args(effect_id, {"path": "a.txt", "dev.undolog/before": {"content": "old"}})
            True
        """
        with self._store.tx() as conn:
            res = conn.execute(_PUT_UNDO_ARGS, {"eid": effect_id, "args": args, "now": utcnow()})
            return bool(res.rowcount == 1)

    def claim_undo(self, undo_id: int, *, seen_state: str, seen_owner: str | None, owner: str,
                   lease_until: dt.datetime) -> bool:
        """Compare-and-swap on what the plan saw: two rollbacks of one session never run a compensation twice."""
        owner_is = _U.c.owner.is_(None) if seen_owner is None else _U.c.owner == seen_owner
        with self._store.tx() as conn:
            res = conn.execute(
                _U.update()
                .where(_U.c.undo_id == undo_id, _U.c.state == seen_state, UNDO.guard("claim", _U.c.state), owner_is)
                .values(state=UndoState.COMPENSATING.value, owner=owner, lease_until=lease_until,
                        updated_at=utcnow())
            )
            return bool(res.rowcount == 1)

    def undo_attempt_failed(self, undo_id: int, error: str) -> None:
        """Count a failed compensation attempt and keep its error; the entry stays as it is."""
        with self._store.tx() as conn:
            conn.execute(_U.update().where(_U.c.undo_id == undo_id)
                         .values(attempts=_U.c.attempts + 1, last_error=error, updated_at=utcnow()))

    def undo_plan(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """Which compensations would run, in order, if the session rolled back now."""
        with self._store.read() as conn:
            rows = conn.execute(
                sa.select(_U.c.undo_id, _U.c.compensation_name, _U.c.compensation_version, _U.c.state,
                          _E.c.tool_name, _E.c.effect_id, _E.c.state.label("effect_state"))
                .select_from(_E.join(_U, _U.c.undo_id == _E.c.seq))
                .where(_E.c.session_id == session_id, _U.c.state != UndoState.COMPENSATED.value)
                .order_by(_U.c.undo_id.desc())
            ).all()
        return [dict(r._mapping) for r in rows]
