"""SQLite's turn check without a statement (issue 13: the LangGraph SAFE step).

``SQLiteHotPath.session_states`` answers from its last read while the wal-index header (``WalStamp``), which every
commit of every connection of every process rewrites, is the one seen just before that read. What must hold:

- a commit by another process (a plain sqlite3 connection, not UndoLog) or by another connection of this process
  changes the stamp, and the next check reads the store and sees the change;
- with no commit in between, the check issues no statement at all;
- nor when the only commits in between were this process's own pre-writes and commit marks, each seen alone (they
  change no session's state): a COMPENSABLE agent's turn does not read its session again after its own call;
- where there is no wal-index to read (a database not in WAL mode) there is no stamp: every check reads.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool
from undolog_core.storage.sqlite import WalStamp
from undolog_core.testing import internals

pytestmark = pytest.mark.sqlite_only


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("tc_unbook"))
def tc_book(slot: str) -> dict[str, str]:
    return {"booked": slot}


@compensation("tc_unbook")
def tc_unbook(ctx: Any) -> None:
    return None


def _path(u: UndoLog) -> str:
    return str(internals(u).sql_engine.url.database)


def _statements(u: UndoLog) -> list[str]:
    """Every statement the hot path's durable connections run from now on."""
    seen: list[str] = []
    pool = u.engine.hot.durable
    conn, gen = pool.checkout()
    pool.checkin(conn, gen)
    for c, _ in pool._idle:
        c.set_trace_callback(seen.append)
    return seen


def test_the_check_reads_only_after_a_commit_from_anywhere(undolog: UndoLog) -> None:
    hot = undolog.engine.hot
    undolog.engine.ensure_session("s1")
    ids = ["s1", "s1#2"]
    assert hot.session_states(ids) == {"s1": ("active", None)}
    seen = _statements(undolog)
    for _ in range(3):
        assert hot.session_states(ids) == {"s1": ("active", None)}
    assert seen == []  # nothing committed since the last read: no statement
    # Another process, through plain sqlite3: the header changes, the check reads and sees the halt.
    code = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "c.execute(\"UPDATE undolog_sessions SET state = 'halted', halted_reason = 'elsewhere' "
            "WHERE session_id = 's1'\"); c.commit(); c.close()")
    subprocess.run([sys.executable, "-c", code, _path(undolog)], check=True, timeout=60)
    assert hot.session_states(ids) == {"s1": ("halted", "elsewhere")}
    assert len(seen) == 1
    assert hot.session_states(ids) == {"s1": ("halted", "elsewhere")}
    assert len(seen) == 1
    # Another connection of this process (any commit, of any table) changes it too.
    c = sqlite3.connect(_path(undolog))
    c.execute("UPDATE undolog_sessions SET state = 'active', halted_reason = NULL WHERE session_id = 's1'")
    c.commit()
    c.close()
    assert hot.session_states(ids) == {"s1": ("active", None)}
    assert len(seen) == 2
    # A session that appears (another process opened the thread's next one) is seen too.
    undolog.engine.ensure_session("s1#2")
    assert set(hot.session_states(ids)) == {"s1", "s1#2"}


def test_no_stamp_where_there_is_no_wal_index(tmp_path: Path) -> None:
    path = str(tmp_path / "plain.db")
    c = sqlite3.connect(path)
    c.execute("CREATE TABLE x (a)")
    c.commit()
    assert str(c.execute("PRAGMA journal_mode").fetchone()[0]) == "delete"
    assert WalStamp.open(c) is None
    wal = sqlite3.connect(path)
    wal.execute("PRAGMA journal_mode=WAL")
    stamp = WalStamp.open(wal)
    assert stamp is not None
    try:
        before = stamp.stamp()
        assert before is not None and stamp.stamp() == before
        other = sqlite3.connect(path)
        other.execute("INSERT INTO x VALUES (1)")
        other.commit()
        other.close()
        assert stamp.stamp() not in (None, before)
    finally:
        stamp.close()


def _reads(seen: list[str]) -> int:
    return sum(q.startswith("SELECT session_id, state, halted_reason") for q in seen)


@pytest.mark.parametrize("fast", [False, True], ids=["durable", "fast_commit_mark"])
def test_own_calls_do_not_make_the_check_read_again(db: Any, fast: bool) -> None:
    """The turn check after this process's own COMPENSABLE calls (a pre-write and a commit mark each) answers from
    its last read; any other commit in between (another connection, a halt through the general path) makes it read
    again and see the change. Fails before the change: every own call made the next check read."""
    u = db.open(fast_commit_mark=fast)
    u.register(tc_book, tc_unbook)
    hot = u.engine.hot
    u.engine.ensure_session("s1")
    session = u.session(agent_id="tc", session_id="s1")
    ids = ["s1", "s1#2"]
    assert hot.session_states(ids) == {"s1": ("active", None)}
    seen = _statements(u)
    for i in range(3):
        assert session.call_sync(tc_book, slot=f"a{i}") == {"booked": f"a{i}"}
        u.engine.flush_marks()  # fast mode: the deferred marks written now, as the flusher would
        assert hot.session_states(ids) == {"s1": ("active", None)}
    assert _reads(seen) == 0
    # An own call, then a commit by another connection (of anything), then an own call: the check reads.
    session.call_sync(tc_book, slot="b")
    c = sqlite3.connect(_path(u))
    c.execute("UPDATE undolog_sessions SET halted_reason = 'elsewhere' WHERE session_id = 's1'")
    c.commit()
    c.close()
    session.call_sync(tc_book, slot="c")
    u.engine.flush_marks()
    assert hot.session_states(ids) == {"s1": ("active", "elsewhere")}
    assert _reads(seen) == 1
    # A halt through the general path after an own call is seen at the next check.
    session.call_sync(tc_book, slot="d")
    u.store.sessions.halt_session("s1", "stop")
    assert hot.session_states(ids)["s1"][0] == "halted"
    assert _reads(seen) == 2


@pytest.mark.parametrize("fast", [False, True], ids=["durable", "fast_commit_mark"])
def test_a_write_that_changed_nothing_is_not_taken_for_an_own_commit(
    db: Any, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A commit mark that changes no row commits nothing; if exactly one commit of another process falls between the
    stamps read around it (here: a halt), that commit is not this process's, and the next check must read the halt.
    Fails before the fix: the halt was taken for the mark's own commit and the check answered "active"."""
    u = db.open(fast_commit_mark=fast)
    hot = u.engine.hot
    u.engine.ensure_session("s1")
    ids = ["s1", "s1#2"]
    assert hot.session_states(ids) == {"s1": ("active", None)}

    def halt_elsewhere() -> None:
        c = sqlite3.connect(_path(u))
        c.execute("UPDATE undolog_sessions SET state = 'halted', halted_reason = 'elsewhere' WHERE session_id = 's1'")
        c.commit()
        c.close()

    if fast:
        real_rows = hot._marked_rows

        def rows_after_a_halt(conn: Any, marks: Any) -> int:
            halt_elsewhere()
            return real_rows(conn, marks)

        monkeypatch.setattr(hot, "_marked_rows", rows_after_a_halt)
        hot.mark_many([("no-such-effect", "{}", 0.0)])
    else:
        real_one = hot._write_one

        def one_after_a_halt(item: Any, wait: bool) -> bool:
            halt_elsewhere()
            return real_one(item, wait)

        monkeypatch.setattr(hot, "_write_one", one_after_a_halt)
        assert hot.mark("no-such-effect", "{}", 0.0, fast=False) is False
    assert hot.session_states(ids) == {"s1": ("halted", "elsewhere")}
