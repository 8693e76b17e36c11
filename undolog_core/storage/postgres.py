"""PostgreSQL through psycopg 3: the engine (``application_name``, the schema's search path, ``synchronous_commit``
off for the fast engine), the hot path's statements (the pre-write as one CTE statement), row locks.

The DBOS shape: ``PostgresStorage`` is the ``Storage`` of a PostgreSQL database; ``sqlite.py`` holds the other one.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from .hotpath import _EFFECT_COLS, _UNDO_COLS, _WRITABLE, HotPath

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




# A session started and its first state read back in one statement (the general path reads, inserts under a
# savepoint and reads again: six round trips). ``ON CONFLICT DO NOTHING``: an id that exists returns no row, and the
# caller reads that one instead.
_PG_START_SESSION = (
    "INSERT INTO undolog_sessions (session_id, agent_id, state, tool_calls_total, created_by, halted_reason, "
    "on_failure, pinned_revisions, created_at, updated_at) "
    "VALUES (%(session_id)s, %(agent_id)s, %(state)s, 0, %(created_by)s, NULL, %(on_failure)s, "
    "%(pinned_revisions)s::json, %(created_at)s, %(updated_at)s) "
    "ON CONFLICT (session_id) DO NOTHING RETURNING session_id, state, pinned_revisions, on_failure"
)
# A session ended with the calls it counted in memory: one durable statement instead of a count flush and a state
# change in two transactions.
_PG_END_SESSION = (
    "UPDATE undolog_sessions SET state = %s, tool_calls_total = tool_calls_total + %s, updated_at = %s "
    "WHERE session_id = %s AND state = ANY(%s)"
)


class _StartedSession(NamedTuple):
    session_id: str
    state: str
    pinned_revisions: Any
    on_failure: str


def _from_epoch(t: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(t, dt.UTC)


class PostgresHotPath(HotPath):
    placeholder = "%s"

    def __init__(self, store: Any, *, pool_size: int, fast_pool_size: int) -> None:
        import psycopg  # the [postgres] extra: imported only when a PostgreSQL store is opened

        self.integrity_error = (psycopg.IntegrityError,)
        super().__init__(store, pool_size=pool_size, fast_pool_size=fast_pool_size)

    def _setup(self, conn: Any) -> None:
        conn.autocommit = True  # one statement, one commit: no BEGIN round trip

    def _prewrite(self, conn: Any, wait: bool, session_id: str, count: int, effect_id: str, call_id: str,
                  tool_name: str, revision: int, args_text: str, digest: str, owner: str, now: float, lease: float,
                  comp: str, comp_version: int) -> bool:
        cur = conn.execute(
            _PG_PREWRITE if count else _PG_PREWRITE_CHECKED,
            {"count": count, "now": _from_epoch(now), "session_id": session_id, "effect_id": effect_id,
             "call_id": call_id, "tool_name": tool_name, "revision": revision, "args": args_text, "digest": digest,
             "owner": owner, "lease": _from_epoch(lease), "comp": comp, "comp_version": comp_version},
        )
        return bool(cur.rowcount == 1)

    def _mark(self, conn: Any, wait: bool, effect_id: str, text: str, now: float) -> bool:
        return bool(conn.execute(_PG_MARK, (text, _from_epoch(now), effect_id)).rowcount == 1)

    def start_session(self, values: dict[str, Any]) -> Any:
        params = {**values, "pinned_revisions": json.dumps(values["pinned_revisions"])}
        with self.durable.connection("starting a session") as conn:
            row = conn.execute(_PG_START_SESSION, params).fetchone()
        return None if row is None else _StartedSession(*row)

    def end_session(self, session_id: str, count: int, state: str, allowed: Sequence[str], now: float) -> bool | None:
        with self.durable.connection("ending a session") as conn:
            cur = conn.execute(_PG_END_SESSION, (state, count, _from_epoch(now), session_id, list(allowed)))
            return bool(cur.rowcount == 1)

    def _mark_many(self, conn: Any, marks: list[tuple[str, str, float]]) -> None:
        with conn.transaction():
            conn.cursor().executemany(_PG_MARK, [(text, _from_epoch(now), eid) for eid, text, now in marks])


def make_engine(url: str, *, schema: str | None, durable: bool, pool_size: int, overflow: int) -> Engine:
    """A PostgreSQL engine over psycopg 3 (``synchronous_commit=off`` for the fast engine)."""
    connect_args: dict[str, Any] = {}
    options = []
    if schema:
        options.append(f"-csearch_path={schema}")
    if not durable:
        options.append("-csynchronous_commit=off")
    if options:
        connect_args["options"] = " ".join(options)
    if "application_name" not in sa.engine.make_url(url).query:
        # So an operator (or a test) can tell UndoLog's connections apart in pg_stat_activity.
        connect_args["application_name"] = "undolog"
    # No pre-ping round trip per checkout: a connection found dead fails one statement, SQLAlchemy then drops
    # every connection of the pool opened before it, and the next transaction connects afresh.
    return sa.create_engine(url, connect_args=connect_args, pool_size=pool_size, max_overflow=overflow,
                            pool_pre_ping=False)

