"""SQLite's WAL checkpoints off the callers' path (undolog_core/storage/checkpoint.py).

What must hold, for an engine with durable commit marks and one with ``fast_commit_mark``:

- a committing caller never checkpoints at SQLite's default threshold: the hot path's connections checkpoint only
  past ``HARD_PAGES``, and the checkpoints below it run on the checkpointer's thread;
- the WAL stays bounded under thousands of commits: near ``SOFT_PAGES`` while the thread runs, and below
  ``HARD_PAGES`` (plus one commit) when it does not (the callers' safeguard);
- ``close()`` stops the thread and gives back its connection and file descriptors; an in-memory database has none.

The tests open their own SQLite files, so they run whichever database the suite is run on.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool
from undolog_core.storage import checkpoint
from undolog_core.storage.checkpoint import HARD_PAGES, CheckpointerState, WalCheckpointer, _WalIndex
from undolog_core.testing import internals


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("wal_unbook"))
def wal_book(slot: str) -> dict[str, str]:
    return {"booked": slot}


@compensation("wal_unbook")
def wal_unbook(ctx: Any) -> None:
    return None


THREAD = "undolog-wal-checkpointer"


def _open(path: Path, fast: bool) -> UndoLog:
    u = UndoLog.open(f"sqlite:///{path}", fast_commit_mark=fast)
    u.register(wal_book, wal_unbook)
    return u


def _checkpointers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


def _wait_for(cond: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _index(u: UndoLog) -> _WalIndex:
    u.engine.hot.session_states(["x"])  # a read: the -shm file exists and is initialised
    return _WalIndex(str(internals(u).sql_engine.url.database))


def _copied_or_started_over(index: _WalIndex, soft: int) -> bool:
    """Nothing left for the thread: every frame copied, or the WAL started over (shorter than ``soft``)."""
    f = index.frames()
    return f is not None and (f[1] >= f[0] or f[0] < soft)


def _frames(index: _WalIndex) -> int:
    while (f := index.frames()) is None:
        pass
    return f[0]


@pytest.mark.parametrize("fast", [False, True], ids=["durable", "fast_commit_mark"])
def test_the_thread_checkpoints_and_the_wal_stays_near_its_threshold(tmp_path: Path, fast: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls paced like an agent's (a gap between two): every checkpoint runs on the checkpointer's thread, the WAL
    starts over again and again, and it never comes near the callers' safeguard."""
    ran_on: list[str] = []
    real = WalCheckpointer._checkpoint

    def spy(self: WalCheckpointer, conn: Any) -> None:
        ran_on.append(threading.current_thread().name)
        real(self, conn)

    monkeypatch.setattr(WalCheckpointer, "_checkpoint", spy)
    # A lower threshold than SQLite's 1,000 pages, so that the WAL starts over three times in a few hundred calls.
    monkeypatch.setattr(checkpoint, "SOFT_PAGES", 300)
    u = _open(tmp_path / "w.db", fast)
    try:
        hot = u.engine.hot
        assert hot.checkpointer is not None
        _wait_for(lambda: hot.checkpointer.state is CheckpointerState.WATCHING, "the checkpointer to watch the file")
        index = _index(u)
        session = u.session(agent_id="wal")
        longest, starts, last = 0, 0, 0
        calls = 0
        # A few thresholds' worth of frames: well past the threshold, well below HARD_PAGES.
        while starts < 3 or calls < 100:
            assert session.call_sync(wal_book, slot=f"s{calls}") == {"booked": f"s{calls}"}
            calls += 1
            length = _frames(index)
            starts += length < last  # the WAL started over
            longest, last = max(longest, length), length
            if calls % 10 == 0 and length >= 300:
                # The model's turn: an agent's next call comes after the model answers (a second or more), and the
                # thread copies the WAL meanwhile. The test waits for that copy, not for a fixed gap: a loaded CI
                # machine kept the thread off the CPU for a whole 5 ms gap after gap, and the WAL grew to HARD_PAGES.
                _wait_for(lambda: _copied_or_started_over(index, 300),
                          "the checkpointer to copy the WAL in the model's turn")
            assert calls < 5000, f"the WAL did not start over three times ({longest} frames at most)"
        index.close()
        assert ran_on and set(ran_on) == {THREAD}
        assert hot.checkpointer.checkpoints >= 3
        assert 300 <= longest < HARD_PAGES
    finally:
        u.close()


