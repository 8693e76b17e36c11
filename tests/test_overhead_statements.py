"""The overhead contract, counted statement by statement (the timing side is benchmarks/overhead.py).

* A SAFE call issues no SQL at all: no statement, no transaction, not even a pool checkout.
* A COMPENSABLE call does exactly one durable transaction before the tool starts (the pre-write, which holds
  the effect and its undo entry), and exactly one after it (the commit mark: durable by default, on the
  non-fsynced engine with ``fast_commit_mark=True``).

Statements are counted at two levels:

* SQLAlchemy: ``before_cursor_execute``, ``commit`` and ``rollback`` on ``store.engine`` and ``store.fast``,
  plus pool checkouts;
* the driver: SQLite's own trace callback (every statement the library runs, BEGIN and COMMIT included),
  PostgreSQL's libpq protocol trace (every Query/Execute message put on the wire).

Each test also shows the counters are live (they do see a statement when one is made), so a zero means zero.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import event

from undolog_core import (
    CompensationDescriptor,
    ToolTier,
    UndoLog,
    compensation,
    current_call,
    errors,
    undolog_tool,
)
from undolog_core._decisions import Execute
from undolog_core.testing import internals

# Counts what reaches each database (its own step in CI, on both databases).
pytestmark = [pytest.mark.perf, pytest.mark.storage]

# -- the counter -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ev:
    level: str  # "sa" (SQLAlchemy) | "wire" (sqlite3 trace / libpq trace) | "pool"
    engine: str  # "durable" (store.engine) | "fast" (store.fast)
    kind: str  # "begin" | "stmt" | "commit" | "rollback" | "checkout"
    text: str
    main: bool  # made by the test's own thread (not the lease renewer)
    conn: int  # id() of the DB-API connection


def _kind(sql: str) -> str:
    head = sql.strip().upper()
    if head.startswith("BEGIN"):
        return "begin"
    if head.startswith("COMMIT"):
        return "commit"
    if head.startswith("ROLLBACK"):
        return "rollback"
    if head.startswith("PRAGMA"):
        return "setup"  # a connection's configuration when the hot path first opens it, not a transaction
    return "stmt"


class _PgTrace:
    """libpq's protocol trace of one psycopg connection, read back at each mark."""

    def __init__(self, pg: Any, engine: str) -> None:
        from psycopg import pq

        self.pg, self.engine = pg, engine
        self.flags = pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE
        fd, self.path = tempfile.mkstemp(prefix="undolog-pqtrace-")
        os.close(fd)
        self.offset = 0
        self.fd: int | None = None
        self.start()

    def start(self) -> None:
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        self.pg.pgconn.trace(self.fd)
        self.pg.pgconn.set_trace_flags(self.flags)

    def drain(self) -> list[tuple[str, str]]:
        """Stop tracing (libpq flushes), return the new frontend messages, trace again."""
        self.pg.pgconn.untrace()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            fh.seek(self.offset)
            data = fh.read()
            self.offset = fh.tell()
        out = []
        for line in data.splitlines():
            parts = line.split("\t", 3)
            if len(parts) >= 3 and parts[0] == "F":
                out.append((parts[2], parts[3].strip() if len(parts) > 3 else ""))
        return out

    def close(self) -> None:
        try:
            self.pg.pgconn.untrace()
        finally:
            if self.fd is not None:
                os.close(self.fd)
            os.unlink(self.path)


