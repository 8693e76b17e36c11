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
from undolog_core.storage import effects, postgres, recovery
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
    ("postgres recovery's undo record", recovery._PG_DONE_AS_ONE, "undolog_undo_stack.state", states.UNDO,
     "compensated"),
    ("postgres session end with deferred marks", postgres._PG_END_SESSION_MARKED, "(e.state || '')", states.EFFECT,
     "commit"),
]


def test_every_commit_mark_is_fenced_by_its_owner() -> None:
    """The deferred marks (a batch, a session's end) are fenced as the one-call mark is (issue 34)."""
    assert sqlite_store._SQLITE_MARK_OWNED.endswith("AND owner = ?")
    for sql in (postgres._PG_MARK, postgres._PG_MARK_MANY, postgres._PG_END_SESSION_MARKED):
        assert re.search(r"\bowner = %\(owner\)s", sql), sql


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
        (recovery._UNDO_DONE, "undolog_undo_stack.state", states.UNDO, "compensated"),
    ]:
        assert guard_of(compiled(stmt, dialect), column) == set(machine.sources(transition))
    assert effects.LATE_FINISH_STATES == set(states.EFFECT.sources("late_finish"))
    assert set(effects._SETTLED_BY.values()) <= set(states.EFFECT.transitions)


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
                changed = u.store.effects.mark_committed(d.effect_id, '{"ok": 1}', utcnow(), fast=False,
                                                 owner=owner) is None
            assert changed == (state in allowed), (path, state)
            with u.store.read() as c:
                now = c.execute(sa.select(e.c.state).where(e.c.effect_id == d.effect_id)).scalar_one()
            assert now == ("committed" if state in allowed else state), (path, state)
    # Not this owner's (taken over): not marked, whatever its state.
    with u.store.tx() as c:
        c.execute(e.update().where(e.c.effect_id == d.effect_id).values(state="pending", owner="elsewhere|1|1|x"))
    assert not u.engine.hot.mark(d.effect_id, '{"ok": 1}', 1.7e9, fast=False)


MACHINE_OF = {"undolog_effect_log": states.EFFECT, "undolog_undo_stack": states.UNDO,
              "undolog_sessions": states.SESSION, "undolog_approval_requests": states.REQUEST}


@pytest.mark.storage
def test_every_statement_that_moves_a_row_is_guarded_by_the_table(db: Any) -> None:
    """Every UPDATE the core sends through SQLAlchemy that writes a ``state`` (approvals decided, timed out,
    auto-approved and cancelled; calls claimed, released, committed, failed, compensated, recovered, finished late
    and resolved; sessions halted, resumed, rolled back and completed) carries a ``state IN (...)`` guard of literal
    states, and the table allows every move it can make: from each guarded state to the state it writes. The hot
    path's raw statements are held to the table above."""
    from undolog_core import ApprovalPending, errors

    u = db.open()
    setup(u)
    seen: list[tuple[str, dict[str, Any]]] = []

    def listen(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
        if statement.lstrip().upper().startswith("UPDATE"):
            params = (context.compiled_parameters or [{}])[0] if context is not None else {}
            seen.append((statement, dict(params or {})))

    for engine in {u.store.engine, u.store.fast}:
        sa.event.listen(engine, "before_cursor_execute", listen)

    def ask(sid: str, call_id: str) -> str:
        with pytest.raises(ApprovalPending) as pending:
            u.session(session_id=sid).call_sync("delete_user_account", user_id="u1", call_id=call_id)
        return str(pending.value.approval_request_id)

    s1 = u.session(session_id="st-approve")
    u.approvals.approve(ask("st-approve", "d1"), approver="ana")
    s1.call_sync("delete_user_account", user_id="u1", call_id="d1")  # claimed to run, committed
    u.approvals.modify(ask("st-modify", "d2"), approver="ana", args={"user_id": "u2"})
    u.approvals.respond(ask("st-respond", "d3"), approver="ana", response="not today")
    first = ask("st-reject", "d4")
    ask("st-reject", "d5")  # cancelled with the rejection
    u.approvals.reject(first, approver="ana", reason="no")
    due = ask("st-timeout", "d6")
    with u.store.tx() as c:
        r = t.approval_requests
        c.execute(r.update().where(r.c.approval_request_id == due).values(timeout_at=utcnow()))
    u.approvals.expire_due()  # timed out, the session halted
    u.policy.set(actor="ana", auto_approve_on_timeout=True)
    auto = ask("st-auto", "d7")
    with u.store.tx() as c:
        c.execute(r.update().where(r.c.approval_request_id == auto).values(timeout_at=utcnow()))
    u.approvals.expire_due()  # auto-approved, the session awake again
    s3 = u.session(session_id="st-rollback")
    s3.call_sync("send_refund_email", user_id="u1", amount=1)
    s3.rollback_sync()  # the intent, the undo claimed and compensated, the session rolled back
    d = u.engine.intercept("st-recover", "send_refund_email", {"user_id": "u1", "amount": 2}, call_id="c1")
    u.driver.release(d)  # handed back without an outcome, then claimed back by its re-issue
    d = u.engine.intercept("st-recover", "send_refund_email", {"user_id": "u1", "amount": 2}, call_id="c1")
    u.engine.complete(d.effect_id, {"ok": 1})
    d = u.engine.intercept("st-recover", "send_refund_email", {"user_id": "u1", "amount": 3}, call_id="c2")
    u.leases.abandon(d.effect_id)
    u.recover()  # compensated by recovery, the session halted
    d = u.engine.intercept("st-late", "send_refund_email", {"user_id": "u1", "amount": 4}, call_id="c3")
    with u.store.tx() as c:
        e = t.effect_log
        c.execute(e.update().where(e.c.effect_id == d.effect_id).values(owner="elsewhere|1|1|x"))
    with pytest.raises(errors.OutcomeConflict):
        u.engine.complete(d.effect_id, {"ok": 1})
    u.resolve_effect(d.effect_id, outcome="compensated", reason="undone by hand", actor="ana")
    u.sessions.resume("st-late", actor="ana")
    s4 = u.session(session_id="st-complete")
    s4.call_sync("send_refund_email", user_id="u2", amount=5)
    s4.complete()

    moved: dict[str, set[str]] = {}
    for sql, params in seen:
        m = re.match(r"\s*UPDATE (\w+) SET (.*?) WHERE (.*)$", sql, re.S)
        if m is None or m.group(1) not in MACHINE_OF or not re.search(r"(?:^|, )state=", m.group(2)):
            continue
        machine = MACHINE_OF[m.group(1)]
        target = str(params.get("state"))
        lists = [{v.strip().strip("'") for v in found.split(",")}
                 for found in re.findall(r"IN \(('[a-z_]+'(?:, '[a-z_]+')*)\)", m.group(3))]
        guards = [g for g in lists if g <= set(machine.states)]
        assert guards, f"a statement moves {machine.entity} rows to {target} without the table's guard: {sql}"
        for guard in guards:
            assert all(machine.legal(s, target) for s in guard), (machine.entity, guard, target, sql)
        moved.setdefault(machine.entity, set()).add(target)
    assert {"approved", "rejected", "timed_out", "auto_approved", "cancelled", "responded"} <= moved["approval request"]
    assert {"running", "pending", "released", "compensated", "unknown", "approved", "rejected", "cancelled",
            "timed_out"} <= moved["effect"], moved["effect"]
    assert {"compensating", "compensated"} <= moved["undo entry"]
    assert {"halted", "active", "rolling_back", "rolled_back", "awaiting_approval"} <= moved["session"]
