"""The store factory: one SQLAlchemy engine on SQLite (embedded default) or PostgreSQL, migrations, identity."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Connection, Engine

# Re-exported: every read of "now" in the core goes through the one clock seam (tests jump it).
from .._clock import utcnow as utcnow
from ..errors import ConfigurationError, DatabaseUnavailable
from .pool import is_unavailable

DEFAULT_SQLITE_FILE = "undolog.db"
FAST_POOL_SIZE = 2
# The general pools' overflow: rare paths (approvals, the desk's requests, sweeps) may burst past the pool, never
# without bound. Kept generous because a thread waiting for a slot holds up whatever it serves (an event loop
# calling the store inline stalls every task on it until a slot frees).
GENERAL_OVERFLOW = 20
_MIGRATION_LOCK_KEY = 0x756E646F6C6F67  # "undolog" as an advisory-lock key


def from_epoch(t: float) -> dt.datetime:
    """The UTC datetime of ``time.time()``'s ``t`` (the hot path keeps epoch seconds, not datetimes)."""
    return dt.datetime.fromtimestamp(t, dt.UTC)


def new_id() -> str:
    """32 random hex digits. Not time-ordered on purpose: people read ids by their first characters (the
    dashboard, the CLI, messages to the model), and time-ordered ids made close in time share those."""
    return os.urandom(16).hex()


def resolve_url(url: str | None) -> str:
    if url is None:
        url = os.environ.get("UNDOLOG_DATABASE_URL") or f"sqlite:///{DEFAULT_SQLITE_FILE}"
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        # Plain libpq URLs are accepted; UndoLog always speaks psycopg 3.
        url = "postgresql+psycopg://" + url.split("://", 1)[1]
    if not (url.startswith("sqlite") or url.startswith("postgresql+psycopg")):
        raise ConfigurationError(
            f"unsupported database URL {url!r}: use sqlite:///path/to/file.db or postgresql+psycopg://user@host/db"
        )
    if url.startswith("sqlite") and (url in ("sqlite://", "sqlite:///:memory:") or ":memory:" in url):
        raise ConfigurationError(
            "an in-memory SQLite database cannot be durable: give UndoLog a file (sqlite:///undolog.db)"
        )
    return url


def _json_rows(rows: Sequence[Mapping[str, Any]]) -> str:
    def default(v: Any) -> Any:
        if isinstance(v, dt.datetime):
            return v.isoformat()
        raise TypeError(f"cannot send {type(v).__name__} in a JSON batch")

    return json.dumps(list(rows), default=default, separators=(",", ":"))


#: How many times ``Store.one_statement`` runs a statement that PostgreSQL chose as a deadlock's victim.
DEADLOCK_TRIES = 3


