"""The state machines as data (issue 34): the table in ``undolog_core/states.py``, the storage statements that take
their ``WHERE state IN (...)`` from it, and the README's diagrams agree.

The static half renders each statement (the hot path's text SQL on both databases, the SQLAlchemy statements
compiled for each dialect) and reads its guard back; the behavioural half puts an effect in every state and runs
the commit mark and the general mark on a real database: it changes exactly the rows the table says it may.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from undolog_core import states
from undolog_core.storage import calls, postgres, recovery
from undolog_core.storage import schema as t
from undolog_core.storage import sqlite as sqlite_store
from undolog_core.storage.base import utcnow

from ..support.toolkit import setup

ROOT = Path(__file__).resolve().parents[2]


def guard_of(sql: str, column: str) -> set[str]:
    """The states of ``<column> IN (...)`` in ``sql`` (the one guard of that column the statement has)."""
    found = re.findall(re.escape(column) + r" IN \(([^)]*)\)", sql)
    assert len(found) == 1, (column, sql)
    return {v.strip().strip("'") for v in found[0].split(",")}


def compiled(stmt: Any, dialect: Any) -> str:
    return str(stmt.compile(dialect=dialect))


TEXT_STATEMENTS = [
    ("sqlite commit mark", sqlite_store._SQLITE_MARK, "state", states.EFFECT, "commit"),
    ("sqlite fenced commit mark", sqlite_store._SQLITE_MARK_OWNED, "state", states.EFFECT, "commit"),
    ("postgres commit mark", postgres._PG_MARK, "state", states.EFFECT, "commit"),
    ("postgres deferred marks", postgres._PG_MARK_MANY, "(e.state || '')", states.EFFECT, "commit"),
    ("postgres recovery's compensated record", recovery._PG_DONE_AS_ONE, "undolog_effect_log.state", states.EFFECT,
     "recover_compensated"),
    ("postgres recovery's halt", recovery._PG_DONE_AS_ONE, "undolog_sessions.state", states.SESSION, "halt"),
]


@pytest.mark.parametrize(("name", "sql", "column", "machine", "transition"), TEXT_STATEMENTS,
                         ids=[s[0] for s in TEXT_STATEMENTS])
def test_each_text_statement_guards_with_the_tables_sources(name: str, sql: str, column: str,
                                                            machine: states.Machine, transition: str) -> None:
    assert guard_of(sql, column) == set(machine.sources(transition)), name


@pytest.mark.parametrize("dialect", [sqlite.dialect(), postgresql.dialect()], ids=["sqlite", "postgres"])
def test_each_sqlalchemy_statement_guards_with_the_tables_sources(dialect: Any) -> None:
    e, s = t.effect_log, t.sessions
    for stmt, column, machine, transition in [
        (recovery._EFFECT_DONE, "undolog_effect_log.state", states.EFFECT, "recover_compensated"),
        (recovery._HALT, "undolog_sessions.state", states.SESSION, "halt"),
        (e.update().where(states.EFFECT.guard("late_finish", e.c.state)), "undolog_effect_log.state", states.EFFECT,
         "late_finish"),
        (s.update().where(states.SESSION.guard("halt", s.c.state)), "undolog_sessions.state", states.SESSION, "halt"),
    ]:
        assert guard_of(compiled(stmt, dialect), column) == set(machine.sources(transition))
    assert calls.LATE_FINISH_STATES == set(states.EFFECT.sources("late_finish"))
    assert set(recovery._SETTLED_BY.values()) <= set(states.EFFECT.transitions)


def test_the_table_names_only_real_states_and_agrees_with_the_schemas_lists() -> None:
    for m in states.MACHINES:
        assert m.transitions, m.entity
    assert set(states.EFFECT.states) == set(t.EFFECT_STATES)
    assert set(states.UNDO.states) == set(t.UNDO_STATES)
    assert set(states.SESSION.states) == set(t.SESSION_STATES)
    assert set(states.REQUEST.states) == set(t.REQUEST_STATES)
    assert states.IN_FLIGHT == t.IN_FLIGHT and states.WRITABLE == t.WRITABLE
    with pytest.raises(ValueError, match="unknown states"):
        states.Machine("x", ["a"], [states.Transition("go", ("a",), "b")])
    assert states.EFFECT.legal("pending", "committed") and not states.EFFECT.legal("compensated", "committed")


def test_the_docs_draw_the_table() -> None:
    """docs/reference/states.md (where the README's "The state machines" moved) draws each machine as the table."""
    page = (ROOT / "docs" / "reference" / "states.md").read_text(encoding="utf-8")
    for m in states.MACHINES:
        assert f"```mermaid\n{states.mermaid(m)}\n```" in page, f"states.md's {m.entity} diagram is not the table's"


@pytest.mark.storage
def test_the_commit_marks_change_exactly_the_states_the_table_allows(db: Any) -> None:
    """An effect put in every state in turn; the fenced hot mark and the general mark commit it only from the
    sources of ``commit`` (and only for its owner)."""
    u = db.open()
    setup(u)
    u.session(session_id="s-states")
    d = u.engine.intercept("s-states", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="c1")
    u.engine._inflight.discard(d.effect_id)
    e = t.effect_log
    allowed = set(states.EFFECT.sources("commit"))
    owner = u.leases.owner
    for state in t.EFFECT_STATES:
        for path in ("hot", "general"):
            with u.store.tx() as c:
                c.execute(e.update().where(e.c.effect_id == d.effect_id).values(state=state, owner=owner))
            if path == "hot":
                changed = u.engine.hot.mark(d.effect_id, '{"ok": 1}', 1.7e9, fast=False)
            else:
                changed = u.store.mark_committed(d.effect_id, '{"ok": 1}', utcnow(), fast=False,
                                                 owner=owner) is None
            assert changed == (state in allowed), (path, state)
            with u.store.read() as c:
                now = c.execute(sa.select(e.c.state).where(e.c.effect_id == d.effect_id)).scalar_one()
            assert now == ("committed" if state in allowed else state), (path, state)
    # Not this owner's (taken over): not marked, whatever its state.
    with u.store.tx() as c:
        c.execute(e.update().where(e.c.effect_id == d.effect_id).values(state="pending", owner="elsewhere|1|1|x"))
    assert not u.engine.hot.mark(d.effect_id, '{"ok": 1}', 1.7e9, fast=False)
