"""The few internals a test must reach, behind one seam, so tests stop pinning how the library is wired.

A test that reads a row the public API does not show, plants one the way a crash or another process would leave
it, or counts statements needs the store's connections; one that waits for deferred writes needs the engine to
flush them. Reached as ``u.store.tx()`` or ``u.engine.flush_counts()``, each such line breaks when the wiring
moves (a store split in two, an engine renamed); through :func:`internals` only this module does.

Example:
    >>> from undolog_core.testing import internals
    >>> with internals(u).write() as conn:
    ...     conn.exec_driver_sql("UPDATE undolog_sessions SET state = 'halted'")
    >>> internals(u).rows("SELECT state FROM undolog_sessions WHERE session_id = :s", s=sid)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

if TYPE_CHECKING:
    from .._undolog import UndoLog


class Internals:
    """What tests may reach inside one :class:`~undolog_core.UndoLog` (see the module docstring).

    Args:
        undolog: The opened UndoLog.

    Example:
        >>> seam = Internals(u)
        >>> seam.is_postgres
        False
    """

    def __init__(self, undolog: UndoLog) -> None:
        self._undolog = undolog

    @property
    def is_postgres(self) -> bool:
        """Whether the store is PostgreSQL (else SQLite)."""
        return bool(self._undolog.store.is_postgres)

    @property
    def sql_engine(self) -> Engine:
        """The store's general SQLAlchemy engine (to listen to its statements, or to read its URL)."""
        engine: Engine = self._undolog.store.engine
        return engine

    @contextmanager
    def read(self) -> Iterator[Connection]:
        """One read transaction on the store, as the library takes it (never the write lock on SQLite)."""
        with self._undolog.store.read() as conn:
            yield conn

    @contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction on the store, as the library takes it (committed when the block ends)."""
        with self._undolog.store.tx() as conn:
            yield conn

    def rows(self, sql: str, **params: Any) -> list[dict[str, Any]]:
        """Run one read query (``:name`` parameters) and return its rows as dicts.

        Example:
            >>> internals(u).rows("SELECT count(*) AS n FROM undolog_effect_log")
            [{'n': 0}]
        """
        with self.read() as conn:
            return [dict(r._mapping) for r in conn.execute(sa.text(sql), params)]

    def execute(self, sql: str, **params: Any) -> int:
        """Run one write statement (``:name`` parameters) in its own transaction; returns the rows it touched."""
        with self.write() as conn:
            return int(conn.execute(sa.text(sql), params).rowcount)

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until the store's background threads have done the I/O they do once at start.

        SQLite's WAL checkpointer opens its own connection from its own thread after its first poll (a pool checkout
        and three statements); from then on it reads shared memory. A test that counts a call's statements starts
        after this, so that the checkpointer's start is never counted as the call's I/O. PostgreSQL and an
        in-memory SQLite store have no such thread: this returns at once.

        Raises:
            TimeoutError: the checkpointer did not watch the file within ``timeout`` seconds.

        Example:
            >>> internals(u).settle()
        """
        from ..storage.checkpoint import CheckpointerState  # a leaf module: imported when a test asks

        checkpointer = getattr(self._undolog.engine.hot, "checkpointer", None)
        if checkpointer is None:
            return
        deadline = time.monotonic() + timeout
        while checkpointer.state is not CheckpointerState.WATCHING:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the WAL checkpointer never watched the file: {checkpointer.state}")
            time.sleep(0.01)

    def flush(self) -> None:
        """Write what the engine keeps in memory for later (SAFE call counters, deferred commit marks) now."""
        self._undolog.engine.flush_counts()


def internals(undolog: UndoLog) -> Internals:
    """The test seam of one UndoLog: :class:`Internals`.

    Args:
        undolog: The opened UndoLog.

    Returns:
        Its :class:`Internals`.

    Example:
        >>> internals(u).flush()
    """
    return Internals(undolog)
