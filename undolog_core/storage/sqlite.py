"""SQLite: the engine (WAL, ``synchronous=FULL``, deferred reads, immediate writes), the hot path's statements
(the pre-write as one autocommit statement into a view whose trigger writes the effect and its undo entry), recovery's cursor.

The DBOS shape: ``SQLiteStorage`` is the ``Storage`` of a SQLite file; ``postgres.py`` holds the other one.
"""

from __future__ import annotations

import json
import mmap
import os
import sqlite3
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine

from ..errors import ConfigurationError, DatabaseUnavailable
from ..states import EFFECT
from . import schema as t
from .checkpoint import HARD_PAGES, WalCheckpointer
from .group import GroupCommit
from .hotpath import _WRITABLE, HotPath, SessionRow
from .pool import IntegrityConflict, RawPool, WouldBlock, is_unavailable

# The pre-write: one INSERT into the view of revision 0010 (schema.SQLITE_PREWRITE_VIEW), whose trigger writes the
# effect while its session accepts writes, and its undo entry with the compensation given.
_SQLITE_PREWRITE = (
    "INSERT INTO undolog_prewrite (effect_id, session_id, call_id, tool_name, tool_revision, args_snapshot, "
    "args_digest, owner, lease_until, created_at, compensation_name, compensation_version) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# The pre-write that also adds the calls counted in memory since the session's last write: one autocommit INSERT
# into a view of the connection's own (TEMP: nothing in the database file, no migration), whose trigger adds the count
# to the session's row while the session accepts writes, then runs the schema's own pre-write trigger program (its
# body, taken from ``schema.SQLITE_PREWRITE_TRIGGER``: the same effect and undo entry, the same session check). It
# was BEGIN IMMEDIATE, the session UPDATE, the INSERT and COMMIT: three statements more, each a trip through the
# driver that lets go of the GIL, on every COMPENSABLE call that follows a SAFE one (the trigger program in place,
# rather than an INSERT into ``undolog_prewrite`` from this trigger: a nested view's trigger cost 3-5 us more).
# Made on a connection of the hot path's durable pool by its first counted pre-write (``_prewrite_in``): only
# there, since a connection that migrates the schema must not carry it (SQLite checks every trigger it can see
# against a table renamed under it, and this one names tables the migrations rebuild).
_SQLITE_COUNTED_VIEW = (
    "CREATE TEMP VIEW IF NOT EXISTS undolog_prewrite_counted AS SELECT NULL AS calls, NULL AS effect_id, "
    "NULL AS session_id, NULL AS call_id, NULL AS tool_name, NULL AS tool_revision, NULL AS args_snapshot, "
    "NULL AS args_digest, NULL AS owner, NULL AS lease_until, NULL AS created_at, NULL AS compensation_name, "
    "NULL AS compensation_version WHERE 0"
)
_SQLITE_COUNTED_TRIGGER = (
    "CREATE TEMP TRIGGER IF NOT EXISTS undolog_prewrite_counted_insert INSTEAD OF INSERT ON undolog_prewrite_counted "
    "BEGIN "
    "UPDATE undolog_sessions SET tool_calls_total = tool_calls_total + NEW.calls, updated_at = NEW.created_at "
    f"WHERE session_id = NEW.session_id AND {_WRITABLE};"
    + t.SQLITE_PREWRITE_TRIGGER.split("BEGIN", 1)[1].rsplit("END", 1)[0]
    + "END"
)
_SQLITE_PREWRITE_COUNTED = (
    "INSERT INTO undolog_prewrite_counted (calls, effect_id, session_id, call_id, tool_name, tool_revision, "
    "args_snapshot, args_digest, owner, lease_until, created_at, compensation_name, compensation_version) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# A new session in one durable autocommit statement (see HotPath.start_session); an id that exists returns no row.
_SQLITE_START_SESSION = (
    "INSERT INTO undolog_sessions (session_id, agent_id, state, tool_calls_total, created_by, halted_reason, "
    "on_failure, pinned_revisions, created_at, updated_at) VALUES (?, ?, 'active', 0, ?, NULL, ?, ?, ?, ?) "
    "ON CONFLICT (session_id) DO NOTHING RETURNING session_id, state, pinned_revisions, on_failure"
)
# The same insert, unless another session (``unless``: the thread's next one) exists: an adapter's first look at a
# thread, which is then started without reading the store first (nothing is written when either exists).
_SQLITE_START_SESSION_UNLESS = (
    "INSERT INTO undolog_sessions (session_id, agent_id, state, tool_calls_total, created_by, halted_reason, "
    "on_failure, pinned_revisions, created_at, updated_at) SELECT ?, ?, 'active', 0, ?, NULL, ?, ?, ?, ? "
    "WHERE NOT EXISTS (SELECT 1 FROM undolog_sessions WHERE session_id = ?) "
    "ON CONFLICT (session_id) DO NOTHING RETURNING session_id, state, pinned_revisions, on_failure"
)
# The guard is the state table's (``states.EFFECT``, transition ``commit``).
_SQLITE_MARK = (
    "UPDATE undolog_effect_log SET state = 'committed', result_snapshot = ?, owner = NULL, lease_until = NULL, "
    f"updated_at = ? WHERE effect_id = ? AND {EFFECT.where('commit')}"
)
# One call's commit mark, fenced by its owner (``HotPath.owner``): not over a call another process took over.
_SQLITE_MARK_OWNED = _SQLITE_MARK + " AND owner = ?"


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




# The wal-index header (https://www.sqlite.org/walformat.html): two 48-byte copies at the start of the -shm file,
# which every connection to the database, in every process, maps and updates on each commit. Its first word is the
# format's version, its 13th byte isInit.
_WAL_HDR = 48
_WAL_INDEX_VERSION = 3007000
# How long a remembered session read may be answered from the header alone: a safety net for what the header
# cannot see (the database taken out of WAL mode by another process, or its file replaced), not the mechanism.
STATE_MEMO_SECONDS = 1.0
_STATE_MEMO_SIZE = 4096


# The header's third word: iChange, which every commit of every connection increments by one (a restart of the WAL
# or a checkpoint does not: a header changed without it is no new commit).
_ICHANGE = struct.Struct("=I")


def _any_written(outcomes: Sequence[Any]) -> bool:
    """Whether a group's transaction wrote anything (one of its writes says True: the rest may be refusals)."""
    return any(o is True for o in outcomes)


def _commits_between(before: bytes, after: bytes) -> int:
    """How many commits the wal-index header counted from ``before`` to ``after`` (two ``WalStamp.stamp`` values)."""
    return int(_ICHANGE.unpack_from(after, 8)[0] - _ICHANGE.unpack_from(before, 8)[0]) & 0xFFFFFFFF


class WalStamp:
    """The database's wal-index header, read from shared memory: it changes with every commit of any connection of
    any process, and reading it is a memory read (no statement, no system call, the GIL kept).

    A session read taken after a stamp still holds while the stamp is unchanged: nothing was committed since. It
    takes a connection of its own, held open: while one is open in this process, SQLite never re-initialises the
    ``-shm`` file (its "DMS" lock), so the mapped bytes stay the live header. ``open`` returns None where there is no
    such header to read (an in-memory database, another journal mode, exclusive locking): callers read every time.
    """

    def __init__(self, conn: Any, fd: int, mem: mmap.mmap) -> None:
        self._conn, self._fd, self._mem = conn, fd, mem

    @classmethod
    def open(cls, conn: Any) -> WalStamp | None:
        """Watch the database of ``conn`` (a raw connection this object then owns and closes), or None."""
        fd: int | None = None
        mem: mmap.mmap | None = None
        stamp: WalStamp | None = None
        try:
            rows = conn.execute("PRAGMA database_list").fetchall()
            path = next((r[2] for r in rows if r[1] == "main"), "")
            if not path or str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal" or \
                    str(conn.execute("PRAGMA locking_mode").fetchone()[0]).lower() != "normal":
                return None
            # A read maps the connection's wal-index, and with it the lock that keeps the file from being reset.
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            fd = os.open(path + "-shm", os.O_RDONLY)
            mem = mmap.mmap(fd, 2 * _WAL_HDR, access=mmap.ACCESS_READ)
            if struct.unpack_from("=I", mem, 0)[0] != _WAL_INDEX_VERSION or mem[12] != 1:
                return None  # not a wal-index this code knows how to read
            stamp = cls(conn, fd, mem)  # owns them from here: closed by close()
            return stamp
        except (OSError, ValueError, sqlite3.Error):
            return None
        finally:
            if stamp is None:  # not watched: what was opened here is closed here
                if mem is not None:
                    mem.close()
                if fd is not None:
                    os.close(fd)
                conn.close()

    def stamp(self) -> bytes | None:
        """The header now, or None while a commit is writing it (its two copies differ: read the store)."""
        both = self._mem[: 2 * _WAL_HDR]
        head = both[:_WAL_HDR]
        return head if head == both[_WAL_HDR:] else None

    def close(self) -> None:
        self._mem.close()
        os.close(self._fd)
        self._conn.close()


class SQLiteHotPath(HotPath):
    integrity_error = (sqlite3.IntegrityError,)

    def __init__(self, store: Any, *, pool_size: int, fast_pool_size: int) -> None:
        super().__init__(store, pool_size=pool_size, fast_pool_size=fast_pool_size)
        # Durable pre-writes and commit marks of concurrent threads share one commit (see group.py): a caller
        # alone writes exactly as below, at once.
        self.group = GroupCommit(self._own_write_one, self._own_write_many)
        # Session reads remembered with the wal-index stamp taken before them (see session_states).
        self._watch: WalStamp | None = None
        self._watch_tried = False
        self._watch_lock = threading.Lock()
        self._states: dict[tuple[str, ...], tuple[bytes, float, dict[str, tuple[str, str | None]]]] = {}
        # This hot path's own commits, each seen alone (``_own_commit``): the stamp after it -> the stamp before it.
        self._own: dict[bytes, bytes] = {}
        # WAL checkpoints in a thread of their own, not inside a caller's commit (see checkpoint.py); none for an
        # in-memory database, which has no WAL.
        self.checkpointer = (WalCheckpointer(self._checkpointer_connection, write_lock=self.write_lock)
                             if _on_file(store.engine) else None)

    def _checkpointer_connection(self) -> Any:
        # The durable engine's (synchronous=FULL: a checkpoint fsyncs the WAL before copying it and the file
        # after, whatever mode the callers write in), owned by the checkpointer outside the pool's accounting.
        fairy = self.store.engine.raw_connection()
        fairy.detach()
        return fairy.dbapi_connection

    def session_states(self, session_ids: Sequence[str], *, wait: bool = True) -> dict[str, tuple[str, str | None]]:
        """The read of ``HotPath.session_states``, skipped while nothing was committed since the same ids were read.

        An adapter checks its session at every agent turn, so that a halt or a rollback made by another process stops
        the next turn. Any such change is a commit, and every commit rewrites the wal-index header (``WalStamp``):
        when the header is the one seen just before the last read of these ids, that read is still the store's
        answer. A read costs little in itself, but it is a statement: the driver lets go of the GIL, and inside an
        agent step that hands the interpreter to the framework's background threads (LangGraph's checkpoint writes)
        and costs some ten times the read (benchmarks/agent_step.py's SAFE row). A remembered answer is reused for at
        most ``STATE_MEMO_SECONDS``.
        """
        watch = self._watch if self._watch_tried else self._open_watch(wait)
        if watch is None:
            return super().session_states(session_ids, wait=wait)
        key = tuple(session_ids)
        # Before the read: a commit after it changes the stamp the next turn compares. (WalStamp.stamp, inline: a
        # frame less at every turn.)
        both = watch._mem[: 2 * _WAL_HDR]
        stamp: bytes | None = both[:_WAL_HDR]
        if stamp != both[_WAL_HDR:]:
            stamp = None  # a commit is writing the header: read the store
        now = time.monotonic()
        seen = self._states.get(key)
        if seen is not None and stamp is not None and now - seen[1] < STATE_MEMO_SECONDS:
            if seen[0] == stamp:
                return dict(seen[2])
            # Whether every commit from the read's stamp to this one was one of this hot path's pre-writes or commit
            # marks, each seen alone (see ``_own_commit``): those change no session's state or halt reason (a
            # pre-write adds to the session's call count and writes the effect and its undo entry; a mark changes
            # the effect; no trigger of the schema writes a session), so the read is still the store's answer. A
            # COMPENSABLE agent step commits twice (its pre-write and its mark): without this, every turn of such an
            # agent would read its session again, though nothing but its own calls was written since the last read.
            # A turn's own commits are a few: a longer walk is not worth it (read). In this frame, not one of its
            # own: it runs at every turn of such an agent, where each frame's code is cold.
            own, at = self._own, stamp
            for _ in range(8):
                before = own.get(at)
                if before is None:
                    break
                if before == seen[0]:
                    # Kept from the same read (and its age), under the newer stamp: the next turn walks from here.
                    self._states[key] = (stamp, seen[1], seen[2])
                    return dict(seen[2])
                at = before
        found = super().session_states(session_ids, wait=wait)
        if stamp is not None:
            self._remember_states(key, stamp, now, dict(found))
        return found

    def _remember_states(self, key: tuple[str, ...], stamp: bytes, now: float,
                         found: dict[str, tuple[str, str | None]]) -> None:
        """What the store answers to the check of ``key`` at ``stamp`` (read at ``now``, monotonic seconds); at most
        ``memo_size`` kept, the oldest dropped first (a thread's start adds one: the memory stays bounded however many
        threads are served)."""
        states = self._states
        states.pop(key, None)  # re-inserted: the newest
        while len(states) >= self.memo_size:
            try:
                states.pop(next(iter(states)), None)
            except (StopIteration, RuntimeError):  # emptied, or changed by another thread meanwhile: good enough
                break
        states[key] = (stamp, now, found)

    def _own_commit(self, write: Any, *args: Any, wrote: Callable[[Any], bool] = bool, **kw: Any) -> Any:
        """``write(*args)``, remembered as this hot path's own commit when it was the only commit between the
        header read just before it and the one read just after it (any other commit of any connection or process
        in between counts too: then nothing is remembered, and the next turn's check reads the store).

        Only a write that says it wrote (``wrote(out)``) counts: one that changed nothing commits no frame, so the
        one commit counted across it would be another's (a halt made elsewhere, which the next turn must read)."""
        watch = self._watch
        if watch is None:
            return write(*args, **kw)
        # WalStamp.stamp and _commits_between, inline: this runs around both durable writes of every COMPENSABLE
        # call, where each Python frame costs 1-3 us (its code is cold inside an agent step). A header whose two
        # copies differ is being written by a commit: nothing is remembered then.
        mem = watch._mem
        head = mem[: 2 * _WAL_HDR]
        out = write(*args, **kw)
        tail = mem[: 2 * _WAL_HDR]
        before, after = head[:_WAL_HDR], tail[:_WAL_HDR]
        if before == head[_WAL_HDR:] and after == tail[_WAL_HDR:] and wrote(out) and \
                (_ICHANGE.unpack_from(after, 8)[0] - _ICHANGE.unpack_from(before, 8)[0]) & 0xFFFFFFFF == 1:
            own = self._own
            if len(own) >= _STATE_MEMO_SIZE:
                own.clear()
            own[after] = before
        return out

    def _open_watch(self, wait: bool) -> WalStamp | None:
        if not wait:
            return None  # opening a connection may wait: on an event loop, read as before until a thread opens it
        with self._watch_lock:
            if not self._watch_tried:
                try:
                    fairy = self.store.engine.raw_connection()
                    fairy.detach()  # owned by the stamp, outside SQLAlchemy's pool accounting
                    self._watch = WalStamp.open(fairy.dbapi_connection)
                except Exception:  # noqa: BLE001 - no stamp: every turn reads, as without one
                    self._watch = None
                self._watch_tried = True
        return self._watch

    def close(self) -> None:
        with self._watch_lock:
            watch, self._watch, self._watch_tried = self._watch, None, True
            self._states.clear()
        if watch is not None:
            watch.close()
        if self.checkpointer is not None:
            self.checkpointer.close()
        super().close()

    def prewrite(self, session_id: str, count: int, effect_id: str, call_id: str, tool_name: str, revision: int,
                 args_text: str, digest: str, owner: str, now: float, lease: float, comp: str, comp_version: int,
                 wait: bool = True, start: dict[str, Any] | None = None) -> bool:
        # A session's row is written at its start here (``starts_with_prewrite`` is False): ``start`` is never given.
        assert start is None
        args = (session_id, count, effect_id, call_id, tool_name, revision, args_text, digest, owner, now, lease, comp,
                comp_version)
        return bool(self.group.submit((True, args), wait))

    def mark(self, effect_id: str, text: str, now: float, *, fast: bool, wait: bool = True) -> bool:
        if fast:
            return bool(self._own_commit(super().mark, effect_id, text, now, fast=True, wait=wait))
        return bool(self.group.submit((False, (effect_id, text, now)), wait))

    def _own_write_one(self, item: tuple[bool, tuple[Any, ...]], wait: bool) -> bool:
        return bool(self._own_commit(self._write_one, item, wait))

    def _own_write_many(self, items: Sequence[tuple[bool, tuple[Any, ...]]]) -> list[Any]:
        return list(self._own_commit(self._write_many, items, wrote=_any_written))

    def _write_one(self, item: tuple[bool, tuple[Any, ...]], wait: bool) -> bool:
        """One durable write alone (the group's uncontended path): a connection, the write lock, one statement.

        Written out here rather than through ``HotPath.prewrite``/``mark`` and their per-database hooks: this runs
        twice per COMPENSABLE call, and each layer cost more than the lock round trips it wraps. Same statements,
        same errors (``IntegrityConflict``, ``WouldBlock``, ``DatabaseUnavailable``) as there."""
        is_prewrite, args = item
        pool = self.durable
        conn, gen = pool.checkout(wait=wait)
        broken = False
        try:
            # ``_prewrite``'s and ``_mark``'s lock and statement, in this frame. SQLite has one writer: this
            # process's writers queue on a lock that hands over at once (SQLite's own busy handler sleeps a
            # millisecond or more). On an event loop it is never waited for.
            lock = self.write_lock
            if not lock.acquire(blocking=wait):
                raise WouldBlock()
            try:
                if is_prewrite:
                    # One autocommit statement, with a count or without (see _prewrite).
                    return self._prewrite_in(conn, *args)
                effect_id, text, now = args
                return bool(conn.execute(_SQLITE_MARK_OWNED, (text, _sqlite_time(now), effect_id, self.owner))
                            .rowcount == 1)
            finally:
                lock.release()
        except sqlite3.IntegrityError as exc:
            raise IntegrityConflict(str(exc)) from exc
        except WouldBlock:
            raise
        except BaseException as exc:
            if is_unavailable(exc):
                broken = True
                raise DatabaseUnavailable("the pre-write" if is_prewrite else "the commit mark", exc) from exc
            raise
        finally:
            pool.checkin(conn, gen, broken=broken)

    def _write_many(self, items: Sequence[tuple[bool, tuple[Any, ...]]]) -> list[Any]:
        """Several durable writes in one transaction, each in its own savepoint: one outcome per write (True,
        False for a refused session or an effect not in flight, or ``IntegrityConflict``)."""
        with self.durable.connection("a group commit") as conn, self.write_lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                out = [self._grouped(conn, item) for item in items]
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return out

    def _grouped(self, conn: Any, item: tuple[bool, tuple[Any, ...]]) -> Any:
        is_prewrite, args = item
        conflict: IntegrityConflict | None = None
        conn.execute("SAVEPOINT undolog_w")
        try:
            if is_prewrite:
                ok = self._prewrite_in(conn, *args)
            else:
                effect_id, text, now = args
                ok = conn.execute(_SQLITE_MARK_OWNED, (text, _sqlite_time(now), effect_id, self.owner)).rowcount == 1
        except sqlite3.IntegrityError as exc:
            ok, conflict = False, IntegrityConflict(str(exc))
        if not ok:
            conn.execute("ROLLBACK TO undolog_w")  # this write only; the others in the group stand
        conn.execute("RELEASE undolog_w")
        return conflict if conflict is not None else ok

    @staticmethod
    def _prewrite_in(conn: Any, session_id: str, count: int, effect_id: str, call_id: str, tool_name: str,
                     revision: int, args_text: str, digest: str, owner: str, now: float, lease: float, comp: str,
                     comp_version: int) -> bool:
        """The pre-write's one statement, with or without ``count`` (then through the counting view, which adds it
        to the session's row): autocommit alone, or inside a group's transaction. An INSERT into a view reports no
        rowcount: the connection's change counter says whether every row was written (the effect and its undo
        entry, and the session's row when there is a count). A statement that fails (the call id written before)
        takes back every row its triggers wrote: nothing of it stands."""
        before = conn.total_changes
        if count:
            row = (count, effect_id, session_id, call_id, tool_name, revision, args_text, digest, owner,
                   _sqlite_time(lease), _sqlite_time(now), comp, comp_version)
            try:
                conn.execute(_SQLITE_PREWRITE_COUNTED, row)
            except sqlite3.OperationalError as exc:
                # This connection's first counted pre-write: the view is made now, not as the connection joins the
                # pool, so that a run of SAFE calls (whose one read takes a connection) sends no statement but that
                # read. The failed INSERT was refused as it was prepared: nothing of it was written.
                if "undolog_prewrite_counted" not in str(exc):
                    raise
                conn.execute(_SQLITE_COUNTED_VIEW)
                conn.execute(_SQLITE_COUNTED_TRIGGER)
                conn.execute(_SQLITE_PREWRITE_COUNTED, row)
            return bool(conn.total_changes - before == 3)
        conn.execute(_SQLITE_PREWRITE, (effect_id, session_id, call_id, tool_name, revision, args_text, digest, owner,
                                        _sqlite_time(lease), _sqlite_time(now), comp, comp_version))
        return bool(conn.total_changes - before == 2)

    def _setup(self, conn: Any) -> None:
        # What the pool's connections check by foreign key, the hot path's statements guarantee themselves:
        # the effect is inserted only where the session row exists (in the same statement), its undo entry
        # refers to it, and a commit mark changes no key. Skipping the checks saves two lookups per pre-write.
        conn.execute("PRAGMA foreign_keys=OFF")
        # Likewise the CHECK constraints: every value these connections write is a constant of the statements
        # above ('compensable', 'pending', 'committed', the trigger's 'armed') or a counter, never a caller's value,
        # so re-proving the enum lists on every row proves nothing; SQLite evaluates each IN-list check per row,
        # about a sixth of the CPU of a COMPENSABLE call's two statements. The one caller's value that meets a CHECK
        # here, a new session's on_failure, is checked by start_session before it is written. The general engine's
        # connections, which write every other state, keep every check (tests/core/test_hot_path_checks.py).
        conn.execute("PRAGMA ignore_check_constraints=ON")
        # The WAL is checkpointed by the hot path's thread (checkpoint.py): a commit here checkpoints only past
        # HARD_PAGES, the safeguard for when that thread cannot keep up.
        conn.execute(f"PRAGMA wal_autocheckpoint={HARD_PAGES}")

    def _prewrite(self, conn: Any, wait: bool, session_id: str, count: int, effect_id: str, call_id: str,
                  tool_name: str, revision: int, args_text: str, digest: str, owner: str, now: float, lease: float,
                  comp: str, comp_version: int, start: dict[str, Any] | None = None) -> bool:
        # ``start`` is never given here: a session's row is written at its start (``starts_with_prewrite`` False).
        args = (session_id, count, effect_id, call_id, tool_name, revision, args_text, digest, owner, now, lease, comp,
                comp_version)
        # SQLite has one writer: this process's writers queue on a lock that hands over at once (SQLite's own
        # busy handler sleeps a millisecond or more). On an event loop it is never waited for.
        if not self.write_lock.acquire(blocking=wait):
            raise WouldBlock()
        try:
            # One autocommit statement, with a count or without: a write statement takes the write lock before it
            # reads, like BEGIN IMMEDIATE, so the triggers' session check and their writes see one state.
            return self._prewrite_in(conn, *args)
        finally:
            self.write_lock.release()

    def start_session(self, values: dict[str, Any], *, durable: bool = True, unless: str | None = None,
                      wait: bool = True) -> Any:
        """A new session's row in one durable autocommit statement, or None when the id exists (the caller reads it).

        The general path's read, savepoint and insert through SQLAlchemy cost about a millisecond of CPU; an adapter
        starts a session per conversation, and a conversation may be a few calls. The values are those Core would
        write (the same datetime text, the same JSON); this pool's connections skip CHECK constraints, so the one
        value a caller chose (``on_failure``) is checked here first.

        ``durable=False``: committed without waiting for the disk (on the fast pool, ``synchronous=NORMAL``: the WAL
        is written, not fsynced). Visible to every connection at once, and durable with the next durable
        commit of any connection of any process: that commit fsyncs the whole WAL file, this row's frames with it
        (a checkpoint syncs the database first). Every write that depends on the row is such a commit (a pre-write
        checks the session in its own statement, a halt or a rollback changes the row), so a power loss can only
        take the row while nothing in the store refers to it: the same store as if it had not been started yet.

        ``unless``: nothing is written (None) when a session with that id exists either, checked in the same
        statement; a row written so is also the answer the next :meth:`session_states` of ``[session_id, unless]``
        gives without a read, while nothing else commits."""
        on_failure = t.OnFailure(values["on_failure"]).value  # ValueError for anything the CHECK would refuse
        now_s = _sqlite_time(values["created_at"].timestamp())
        params: tuple[Any, ...] = (values["session_id"], values["agent_id"], values["created_by"], on_failure,
                                   json.dumps(values["pinned_revisions"]), now_s, now_s)
        sql = _SQLITE_START_SESSION
        if unless is not None:
            sql, params = _SQLITE_START_SESSION_UNLESS, (*params, unless)
        # The wal-index header around the insert (a started thread's next turn check is answered from it, below).
        watch = (self._watch if self._watch_tried else self._open_watch(True)) if unless is not None else None
        before = watch.stamp() if watch is not None else None
        rows = self._start_one(self.durable if durable else self.fast, sql, params, wait)
        if not rows:
            return None
        sid, state, pins, failure = rows[0]
        if watch is not None and before is not None and unless is not None:
            after = watch.stamp()
            if after is not None and _commits_between(before, after) == 1:
                # The insert was the one commit across it: the store's answer to the check of ``[sid, unless]`` at
                # ``after`` is this row (active, no halt reason) and no ``unless`` (the statement checked it). So
                # remembered, as that check's own read would be: the thread's second turn reads nothing either
                # while nothing else commits (a halt or a rollback made anywhere is a commit: it reads then).
                # Not an own commit (``_own``): a new session changes what other checks of its id would read.
                self._remember_states((sid, unless), after, time.monotonic(), {sid: (state, None)})
        return SessionRow(sid, state, json.loads(pins) if pins else {}, failure)

    def _start_one(self, pool: RawPool, sql: str, params: tuple[Any, ...], wait: bool) -> list[Any]:
        """``start_session``'s statement, alone, on a connection of ``pool``. On the fast pool (``durable=False``)
        its commit writes the WAL without waiting for the disk (``synchronous=NORMAL``), where a durable connection
        switched to NORMAL and back cost two statements more (each lets go of the GIL, inside an agent step).
        ``wait=False``: ``WouldBlock`` (nothing written) when the connection or the write lock is taken."""
        with pool.connection("starting a session", wait=wait) as conn:
            if not self.write_lock.acquire(blocking=wait):
                raise WouldBlock()
            try:
                # fetchall: the autocommit statement ends (and commits) only once its RETURNING rows are read.
                rows: list[Any] = conn.execute(sql, params).fetchall()
            finally:
                self.write_lock.release()
        return rows

    def _mark(self, conn: Any, wait: bool, effect_id: str, text: str, now: float) -> bool:
        if not self.write_lock.acquire(blocking=wait):
            raise WouldBlock()
        try:
            return bool(conn.execute(_SQLITE_MARK_OWNED, (text, _sqlite_time(now), effect_id, self.owner)).rowcount
                        == 1)
        finally:
            self.write_lock.release()

    def _mark_many(self, conn: Any, marks: list[tuple[str, str, float]]) -> int:
        return int(self._own_commit(self._marked_rows, conn, marks))

    def _marked_rows(self, conn: Any, marks: list[tuple[str, str, float]]) -> int:
        """The marks in one transaction, each fenced by its owner; how many effects they changed (none: nothing was
        committed)."""
        owner = self.owner
        rows = [(text, _sqlite_time(now), eid, owner) for eid, text, now in marks]
        with self.write_lock:
            conn.execute("BEGIN IMMEDIATE")
            try:
                changed = int(conn.executemany(_SQLITE_MARK_OWNED, rows).rowcount)
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        return changed


def _on_file(engine: Engine) -> bool:
    """Whether ``engine`` is on a database file (not ``:memory:``, a temporary database or a ``mode=memory`` URI)."""
    database = engine.url.database or ""
    return database not in ("", ":memory:") and "mode=memory" not in str(engine.url)


def make_engine(url: str, *, durable: bool, pool_size: int, overflow: int, default_file: str) -> Engine:
    """A SQLite engine: WAL, ``synchronous=FULL`` (``NORMAL`` for the fast engine), foreign keys on, reads deferred
    and writes ``BEGIN IMMEDIATE``."""
    path = url.split("///", 1)[1] if "///" in url else default_file
    parent = Path(path).expanduser().resolve().parent
    if not parent.is_dir():
        raise ConfigurationError(f"the folder for the SQLite database does not exist: {parent}")
    eng = sa.create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": 30, "isolation_level": None},
        pool_size=pool_size,
        max_overflow=overflow,
    )
    # The fast engine: NORMAL, not OFF. In WAL mode neither fsyncs a commit (the same cost), but with OFF a
    # checkpoint run on that connection does not fsync the database file before the WAL may be started over, so a
    # power loss could take commits that other connections had made durable (synchronous=FULL) in the WAL.
    sync = "FULL" if durable else "NORMAL"

    @event.listens_for(eng, "connect")
    def _pragmas(dbapi_conn: Any, _rec: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA busy_timeout=30000")
        _wal(cur)
        cur.execute(f"PRAGMA synchronous={sync}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(eng, "begin")
    def _begin(conn: Connection) -> None:
        # IMMEDIATE takes the write lock up front, so two writers queue on busy_timeout instead of failing when
        # a read transaction tries to upgrade. Reads stay deferred: in WAL mode they never wait for a writer.
        if conn.get_execution_options().get("undolog_read"):
            conn.exec_driver_sql("BEGIN")
        else:
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return eng


def _wal(cur: Any) -> None:
    """Put the database in WAL mode (it stays so, in the file), waiting out another connection's lock.

    Asking for WAL is a no-op when the file already is in WAL mode, but it can still answer "database is locked"
    without going through the busy handler while another connection changes the schema (a migration); so the
    mode is read first, and set with a bounded retry only on a database that is not in WAL mode yet.
    """
    for attempt in range(300):
        try:
            if str(cur.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal":
                return
            cur.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or attempt == 299:
                raise
            time.sleep(0.01 * min(10, attempt + 1))


def back_in_flight_in(conn: Connection, seq: int) -> None:
    """The effect ``seq`` is in flight again: move recovery's cursor back to it (see ``schema.py``)."""
    rc = t.recovery_cursor
    conn.execute(
        rc.update().where(rc.c.cursor_id == 1, rc.c.effect_seq >= seq)
        .values(effect_seq=seq - 1, version=rc.c.version + 1)
    )


def cursor_in(conn: Connection) -> tuple[Any, int]:
    """Recovery's cursor (how far every effect was seen settled, and its version) and the newest effect's seq."""
    rc, e = t.recovery_cursor, t.effect_log
    cursor = conn.execute(sa.select(rc.c.effect_seq, rc.c.version).where(rc.c.cursor_id == 1)).one()
    newest = int(conn.execute(sa.select(sa.func.coalesce(sa.func.max(e.c.seq), 0))).scalar_one())
    return cursor, newest


def advance_cursor_in(conn: Connection, cursor: Any, upto: int) -> None:
    """Move the cursor up, by compare-and-swap on its version: a claim that moved it back meanwhile wins."""
    rc = t.recovery_cursor
    conn.execute(rc.update().where(rc.c.cursor_id == 1, rc.c.version == cursor.version)
                 .values(effect_seq=upto, version=rc.c.version + 1))