# The WAL's longest length allowed under writers that never pause. What it takes to start the WAL over from
# SOFT_PAGES: the thread's next look (POLL_MIN, 50 ms), its checkpoint of those pages (10-30 ms with the fsync of the
# database file), the catch-up under the write lock (LOCK_WAIT at most), and the next writer's commit. A tight loop
# appends some 3-7 frames per millisecond here (one pre-write and one mark, each fsynced), so a few hundred frames
# past SOFT_PAGES (1,300-1,700 measured); four times SOFT_PAGES leaves room for a thread kept off the CPU for some
# 300 ms by a loaded 2-core machine, and is still well below HARD_PAGES, which the WAL reached before (the callers'
# safeguard was the only thing that started it over: 10,000 frames).
NONSTOP_BOUND = 4 * checkpoint.SOFT_PAGES
# Frames the loops append: three times the bound, so that a WAL under the bound has started over at least three times.
NONSTOP_FRAMES = 3 * NONSTOP_BOUND


class _WalSeen:
    """The WAL's length as a writer sees it after each of its commits: the longest, and how often it started over."""

    def __init__(self) -> None:
        self.longest = self.starts = self.appended = self.last = 0

    def saw(self, length: int) -> None:
        self.starts += length < self.last
        self.appended += length - self.last if length >= self.last else length
        self.longest, self.last = max(self.longest, length), length


def _nonstop_pairs(u: UndoLog, index: _WalIndex, sid: str, seen: _WalSeen, enough: Any) -> None:
    """Durable pre-write and commit mark pairs on the hot path, one right after the other, until ``enough()``."""
    hot = u.engine.hot
    spec = u.tool_spec("wal_book")
    now = time.time()
    i = 0
    while not enough():
        eid = f"{sid}-{i}"
        assert hot.prewrite(sid, 0, eid, eid, spec.name, spec.revision, '{"slot":"x"}', "d" * 64, u.engine.owner,
                            now, now + 60, "wal_unbook", 1)
        seen.saw(_frames(index))
        assert hot.mark(eid, '"r"', now, fast=False)
        seen.saw(_frames(index))
        i += 1
        assert i < 20 * NONSTOP_FRAMES  # a pair appends a few frames: never this many pairs


@pytest.mark.parametrize("threads", [1, 4], ids=["one_writer", "four_writers_group_commit"])
def test_the_wal_starts_over_under_writers_that_never_pause(tmp_path: Path, threads: int) -> None:
    """Durable hot-path writes with no gap between them (one thread in a tight loop, or four at once through the
    group commit): each checkpoint of the thread alone is outrun by the frames appended while it copies, so before
    the catch-up under the write lock the WAL grew to HARD_PAGES (10,000 frames: a 40 MB file, each commit fsyncing
    a growing file) and started over only in a caller's commit. Now it starts over near SOFT_PAGES, again and
    again, and no caller checkpoints."""
    u = _open(tmp_path / "w.db", False)
    try:
        hot = u.engine.hot
        assert hot.checkpointer is not None
        _wait_for(lambda: hot.checkpointer.state is CheckpointerState.WATCHING, "the checkpointer to watch the file")
        for t in range(threads):
            u.session(agent_id="wal", session_id=f"w{t}")
        indexes = [_index(u) for _ in range(threads)]
        seen = [_WalSeen() for _ in range(threads)]
        errors: list[BaseException] = []

        def enough() -> bool:
            # Each writer sees every writer's frames (the WAL's length after each of its own commits).
            return max(s.appended for s in seen) >= NONSTOP_FRAMES or bool(errors)

        def writer(t: int) -> None:
            try:
                _nonstop_pairs(u, indexes[t], f"w{t}", seen[t], enough)
            except BaseException as exc:  # noqa: BLE001 - reported by the test's thread
                errors.append(exc)

        workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(300)
        for index in indexes:
            index.close()
        assert not errors, errors
        longest = max(s.longest for s in seen)
        assert longest < NONSTOP_BOUND, (longest, [s.starts for s in seen])
        assert sum(s.starts for s in seen) >= 1  # implied by the bound and the frames appended; said outright
        assert hot.checkpointer.catch_ups >= 1
        if threads > 1:
            assert hot.group.largest >= 2  # the writes went through the group commit, several in one transaction
    finally:
        u.close()


