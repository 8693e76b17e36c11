"""PostgreSQL through psycopg 3: the engine (``application_name``, the schema's search path, ``synchronous_commit``
off for the fast engine), the hot path's statements (the pre-write as one CTE statement, fast mode's marks as one
statement per batch), each prepared once per connection and run through libpq itself (``Prepared``), row locks.

The DBOS shape: ``PostgresStorage`` is the ``Storage`` of a PostgreSQL database; ``sqlite.py`` holds the other one.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from ..states import EFFECT
from .hotpath import _EFFECT_COLS, _WRITABLE, ARM_FROM_E, Ended, HotPath, SessionRow

# The effect and its undo entry, inserted for the session row that CTE ``g`` returned (none: nothing written).
_EFFECT_AND_UNDO_FROM_G = f"""  INSERT INTO undolog_effect_log ({_EFFECT_COLS})
  SELECT %(effect_id)s, g.session_id, %(call_id)s, %(tool_name)s, %(revision)s, 'compensable', 'pending',
         %(args)s::json, %(digest)s, %(owner)s, %(lease)s, 0, %(now)s, %(now)s FROM g
  RETURNING seq, effect_id, session_id
)
{ARM_FROM_E}"""
# One statement, one round trip, one commit: the session check, the effect and its undo entry.
_PG_PREWRITE = f"""
WITH g AS (
  UPDATE undolog_sessions SET tool_calls_total = tool_calls_total + %(count)s, updated_at = %(now)s
  WHERE session_id = %(session_id)s AND {_WRITABLE} RETURNING session_id
), e AS (
{_EFFECT_AND_UNDO_FROM_G}"""
# Without a count to flush the session is only read, but read under ``FOR KEY SHARE``: a transaction that decided
# from the session's rows while holding it ``FOR UPDATE`` (a rollback's plan, gc closing it) is waited for, and the
# state is then tested again on the row it committed (a plain read would test the state it had before, and write the
# effect behind that transaction's back: a call run after its rollback was requested, never compensated). The
# effect's foreign key takes the same lock at the statement's end anyway, so this costs no lock more.
_PG_PREWRITE_CHECKED = f"""
WITH e AS (
  INSERT INTO undolog_effect_log ({_EFFECT_COLS})
  SELECT %(effect_id)s, s.session_id, %(call_id)s, %(tool_name)s, %(revision)s, 'compensable', 'pending',
         %(args)s::json, %(digest)s, %(owner)s, %(lease)s, 0, %(now)s, %(now)s
  FROM undolog_sessions s WHERE s.session_id = %(session_id)s AND s.{_WRITABLE} FOR KEY SHARE OF s
  RETURNING seq, effect_id, session_id
)
{ARM_FROM_E}"""
# A session's first logged call: its row inserted by the pre-write's own statement (where a start of its own was a
# statement and a durable commit more per session). The effect's foreign key to the session is checked at the
# statement's end, when the row is there. ``ON CONFLICT DO NOTHING``: an id that exists writes nothing (the caller
# reads that session and takes the general path).
_PG_PREWRITE_STARTING = f"""
WITH g AS (
  INSERT INTO undolog_sessions (session_id, agent_id, state, tool_calls_total, created_by, halted_reason, on_failure,
                                pinned_revisions, created_at, updated_at)
  VALUES (%(session_id)s, %(agent_id)s, 'active', %(count)s, %(created_by)s, NULL, %(on_failure)s,
          %(pinned_revisions)s::json, %(created_at)s, %(now)s)
  ON CONFLICT (session_id) DO NOTHING RETURNING session_id
), e AS (
{_EFFECT_AND_UNDO_FROM_G}"""
# Many commit marks (fast mode's flush) as one statement: one round trip and one commit instead of a BEGIN, a
# statement per mark and a COMMIT. Each effect is marked at most once per batch (an effect has one mark).
# The state is tested as ``state || ''`` so that the planner cannot answer it from the in-flight partial index
# (whose predicate ``state IN ('pending', 'running')`` it would match): it estimated that index at a few rows and
# took a bitmap scan of it, hashed against the batch, and that index keeps the entry of every effect marked since
# the last vacuum (a bitmap scan never marks an entry dead), so a batch of ten visited every row marked since then
# (10,010 index entries and 693 heap pages for a batch of ten, 4x the statement's time, after 1,000 sessions). Tested
# on the effect's own row, reached through the effect_id index, a batch reads its own rows only.
_PG_MARK_MANY = (
    "UPDATE undolog_effect_log e SET state = 'committed', result_snapshot = m.result::json, owner = NULL, "
    "lease_until = NULL, updated_at = m.at "
    "FROM unnest(%(results)s::text[], %(ats)s::timestamptz[], %(ids)s::text[]) AS m(result, at, effect_id) "
    "WHERE e.effect_id = m.effect_id AND " + EFFECT.where("commit", column="(e.state || '')")
    # Fenced by the calls' owner (``HotPath.owner``) as the one-call mark is: a deferred mark of a call another
    # process took over meanwhile does not land (the engine records the late finish).
    + " AND e.owner = %(owner)s"
)
# Fenced by the call's owner (``HotPath.owner``): never over a call another process took over.
_PG_MARK = (
    "UPDATE undolog_effect_log SET state = 'committed', result_snapshot = %(text)s::json, owner = NULL, "
    f"lease_until = NULL, updated_at = %(now)s WHERE effect_id = %(effect_id)s AND {EFFECT.where('commit')} "
    "AND owner = %(owner)s"
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
    "UPDATE undolog_sessions SET state = %(state)s, tool_calls_total = tool_calls_total + %(count)s, "
    "updated_at = %(now)s WHERE session_id = %(session_id)s AND state = ANY(%(allowed)s)"
)
# Fast mode's session end: the queued commit marks and the state change as one durable statement, one commit,
# where a marks batch (a statement and its commit of its own) came first. A data-modifying CTE runs to completion
# whether or not the outer statement reads it, so the marks are written even when the session is in no allowed
# state. The session moves only if every mark landed (a mark fenced off is a late finish, which halts the session:
# it must not be completed first); the one row answers how many marks landed and whether the session moved.
_PG_END_SESSION_MARKED = (
    f"WITH m AS ({_PG_MARK_MANY} RETURNING 1), s AS ({_PG_END_SESSION} "
    "AND (SELECT count(*) FROM m) = %(n)s RETURNING 1) "
    "SELECT (SELECT count(*) FROM m), (SELECT count(*) FROM s)"
)


_seconds: dict[int, str] = {}


def _stamp_text(t: float) -> str:
    """Epoch seconds as the text of an aware UTC datetime (a timestamptz parameter): exactly
    ``datetime.fromtimestamp(t, UTC).isoformat()``, the value the general path would write for the same instant.

    Built without a datetime: the call's statements carry three or four of these, and each datetime built and
    formatted cost about a microsecond of client CPU. The microseconds are rounded half to even as
    ``fromtimestamp`` rounds them (``t - int(t)`` is exact, as its ``modf`` is; a fraction that rounds up to a
    whole second carries into the seconds), and the seconds part, which changes once a second, is formatted once
    and kept (a few are kept; a dict's get and set are atomic under the GIL)."""
    if t < 0:
        return dt.datetime.fromtimestamp(t, dt.UTC).isoformat()  # never on the hot path: not worth a second path
    sec = int(t)
    us = round((t - sec) * 1e6)
    if us >= 1_000_000:
        sec, us = sec + 1, us - 1_000_000
    head = _seconds.get(sec)
    if head is None:
        if len(_seconds) > 16:
            _seconds.clear()
        head = _seconds[sec] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
    return f"{head}.{us:06d}+00:00" if us else f"{head}+00:00"  # isoformat leaves out a zero fraction


def _stamp(t: float) -> bytes:
    """:func:`_stamp_text` as a parameter's bytes."""
    return _stamp_text(t).encode()


class Prepared(NamedTuple):
    """A hot statement run as a named prepared statement through libpq itself (``PGconn.exec_prepared``).

    psycopg's own execute (adapting the parameters, its prepared-statement cache, the cursor and its result
    handling, in Python) costs about as much client CPU as the statement's round trip on a 2-core machine where
    clients and the server share the cores; the hot path's parameters are a few strings and numbers whose text
    form is known, so they go to libpq as bytes and the statement is prepared once per connection. libpq's
    blocking call releases the GIL, as psycopg's waiting does.
    """

    name: bytes
    sql: bytes
    params: tuple[str, ...]  # the parameter names, in $n order


def prepared(name: str, sql: str) -> Prepared:
    """``sql`` written with ``%(name)s`` placeholders, numbered ``$1..$n`` for ``PREPARE`` (a name used twice is one
    parameter)."""
    names: list[str] = []

    def number(m: re.Match[str]) -> str:
        if m.group(1) not in names:
            names.append(m.group(1))
        return f"${names.index(m.group(1)) + 1}"

    return Prepared(name.encode(), re.sub(r"%\((\w+)\)s", number, sql).encode(), tuple(names))


# libpq's result statuses of a statement that succeeded (COMMAND_OK, TUPLES_OK), as the ints it returns.
_DONE = frozenset((1, 2))


def run_prepared(conn: Any, stmt: Prepared, values: Sequence[bytes | None]) -> Any:
    """Run ``stmt`` on ``conn`` (a psycopg connection in autocommit, UTF-8) with ``values`` in ``$n`` order, as
    text; the libpq result. Raises what psycopg's own execute would: an ``IntegrityError`` for a unique key written
    twice, an ``OperationalError`` when the server went away (no SQLSTATE, or class 08 or 57P).

    Which statements a connection has prepared is kept on the connection itself (a set in an attribute: a lookup
    per statement, not a weak dictionary's); a connection is used by one thread at a time."""
    pgconn = conn.pgconn
    try:
        done = conn._undolog_prepared
    except AttributeError:
        done = conn._undolog_prepared = set()
    if stmt.name not in done:
        _check(pgconn, pgconn.prepare(stmt.name, stmt.sql))
        done.add(stmt.name)
    res = pgconn.exec_prepared(stmt.name, values)
    return res if res.status in _DONE else _check(pgconn, res)


def _check(pgconn: Any, res: Any) -> Any:
    from psycopg import errors, pq

    if res.status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
        return res
    if res.error_field(pq.DiagnosticField.SQLSTATE) is None or pgconn.status != pq.ConnStatus.OK:
        # No SQLSTATE: the client lost the server (psycopg says so with an OperationalError too).
        raise errors.OperationalError(res.get_error_message() or "the connection to the server was lost")
    raise errors.error_from_result(res)


_PW_CHECKED = prepared("undolog_prewrite_checked", _PG_PREWRITE_CHECKED)
_PW_COUNTED = prepared("undolog_prewrite", _PG_PREWRITE)
_MARK = prepared("undolog_mark", _PG_MARK)


def pg_prewrite(conn: Any, session_id: str, count: int, effect_id: str, call_id: str, tool_name: str,
                revision: int, args_text: str, digest: str, owner: str, now: float, lease: float, comp: str,
                comp_version: int) -> bool:
    """The pre-write (the session checked, and its count flushed when ``count``; the effect and its undo entry) as
    one autocommit statement on ``conn``: False when the session does not accept writes (nothing written)."""
    stamp = _stamp(now)
    # In the order of the statements' $n (``Prepared.params``; a test holds the two in step).
    tail = [effect_id.encode(), call_id.encode(), tool_name.encode(), str(revision).encode(), args_text.encode(),
            digest.encode(), owner.encode(), _stamp(lease)]
    if count:
        params = [str(count).encode(), stamp, session_id.encode(), *tail, comp.encode(), str(comp_version).encode()]
        return bool(run_prepared(conn, _PW_COUNTED, params).command_tuples == 1)
    params = [*tail, stamp, session_id.encode(), comp.encode(), str(comp_version).encode()]
    return bool(run_prepared(conn, _PW_CHECKED, params).command_tuples == 1)


_PW_STARTING = prepared("undolog_prewrite_starting", _PG_PREWRITE_STARTING)


def pg_prewrite_starting(conn: Any, start: dict[str, Any], session_id: str, count: int, effect_id: str,
                         call_id: str, tool_name: str, revision: int, args_text: str, digest: str, owner: str,
                         now: float, lease: float, comp: str, comp_version: int) -> bool:
    """The pre-write of a session's first logged call with the session's row (``start``: ``agent_id``,
    ``created_by``, ``on_failure``, ``pinned_revisions``, ``created_at`` in epoch seconds) as one autocommit
    statement on ``conn``: False when a session with that id exists (nothing written)."""
    values = {"session_id": session_id, "agent_id": start["agent_id"], "count": str(count),
              "created_by": start["created_by"], "on_failure": start["on_failure"],
              "pinned_revisions": json.dumps(start["pinned_revisions"]), "created_at": _stamp_text(start["created_at"]),
              "now": _stamp_text(now), "effect_id": effect_id, "call_id": call_id, "tool_name": tool_name,
              "revision": str(revision), "args": args_text, "digest": digest, "owner": owner,
              "lease": _stamp_text(lease), "comp": comp, "comp_version": str(comp_version)}
    params = [None if (v := values[k]) is None else v.encode() for k in _PW_STARTING.params]
    return bool(run_prepared(conn, _PW_STARTING, params).command_tuples == 1)


_START = prepared("undolog_start_session", _PG_START_SESSION)
_END = prepared("undolog_end_session", _PG_END_SESSION)
_END_MARKED = prepared("undolog_end_session_marked", _PG_END_SESSION_MARKED)


def _quoted(s: str) -> str:
    """``s`` as an element of a text array literal."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _array(items: Iterable[str]) -> bytes:
    """A text array literal of ``items`` (each quoted and escaped), as a parameter's text."""
    return ("{" + ",".join(_quoted(s) for s in items) + "}").encode()


def pg_start_session(conn: Any, values: dict[str, Any]) -> Any:
    """A new session's row inserted on ``conn``; its first state as a row, or None when the id exists."""
    v = {**values, "pinned_revisions": json.dumps(values["pinned_revisions"])}
    params = [None if v[k] is None else (v[k].isoformat() if isinstance(v[k], dt.datetime) else str(v[k])).encode()
              for k in _START.params]
    res = run_prepared(conn, _START, params)
    if res.ntuples == 0:
        return None
    sid, state, pins, on_failure = (res.get_value(0, i) for i in range(4))
    return SessionRow(sid.decode(), state.decode(), json.loads(pins), on_failure.decode())


def pg_end_session(conn: Any, session_id: str, count: int, state: str, allowed: Sequence[str], now: float,
                   marks: Sequence[tuple[str, str, float]] = (), owner: str = "") -> Ended:
    """The session moved to ``state`` from one of ``allowed`` with ``count`` calls added, one statement on ``conn``;
    with ``marks`` (``(effect_id, result text, epoch seconds)``, as :func:`pg_mark_many` takes them, fenced by
    ``owner``) those commit marks are written by the same statement, and the session moves only if all landed."""
    values = {"state": state.encode(), "count": str(count).encode(), "now": _stamp(now),
              "session_id": session_id.encode(), "allowed": _array(allowed)}
    if not marks:
        res = run_prepared(conn, _END, [values[k] for k in _END.params])
        return Ended(res.command_tuples == 1)
    values.update(_mark_arrays(marks, owner))
    values["n"] = str(len(marks)).encode()
    res = run_prepared(conn, _END_MARKED, [values[k] for k in _END_MARKED.params])
    return Ended(int(res.get_value(0, 1)) == 1, int(res.get_value(0, 0)))


def _mark_arrays(marks: Sequence[tuple[str, str, float]], owner: str) -> dict[str, bytes]:
    """The parameters of :data:`_PG_MARK_MANY` for ``marks`` of ``owner``'s calls."""
    return {"results": _array(text for _, text, _ in marks), "ats": _array(_stamp_text(t) for _, _, t in marks),
            "ids": _array(eid for eid, _, _ in marks), "owner": owner.encode()}


_MARK_MANY = prepared("undolog_mark_many", _PG_MARK_MANY)


def pg_mark_many(conn: Any, marks: Sequence[tuple[str, str, float]], owner: str) -> int:
    """``(effect_id, result text, epoch seconds)`` commit marks of ``owner``'s calls as one autocommit statement
    on ``conn``; how many effects were in flight, still ``owner``'s, and are marked now."""
    values = _mark_arrays(marks, owner)
    return int(run_prepared(conn, _MARK_MANY, [values[k] for k in _MARK_MANY.params]).command_tuples or 0)


def pg_mark(conn: Any, effect_id: str, text: str, now: float, owner: str) -> bool:
    """The commit mark as one autocommit statement on ``conn``: False when the effect was not in flight, or not
    owned by ``owner`` any more (taken over)."""
    return bool(run_prepared(conn, _MARK, [text.encode(), _stamp(now), effect_id.encode(), owner.encode()])
                .command_tuples == 1)


class PostgresHotPath(HotPath):
    placeholder = "%s"

    def __init__(self, store: Any, *, pool_size: int, fast_pool_size: int) -> None:
        import psycopg  # the [postgres] extra: imported only when a PostgreSQL store is opened

        self.integrity_error = (psycopg.IntegrityError,)
        super().__init__(store, pool_size=pool_size, fast_pool_size=fast_pool_size)

    def _setup(self, conn: Any) -> None:
        conn.autocommit = True  # one statement, one commit: no BEGIN round trip
        if conn.info.encoding != "utf-8":  # the prepared statements' parameters are sent as UTF-8 text
            conn.execute("SET client_encoding TO 'UTF8'")

    def _prewrite(self, conn: Any, wait: bool, session_id: str, count: int, effect_id: str, call_id: str,
                  tool_name: str, revision: int, args_text: str, digest: str, owner: str, now: float, lease: float,
                  comp: str, comp_version: int, start: dict[str, Any] | None = None) -> bool:
        if start is None:
            return pg_prewrite(conn, session_id, count, effect_id, call_id, tool_name, revision, args_text, digest,
                               owner, now, lease, comp, comp_version)
        return pg_prewrite_starting(conn, start, session_id, count, effect_id, call_id, tool_name, revision,
                                    args_text, digest, owner, now, lease, comp, comp_version)

    def _mark(self, conn: Any, wait: bool, effect_id: str, text: str, now: float) -> bool:
        return pg_mark(conn, effect_id, text, now, self.owner)

    starts_with_prewrite = True

    def start_session(self, values: dict[str, Any], *, durable: bool = True, unless: str | None = None,
                      wait: bool = True) -> Any:
        # Durable whatever ``durable`` says: the first turn's write on PostgreSQL is left as it was measured; and no
        # statement here for ``unless`` (the caller reads the store first, as before).
        if unless is not None:
            return None
        with self.durable.connection("starting a session", wait=wait) as conn:
            return pg_start_session(conn, values)

    ends_with_marks = True

    def end_session(self, session_id: str, count: int, state: str, allowed: Sequence[str], now: float,
                    marks: Sequence[tuple[str, str, float]] = ()) -> Ended | None:
        with self.durable.connection("ending a session") as conn:
            return pg_end_session(conn, session_id, count, state, allowed, now, marks, self.owner)

    def _mark_many(self, conn: Any, marks: list[tuple[str, str, float]]) -> int:
        return pg_mark_many(conn, marks, self.owner)


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