class StatementCounter:
    """Counts everything UndoLog sends to its database, per engine, at the SQLAlchemy and the driver level."""

    def __init__(self, undolog: UndoLog) -> None:
        # Counting starts once the store's background threads are past their start (SQLite's WAL checkpointer opens
        # its own connection from its own thread: on a loaded machine that fell inside a SAFE test's window).
        internals(undolog).settle()
        self.store = undolog.store
        self.main = threading.get_ident()
        self.events: list[Ev] = []
        self.raw: dict[int, tuple[str, Any]] = {}  # id(dbapi conn) -> (engine tag, driver connection)
        self._pg: dict[int, _PgTrace] = {}
        self._marks: dict[str, int] = {}
        self._lock = threading.Lock()
        self._listeners: list[tuple[Any, str, Any]] = []
        for tag, eng in (("durable", self.store.engine), ("fast", self.store.fast)):
            self._listen(eng, "before_cursor_execute", self._on_stmt(tag))
            self._listen(eng, "commit", self._on_tx(tag, "commit"))
            self._listen(eng, "rollback", self._on_tx(tag, "rollback"))
            self._listen(eng, "checkout", self._on_checkout(tag))

    def _listen(self, target: Any, name: str, fn: Any) -> None:
        event.listen(target, name, fn)
        self._listeners.append((target, name, fn))

    def _add(self, ev: Ev) -> None:
        with self._lock:
            self.events.append(ev)

    def _is_main(self) -> bool:
        return threading.get_ident() == self.main

    def _on_stmt(self, tag: str) -> Any:
        def fn(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
            dbapi = conn.connection.dbapi_connection
            self._add(
                Ev("sa", tag, _kind(statement), " ".join(statement.split()), self._is_main(), id(dbapi))
            )

        return fn

    def _on_tx(self, tag: str, kind: str) -> Any:
        def fn(conn: Any) -> None:
            dbapi = conn.connection.dbapi_connection
            self._add(Ev("sa", tag, kind, kind.upper(), self._is_main(), id(dbapi)))

        return fn

    def _on_checkout(self, tag: str) -> Any:
        def fn(dbapi_conn: Any, record: Any, proxy: Any) -> None:
            raw = getattr(dbapi_conn, "driver_connection", dbapi_conn)
            key = id(dbapi_conn)
            self._add(Ev("pool", tag, "checkout", "", self._is_main(), key))
            if key in self.raw:
                return
            self.raw[key] = (tag, raw)
            if self.store.is_postgres:
                self._pg[key] = _PgTrace(raw, tag)
            else:
                main = self._is_main  # sqlite3 calls the trace callback in the thread running the statement
                raw.set_trace_callback(
                    lambda sql, _t=tag, _k=key: self._add(
                        Ev("wire", _t, _kind(sql), " ".join(sql.split()), main(), _k)
                    )
                )

        return fn

    def _drain_pg(self) -> None:
        for key, tr in self._pg.items():
            for msg, body in tr.drain():
                if msg == "Query":
                    text = body.strip('"')
                    self._add(Ev("wire", tr.engine, _kind(text), text, True, key))
                elif msg == "Execute":
                    self._add(Ev("wire", tr.engine, "stmt", "(extended-protocol Execute)", True, key))
                elif msg == "Sync":
                    pass
            tr.start()

    def mark(self, name: str) -> None:
        if self.store.is_postgres:
            self._drain_pg()
        with self._lock:
            self._marks[name] = len(self.events)

    def window(self, a: str, b: str) -> list[Ev]:
        return self.events[self._marks[a] : self._marks[b]]

    def close(self) -> None:
        for target, name, fn in self._listeners:
            event.remove(target, name, fn)
        for _key, (_tag, raw) in list(self.raw.items()):
            if not self.store.is_postgres:
                try:
                    raw.set_trace_callback(None)
                except Exception:  # noqa: BLE001 - a closed connection needs no untracing
                    pass
        for tr in self._pg.values():
            try:
                tr.close()
            except Exception:  # noqa: BLE001
                pass


def tally(evs: list[Ev]) -> Counter[tuple[str, str, str]]:
    return Counter((e.level, e.engine, e.kind) for e in evs)


def describe(evs: list[Ev]) -> str:
    return "\n".join(f"  {e.level:5} {e.engine:8} {e.kind:9} {e.text[:110]}" for e in evs) or "  (nothing)"


@pytest.fixture
def counter_for() -> Any:
    made: list[StatementCounter] = []

    def make(u: UndoLog) -> StatementCounter:
        c = StatementCounter(u)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


# -- the tools -------------------------------------------------------------------------------------

_MARKER: dict[str, Any] = {}


@undolog_tool(tier=ToolTier.SAFE)
def oh_search(query: str, limit: int = 5) -> list[str]:
    return [query] * min(limit, 1)


@undolog_tool(tier=ToolTier.SAFE)
async def oh_asearch(query: str, limit: int = 5) -> list[str]:
    return [query] * min(limit, 1)


def _tool_started() -> None:
    ctx = current_call()
    assert ctx is not None and ctx.idempotency_key == f"do-{ctx.effect_id}"
    _MARKER["counter"].mark("tool_start")


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("oh_cancel_refund"))
async def oh_refund(user_id: str, amount: int) -> dict[str, Any]:
    _tool_started()
    return {"refunded": user_id, "amount": amount}


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("oh_cancel_refund"))
def oh_refund_sync(user_id: str, amount: int) -> dict[str, Any]:
    _tool_started()
    return {"refunded": user_id, "amount": amount}


