"""SQLite's WAL checkpoints off the callers' path: one background thread per hot path (per ``UndoLog`` on a file).

In WAL mode a commit appends pages to the ``-wal`` file; a *checkpoint* copies them back into the database file and
fsyncs it, after which the next writer starts the WAL over from its beginning. SQLite's default
(``wal_autocheckpoint=1000``) runs that checkpoint inside whichever commit took the WAL past 1,000 pages: every few
hundred COMPENSABLE calls, one caller's tool call also copies a thousand pages and waits for an fsync of the database
file (a few milliseconds: the slowest step of an agent run). Here the engine's connections checkpoint themselves
only past :data:`HARD_PAGES` (the safeguard), and a daemon thread runs a PASSIVE checkpoint as soon as the WAL holds
:data:`SOFT_PAGES` (SQLite's own threshold, so the files look as they always did).

What does not change: durability. A commit is durable when its WAL frames are fsynced (``synchronous=FULL``),
before the caller's statement returns, whoever checkpoints later; a checkpoint is SQLite's own crash-safe copy (it
fsyncs the WAL before copying and the database file before the WAL may be reused), run on a connection of the
durable engine (``synchronous=FULL``) whichever mode the caller writes in. A PASSIVE checkpoint never waits for
and never blocks a writer or a reader on SQLite's locks, in this process or another: several processes on one file
each run a checkpointer, and one that finds another's checkpoint running skips its turn (SQLite answers busy at
once). The one wait it may cause is this process's writers' on the in-process write lock, below.

Why the WAL stays bounded: the thread checkpoints while the WAL is at least :data:`SOFT_PAGES` long and not all
copied, every :data:`POLL_MIN` seconds; SQLite starts the WAL over when a writer begins a transaction and finds every
frame copied (nBackfill == mxFrame) and no reader on the WAL. A writer that never pauses (a tight loop of durable
commits, or threads committing one after the other) appends frames while each checkpoint copies, so the copy never
catches up on its own (it used to grow to :data:`HARD_PAGES`). So when a checkpoint leaves frames behind, the thread
runs one more PASSIVE checkpoint while it holds this process's write lock (``WriteLock``, which every writer of the
hot path and of the store takes): only the frames appended meanwhile are left to copy (a short hold: their copy and
the fsync of the database file), and the next writer finds the WAL all copied and starts it over. The lock is taken
within :data:`LOCK_WAIT` seconds or not at all, never ahead of an urgent writer, while the thread holds nothing a
writer waits for, and it is released on every path; a writer waits for it as for another writer's commit, and the
copying stays off the writers' commits. Other processes' writers are not held back: if they append meanwhile, or a
reader still reads the WAL, that turn does not start it over and a later one does. Whatever still outruns the
thread (other processes writing without a pause), and a thread that cannot run at all (it is stopped, or the file is
not in WAL mode yet), meet the safeguard: the committing caller checkpoints itself at :data:`HARD_PAGES`
(``wal_autocheckpoint``), as SQLite always does, which finishes before that caller's next write. Nothing here
truncates the file: a WAL rewritten in place is fsynced faster than a growing one (no file-size change to journal).

    >>> cp = WalCheckpointer(connect)   # doctest: +SKIP - a callable opening a connection to the file
    >>> cp.close()                      # doctest: +SKIP - stops and joins the thread, closes its connection
"""

from __future__ import annotations

import enum
import logging
import mmap
import os
import sqlite3
import struct
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

#: The WAL length (pages) at which the thread checkpoints: SQLite's default autocheckpoint threshold.
SOFT_PAGES = 1000
#: ``wal_autocheckpoint`` of every UndoLog connection to a file: past it a committing caller checkpoints itself.
HARD_PAGES = 10 * SOFT_PAGES
#: How often the thread reads the WAL's length while it grows (seconds), and how long it sleeps at most while the
#: WAL does not change (the wait doubles from one to the other).
POLL_MIN = 0.05
POLL_MAX = 1.0
#: How long the thread waits for this process's write lock to catch up with writers (seconds) before it skips the turn.
LOCK_WAIT = 0.05

# The wal-index (https://www.sqlite.org/walformat.html), mapped from the ``-shm`` file: two copies of a 48-byte
# header (equal unless a commit is writing them), mxFrame (the WAL's length in frames, one page each) at offset 16
# of each, then the checkpoint info, whose first word (offset 96) is nBackfill (how many frames are copied back).
_HDR = 48
_MX_FRAME = 16
_BACKFILL = 96
_MAP = 136  # both headers and the checkpoint info
_VERSION = 3007000


class CheckpointerState(enum.Enum):
    """Where the thread is: watching the file, not yet able to (no WAL to read: it retries), or stopped."""

    WAITING = "waiting"
    WATCHING = "watching"
    STOPPED = "stopped"


