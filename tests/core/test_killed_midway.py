"""Connections killed (``pg_terminate_backend``) in the middle of a rollback walk and of ``recover()``, from inside a
compensation, so the kill lands between the compensation and its record. The run that meets it raises
``DatabaseUnavailable``; the next run in the same process must finish the work, every compensation run once, except
the documented retry (same ``undo-{id}`` key) of the one whose record the kill lost.

PostgreSQL only: SQLite has no server connection to kill.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from undolog_core import ToolTier, UndoLog, compensation, undolog_tool
from undolog_core.errors import DatabaseUnavailable

pytestmark = pytest.mark.postgres_only

UNDONE: list[str] = []
KILL: dict[str, Any] = {}


def _kill_everything() -> None:
    """Terminate every backend of the UndoLog under test (tagged by its application name), as an outage would."""
    with KILL["admin"].connect() as c:
        c.exec_driver_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                          (KILL["tag"],))


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="refund_charge")
def charge(n: int) -> dict[str, int]:
    return {"charged": n}


@compensation("refund_charge")
def refund_charge(ctx: Any) -> None:
    UNDONE.append(ctx.idempotency_key)
    if KILL.pop("armed", False):
        _kill_everything()


@pytest.fixture
def u(db: Any, pg_admin: Any) -> Iterator[UndoLog]:
    UNDONE.clear()
    KILL.clear()
    KILL.update(admin=pg_admin, tag=db.schema)
    u = UndoLog.open(f"{db.url}?application_name={db.schema}", schema=db.schema)
    db.opened.append(u)
    u.register(charge, refund_charge)
    yield u


def _abandoned_calls(u: UndoLog, n: int) -> list[str]:
    """``n`` calls in flight in sessions of their own, left as a crashed process leaves them."""
    sids = []
    for i in range(n):
        s = u.session(agent_id=f"crashed-{i}")
        d = u.driver.decide(s.id, "charge", {"n": i}, call_id="c")
        u.leases.abandon(d.effect_id)
        sids.append(s.id)
    return sids


def _exactly_once_but_the_interrupted(keys: list[str]) -> None:
    counts = Counter(keys)
    assert max(counts.values()) <= 2 and sum(1 for v in counts.values() if v == 2) <= 1, counts


def test_recover_killed_between_a_compensation_and_its_record_is_finished_by_the_next_run(u: UndoLog) -> None:
    """Before the fix the batch path left the undo entries it had claimed counted as being compensated by this
    process when a write failed: every later ``recover()`` here answered "being rolled back right now" for them (and
    the lease loop kept their leases alive for every other process too) until the process exited."""
    sids = _abandoned_calls(u, 3)
    KILL["armed"] = True
    with pytest.raises(DatabaseUnavailable):
        u.recover()
    assert UNDONE  # the kill came after a compensation ran (where exactly depends on which pooled connection died)
    report = u.recover()
    assert report.errors == [] and report.dead_lettered == [], report.to_dict()
    for sid in sids:
        assert [e["state"] for e in u.sessions.effects(sid)] == ["compensated"], sid
        assert u.sessions.get(sid).state == "halted"
    assert len(set(UNDONE)) == 3
    _exactly_once_but_the_interrupted(UNDONE)


def test_rollback_killed_between_a_compensation_and_its_record_is_finished_by_the_next_one(u: UndoLog) -> None:
    s = u.session(agent_id="walker")
    for i in range(3):
        s.call_sync(charge, n=i)
    KILL["armed"] = True
    with pytest.raises(DatabaseUnavailable):
        s.rollback_sync()
    assert u.sessions.get(s.id).state == "rolling_back"
    report = s.rollback_sync()
    assert report.complete
    assert u.sessions.get(s.id).state == "rolled_back"
    assert [e["state"] for e in u.sessions.effects(s.id)] == ["compensated"] * 3
    assert len(set(UNDONE)) == 3
    _exactly_once_but_the_interrupted(UNDONE)