@compensation("oh_cancel_refund")
def oh_cancel_refund(ctx: Any) -> None:
    return None


TOOLS = (oh_search, oh_asearch, oh_refund, oh_refund_sync, oh_cancel_refund)


def _assert_counters_live(u: UndoLog, c: StatementCounter, session_id: str) -> None:
    u.engine.persist(session_id)  # a session started here and not written yet (PostgreSQL): written before the probe
    c.mark("probe_a")
    u.sessions.get(session_id)  # one read on the durable engine
    c.mark("probe_b")
    seen = tally([e for e in c.window("probe_a", "probe_b") if e.main])
    assert seen[("sa", "durable", "stmt")] >= 1, describe(c.window("probe_a", "probe_b"))
    assert seen[("wire", "durable", "stmt")] >= 1, describe(c.window("probe_a", "probe_b"))
    assert seen[("pool", "durable", "checkout")] == 1


# -- SAFE: zero --------------------------------------------------------------------------------------


async def test_safe_call_issues_no_statement(undolog: UndoLog, counter_for: Any) -> None:
    undolog.register(*TOOLS)
    async with undolog.session(agent_id="overhead") as s:  # creating the session writes; not counted
        c = counter_for(undolog)
        c.mark("start")
        for i in range(20):
            assert await s.call(oh_asearch, query=f"q{i}", limit=2) == [f"q{i}"]
            assert await s.call(oh_search, query=f"q{i}") == [f"q{i}"]
            assert s.call_sync(oh_search, query=f"q{i}", limit="3") == [f"q{i}"]  # coerced by pydantic
            d = undolog.engine.intercept(s.id, "oh_search", {"query": "x"})
            assert isinstance(d, Execute) and d.effect_id is None and d.idempotency_key is None
        # A session this process has never seen: still nothing before its first logged call.
        d = undolog.engine.intercept("never-seen-session", "oh_asearch", {"query": "x"})
        assert isinstance(d, Execute) and d.effect_id is None
        c.mark("end")
        window = c.window("start", "end")
        # Nothing at all, from any thread: no statement, no transaction, no pool checkout.
        assert window == [], "SAFE calls touched the database:\n" + describe(window)
        _assert_counters_live(undolog, c, s.id)


def test_safe_call_sync_issues_no_statement(undolog: UndoLog, counter_for: Any) -> None:
    undolog.register(*TOOLS)
    with undolog.session(agent_id="overhead-sync") as s:
        c = counter_for(undolog)
        c.mark("start")
        for i in range(20):
            assert s.call_sync(oh_search, query=f"q{i}") == [f"q{i}"]
            assert s.call_sync(oh_asearch, query=f"q{i}") == [f"q{i}"]  # an async tool from sync code
        c.mark("end")
        window = c.window("start", "end")
        assert window == [], "SAFE calls touched the database:\n" + describe(window)
        _assert_counters_live(undolog, c, s.id)


# -- COMPENSABLE: one durable transaction before the tool -------------------------------------------


def _durability(u: UndoLog, c: StatementCounter, key: int) -> bool:
    """Whether the DB-API connection ``key`` commits durably, asked of that very connection."""
    _tag, raw = c.raw[key]
    if internals(u).is_postgres:
        value = raw.execute("SHOW synchronous_commit").fetchone()[0]
        raw.rollback()
        return bool(value != "off")
    (level,) = raw.execute("PRAGMA synchronous").fetchone()
    return int(level) >= 2  # FULL (2) or EXTRA (3); OFF is 0