class Store:
    """Two engines on one database: ``engine`` for durable commits, ``fast`` for commit marks that need not fsync."""

    def __init__(self, url: str | None = None, *, schema: str | None = None, pool_size: int = 5) -> None:
        if pool_size < 1:
            raise ConfigurationError(f"pool_size must be at least 1, got {pool_size}")
        self.pool_size = pool_size
        self.url = resolve_url(url)
        self.schema = schema or os.environ.get("UNDOLOG_SCHEMA") or None
        self.dialect = "sqlite" if self.url.startswith("sqlite") else "postgresql"
        if self.dialect == "sqlite" and self.schema:
            raise ConfigurationError("schema= applies to PostgreSQL only")
        # SQLite has one writer at a time and its busy handler waits by sleeping (a millisecond or more):
        # this process's own writers queue on a lock instead, which hands over at once. Re-entrant, because
        # a write may be nested in another on the same thread (never across threads).
        self.write_lock: Any = WriteLock() if self.dialect == "sqlite" else _NoLock()
        # Bounded whatever the number of threads: a thread that finds every connection in use waits for one
        # (the overflow lets a transaction that reads on a second connection finish, and bursts pass).
        self.engine = self._make_engine(durable=True, pool_size=pool_size)
        self.fast = self._make_engine(durable=False, pool_size=FAST_POOL_SIZE)

    @property
    def max_connections(self) -> int:
        """The most connections UndoLog holds to the database at once: the general pools (durable and fast, each
        with its overflow) and the hot path's two pools."""
        general = self.pool_size + GENERAL_OVERFLOW + FAST_POOL_SIZE + GENERAL_OVERFLOW
        return general + self.pool_size + FAST_POOL_SIZE

    @property
    def is_postgres(self) -> bool:
        return self.dialect == "postgresql"

    def _make_engine(self, *, durable: bool, pool_size: int) -> Engine:
        # Each database's engine (pragmas and transaction modes, or connection options) is made by its own module.
        if self.dialect == "sqlite":
            from . import sqlite

            return sqlite.make_engine(self.url, durable=durable, pool_size=pool_size, overflow=GENERAL_OVERFLOW,
                                      default_file=DEFAULT_SQLITE_FILE)
        from . import postgres

        return postgres.make_engine(self.url, schema=self.schema, durable=durable, pool_size=pool_size,
                                    overflow=GENERAL_OVERFLOW)

    @contextmanager
    def tx(self, *, fast: bool = False, urgent: bool = False) -> Iterator[Connection]:
        """One write transaction; a database that does not answer raises ``DatabaseUnavailable``.

        ``urgent`` (a person's decision, who is waiting for the answer) goes ahead of the writers queued for
        SQLite's write lock (see :class:`WriteLock`); PostgreSQL has no such lock and ignores it.
        """
        try:
            with self.write_lock.held(urgent=urgent), (self.fast if fast else self.engine).begin() as conn:
                yield conn
        except (sa_exc.DBAPIError, sa_exc.TimeoutError) as exc:
            if isinstance(exc, sa_exc.TimeoutError) or is_unavailable(exc):
                raise DatabaseUnavailable("a write transaction", exc) from exc
            raise

    def one_statement(self, sql: str, params: Mapping[str, Any], *, fast: bool = False) -> None:
        """Run ONE statement (psycopg's ``%(name)s`` parameters) as its own transaction in autocommit on PostgreSQL:
        one round trip where ``tx()`` takes three (psycopg sends ``BEGIN`` and ``COMMIT`` as statements of their
        own). The connection comes from the general pool and goes back to it out of autocommit.

        A deadlock is asked again (``DEADLOCK_TRIES`` in all): the server rolled the statement back whole, so
        running it again is its first run, and the other transaction has gone on meanwhile."""
        raw = (self.fast if fast else self.engine).raw_connection()
        try:
            conn = raw.driver_connection
            assert conn is not None
            conn.autocommit = True
            try:
                for attempt in range(1, DEADLOCK_TRIES + 1):
                    try:
                        conn.execute(sql, params)
                        break
                    except Exception as exc:
                        if getattr(exc, "sqlstate", None) != "40P01" or attempt == DEADLOCK_TRIES:
                            raise
            finally:
                conn.autocommit = False
        except BaseException as exc:
            if is_unavailable(exc):
                raw.invalidate()
                raise DatabaseUnavailable("a write", exc) from exc
            raise
        finally:
            raw.close()

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """One read transaction (deferred on SQLite: it never takes the write lock)."""
        try:
            with self.engine.connect().execution_options(undolog_read=True) as conn:
                yield conn
                conn.rollback()
        except (sa_exc.DBAPIError, sa_exc.TimeoutError) as exc:
            if isinstance(exc, sa_exc.TimeoutError) or is_unavailable(exc):
                raise DatabaseUnavailable("a read", exc) from exc
            raise

    def insert_many_in(self, conn: Connection, table: sa.Table, rows: Sequence[Mapping[str, Any]]) -> None:
        """Insert ``rows`` (dicts with the same keys) in one statement, inside the caller's transaction.

        On PostgreSQL the rows travel as ONE JSON parameter expanded by ``json_to_recordset``: an executemany
        costs a round trip per row, and a multi-row VALUES a parameter per cell, which psycopg parses in Python
        (a batch of 500 audit events took longer to send than to store). SQLite's executemany runs in C.
        """
        if not rows:
            return
        if not self.is_postgres:
            conn.execute(table.insert(), list(rows))
            return
        names = list(rows[0])
        cols = [sa.column(n, table.c[n].type) for n in names]
        src = (sa.func.json_to_recordset(sa.cast(sa.literal(_json_rows(rows), sa.Text), sa.JSON))
               .table_valued(*cols).render_derived(name="batch", with_types=True))
        conn.execute(table.insert().from_select(names, sa.select(*(src.c[n] for n in names))))

    def one_of(self, col: Any, values: Sequence[Any]) -> Any:
        """``col IN (values)`` for batches: on PostgreSQL ``col = ANY(:array)``, one parameter whatever the
        size (an IN list of 500 is 500 parameters, which psycopg splits out of the query text in Python)."""
        if self.is_postgres:
            from sqlalchemy.dialects import postgresql as pg

            return col == sa.any_(sa.literal(list(values), pg.ARRAY(col.type)))
        return col.in_(list(values))

    def for_update(self, stmt: Any, *, skip_locked: bool = False) -> Any:
        # SQLite has no row locks; BEGIN IMMEDIATE already serialises writers there.
        if self.is_postgres:
            return stmt.with_for_update(skip_locked=skip_locked)
        return stmt

    def migrate(self) -> None:
        from . import migrate as _migrate

        _migrate.upgrade(self.engine, lock_key=_MIGRATION_LOCK_KEY, schema=self.schema if self.is_postgres else None)

    def dispose(self) -> None:
        self.engine.dispose()
        self.fast.dispose()


