"""SQLite's turn check without a statement, and a new session in one (issue 13: the LangGraph SAFE step).

``SQLiteHotPath.session_states`` answers from its last read while the wal-index header (``WalStamp``), which every
commit of every connection of every process rewrites, is the one seen just before that read. What must hold:

- a commit by another process (a plain sqlite3 connection, not UndoLog) or by another connection of this process
  changes the stamp, and the next check reads the store and sees the change;
- with no commit in between, the check issues no statement at all;
- where there is no wal-index to read (a database not in WAL mode) there is no stamp: every check reads;
- ``start_session`` writes exactly the row Core writes, and returns None (nothing written) for an id that exists
  or a value its CHECK-less connection must not store.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

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


def _raw_row(u: UndoLog, sid: str) -> tuple[Any, ...]:
    c = sqlite3.connect(_path(u))
    try:
        return tuple(c.execute(
            "SELECT agent_id, state, tool_calls_total, created_by, halted_reason, on_failure, pinned_revisions, "
            "typeof(pinned_revisions), length(created_at), typeof(created_at), created_at = updated_at "
            "FROM undolog_sessions WHERE session_id = ?", (sid,)).fetchone())
    finally:
        c.close()


def test_a_session_started_in_one_statement_is_the_row_core_writes(undolog: UndoLog) -> None:
    e = undolog.engine
    hot = e.hot.start_session
    calls: list[Any] = []
    e.hot.start_session = lambda values: calls.append(hot(values)) or calls[-1]  # type: ignore[method-assign]
    e.ensure_session("hot-1", agent_id="agent", on_failure="continue", fresh=True)
    assert calls and calls[-1] is not None  # written by the hot path's statement
    e.ensure_session("core-1", agent_id="agent", on_failure="continue")
    assert _raw_row(undolog, "hot-1") == _raw_row(undolog, "core-1")
    rec = undolog.sessions.get("hot-1")
    assert rec.on_failure == "continue" and rec.agent_id == "agent" and rec.created_at.tzinfo is not None
    # An id that exists: nothing written, None (the caller reads the existing row).
    values = {"session_id": "hot-1", "agent_id": "other", "state": "active", "tool_calls_total": 0,
              "created_by": None, "halted_reason": None, "on_failure": "rollback", "pinned_revisions": {},
              "created_at": rec.created_at, "updated_at": rec.created_at}
    assert hot(values) is None and undolog.sessions.get("hot-1").agent_id == "agent"
    # A value its connections (CHECK constraints off) must not store is left to the general path.
    assert hot({**values, "session_id": "hot-2", "on_failure": "explode"}) is None
    assert hot({**values, "session_id": "hot-3", "state": "halted"}) is None
    c = sqlite3.connect(_path(undolog))
    assert c.execute("SELECT count(*) FROM undolog_sessions WHERE session_id IN ('hot-2', 'hot-3')").fetchone()[0] == 0
    c.close()
