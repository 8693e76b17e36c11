"""SQLite's turn check without a statement (issue 13: the LangGraph SAFE step).

``SQLiteHotPath.session_states`` answers from its last read while the wal-index header (``WalStamp``), which every
commit of every connection of every process rewrites, is the one seen just before that read. What must hold:

- a commit by another process (a plain sqlite3 connection, not UndoLog) or by another connection of this process
  changes the stamp, and the next check reads the store and sees the change;
- with no commit in between, the check issues no statement at all;
- where there is no wal-index to read (a database not in WAL mode) there is no stamp: every check reads.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from undolog_core import UndoLog
from undolog_core.storage.sqlite import WalStamp

pytestmark = pytest.mark.sqlite_only


def _path(u: UndoLog) -> str:
    return str(u.store.engine.url.database)


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
