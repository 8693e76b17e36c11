"""The COMPENSABLE hot path on the raw driver: SQL rendered once, connections from two small bounded pools.

SQLAlchemy Core costs more per statement than the durable commit it wraps on a fast disk, and the pre-write and
the commit mark run on every COMPENSABLE call. Everything else (rare paths, errors, pins) stays on Core.
The values written are exactly what Core would write (same datetime text on SQLite, same JSON), so both paths
read back alike.
"""

from __future__ import annotations

import sqlite3
import time
from typing import Any

from ..errors import DatabaseUnavailable
from .base import Store, from_epoch
from .pool import IntegrityConflict, RawPool, WouldBlock, is_unavailable

_EFFECT_COLS = (
    "effect_id, session_id, call_id, tool_name, tool_revision, tier, state, args_snapshot, args_digest, owner, "
    "lease_until, recovery_attempts, created_at, updated_at"
)
_UNDO_COLS = (
    "undo_id, effect_id, session_id, compensation_name, compensation_version, args_snapshot, state, attempts, created_at, "
    "updated_at"
)
_WRITABLE = "state IN ('active', 'awaiting_approval')"

_SQLITE_GUARD = (
    f"UPDATE undolog_sessions SET tool_calls_total = tool_calls_total + ?, updated_at = ? "
    f"WHERE session_id = ? AND {_WRITABLE}"
)
_SQLITE_EFFECT = (
    f"INSERT INTO undolog_effect_log ({_EFFECT_COLS}) "
    "VALUES (?, ?, ?, ?, ?, 'compensable', 'pending', ?, ?, ?, ?, 0, ?, ?)"
)
# With no counts to flush, the session is only checked, not written: one page less in every pre-write.
_SQLITE_EFFECT_CHECKED = (
    f"INSERT INTO undolog_effect_log ({_EFFECT_COLS}) "
    "SELECT ?, ?, ?, ?, ?, 'compensable', 'pending', ?, ?, ?, ?, 0, ?, ? "
    f"WHERE EXISTS (SELECT 1 FROM undolog_sessions WHERE session_id = ? AND {_WRITABLE})"
)
_SQLITE_MARK = (
    "UPDATE undolog_effect_log SET state = 'committed', result_snapshot = ?, owner = NULL, lease_until = NULL, "
    "updated_at = ? WHERE effect_id = ? AND state IN ('pending', 'running')"
)

# One statement, one round trip, one commit: the session check, the effect and its undo entry.
_PG_PREWRITE = f"""
WITH g AS (
  UPDATE undolog_sessions SET tool_calls_total = tool_calls_total + %(count)s, updated_at = %(now)s
  WHERE session_id = %(session_id)s AND {_WRITABLE} RETURNING session_id
), e AS (
  INSERT INTO undolog_effect_log ({_EFFECT_COLS})
  SELECT %(effect_id)s, g.session_id, %(call_id)s, %(tool_name)s, %(revision)s, 'compensable', 'pending',
         %(args)s::json, %(digest)s, %(owner)s, %(lease)s, 0, %(now)s, %(now)s FROM g
  RETURNING seq, effect_id, session_id
)
INSERT INTO undolog_undo_stack ({_UNDO_COLS})
SELECT e.seq, e.effect_id, e.session_id, %(comp)s, %(comp_version)s, %(args)s::json, 'armed', 0, %(now)s, %(now)s FROM e
"""
_PG_PREWRITE_CHECKED = f"""
WITH e AS (
  INSERT INTO undolog_effect_log ({_EFFECT_COLS})
  SELECT %(effect_id)s, s.session_id, %(call_id)s, %(tool_name)s, %(revision)s, 'compensable', 'pending',
         %(args)s::json, %(digest)s, %(owner)s, %(lease)s, 0, %(now)s, %(now)s
  FROM undolog_sessions s WHERE s.session_id = %(session_id)s AND s.{_WRITABLE}
  RETURNING seq, effect_id, session_id
)
INSERT INTO undolog_undo_stack ({_UNDO_COLS})
SELECT e.seq, e.effect_id, e.session_id, %(comp)s, %(comp_version)s, %(args)s::json, 'armed', 0, %(now)s, %(now)s FROM e
"""
_PG_MARK = (
    "UPDATE undolog_effect_log SET state = 'committed', result_snapshot = %s::json, owner = NULL, "
    "lease_until = NULL, updated_at = %s WHERE effect_id = %s AND state IN ('pending', 'running')"
)


_seconds: dict[int, str] = {}


def _sqlite_time(t: float) -> str:
    """The text SQLAlchemy's SQLite DateTime writes for the UTC instant ``t`` (epoch seconds).

    ``YYYY-MM-DD HH:MM:SS.ffffff``: the seconds part changes once a second, so it is formatted once and kept (a
    call formats two seconds: now and its lease's end; a few are kept, and a dict's get and set are atomic under
    the GIL). Working from ``time.time()`` instead of datetimes keeps object churn off the hot path.
    """
    sec = int(t)
    text = _seconds.get(sec)
    if text is None:
        if len(_seconds) > 16:
            _seconds.clear()
        text = _seconds[sec] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(sec))
    return f"{text}.{int((t - sec) * 1e6):06d}"


