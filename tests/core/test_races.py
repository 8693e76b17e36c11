"""Races between processes on the same session, forced into their worst interleaving with real subprocesses.

PostgreSQL only: there the pre-write of a process that read the session as writable can commit while another
process's transaction that decided from the session's rows (a rollback's plan, gc's archive) is still open. SQLite
has no such interleaving: every writer takes the database's one write lock at BEGIN (BEGIN IMMEDIATE), so a
pre-write is wholly before or wholly after such a transaction.

The interleaving is forced, not hoped for: the test holds a lock on a table the deciding transaction writes last
(``LOCK TABLE``), so that transaction stops after it has read and locked the session and before it commits; then
the other process calls, and only once that call has finished or is itself waiting for a lock is the table let go.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ..support import crash_app

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.postgres_only


@pytest.fixture
def world(db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    state = tmp_path / "world"
    state.mkdir()
    monkeypatch.setenv("CRASH_STATE", str(state))
    procs: list[subprocess.Popen[str]] = []

    class World:
        def app(self) -> Any:
            u = crash_app.build(url=db.url, schema=db.schema)
            db.opened.append(u)
            return u

        def start(self, *args: str, code: str | None = None) -> subprocess.Popen[str]:
            env = {**os.environ, **db.env, "CRASH_STATE": str(state), "PYTHONPATH": str(ROOT),
                   "UNDOLOG_DATABASE_URL": _tagged(db)}
            env.pop("UNDOLOG_FAULT", None)
            cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "tests.support.crash_app", *args]
            p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs.append(p)
            return p

    yield World()
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(30)
        if p.stdout:
            p.stdout.close()
        if p.stderr:
            p.stderr.close()


def _tagged(db: Any) -> str:
    """The test's URL with an application name of its own, so that only its subprocesses' waits are counted (other
    tests may share the server)."""
    return f"{db.url}?application_name={db.schema}"


def _waiting_for_locks(admin: Any, schema: str) -> int:
    """How many of this test's subprocesses' connections wait for a lock right now."""
    return int(admin.exec_driver_sql(
        "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
        "WHERE NOT l.granted AND a.application_name = %s", (schema,)
    ).scalar())


def _until(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.02)


def _held(pg_admin: Any, schema: str, table: str) -> Any:
    conn = pg_admin.connect().execution_options(isolation_level="READ COMMITTED")
    conn.begin()
    conn.exec_driver_sql(f'LOCK TABLE "{schema}".{table} IN EXCLUSIVE MODE')
    return conn


def _call_then_let_go(world: Any, pg_admin: Any, schema: str, held: Any, session_id: str,
                      already_waiting: int) -> subprocess.Popen[str]:
    """Another process calls ``send`` in the session; the held table is let go once that call ended or waits."""
    with pg_admin.connect() as watch:
        b = world.start("call", session_id, "send")
        _until(lambda: b.poll() is not None or _waiting_for_locks(watch, schema) > already_waiting,
               "the other process's call to end or to wait for a lock")
    held.commit()
    held.close()
    b.wait(60)
    return b


def test_a_call_racing_a_rollback_request_never_runs_unrolled(db: Any, pg_admin: Any, world: Any) -> None:
    """A rollback has locked the session and read its undo stack, and has not committed its intent yet; another
    process's COMPENSABLE call in that session must not slip in behind it: before this was fixed the call's
    pre-write (which read the session without locking it) waited for the rollback to commit, then wrote its
    effect, the tool ran, and the session ended ``rolled_back`` with that call committed and never compensated."""
    u = world.app()
    s = u.session(agent_id="racer")
    s.call_sync("send", user_id="u0", call_id="c0")
    held = _held(pg_admin, db.schema, "undolog_rollbacks")
    a = world.start("rollback", s.id)
    with pg_admin.connect() as watch:
        _until(lambda: _waiting_for_locks(watch, db.schema) >= 1, "the rollback to wait on its intent's table")
    b = _call_then_let_go(world, pg_admin, db.schema, held, s.id, already_waiting=1)
    assert a.wait(60) == 0, a.stderr.read() if a.stderr else ""
    # The call that lost the race is refused, and it never ran: the rollback was requested before it.
    assert b.returncode != 0
    assert "SessionClosed" in (b.stderr.read() if b.stderr else "")
    sent = [c for c in crash_app.calls() if c[0] == "send"]
    cancelled = {c[2] for c in crash_app.calls() if c[0] == "cancel"}
    assert [c[1] for c in sent] == ["u0"], sent
    assert u.sessions.get(s.id).state == "rolled_back"
    effects = u.sessions.effects(s.id)
    assert [(e["call_id"], e["state"]) for e in effects] == [("c0", "compensated")], effects
    assert len(cancelled) == 1


GC_CODE = """
import sys
from undolog_core import UndoLog
from undolog_core._gc import collect, parse_age
u = UndoLog.open()
print(collect(u.store, parse_age("0s"), actor="gc-bot").to_dict(), flush=True)
u.close()
"""


def test_a_call_racing_gc_never_lands_in_the_session_gc_closed(db: Any, pg_admin: Any, world: Any) -> None:
    """gc closes an idle active session as it archives it (its call ids could no longer be recognised). A call
    from another process that read the session as writable just before must be refused, not written into the
    closed session behind gc's back (before the fix: it waited for gc to commit, then ran in the `completed`
    session)."""
    u = world.app()
    s = u.session(agent_id="idle")
    s.call_sync("send", user_id="u0", call_id="c0")
    held = _held(pg_admin, db.schema, "undolog_archive")
    g = world.start(code=GC_CODE)
    with pg_admin.connect() as watch:
        _until(lambda: _waiting_for_locks(watch, db.schema) >= 1, "gc to wait on the archive table")
    b = _call_then_let_go(world, pg_admin, db.schema, held, s.id, already_waiting=1)
    out, err = g.communicate(timeout=60)
    assert g.returncode == 0, err
    assert "'closed': ['" + s.id in out, out
    assert b.returncode != 0
    assert "SessionClosed" in (b.stderr.read() if b.stderr else "")
    assert [c[1] for c in crash_app.calls() if c[0] == "send"] == ["u0"]
    assert u.sessions.get(s.id).state == "completed"
    assert u.sessions.effects(s.id) == []
