"""The COMPENSABLE hot path on the raw driver: SQL rendered once, connections from two small bounded pools.

SQLAlchemy Core costs more per statement than the durable commit it wraps on a fast disk, and the pre-write and
the commit mark run on every COMPENSABLE call. Everything else (rare paths, errors, pins) stays on Core.
The values written are exactly what Core would write (same datetime text on SQLite, same JSON), so both paths
read back alike. This module holds what both databases share (the pools, the error handling); the statements are
per database, in ``sqlite.py`` and ``postgres.py``.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from sqlalchemy.engine import Engine

from ..errors import DatabaseUnavailable
from .pool import IntegrityConflict, RawPool, WouldBlock, is_unavailable
from .schema import WRITABLE

_EFFECT_COLS = (
    "effect_id, session_id, call_id, tool_name, tool_revision, tier, state, args_snapshot, args_digest, owner, "
    "lease_until, recovery_attempts, created_at, updated_at"
)
#: The columns of an undo entry as the hot paths' raw statements write them.
UNDO_COLS = (
    "undo_id, effect_id, session_id, compensation_name, compensation_version, args_snapshot, state, attempts, created_at, "
    "updated_at"
)
#: ``arm_in``'s row in PostgreSQL's one-statement pre-write: the entry of the effect that CTE ``e`` inserted (none:
#: nothing written), armed with the compensation given and the call's arguments (``postgres.py`` binds them): the
#: row ``store.undo.arm_in`` writes.
ARM_FROM_E = f"""INSERT INTO undolog_undo_stack ({UNDO_COLS})
SELECT e.seq, e.effect_id, e.session_id, %(comp)s, %(comp_version)s, %(args)s::json, 'armed', 0, %(now)s, %(now)s FROM e
"""

# The states in which a session accepts calls, rendered once from the schema's own list.
_WRITABLE = f"state IN ({', '.join(repr(v) for v in WRITABLE)})"



class SessionRow(NamedTuple):
    """A session as :meth:`HotPath.read_session` reads it (what ``Engine.remember`` needs)."""

    session_id: str
    state: str
    pinned_revisions: dict[str, int]
    on_failure: str


class Ended:
    """What :meth:`HotPath.end_session` did: ``moved`` (the session changed state; the object's truth) and
    ``marked``, how many of the deferred marks it was given landed.

    Example:
        >>> done = hot.end_session(sid, 0, "completed", ["active"], time.time(), marks)
        >>> bool(done), done.marked == len(marks)
        (True, True)
    """

    __slots__ = ("marked", "moved")

    def __init__(self, moved: bool, marked: int = 0) -> None:
        self.moved = moved
        self.marked = marked

    def __bool__(self) -> bool:
        return self.moved

    def __repr__(self) -> str:
        return f"Ended(moved={self.moved}, marked={self.marked})"


class HotStore(Protocol):
    """What the hot path uses of its store: the two engines its pools draw from, and SQLite's writer lock."""

    engine: Engine
    fast: Engine
    write_lock: Any


class HotPath(abc.ABC):
    """The pre-write and the commit mark on raw connections from two small pools (durable and fast).

    ``wait=False`` (the async driver on an event loop) raises ``WouldBlock`` before anything is written when a
    connection (or, on SQLite, the in-process write lock) is not free at once, so the caller can retry in a thread.
    """

    #: The driver's unique-violation exception (the same call id written twice).
    integrity_error: tuple[type[BaseException], ...] = ()
    #: The driver's parameter placeholder (``?`` for sqlite3, ``%s`` for psycopg).
    placeholder = "?"
    #: How many session reads a hot path that remembers them (SQLite's turn check) keeps at most, the oldest
    #: dropped first; the engine lowers it to its ``max_sessions``.
    memo_size = 4096

    def __init__(self, store: HotStore, *, pool_size: int, fast_pool_size: int) -> None:
        self.store = store
        self.write_lock = store.write_lock
        self.durable = RawPool(store.engine, pool_size, setup=self._setup_durable)
        self.fast = RawPool(store.fast, fast_pool_size, setup=self._setup)

    @abc.abstractmethod
    def _setup(self, conn: Any) -> None:
        """How a new raw connection of the hot path is configured."""

    def _setup_durable(self, conn: Any) -> None:
        """How a new connection of the durable pool (the pre-writes') is configured: as every one, by default."""
        self._setup(conn)

    @abc.abstractmethod
    def _prewrite(self, conn: Any, wait: bool, session_id: str, count: int, effect_id: str, call_id: str,
                  tool_name: str, revision: int, args_text: str, digest: str, owner: str, now: float, lease: float,
                  comp: str, comp_version: int, start: dict[str, Any] | None = None) -> bool:
        """The pre-write's statements on ``conn``: the session checked, the effect and its undo entry written; with
        ``start`` (only where ``starts_with_prewrite``), the session's row written by the same statement."""

    @abc.abstractmethod
    def _mark(self, conn: Any, wait: bool, effect_id: str, text: str, now: float) -> bool:
        """The commit mark's statement on ``conn``."""

    @abc.abstractmethod
    def _mark_many(self, conn: Any, marks: list[tuple[str, str, float]]) -> int:
        """Many commit marks in one transaction on ``conn``, each fenced by :attr:`owner`; how many landed."""

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
        start: dict[str, Any] | None = None,
    ) -> bool:
        """One durable transaction; False when the session does not accept writes (nothing written).

        ``count`` calls counted in memory are flushed to the session row on the way; with none, the session row is
        only checked. ``now`` and ``lease`` (the lease's end) are epoch seconds, as ``time.time()`` gives them.
        Positional on purpose: this runs on every COMPENSABLE call. A database that went away raises
        ``DatabaseUnavailable``; the effect may then exist (the commit's outcome is unknown), owned by this
        process and never run: ``recover()`` settles it by its id, and it is never written a second time.

        ``start`` (only where ``starts_with_prewrite``): the call is its session's first logged call and the
        session's row is written by the same statement, ``active`` with ``count`` calls and ``start``'s values
        (``agent_id``, ``created_by``, ``on_failure``, ``pinned_revisions``, ``created_at`` in epoch seconds); False,
        nothing written, when a session with that id exists already (the caller reads it and takes the general path).
        """
        pool = self.durable
        conn, gen = pool.checkout(wait=wait)
        broken = False
        try:
            return self._prewrite(conn, wait, session_id, count, effect_id, call_id, tool_name, revision, args_text,
                                  digest, owner, now, lease, comp, comp_version, start)
        except self.integrity_error as exc:
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

    #: Whether :meth:`prewrite` takes ``start`` here (PostgreSQL): a session's row written by the statement of
    #: its first logged call's pre-write.
    starts_with_prewrite = False

    #: The owner a commit mark requires of the effect (the engine's ``leases.owner``): a call taken over by another
    #: process meanwhile (recovery claimed it: its owner changed) is not marked committed behind that process's
    #: back; the engine records the late finish instead (``OutcomeConflict``). The deferred marks
    #: (:meth:`mark_many`, :meth:`end_session`) are fenced the same way, and say how many landed.
    owner = ""

    def mark(self, effect_id: str, text: str, now: float, *, fast: bool, wait: bool = True) -> bool:
        """The commit mark as one autocommit UPDATE; False when the effect was not in flight."""
        pool = self.fast if fast else self.durable
        conn, gen = pool.checkout(wait=wait)
        broken = False
        try:
            return self._mark(conn, wait, effect_id, text, now)
        except WouldBlock:
            raise
        except BaseException as exc:
            if is_unavailable(exc):
                broken = True
                raise DatabaseUnavailable("the commit mark", exc) from exc
            raise
        finally:
            pool.checkin(conn, gen, broken=broken)

    def session_states(self, session_ids: Sequence[str], *, wait: bool = True) -> dict[str, tuple[str, str | None]]:
        """``{session_id: (state, halted_reason)}`` for those of ``session_ids`` that exist: one read.

        The framework adapters check their session once per agent turn; on a pooled raw connection that read costs
        a fraction of what SQLAlchemy Core adds to it. ``wait=False`` raises ``WouldBlock`` when no connection is
        free at once (an event loop).
        """
        marks = ", ".join([self.placeholder] * len(session_ids))
        sql = f"SELECT session_id, state, halted_reason FROM undolog_sessions WHERE session_id IN ({marks})"
        with self.durable.connection("reading sessions", wait=wait) as conn:
            rows = conn.execute(sql, tuple(session_ids)).fetchall()
        return {r[0]: (r[1], r[2]) for r in rows}

    def read_session(self, session_id: str, *, wait: bool = True) -> Any:
        """The session's row (``session_id``, ``state``, ``pinned_revisions`` as a dict, ``on_failure``), or None
        when the store has no such session: one read, nothing written.

        What an adapter reads the first time it sees a session in this process, so that a session it resumes keeps
        its pins and state while one it starts is written only by its first logged call. ``wait=False`` raises
        ``WouldBlock`` when no connection is free at once (an event loop).
        """
        sql = ("SELECT session_id, state, pinned_revisions, on_failure FROM undolog_sessions "
               f"WHERE session_id = {self.placeholder}")
        with self.durable.connection("reading a session", wait=wait) as conn:
            row = conn.execute(sql, (session_id,)).fetchone()
        if row is None:
            return None
        pins = row[2]
        if isinstance(pins, (str, bytes)):
            pins = json.loads(pins)  # SQLite keeps JSON as text; psycopg decodes it
        return SessionRow(row[0], row[1], pins or {}, row[3])

    def start_session(self, values: dict[str, Any], *, durable: bool = True, unless: str | None = None,
                      wait: bool = True) -> Any:
        """A new session's row written durably in one round trip, or None: the database has no such statement
        here (the caller takes the general path), or a row with that id already exists (the caller reads it).
        ``wait=False`` raises ``WouldBlock`` (nothing written) instead of waiting for a connection or a lock.

        ``durable=False`` allows the commit not to wait for the disk where the row then becomes durable with the
        next durable commit of anything (SQLite's WAL); elsewhere it is written durably all the same. ``unless``: no
        row is written (None) when a session with that id exists, checked in the same statement; a hot path without
        that statement answers None (the caller reads the store).
        The returned row has ``session_id``, ``state``, ``pinned_revisions`` and ``on_failure``."""
        return None

    #: Whether :meth:`end_session` exists here and writes the deferred commit marks it is given in the same
    #: statement (PostgreSQL); elsewhere the caller writes them first (:meth:`mark_many`).
    ends_with_marks = False

    def end_session(self, session_id: str, count: int, state: str, allowed: Sequence[str], now: float,
                    marks: Sequence[tuple[str, str, float]] = ()) -> Ended | None:
        """Move the session to ``state`` from one of ``allowed`` and add ``count`` calls, in one durable statement:
        an :class:`Ended` (true when done; false when the session was in no state of ``allowed``, nothing of the
        session written), None when the database has no such statement here (the caller takes the general path).
        ``marks``: deferred commit marks (``(effect_id, result text, epoch seconds)``, fenced by :attr:`owner`)
        written by the same statement whether or not the session moves (only where ``ends_with_marks``); the session
        moves only if every one of them landed (a mark that did not is a late finish, which halts it)."""
        return None

    def mark_many(self, marks: list[tuple[str, str, float]]) -> int:
        """Deferred commit marks (fast mode, or marks a dropped connection held back), in one transaction that is
        not fsynced, each fenced by :attr:`owner` as :meth:`mark` is; how many landed (fewer than given: some call
        was taken over meanwhile, or already settled, and the engine looks at which)."""
        with self.fast.connection("the deferred commit marks") as conn:
            return self._mark_many(conn, marks)

    def close(self) -> None:
        self.durable.close()
        self.fast.close()

