"""A small, bounded pool of raw driver connections for the hot path, and the map from driver errors to ours.

The hot path's connections run in autocommit (and, on SQLite, without foreign-key checks), so they must not mix
with SQLAlchemy's general pool. Connections are checked out for one statement and handed back: a framework that
runs every tool call in a fresh thread (LangGraph does) reuses the same few connections instead of opening one
per step. A connection whose database went away is closed, and every idle connection opened before it is dropped
too (they went away with it), so one failed call is enough to heal: the next one opens a fresh connection. There
is no pre-ping round trip on every checkout.
"""

from __future__ import annotations

import sqlite3
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Engine

from ..errors import DatabaseUnavailable

# SQLite's words for a database it cannot reach (a lock held past busy_timeout, a disk error, a file gone); its
# OperationalError also covers plain SQL mistakes, which are not the database's absence.
_SQLITE_GONE = ("locked", "disk i/o", "unable to open", "readonly database")


def _driver_gone(exc: BaseException) -> bool:
    # psycopg (the [postgres] extra) is looked up, never imported here: a psycopg error exists only in a process
    # that loaded psycopg, and a SQLite-only process (a CLI command, a gateway, `undolog mcp connect`) is spared
    # its import (some 0.2 CPU-s of each start).
    psycopg = sys.modules.get("psycopg")
    if psycopg is not None:
        if isinstance(exc, psycopg.InterfaceError):
            return True  # the connection is closed
        if isinstance(exc, psycopg.OperationalError):
            # No SQLSTATE: the client lost the server. Class 08 (connection exception) and 57P (operator
            # intervention: terminated, shutting down) too. A deadlock or a statement timeout is not an absence.
            state = exc.sqlstate
            return state is None or state.startswith("08") or state.startswith("57P")
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        return any(word in text for word in _SQLITE_GONE)
    return False


def is_unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says the database did not answer (as opposed to refusing a statement)."""
    if isinstance(exc, sa_exc.DBAPIError):
        return bool(exc.connection_invalidated) or (exc.orig is not None and _driver_gone(exc.orig))
    return _driver_gone(exc)


class IntegrityConflict(Exception):
    """A unique key already exists: the same call id was written before (the caller replays it)."""


class WouldBlock(Exception):
    """Raised instead of waiting, when the caller asked not to wait (an event loop): retry the call in a thread."""


class RawPool:
    """At most ``size`` raw connections, checked out per statement, LIFO (the warmest one first).

    Example:
        >>> pool = RawPool(engine, 4, setup=lambda conn: None)
        >>> with pool.connection() as conn:
        ...     conn.execute("SELECT 1")
    """

    def __init__(self, engine: Engine, size: int, *, setup: Callable[[Any], None], timeout: float = 30.0) -> None:
        self._engine = engine
        self._setup = setup
        self.size = size
        self.timeout = timeout
        # A plain lock and a count, not a semaphore: threading.Semaphore is pure Python (a Condition inside) and
        # costs several microseconds per checkout on a path that runs twice per COMPENSABLE call. The condition
        # is only waited on, and notified, when every connection is out.
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)
        self._out = 0
        self._waiting = 0
        self._idle: list[tuple[Any, int]] = []  # (connection, generation)
        self._generation = 0
        self._closed = False

    def _open(self) -> Any:
        fairy = self._engine.raw_connection()
        # Detached: this pool owns the connection, outside SQLAlchemy's pool accounting.
        fairy.detach()
        conn = fairy.dbapi_connection
        assert conn is not None
        self._setup(conn)
        return conn

    def checkout(self, *, wait: bool = True) -> tuple[Any, int]:
        """A connection and its generation; raises ``WouldBlock`` when ``wait`` is False and none is free."""
        with self._lock:
            # The common case, twice per COMPENSABLE call: a warm connection of this generation is idle.
            if self._idle and self._out < self.size:
                found = self._idle[-1]
                if found[1] == self._generation:
                    self._idle.pop()
                    self._out += 1
                    return found
        return self._checkout(wait)

    def _checkout(self, wait: bool) -> tuple[Any, int]:
        stale: list[Any] = []
        with self._lock:
            if self._out >= self.size:
                if not wait:
                    raise WouldBlock()
                self._waiting += 1
                try:
                    if not self._free.wait_for(lambda: self._out < self.size, timeout=self.timeout):
                        raise DatabaseUnavailable(
                            "checkout", f"no connection free after {self.timeout:g} s (pool of {self.size})")
                finally:
                    self._waiting -= 1
            self._out += 1
            found = None
            while self._idle:
                conn, gen = self._idle.pop()
                if gen == self._generation:
                    found = (conn, gen)
                    break
                stale.append(conn)  # opened before the database went away
            generation = self._generation
        for conn in stale:
            _close(conn)
        if found is not None:
            return found
        try:
            return self._open(), generation
        except BaseException as exc:
            self._give_back()
            if is_unavailable(exc):
                raise DatabaseUnavailable("connect", exc) from exc
            raise

    def _give_back(self) -> None:
        with self._lock:
            self._out -= 1
            if self._waiting:
                self._free.notify()

    def checkin(self, conn: Any, gen: int, *, broken: bool = False) -> None:
        with self._lock:
            self._out -= 1
            keep = not broken and gen == self._generation and not self._closed
            if keep:
                self._idle.append((conn, gen))
            elif broken and gen == self._generation:
                self._generation += 1  # every idle connection of that generation is stale now
            if self._waiting:
                self._free.notify()
        if not keep:
            _close(conn)

    @contextmanager
    def connection(self, operation: str, *, wait: bool = True) -> Iterator[Any]:
        """Check a connection out for one unit of work; a database that went away becomes ``DatabaseUnavailable``."""
        conn, gen = self.checkout(wait=wait)
        try:
            yield conn
        except BaseException as exc:
            if is_unavailable(exc):
                self.checkin(conn, gen, broken=True)
                raise DatabaseUnavailable(operation, exc) from exc
            self.checkin(conn, gen)
            raise
        self.checkin(conn, gen)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._generation += 1
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            _close(conn)


def _close(conn: Any) -> None:
    try:
        conn.close()
    except Exception:  # noqa: BLE001, S110 - a connection that is already gone cannot be closed twice
        pass