class HotPath:
    """The pre-write and the commit mark on raw connections from two small pools (durable and fast).

    ``wait=False`` (the async driver on an event loop) raises ``WouldBlock`` before anything is written when a
    connection or SQLite's in-process write lock is not free at once, so the caller can retry in a thread.
    """

    def __init__(self, store: Store, *, pool_size: int, fast_pool_size: int) -> None:
        self.store = store
        self.sqlite = not store.is_postgres
        self.write_lock = store.write_lock
        self.durable = RawPool(store.engine, pool_size, setup=self._setup)
        self.fast = RawPool(store.fast, fast_pool_size, setup=self._setup)

    def _setup(self, conn: Any) -> None:
        if self.sqlite:
            # What the pool's connections check by foreign key, the hot path's statements guarantee themselves:
            # the effect is inserted only where the session row exists (in the same statement), its undo entry
            # refers to it, and a commit mark changes no key. Skipping the checks saves two lookups per pre-write.
            conn.execute("PRAGMA foreign_keys=OFF")
        else:
            conn.autocommit = True

    def _lock(self, wait: bool) -> None:
        if not self.write_lock.acquire(blocking=wait):
            raise WouldBlock()

    def prewrite(
        self,
        session_id: str,
        count: int,
        effect_id: str,
        call_id: str,
        tool_name: str,
        revision: int,
        args_text: str,
        digest: str,
        owner: str,
        now: float,
        lease: float,
        comp: str,
        comp_version: int,
        wait: bool = True,
    ) -> bool:
        """One durable transaction; False when the session does not accept writes (nothing written).

        ``count`` calls counted in memory are flushed to the session row on the way; with none, the session row is
        only checked. ``now`` and ``lease`` (the lease's end) are epoch seconds, as ``time.time()`` gives them.
        Positional on purpose: this runs on every COMPENSABLE call. A database that went away raises
        ``DatabaseUnavailable``; the effect may then exist (the commit's outcome is unknown), owned by this
        process and never run: ``recover()`` settles it by its id, and it is never written a second time.
        """
        pool = self.durable
        conn, gen = pool.checkout(wait=wait)
        broken = False
        try:
            if self.sqlite:
                now_s = _sqlite_time(now)
                # The undo entry is written by the schema's trigger (schema.SQLITE_UNDO_TRIGGER), in the same
                # statement as the effect.
                row = (effect_id, session_id, call_id, tool_name, revision, args_text, digest, owner,
                       _sqlite_time(lease), now_s, now_s)
                self._lock(wait)
                try:
                    if not count:
                        # One autocommit statement: a write statement takes the write lock before it reads, like
                        # BEGIN IMMEDIATE, so the session check and the insert see one state.
                        return bool(conn.execute(_SQLITE_EFFECT_CHECKED, (*row, session_id)).rowcount == 1)
                    return self._sqlite_prewrite(conn, row, now_s, session_id, count)
                finally:
                    self.write_lock.release()
            cur = conn.execute(
                _PG_PREWRITE if count else _PG_PREWRITE_CHECKED,
                {"count": count, "now": from_epoch(now), "session_id": session_id, "effect_id": effect_id,
                 "call_id": call_id, "tool_name": tool_name, "revision": revision, "args": args_text,
                 "digest": digest, "owner": owner, "lease": from_epoch(lease), "comp": comp,
                 "comp_version": comp_version},
            )
            return bool(cur.rowcount == 1)
        except (sqlite3.IntegrityError, _pg_integrity_error()) as exc:
            raise IntegrityConflict(str(exc)) from exc
        except WouldBlock:
            raise
        except BaseException as exc:
            if is_unavailable(exc):
                broken = True
                raise DatabaseUnavailable("the pre-write", exc) from exc
            raise
        finally:
            pool.checkin(conn, gen, broken=broken)

    @staticmethod
    def _sqlite_prewrite(conn: Any, row: tuple[Any, ...], now_s: str, session_id: str, count: int) -> bool:
        conn.execute("BEGIN IMMEDIATE")
        try:
            if conn.execute(_SQLITE_GUARD, (count, now_s, session_id)).rowcount != 1:
                conn.execute("ROLLBACK")
                return False
            conn.execute(_SQLITE_EFFECT, row)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return True

    def mark(self, effect_id: str, text: str, now: float, *, fast: bool, wait: bool = True) -> bool:
        """The commit mark as one autocommit UPDATE; False when the effect was not in flight."""
        pool = self.fast if fast else self.durable
        conn, gen = pool.checkout(wait=wait)
        broken = False
        try:
            if self.sqlite:
                self._lock(wait)
                try:
                    return bool(conn.execute(_SQLITE_MARK, (text, _sqlite_time(now), effect_id)).rowcount == 1)
                finally:
                    self.write_lock.release()
            return bool(conn.execute(_PG_MARK, (text, from_epoch(now), effect_id)).rowcount == 1)
        except WouldBlock:
            raise
        except BaseException as exc:
            if is_unavailable(exc):
                broken = True
                raise DatabaseUnavailable("the commit mark", exc) from exc
            raise
        finally:
            pool.checkin(conn, gen, broken=broken)

    def mark_many(self, marks: list[tuple[str, str, float]]) -> None:
        """Deferred commit marks (fast mode, or marks a dropped connection held back), in one transaction that is
        not fsynced."""
        with self.fast.connection("the deferred commit marks") as conn:
            if self.sqlite:
                rows = [(text, _sqlite_time(now), eid) for eid, text, now in marks]
                with self.write_lock:
                    conn.execute("BEGIN IMMEDIATE")
                    try:
                        conn.executemany(_SQLITE_MARK, rows)
                        conn.execute("COMMIT")
                    except BaseException:
                        if conn.in_transaction:
                            conn.execute("ROLLBACK")
                        raise
                return
            with conn.transaction():
                conn.cursor().executemany(_PG_MARK, [(text, from_epoch(now), eid) for eid, text, now in marks])

    def close(self) -> None:
        self.durable.close()
        self.fast.close()


def _pg_integrity_error() -> type[BaseException]:
    try:
        import psycopg
    except ImportError:  # the [postgres] extra is not installed: SQLite only
        return sqlite3.IntegrityError
    return psycopg.IntegrityError