class WriteLock:
    """SQLite's in-process writer lock (re-entrant), with a way past the queue for urgent writers.

    Every writer of this process queues here rather than on SQLite's busy handler. Ordinary writers pass a
    turnstile first, so at most one of them at a time waits on the lock itself; an urgent writer (a person's
    decision) goes straight to the lock and so waits for the holder and at most that one writer, not for the whole
    queue of agents' writes. Under the desk's load test a decision otherwise waited some 500 ms here behind dozens
    of agents' writes. A thread that already holds the lock (a nested write) re-enters without the turnstile: it
    must not queue behind writers that wait for it.

    While an urgent writer waits, an ordinary one steps aside: it does not take the lock, and if it got it in the
    meantime it hands it back. A released lock is not handed to the thread it wakes (whoever asks first gets it),
    so a busy thread that released the lock and asked again at once used to win over the urgent writer woken for
    it, again and again: under the load test a decision waited 360-400 ms through several ordinary writes.

    Example:
        >>> lock = WriteLock()
        >>> with lock.held(urgent=True):
        ...     ...  # the decision's transaction
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._turnstile = threading.Lock()
        # Urgent writers waiting for the lock; ordinary writers wait on the condition until there are none.
        self._urgent = 0
        self._no_urgent = threading.Condition(threading.Lock())
        # The hot path releases with the RLock's own method: no Python frame on that path.
        self.release = self._lock.release

    def acquire(self, blocking: bool = True, *, urgent: bool = False) -> bool:
        lock = self._lock
        if lock._is_owned():  # type: ignore[attr-defined]  # the C RLock's method, as Condition uses
            return lock.acquire(blocking)
        if urgent:
            return self._acquire_urgent(blocking)
        if not self._turnstile.acquire(blocking):
            return False
        try:
            while True:
                if self._urgent and not self._wait_no_urgent(blocking):
                    return False
                if not lock.acquire(blocking):
                    return False
                if not self._urgent:  # read under the lock: an urgent writer arriving now waits for this one
                    return True
                lock.release()  # an urgent writer came while this one waited: it goes first

        finally:
            self._turnstile.release()

    def acquire_within(self, timeout: float) -> bool:
        """Take the lock as an ordinary writer does (through the turnstile), or give up (False): after ``timeout``
        seconds, or at once when an urgent writer waits. For work that may skip its turn (the WAL checkpointer's,
        ``checkpoint.py``): it never waits longer than asked, and never ahead of a person's decision. A thread that
        holds the lock already re-enters at once.

        Example:
            >>> if lock.acquire_within(0.05):
            ...     try:
            ...         ...  # a short piece of work with this process's writers held back
            ...     finally:
            ...         lock.release()
        """
        lock = self._lock
        if lock._is_owned():  # type: ignore[attr-defined]  # the C RLock's method, as Condition uses
            return lock.acquire()
        deadline = time.monotonic() + timeout
        if not self._turnstile.acquire(True, timeout):
            return False
        try:
            if self._urgent or not lock.acquire(True, max(0.0, deadline - time.monotonic())):
                return False
            if self._urgent:  # an urgent writer came while this one waited: it goes first
                lock.release()
                return False
            return True
        finally:
            self._turnstile.release()

    def _acquire_urgent(self, blocking: bool) -> bool:
        with self._no_urgent:
            self._urgent += 1
        try:
            return self._lock.acquire(blocking)
        finally:
            with self._no_urgent:
                self._urgent -= 1
                if not self._urgent:
                    self._no_urgent.notify_all()

    def _wait_no_urgent(self, blocking: bool) -> bool:
        with self._no_urgent:
            while self._urgent:
                if not blocking:
                    return False
                self._no_urgent.wait()
        return True

    def __enter__(self) -> WriteLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    @contextmanager
    def held(self, *, urgent: bool = False) -> Iterator[None]:
        self.acquire(urgent=urgent)
        try:
            yield
        finally:
            self._lock.release()


class _NoLock:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None

    @contextmanager
    def held(self, *, urgent: bool = False) -> Iterator[None]:
        yield


# -- process identity, used for leases -------------------------------------------------------------

#: Which host this process says it is in an owner string. ``UNDOLOG_HOST_ID`` overrides the host name: a test
#: makes a process on this machine look foreign (its stall then looks like a death elsewhere: the lease decides),
#: and hosts that share a name (containers) can be told apart.
HOST_ID_ENV = "UNDOLOG_HOST_ID"
_HOST = os.environ.get(HOST_ID_ENV) or socket.gethostname()


def _proc_start_ticks(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or None when no such process runs (a zombie,
    killed and not yet reaped by its parent, runs nothing: None too)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return None
    # The command name may contain spaces and parentheses; fields resume after the last ')'.
    rest = data.rsplit(")", 1)[-1].split()
    if rest and rest[0] in ("Z", "X"):
        return None
    return rest[19] if len(rest) > 19 else None


class Owner:
    """Who is running an effect: host, pid and process start time (so a recycled pid is not mistaken for us)."""

    _lock = threading.Lock()
    _me: str | None = None
    _pid: int | None = None

    @classmethod
    def me(cls) -> str:
        pid = os.getpid()
        if cls._me is None or cls._pid != pid:
            with cls._lock:
                cls._pid = pid
                cls._me = f"{_HOST}|{pid}|{_proc_start_ticks(pid) or '0'}"
        assert cls._me is not None
        return cls._me

    @staticmethod
    def is_alive_locally(owner: str) -> bool:
        """True when the owner is a process on this host that still runs: its pid exists with the start time the
        owner recorded (a recycled pid has another). False when it is gone, elsewhere, or its start time was not
        known (``0``: only the lease can tell then)."""
        try:
            host, pid_s, ticks = owner.split("|")[:3]
            pid = int(pid_s)
        except ValueError:
            return False
        if host != _HOST or ticks == "0":
            return False
        return _proc_start_ticks(pid) == ticks

    @staticmethod
    def is_dead_locally(owner: str) -> bool:
        """True when the owner is a process on this host that no longer exists; False if alive or elsewhere."""
        try:
            host, pid_s, ticks = owner.split("|")[:3]
            pid = int(pid_s)
        except ValueError:
            return False
        if host != _HOST:
            return False
        current = _proc_start_ticks(pid)
        if current is None:
            return True
        return ticks != "0" and current != ticks