def wire_transactions(evs: list[Ev]) -> tuple[list[list[str]], list[str]]:
    """Group the driver-level statements into transactions: BEGIN..COMMIT, or one autocommit statement.

    Returns the committed transactions and whatever is left open (or rolled back) at the end.
    """
    done: list[list[str]] = []
    current: list[str] | None = None
    previous: tuple[int, str] | None = None
    for e in evs:
        if e.level != "wire" or e.kind == "setup":
            continue
        if e.kind == "stmt" and previous == (e.conn, e.text):
            # Python's sqlite3 reports each trigger program a statement runs with the statement's own text:
            # an echo of the statement (whose text carries its fresh ids), not a statement of its own.
            continue
        previous = (e.conn, e.text)
        if e.kind == "begin":
            current = []
        elif e.kind == "commit":
            done.append(current or [])
            current = None
        elif e.kind == "rollback":
            current = None
        elif current is None:
            done.append([e.text])  # outside BEGIN..COMMIT: a transaction of its own
        else:
            current.append(e.text)
    return done, current or []


def _one_transaction(evs: list[Ev], *, engine: str) -> dict[str, Any]:
    """Assert ``evs`` (the test thread's events of one window) are exactly one committed transaction.

    The hot path runs on the raw driver (SQLAlchemy sees nothing), so the wire is the authority; where
    SQLAlchemy did issue statements, the wire must show exactly those and nothing hidden below them.
    """
    t = tally(evs)
    where = "\n" + describe(evs)
    other = "fast" if engine == "durable" else "durable"
    assert t[("sa", engine, "commit")] <= 1, f"more than one commit on {engine}" + where
    for level in ("sa", "wire"):
        assert t[(level, other, "commit")] == 0, f"{level}: unexpected commit on {other}" + where
        assert t[(level, engine, "rollback")] + t[(level, other, "rollback")] == 0, "rollback" + where
        assert t[(level, other, "stmt")] == 0 and t[(level, other, "begin")] == 0, (
            f"{level}: {other} used" + where
        )
    # A thread takes its hot-path connection from the pool once and keeps it.
    assert t[("pool", engine, "checkout")] <= 1 and t[("pool", other, "checkout")] == 0, "one connection" + where
    conns = {e.conn for e in evs if e.level == "wire"}
    assert len(conns) == 1, "all on one connection" + where
    done, left_open = wire_transactions(evs)
    assert len(done) == 1 and not left_open, "exactly one committed transaction on the wire" + where
    sa_stmts = [e.text for e in evs if e.level == "sa" and e.kind == "stmt"]
    if sa_stmts:
        assert len(done[0]) == len(sa_stmts), "driver-level statements differ from SQLAlchemy's" + where
    return {"conn": conns.pop(), "statements": sa_stmts or done[0]}