def test_the_catch_up_lets_go_of_the_write_lock_when_its_checkpoint_fails(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A catch-up whose checkpoint raises (the thread stops: the callers' safeguard takes over) leaves the write lock
    free: this process's writers go on."""
    import sqlite3

    from undolog_core.storage.base import WriteLock

    path = str(tmp_path / "c.db")
    c = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    c.execute("PRAGMA journal_mode=WAL")
    c.execute("PRAGMA wal_autocheckpoint=0")
    c.execute("CREATE TABLE x (b BLOB)")
    for _ in range(20):
        c.execute("INSERT INTO x VALUES (randomblob(6000))")
    real = WalCheckpointer._checkpoint
    lock = WriteLock()
    under_lock: list[bool] = []

    def failing(self: WalCheckpointer, conn: Any) -> bool:
        if lock._lock._is_owned():
            under_lock.append(True)
            raise RuntimeError("the catch-up's checkpoint failed")
        real(self, conn)
        c.execute("INSERT INTO x VALUES (randomblob(6000))")  # a writer outran it: frames left to copy
        return True

    monkeypatch.setattr(WalCheckpointer, "_checkpoint", failing)
    cp = WalCheckpointer(lambda: sqlite3.connect(path, check_same_thread=False), write_lock=lock, soft_pages=10,
                         poll_min=0.01, poll_max=0.02)
    try:
        _wait_for(lambda: cp.state is CheckpointerState.STOPPED, "the thread to stop on the failure")
        assert under_lock == [True]
        assert lock.acquire(blocking=False)
        lock.release()
    finally:
        cp.close()
        c.close()


@pytest.mark.parametrize("fast", [False, True], ids=["durable", "fast_commit_mark"])
def test_callers_checkpoint_only_past_the_hard_limit(tmp_path: Path, fast: bool) -> None:
    """With the thread stopped: the WAL grows past SQLite's default threshold (no caller checkpointed at 1,000
    pages: fails with SQLite's default), and the safeguard starts it over at HARD_PAGES: bounded under thousands of
    commits."""
    u = _open(tmp_path / "w.db", fast)
    try:
        hot = u.engine.hot
        assert hot.checkpointer is not None
        hot.checkpointer.close()
        assert not hot.checkpointer.alive
        index = _index(u)
        for pool in (hot.durable, hot.fast):
            with pool.connection("test") as conn:
                assert conn.execute("PRAGMA wal_autocheckpoint").fetchone()[0] == HARD_PAGES
        # Thousands of small commits on a hot connection, without fsync so that the test is quick (the frames
        # and the checkpoint threshold are the same).
        with hot.durable.connection("test") as conn:
            conn.execute("PRAGMA synchronous=OFF")
            conn.execute("CREATE TABLE scratch (b BLOB)")
            longest, last, starts, commits = 0, 0, 0, 0
            while starts < 1:
                conn.execute("INSERT INTO scratch VALUES (randomblob(6000))")  # two pages of their own
                commits += 1
                length = _frames(index)
                if length < last:
                    starts += 1
                    assert last >= HARD_PAGES  # not before the safeguard (SQLite's default: at 1,000)
                longest, last = max(longest, length), length
                assert commits < 4 * HARD_PAGES
            conn.execute("PRAGMA synchronous=FULL")
        index.close()
        assert longest < HARD_PAGES + 10  # a commit's frames past the limit, then the caller checkpoints
        assert commits > 2000
    finally:
        u.close()


@pytest.mark.parametrize("fast", [False, True], ids=["durable", "fast_commit_mark"])
def test_close_stops_the_thread_and_gives_back_its_descriptors(tmp_path: Path, fast: bool) -> None:
    before_threads = len(_checkpointers())
    before_fds = set(os.listdir("/proc/self/fd"))
    u = _open(tmp_path / "w.db", fast)
    hot = u.engine.hot
    assert hot.checkpointer is not None
    _wait_for(lambda: hot.checkpointer.state is CheckpointerState.WATCHING, "the checkpointer to watch the file")
    assert len(_checkpointers()) == before_threads + 1
    u.session(agent_id="wal").call_sync(wal_book, slot="a")
    u.close()
    assert not hot.checkpointer.alive
    assert hot.checkpointer.state is CheckpointerState.STOPPED
    assert len(_checkpointers()) == before_threads
    assert set(os.listdir("/proc/self/fd")) <= before_fds


def test_two_engines_on_one_file_each_checkpoint_without_waiting(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Two checkpointers on one file (as two processes would have): both run, neither blocks the other or a caller
    (PASSIVE: one that finds the other's checkpoint running skips its turn), and the WAL still starts over."""
    monkeypatch.setattr(checkpoint, "SOFT_PAGES", 300)
    durable = _open(tmp_path / "w.db", False)
    fast = UndoLog.open(f"sqlite:///{tmp_path / 'w.db'}", fast_commit_mark=True, migrate=False)
    fast.register(wal_book, wal_unbook)
    try:
        index = _index(durable)
        sessions = [durable.session(agent_id="a"), fast.session(agent_id="b")]
        starts, last = 0, 0
        for i in range(3000):
            sessions[i % 2].call_sync(wal_book, slot=f"s{i}")
            length = _frames(index)
            starts += length < last
            last = length
            if i % 10 == 0:
                time.sleep(0.005)
            if starts >= 2:
                break
        index.close()
        assert starts >= 2
        assert durable.engine.hot.checkpointer.checkpoints + fast.engine.hot.checkpointer.checkpoints >= 2
    finally:
        fast.close()
        durable.close()


def test_no_thread_for_an_in_memory_database() -> None:
    """UndoLog refuses an in-memory database (it cannot be durable); an engine on one would get no thread."""
    import sqlalchemy as sa

    from undolog_core.storage.sqlite import _on_file

    for url in ("sqlite://", "sqlite:///:memory:", "sqlite:///file:x?mode=memory&uri=true"):
        assert not _on_file(sa.create_engine(url))
    assert _on_file(sa.create_engine("sqlite:///some/file.db"))


def test_a_file_not_in_wal_mode_is_waited_for(tmp_path: Path) -> None:
    import sqlite3

    path = str(tmp_path / "plain.db")
    sqlite3.connect(path).close()
    cp = WalCheckpointer(lambda: sqlite3.connect(path, check_same_thread=False), poll_min=0.01, poll_max=0.02)
    try:
        time.sleep(0.1)
        assert cp.state is CheckpointerState.WAITING
        c = sqlite3.connect(path)
        c.execute("PRAGMA journal_mode=WAL")
        c.execute("CREATE TABLE x (a)")
        c.commit()
        _wait_for(lambda: cp.state is CheckpointerState.WATCHING, "the checkpointer to watch the file")
        c.close()
    finally:
        cp.close()
    assert cp.state is CheckpointerState.STOPPED


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="soft_pages=0"):
        WalCheckpointer(lambda: None, soft_pages=0)
    assert checkpoint.POLL_MIN <= checkpoint.POLL_MAX


_WRITER = """
import sys
from undolog_core import UndoLog
from undolog_core.storage import checkpoint

checkpoint.SOFT_PAGES = 200  # the thread checkpoints often: several processes' checkpoints overlap

path, name, fast, calls, here = sys.argv[1], sys.argv[2], sys.argv[3] == "fast", int(sys.argv[4]), sys.argv[5]
sys.path.insert(0, here)
from test_wal_checkpointer import wal_book, wal_unbook  # this test file's own tool and compensation

u = UndoLog.open(f"sqlite:///{path}", fast_commit_mark=fast, migrate=False)
u.register(wal_book, wal_unbook)
done = 0
while done < calls:
    s = u.session(agent_id=name)
    for _ in range(5):
        s.call_sync(wal_book, slot=f"{name}-{done}")
        done += 1
        if done == 50:
            print("ready", flush=True)
    s.complete()
u.close()
print("done", flush=True)
"""


def test_processes_writing_one_file_and_one_killed_keep_it_whole(tmp_path: Path) -> None:
    """Three processes on one file (two durable, one fast mode), each with its own checkpointer thread, one
    SIGKILLed in the middle of its calls: the WAL stays bounded throughout, the survivors' calls are all committed,
    the killed process's in-flight calls are settled by ``recover()``, and the file passes SQLite's integrity check."""
    import signal
    import sqlite3
    import subprocess
    import sys

    path = tmp_path / "procs.db"
    u = _open(path, False)  # migrated here, once; the children open it without migrating
    index = _index(u)
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    calls = 600
    procs = {
        name: subprocess.Popen([sys.executable, str(script), str(path), name, mode, str(n),
                                str(Path(__file__).parent)],
                               stdout=subprocess.PIPE, text=True)
        # The one to be killed is given more calls than it can make before the kill.
        for name, mode, n in (("p-killed", "durable", 10**6), ("p-durable", "durable", calls),
                              ("p-fast", "fast", calls))
    }
    try:
        killed = procs["p-killed"]
        assert killed.stdout is not None and killed.stdout.readline().strip() == "ready"
        killed.send_signal(signal.SIGKILL)  # while the others write (or start to)
        longest = 0
        while any(p.poll() is None for n, p in procs.items() if n != "p-killed"):
            longest = max(longest, _frames(index))
            time.sleep(0.002)
        for name in ("p-durable", "p-fast"):
            out, _ = procs[name].communicate(timeout=60)
            assert procs[name].returncode == 0 and out.split() == ["ready", "done"], (name, out)
        assert procs["p-killed"].wait(timeout=30) == -signal.SIGKILL
        assert longest < HARD_PAGES + 100, longest  # the safeguard held whoever checkpointed
        u.recover()
        c = sqlite3.connect(str(path))
        try:
            assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            rows = dict(c.execute(
                "SELECT s.agent_id || ':' || e.state, count(*) FROM undolog_effect_log e "
                "JOIN undolog_sessions s ON s.session_id = e.session_id GROUP BY 1").fetchall())
        finally:
            c.close()
        assert rows.get("p-durable:committed") == calls and rows.get("p-fast:committed") == calls, rows
        assert not any(k.endswith(":pending") for k in rows), rows  # nothing left in flight, the killed one's included
        assert rows.get("p-killed:committed", 0) >= 49, rows
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        index.close()
        u.close()
