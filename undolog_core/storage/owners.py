"""``store.owners``: sessions held by a live process (``undolog_session_owners``): its lease, and a rollback filed
for it to run. A repository of its own rather than part of ``store.sessions``: the table is the gateway's and
the desk's rendezvous (who serves a session now, and the rollback one files for the other), written by no
transaction that writes another table, and read on no call's path."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa

from . import schema as t
from .base import Store

_O = t.session_owners

# The owner of one session (None: no process holds it).
OWNER_OF = sa.select(_O.c.owner, _O.c.lease_until, _O.c.wakes_on_signal).where(_O.c.session_id == sa.bindparam("session_id"))
# A process takes (or renews) a session it serves: whoever held it before, the process serving it now owns it.
TAKE = (_O.update().where(_O.c.session_id == sa.bindparam("sid"))
        .values(owner=sa.bindparam("own"), lease_until=sa.bindparam("until"), wakes_on_signal=sa.bindparam("wakes")))
# Every session the owner holds, its lease renewed at once.
RENEW = _O.update().where(_O.c.owner == sa.bindparam("own")).values(lease_until=sa.bindparam("until"))
# A rollback filed for the owner: only one at a time (a second request waits on the first's report).
FILE = (_O.update().where(_O.c.session_id == sa.bindparam("sid"), _O.c.rollback_requested_at.is_(None))
        .values(rollback_actor=sa.bindparam("actor"), rollback_reason=sa.bindparam("reason"),
                rollback_requested_at=sa.bindparam("now"), rollback_report=sa.null()))
# The rollbacks filed for an owner that it has not answered yet (an SQL NULL report: sa.null(), not JSON null).
FILED = (sa.select(_O.c.session_id, _O.c.rollback_actor, _O.c.rollback_reason)
         .where(_O.c.owner == sa.bindparam("own"), _O.c.rollback_requested_at.is_not(None),
                _O.c.rollback_report.is_(None)))
# The owner's answer to a filed rollback: its report (or the error that refused it).
ANSWER = (_O.update().where(_O.c.session_id == sa.bindparam("sid"), _O.c.rollback_requested_at.is_not(None))
          .values(rollback_report=sa.bindparam("report")))
# What the requester reads while it waits.
REPORT = sa.select(_O.c.rollback_report, _O.c.rollback_requested_at).where(_O.c.session_id == sa.bindparam("sid"))
# The request answered and read: the session can be filed for again.
CLOSE = (_O.update().where(_O.c.session_id == sa.bindparam("sid"))
         .values(rollback_actor=None, rollback_reason=None, rollback_requested_at=None, rollback_report=sa.null()))
# A process that stops serving lets go of every session it held: its lease ends now (a requester then runs the
# rollback itself, and says it ran without the live upstream).
LET_GO = _O.update().where(_O.c.owner == sa.bindparam("own")).values(lease_until=sa.bindparam("now"))


class OwnersSQL:
    """``store.owners``: sessions held by a live process, and rollbacks filed for it (``contract.OwnersRepository``).

    Example:
        >>> storage.owners.hold_sessions(owner, ["s1"], until=utcnow() + dt.timedelta(seconds=30))
        >>> storage.owners.session_owner("s1").owner == owner
        True
    """

    def __init__(self, store: Store) -> None:
        self._store = store

    def session_owner(self, session_id: str) -> Any:
        """The process holding the session (``owner``, ``lease_until``, ``wakes_on_signal``), or None."""
        with self._store.read() as conn:
            return conn.execute(OWNER_OF, {"session_id": session_id}).first()

    def hold_sessions(self, owner: str, session_ids: Iterable[str], *, until: dt.datetime,
                      wakes_on_signal: bool = False) -> None:
        """Take (or renew) the sessions for ``owner`` until ``until``, whoever held them before, in one
        transaction: the process serving a session now owns it."""
        with self._store.tx() as conn:
            for sid in session_ids:
                taken = {"sid": sid, "own": owner, "until": until, "wakes": wakes_on_signal}
                if conn.execute(TAKE, taken).rowcount == 0:
                    conn.execute(_O.insert().values(session_id=sid, owner=owner, lease_until=until,
                                                    wakes_on_signal=wakes_on_signal))

    def renew_sessions(self, owner: str, *, until: dt.datetime) -> None:
        """Renew the lease of every session ``owner`` holds."""
        with self._store.tx() as conn:
            conn.execute(RENEW, {"own": owner, "until": until})

    def file_rollback(self, session_id: str, *, actor: str, reason: str | None, now: dt.datetime) -> bool:
        """File a rollback of the session for its owner to run; False when one is filed already (the caller
        waits on that one's report)."""
        with self._store.tx() as conn:
            return bool(conn.execute(FILE, {"sid": session_id, "actor": actor, "reason": reason, "now": now})
                        .rowcount)

    def filed_rollbacks(self, owner: str) -> list[Any]:
        """The rollbacks filed for ``owner``'s sessions that it has not answered yet."""
        with self._store.read() as conn:
            return list(conn.execute(FILED, {"own": owner}).all())

    def answer_rollback(self, session_id: str, report: Mapping[str, Any]) -> None:
        """The owner's answer to a filed rollback: its report (or the error that refused it)."""
        with self._store.tx() as conn:
            conn.execute(ANSWER, {"sid": session_id, "report": dict(report)})

    def rollback_answer(self, session_id: str) -> Any:
        """What the requester of a rollback reads while it waits: the report (None: not answered yet)."""
        with self._store.read() as conn:
            return conn.execute(REPORT, {"sid": session_id}).first()

    def close_rollback(self, session_id: str) -> None:
        """The filed rollback answered and read: the session can be filed for again."""
        with self._store.tx() as conn:
            conn.execute(CLOSE, {"sid": session_id})

    def let_go_sessions(self, owner: str, *, now: dt.datetime) -> None:
        """``owner`` stops serving: the lease of every session it held ends ``now``."""
        with self._store.tx() as conn:
            conn.execute(LET_GO, {"own": owner, "now": now})