@pytest.mark.parametrize("fast_mark", [False, True], ids=["durable_mark", "fast_mark"])
@pytest.mark.parametrize("path", ["call", "call_sync", "intercept"])
async def test_compensable_call_one_durable_transaction_before_tool(
    db: Any, counter_for: Any, fast_mark: bool, path: str
) -> None:
    u = db.open(fast_commit_mark=fast_mark)
    u.register(*TOOLS)
    # The counter first: on PostgreSQL a new session is written on the hot path's pool, whose connection the
    # counter must see opened (the pool keeps it, so the call's own checkout is not an engine checkout).
    c = counter_for(u)
    s = u.session(agent_id="overhead")
    _MARKER["counter"] = c
    try:
        c.mark("before")
        if path == "call":
            out = await s.call(oh_refund, user_id="u1", amount=25)
        elif path == "call_sync":
            out = s.call_sync(oh_refund_sync, user_id="u1", amount=25)
        else:  # an adapter that runs the tool itself
            d = u.engine.intercept(s.id, "oh_refund_sync", {"user_id": "u1", "amount": 25})
            assert isinstance(d, Execute) and d.effect_id
            with u.engine.running(d, s.id):
                out = oh_refund_sync(**d.args)
            u.engine.complete(d.effect_id, out)
        c.mark("after")
    finally:
        _MARKER.pop("counter", None)
    assert out == {"refunded": "u1", "amount": 25}

    # The lease renewer runs in its own thread; it is not part of the call path.
    pre = [e for e in c.window("before", "tool_start") if e.main]
    post = [e for e in c.window("tool_start", "after") if e.main]

    # Before the tool: exactly one transaction, durable, holding the effect and its undo entry.
    prewrite = _one_transaction(pre, engine="durable")
    assert _durability(u, c, prewrite["conn"]), "the pre-write must be an fsynced commit"
    stmts = [st.lower() for st in prewrite["statements"]]
    if internals(u).is_postgres and all(st.startswith("(") for st in stmts):
        # libpq's trace shows a prepared statement only as Execute: the pre-write is one statement, one round
        # trip; the rows it wrote are checked below.
        assert len(stmts) == 1, describe(pre)
    elif internals(u).is_postgres:
        assert sum(st.count("insert into undolog_effect_log") for st in stmts) == 1, describe(pre)
        assert sum(st.count("insert into undolog_undo_stack") for st in stmts) == 1, describe(pre)
    else:
        # SQLite: one INSERT into the pre-write view, whose trigger writes the effect and its undo entry (the rows
        # are checked below).
        assert len(stmts) == 1 and stmts[0].startswith("insert into undolog_prewrite"), (
            "one autocommit statement" + describe(pre))
    assert not any(st.startswith("select") for st in stmts), (
        "a read before the tool costs a round trip\n" + describe(pre)
    )
    non_begin = [st for st in stmts if not st.startswith("begin")]
    assert len(non_begin) <= 3, "pre-write statement budget exceeded\n" + describe(pre)

    if fast_mark:
        # Fast mode: the caller pays nothing after the tool; the mark is queued for the flusher thread,
        # which writes it in a batch that is not fsynced. Until then the effect stays leased and in flight.
        assert [e for e in post if e.level in ("sa", "wire")] == [], describe(post)
        assert u.engine._marks, "the commit mark was not queued"
        c.mark("flush")
        u.engine.flush_marks()
        c.mark("flushed")
        flushed = [e for e in c.window("flush", "flushed") if e.main]
        mark = _one_transaction(flushed, engine="fast")
        assert _durability(u, c, mark["conn"]) is False
    else:
        # After the tool: exactly one transaction, the commit mark, fsynced.
        mark = _one_transaction(post, engine="durable")
        assert _durability(u, c, mark["conn"]) is True
        mstmts = [st.lower() for st in mark["statements"] if not st.lower().startswith("begin")]
        assert len(mstmts) == 1, describe(post)
        assert "update undolog_effect_log" in mstmts[0] or mstmts[0].startswith("("), describe(post)

    effects = u.sessions.effects(s.id)
    assert [(e["tool_name"], e["state"], e["undo_state"]) for e in effects] == [
        ("oh_refund" if path == "call" else "oh_refund_sync", "committed", "armed")
    ]


# -- a session's start on SQLite: one durable statement --------------------------------------------------------


@pytest.mark.sqlite_only  # PostgreSQL's start (and end) is the test below
def test_sqlite_session_start_is_one_durable_statement_and_writes_what_core_writes(db: Any, counter_for: Any) -> None:
    """A new session is one autocommit ``INSERT .. ON CONFLICT DO NOTHING RETURNING`` on the hot path's pool (the
    general path's read, savepoint and insert through SQLAlchemy cost about a millisecond of CPU per session: an
    adapter starts one per conversation). The row reads back as the general path writes it; an id that exists is
    read, never overwritten; an ``on_failure`` the schema's CHECK would refuse is refused before anything is
    written, though the hot path's connections skip CHECK constraints."""
    u = db.open()
    u.register(*TOOLS)
    c = counter_for(u)
    u.session(agent_id="warm")  # the hot path's connection opened (and traced) before the window
    c.mark("a")
    s = u.session(agent_id="overhead", created_by="ana")
    c.mark("b")
    evs = [e for e in c.window("a", "b") if e.main]
    wire = [e for e in evs if e.level == "wire" and e.kind != "setup"]
    assert [e.kind for e in wire] == ["stmt"] and wire[0].text.startswith("INSERT"), describe(evs)
    assert _durability(u, c, wire[0].conn), "a session's start is an fsynced commit"
    # The general path's row for the same values (what UndoLog.session(session_id=...) writes for a new id).
    general = u.engine.ensure_session("general", agent_id="overhead", created_by="ana")
    rec, ref = u.sessions.get(s.id), u.sessions.get(general.session_id)
    assert (rec.agent_id, rec.created_by, rec.state, rec.on_failure, rec.tool_calls_total, rec.pinned_revisions) == (
        ref.agent_id, ref.created_by, ref.state, ref.on_failure, ref.tool_calls_total, ref.pinned_revisions)
    assert rec.created_at.tzinfo is not None and abs((rec.created_at - ref.created_at).total_seconds()) < 60
    _MARKER["counter"] = c
    try:
        s.call_sync(oh_refund_sync, user_id="u1", amount=5)  # the row takes calls like any other
    finally:
        _MARKER.pop("counter", None)
    s.complete()
    # An id that exists is read, never overwritten.
    assert u.engine.ensure_session(s.id, agent_id="someone-else", fresh=True) is not None
    assert (u.sessions.get(s.id).agent_id, u.sessions.get(s.id).state) == ("overhead", "completed")
    with pytest.raises(ValueError):
        u.engine.ensure_session("bad-policy", on_failure="sometimes", fresh=True)
    with pytest.raises(errors.SessionNotFound):
        u.sessions.get("bad-policy")