class _WalIndex:
    """The wal-index header read from shared memory (a memory read: no statement, no system call)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path + "-shm", os.O_RDONLY)
        try:
            self._mem = mmap.mmap(self._fd, _MAP, access=mmap.ACCESS_READ)
        except BaseException:
            os.close(self._fd)
            raise
        if struct.unpack_from("=I", self._mem, 0)[0] != _VERSION or self._mem[12] != 1:
            self.close()
            raise ValueError("not a wal-index this code knows how to read")

    def frames(self) -> tuple[int, int] | None:
        """(mxFrame, nBackfill), or None while a commit is writing the header."""
        both = self._mem[: 2 * _HDR]
        if both[:_HDR] != both[_HDR:]:
            return None
        return struct.unpack_from("=I", both, _MX_FRAME)[0], struct.unpack_from("=I", self._mem, _BACKFILL)[0]

    def close(self) -> None:
        self._mem.close()
        os.close(self._fd)


class WalCheckpointer:
    """A daemon thread that runs PASSIVE checkpoints of one SQLite file once its WAL holds ``soft_pages``.

    ``connect`` opens a connection to the file (the thread's own, closed on :meth:`close`); it is called from the
    thread, again after a failure, so a file that is not in WAL mode yet (or not created yet) is simply waited for.
    ``write_lock`` is the process's SQLite writer lock (``WriteLock``), held for a checkpoint that catches up with
    writers that never pause (see the module's docstring); without it the thread never holds writers back.
    ``checkpoints`` counts the checkpoints this thread ran (one that found another's running is not counted),
    ``catch_ups`` those of them run holding the write lock.

    >>> cp = WalCheckpointer(lambda: sqlite3.connect(path, check_same_thread=False))  # doctest: +SKIP
    >>> cp.close()  # doctest: +SKIP
    """

    def __init__(self, connect: Callable[[], Any], *, write_lock: Any = None, soft_pages: int | None = None,
                 poll_min: float = POLL_MIN, poll_max: float = POLL_MAX) -> None:
        soft_pages = SOFT_PAGES if soft_pages is None else soft_pages
        if soft_pages < 1 or not 0 < poll_min <= poll_max:
            raise ValueError(f"bad checkpointer settings: soft_pages={soft_pages}, poll {poll_min}-{poll_max} s")
        self._connect = connect
        self._write_lock = write_lock
        self.soft_pages = soft_pages
        self._poll_min, self._poll_max = poll_min, poll_max
        self._stop = threading.Event()
        self.state = CheckpointerState.WAITING
        self.checkpoints = 0
        self.catch_ups = 0
        self._thread = threading.Thread(target=self._run, name="undolog-wal-checkpointer", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread and wait for it (a checkpoint under way finishes first: an fsync, milliseconds)."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        conn: Any = None
        index: _WalIndex | None = None
        wait, last = self._poll_min, -1
        try:
            while not self._stop.wait(wait):
                if index is None:
                    conn, index = self._open(conn)
                    if index is None:
                        wait = self._poll_max
                        continue
                frames = index.frames()
                if frames is None:  # a commit is writing the header: look again soon
                    wait = self._poll_min
                    continue
                length, copied = frames
                if length >= self.soft_pages and copied < length and self._checkpoint(conn):
                    self._catch_up(conn, index)
                # While the WAL grows, look often (it may pass the threshold); while it rests, less and less.
                wait = self._poll_min if length != last else min(wait * 2, self._poll_max)
                last = length
        except Exception:  # noqa: BLE001 - a background thread: say why it stopped; the safeguard takes over
            log.exception("the WAL checkpointer stopped; committing callers checkpoint past %d pages", HARD_PAGES)
        finally:
            self.state = CheckpointerState.STOPPED
            if index is not None:
                index.close()
            if conn is not None:
                conn.close()

    def _open(self, conn: Any) -> tuple[Any, _WalIndex | None]:
        """A connection and the file's wal-index, or (None, None) to try again later (nothing left open)."""
        if conn is not None:
            conn.close()
        conn = None
        try:
            conn = self._connect()
            rows = conn.execute("PRAGMA database_list").fetchall()
            path = next((r[2] for r in rows if r[1] == "main"), "")
            if not path or str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
                raise ValueError("the file is not in WAL mode (yet)")
            # A read maps this connection's wal-index and takes the lock that keeps SQLite from resetting the
            # -shm file while the connection is open: the mapped bytes stay the live header.
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            index = _WalIndex(path)
        except (OSError, ValueError, sqlite3.Error) as exc:
            log.debug("the WAL checkpointer waits for the file: %s", exc)
            if conn is not None:
                conn.close()
            return None, None
        self.state = CheckpointerState.WATCHING
        return conn, index

    def _checkpoint(self, conn: Any) -> bool:
        """One PASSIVE checkpoint: copies what it can without waiting for anyone. Whether it ran (not when another
        checkpoint was running: SQLite answers busy at once; nor when it failed)."""
        try:
            busy, _log, _copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.OperationalError as exc:  # e.g. the file being recovered by another process: next turn
            log.debug("a WAL checkpoint did not run: %s", exc)
            return False
        if busy:
            return False
        self.checkpoints += 1
        return True

    def _catch_up(self, conn: Any, index: _WalIndex) -> None:
        """After a checkpoint that writers outran (frames appended while it copied), one more holding this process's
        write lock: the next writer then finds every frame copied and starts the WAL over. Skipped when the WAL is
        all copied already, or when the lock is not free within ``LOCK_WAIT`` (next turn)."""
        lock = self._write_lock
        frames = index.frames()  # None: a commit is writing the header, so frames were appended
        if lock is None or (frames is not None and frames[1] >= frames[0]):
            return
        if not lock.acquire_within(LOCK_WAIT):
            return
        try:
            frames = index.frames()  # no writer of this process appends now; another process's may
            if (frames is None or frames[1] < frames[0]) and self._checkpoint(conn):
                self.catch_ups += 1
        finally:
            lock.release()
