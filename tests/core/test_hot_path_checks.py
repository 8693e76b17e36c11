"""SQLite's hot-path connections skip the CHECK constraints; nothing they write could break one, and every other
connection still enforces them.

The hot path's two statements (the pre-write with its trigger's undo entry, the commit mark) write only constant
states and counters, so ``storage/sqlite.py`` turns CHECK evaluation off on its own raw connections (as it turns
foreign keys off), to save the per-row IN-list checks. What must hold:

- the hot path's connections, and only they, have the checks off: the general engine's connections (every other
  state change: failures, approvals, rollbacks, recovery) refuse a value outside a column's list;
- after COMPENSABLE calls of every kind through the hot path (alone, grouped across threads, refused, failed,
  rolled back), every stored row satisfies every CHECK constraint of the schema, evaluated by a query.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool
from undolog_core.storage import schema as t
from undolog_core.storage.pool import IntegrityConflict
from undolog_core.testing import internals

pytestmark = pytest.mark.sqlite_only


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("hpc_undo"))
def hpc_book(slot: str) -> dict[str, Any]:
    if slot == "boom":
        raise RuntimeError("the tool failed")
    return {"booked": slot}


@compensation("hpc_undo")
def hpc_undo(ctx: Any) -> None:
    return None


def _hot_connection(u: UndoLog) -> Any:
    conn, gen = u.engine.hot.durable.checkout()
    u.engine.hot.durable.checkin(conn, gen)
    return conn


def test_only_the_hot_paths_connections_skip_check_constraints(undolog: UndoLog) -> None:
    undolog.register(hpc_book, hpc_undo)
    undolog.session(agent_id="a").call_sync("hpc_book", slot="x")
    assert _hot_connection(undolog).execute("PRAGMA ignore_check_constraints").fetchone()[0] == 1
    with internals(undolog).write() as conn:
        assert conn.exec_driver_sql("PRAGMA ignore_check_constraints").scalar_one() == 0
    # The general engine still refuses a state outside the list, on every table the hot path writes.
    for table, column in ((t.effect_log, "state"), (t.undo_stack, "state"), (t.sessions, "state")):
        with pytest.raises(sa.exc.IntegrityError, match="CHECK constraint failed"):
            with internals(undolog).write() as conn:
                conn.execute(table.update().values({column: "not-a-state"}))


def _violations(u: UndoLog) -> list[str]:
    """Every stored row that breaks a CHECK constraint of the schema, checked by a query per constraint."""
    found: list[str] = []
    with internals(u).write() as conn:
        for table in t.metadata.sorted_tables:
            for ck in table.constraints:
                if isinstance(ck, sa.CheckConstraint):
                    n = conn.execute(sa.text(f"SELECT count(*) FROM {table.name} WHERE NOT ({ck.sqltext})")).scalar_one()
                    if n:
                        found.append(f"{table.name}: {n} rows break {ck.name}")
    return found


def test_rows_written_through_the_hot_path_satisfy_every_check(undolog: UndoLog) -> None:
    undolog.register(hpc_book, hpc_undo)
    s = undolog.session(agent_id="a")
    for i in range(5):
        s.call_sync("hpc_book", slot=f"s{i}")
    # Grouped commits: threads writing at once share a transaction (storage/group.py).
    group = undolog.session(agent_id="g")
    threads = [threading.Thread(target=lambda i=i: group.call_sync("hpc_book", slot=f"g{i}")) for i in range(16)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert undolog.engine.hot.group.commits >= 1
    # A failure (and the rollback it starts), a call id written twice, a rolled-back session and a halted one.
    failing = undolog.session(agent_id="f")
    failing.call_sync("hpc_book", slot="before")
    with pytest.raises(RuntimeError):
        failing.call_sync("hpc_book", slot="boom")
    undolog.rollback(s.id)
    with internals(undolog).write() as conn:
        states = dict(conn.execute(sa.select(t.sessions.c.session_id, t.sessions.c.state)).all())
    assert states[s.id] == "rolled_back" and states[group.id] == "active"
    assert _violations(undolog) == []
    with internals(undolog).write() as conn:
        n = conn.execute(sa.select(sa.func.count()).select_from(t.undo_stack)).scalar_one()
    assert n == 5 + 16 + 2


def test_the_prewrite_view_writes_both_rows_or_neither(undolog: UndoLog) -> None:
    """Checks off is not "anything goes": the pre-write view's trigger writes the effect only while its session
    accepts writes, and the undo entry only with it; a refused pre-write leaves no row; a compensation that is
    missing fails the NOT NULL constraint (not a CHECK: still enforced) and leaves no row either."""
    undolog.register(hpc_book, hpc_undo)
    s = undolog.session(agent_id="a")
    s.call_sync("hpc_book", slot="x")
    hot = undolog.engine.hot
    now = 1_800_000_000.0

    def prewrite(effect_id: str, comp: Any = "hpc_undo") -> bool:
        return bool(hot.prewrite(s.id, 0, effect_id, effect_id, "hpc_book", 1, "{}", "d" * 64, "me", now, now + 30,
                                 comp, 1))

    def rows(effect_id: str) -> tuple[int, int]:
        with internals(undolog).write() as conn:
            e = conn.execute(sa.select(sa.func.count()).select_from(t.effect_log)
                             .where(t.effect_log.c.effect_id == effect_id)).scalar_one()
            u = conn.execute(sa.select(sa.func.count()).select_from(t.undo_stack)
                             .where(t.undo_stack.c.effect_id == effect_id)).scalar_one()
        return e, u

    assert prewrite("e-ok") is True and rows("e-ok") == (1, 1)
    with internals(undolog).write() as conn:
        undo = conn.execute(sa.select(t.undo_stack, t.effect_log.c.seq).join(
            t.effect_log, t.effect_log.c.effect_id == t.undo_stack.c.effect_id)
            .where(t.undo_stack.c.effect_id == "e-ok")).one()
    assert (undo.undo_id, undo.compensation_name, undo.state) == (undo.seq, "hpc_undo", "armed")
    with pytest.raises(IntegrityConflict, match="NOT NULL constraint failed: undolog_undo_stack"):
        prewrite("e-nocomp", comp=None)
    assert rows("e-nocomp") == (0, 0)
    with internals(undolog).write() as conn:
        conn.execute(t.sessions.update().where(t.sessions.c.session_id == s.id).values(state="halted"))
    assert prewrite("e-halted") is False and rows("e-halted") == (0, 0)