@pytest.mark.sqlite_only  # PostgreSQL carries the count in its one pre-write statement already (its CTE)
def test_sqlite_prewrite_after_safe_calls_is_one_durable_statement_that_carries_their_count(
        db: Any, counter_for: Any) -> None:
    """SAFE calls are counted in memory and reach the session's row with its next write: on SQLite a COMPENSABLE
    call after them is still one autocommit statement (the counting view's INSERT, whose trigger adds the count and
    writes the effect and its undo entry), where it was BEGIN, the session's UPDATE, the INSERT and COMMIT. The rows
    are those of the plain pre-write (the undo entry under the effect's sequence number); a halted session takes
    nothing, neither the count nor the call."""
    u = db.open()
    u.register(*TOOLS)
    c = counter_for(u)
    s = u.session(agent_id="overhead")
    _MARKER["counter"] = c
    try:
        s.call_sync(oh_refund_sync, user_id="u0", amount=1)  # the session's row and the hot path's connection, warm
        # A first counted pre-write makes the connection's counting view (once per connection, see _prewrite_in).
        s.call_sync(oh_search, query="warm")
        s.call_sync(oh_refund_sync, user_id="u00", amount=1)
        for i in range(3):
            s.call_sync(oh_search, query=f"q{i}")
        c.mark("before")
        s.call_sync(oh_refund_sync, user_id="u1", amount=5)
    finally:
        _MARKER.pop("counter", None)
    pre = [e for e in c.window("before", "tool_start") if e.main]
    prewrite = _one_transaction(pre, engine="durable")
    assert _durability(u, c, prewrite["conn"]), "the pre-write must be an fsynced commit"
    stmts = [st.lower() for st in prewrite["statements"]]
    assert len(stmts) == 1 and stmts[0].startswith("insert into undolog_prewrite_counted"), describe(pre)
    assert u.sessions.get(s.id).tool_calls_total == 6  # the four SAFE calls and the two logged ones before
    with internals(u).sql_engine.connect() as conn:
        rows = conn.exec_driver_sql(
            "SELECT e.seq, u.undo_id, u.state FROM undolog_effect_log e JOIN undolog_undo_stack u "
            "ON u.effect_id = e.effect_id WHERE e.session_id = ? ORDER BY e.seq", (s.id,)).all()
    assert len(rows) == 3 and all(seq == undo_id and state == "armed" for seq, undo_id, state in rows), rows
    # Refused by a halted session: nothing written, the count kept in memory.
    s.call_sync(oh_search, query="before the halt")
    u.store.sessions.halt_session(s.id, "stop")
    with pytest.raises(errors.SessionHalted):
        s.call_sync(oh_refund_sync, user_id="u2", amount=5)
    assert [e["tool_name"] for e in u.sessions.effects(s.id)] == ["oh_refund_sync"] * 3


# -- a session's start and end on PostgreSQL: one durable statement each ---------------------------------------


@pytest.mark.postgres_only  # SQLite starts and ends a session on the general path (its commits have no round trip)
def test_postgres_session_start_and_complete_are_one_durable_statement_each(db: Any, counter_for: Any) -> None:
    """A new session is written by its first logged call's pre-write statement (an ``INSERT .. ON CONFLICT DO
    NOTHING`` in it, carrying the SAFE calls counted before), and ``complete()`` is one ``UPDATE`` that carries the
    calls counted in memory: one round trip each, durable (benchmarks/scale.py runs sessions of ten calls, where
    the start's six round trips and the end's two transactions cost as much as the calls)."""
    u = db.open()
    u.register(*TOOLS)
    c = counter_for(u)
    _MARKER["counter"] = c
    try:
        warm = u.session(agent_id="warm")  # the hot path's connection opened (and traced) before the windows
        warm.call_sync(oh_refund_sync, user_id="u0", amount=1)
        c.mark("a")
        s = u.session(agent_id="overhead")
        c.mark("b")
        s.call_sync(oh_search, query="q")  # a SAFE call: counted in memory, carried by complete()
        s.call_sync(oh_refund_sync, user_id="u1", amount=5)
        c.mark("c")
        s.complete()
        c.mark("d")
    finally:
        _MARKER.pop("counter", None)
    # The start writes nothing: the session's row goes in with its first logged call's pre-write statement.
    assert [e for e in c.window("a", "b") if e.main] == [], describe(c.window("a", "b"))
    for a, b in (("b", "tool_start"), ("c", "d")):
        evs = [e for e in c.window(a, b) if e.main]
        wire = [e for e in evs if e.level == "wire"]
        assert [e.kind for e in wire] == ["stmt"], describe(evs)  # no BEGIN, no COMMIT, no read: one statement
        assert _durability(u, c, wire[0].conn), "a session's start (with its first call) and end are fsynced"
    rec = u.sessions.get(s.id)
    assert rec.state == "completed" and rec.tool_calls_total == 2 and rec.agent_id == "overhead"
    # An id that exists is read, never overwritten: the general path, as before.
    again = u.session(session_id=s.id)
    assert again.state == "completed"


# -- a fast-mode session of ten COMPENSABLE calls on PostgreSQL: the statements it sends, counted ----------------


@pytest.mark.postgres_only  # SQLite's commits have no round trip; its end takes the general path
def test_postgres_fast_session_of_ten_calls_sends_eleven_statements(db: Any, counter_for: Any,
                                                                    monkeypatch: Any) -> None:
    """benchmarks/scale.py's session (ten COMPENSABLE calls in fast mode) on PostgreSQL: ten pre-writes and the
    end, one statement each. The session's row goes in with the first pre-write's statement, where a start of its
    own went before (a statement and a durable commit); the ten marks ride in the end's statement (and commit),
    where a marks batch of their own went before it. 13 statements before, 11 now. Every queued mark is written,
    and the session reads back completed with its ten calls, as it was started."""
    import undolog_core._mark_queue as engine_mod

    # No period passes inside the session: the flusher's own batch (a mark queued a whole period) stays out.
    monkeypatch.setattr(engine_mod, "MARK_FLUSH_SECONDS", 60.0)
    u = db.open(fast_commit_mark=True)
    u.register(*TOOLS)
    c = counter_for(u)
    _MARKER["counter"] = c
    try:
        warm = u.session(agent_id="warm")  # both pools' connections opened (and traced) before the window
        warm.call_sync(oh_refund_sync, user_id="u0", amount=1)
        u.engine.flush_marks()
        c.mark("a")
        s = u.session(agent_id="ten", created_by="ana", on_failure="continue")
        for k in range(10):
            s.call_sync(oh_refund_sync, user_id=f"u{k}", amount=k)
        s.complete()
        c.mark("b")
    finally:
        _MARKER.pop("counter", None)
    evs = [e for e in c.window("a", "b") if e.level == "wire" and e.kind != "setup"]
    assert [e.kind for e in evs] == ["stmt"] * 11, describe(evs)  # no BEGIN, COMMIT or read either
    durable = [e for e in evs if e.engine == "durable"]
    assert len(durable) == 11, describe(evs)  # the marks went with the end, none on the fast engine
    assert all(_durability(u, c, e.conn) for e in durable)
    assert u.engine._inflight == set() and not u.engine._marks
    rec = u.sessions.get(s.id)
    assert rec.state == "completed" and rec.tool_calls_total == 10
    assert (rec.agent_id, rec.created_by, rec.on_failure) == ("ten", "ana", "continue")
    assert rec.pinned_revisions == u.engine.current_pins()
    assert [e["state"] for e in u.sessions.effects(s.id)] == ["committed"] * 10
