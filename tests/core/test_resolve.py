"""A call that finished after it was taken over (issue 34): fenced everywhere, its probe asked, and a person's
resolution of it, through the product's own paths on a real database.

The take-over is what recovery's claim does to the row (a new owner, one epoch more), written directly so the
test is deterministic; ``tests/core/test_stall.py`` does the same with a real SIGSTOP past the lease.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from undolog_core import ToolTier, compensation, errors, undolog_tool
from undolog_core.cli import app as cli_app
from undolog_core.storage import schema as t

pytestmark = pytest.mark.storage

ELSEWHERE = "another-host|4242|1700000000.0|recoverer"


def _tools(seen: list[tuple[str, Any]], probe_says: Any = None) -> tuple[Any, ...]:
    def probe(ctx: Any) -> Any:
        seen.append(("probe", ctx.epoch))
        if isinstance(probe_says, Exception):
            raise probe_says
        return probe_says

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="unpay", probe=probe if probe_says is not None else None)
    def pay(order: str) -> dict[str, str]:
        seen.append(("pay", order))
        return {"paid": order}

    @compensation("unpay")
    def unpay(ctx: Any) -> None:
        seen.append(("unpay", ctx.args["order"]))

    return pay, unpay


def _taken_over(u: Any, effect_id: str) -> None:
    """What recovery's claim writes: another owner, the next epoch (the call stays in flight, being decided)."""
    e = t.effect_log
    with u.store.tx() as c:
        c.execute(e.update().where(e.c.effect_id == effect_id).values(owner=ELSEWHERE, epoch=e.c.epoch + 1))


def _row(u: Any, effect_id: str) -> Any:
    with u.store.read() as c:
        return c.execute(sa.select(t.effect_log).where(t.effect_log.c.effect_id == effect_id)).one()


def _undo_state(u: Any, effect_id: str) -> str | None:
    with u.store.read() as c:
        return c.execute(sa.select(t.undo_stack.c.state).where(t.undo_stack.c.effect_id == effect_id)).scalar()


def _events(u: Any, action: str) -> list[dict[str, Any]]:
    e = t.approval_events
    with u.store.read() as c:
        rows = c.execute(sa.select(e.c.subject, e.c.actor, e.c.payload).where(e.c.action == action)
                         .order_by(e.c.event_id)).all()
    return [{"subject": r.subject, "actor": r.actor, **json.loads(r.payload)} for r in rows]


def _late(u: Any, session_id: str, *, fast: bool) -> str:
    """A call of ``session_id`` run here and taken over before its commit mark; its mark is then written (queued
    and flushed, with ``fast``): the late finish is recorded. Returns the effect id."""
    d = u.engine.intercept(session_id, "pay", {"order": "o1"}, call_id="c1")
    _taken_over(u, d.effect_id)
    if fast:
        u.engine.complete(d.effect_id, {"paid": "o1"})  # queued: the caller has its answer now
        u.engine.flush_marks()
    else:
        with pytest.raises(errors.OutcomeConflict):
            u.engine.complete(d.effect_id, {"paid": "o1"})
    return str(d.effect_id)


@pytest.mark.parametrize("fast", [False, True], ids=["durable_mark", "deferred_mark"])
def test_a_mark_of_a_call_taken_over_does_not_land_and_is_recorded_as_a_late_finish(db: Any, fast: bool) -> None:
    """The deferred mark (``fast_commit_mark``) is fenced by owner as the durable one is. Before: the deferred mark
    had no fence, so it committed a call recovery was deciding (in flight under another owner), and one that
    recovery had compensated was dropped without a trace."""
    seen: list[tuple[str, Any]] = []
    u = db.open(fast_commit_mark=fast)
    u.register(*_tools(seen))
    u.session(session_id="s-fence")
    eid = _late(u, "s-fence", fast=fast)
    row = _row(u, eid)
    assert row.state == "unknown" and row.result_snapshot == {"paid": "o1"}, (row.state, row.owner)
    assert "finished after it was taken over (it was pending)" in (row.error or "")
    assert u.sessions.get("s-fence").state == "halted"
    [late] = _events(u, "effect.finished_late")
    assert late["subject"] == f"effect:{eid}" and late["state_before"] == "pending"
    assert seen == []  # no compensation ran, and no probe (the tool has none)
    assert u.verify_audit().ok


def test_a_session_ending_with_a_fenced_off_mark_is_not_completed(db: Any) -> None:
    """On PostgreSQL the session's end writes the queued marks in its own statement; a mark fenced off there
    must not let the session complete (its late finish halts it instead). Both databases refuse the end."""
    u = db.open(fast_commit_mark=True)
    u.register(*_tools([]))
    s = u.session(session_id="s-end")
    d = u.engine.intercept("s-end", "pay", {"order": "o1"}, call_id="c1")
    _taken_over(u, d.effect_id)
    u.engine.complete(d.effect_id, {"paid": "o1"})
    with pytest.raises(errors.InvalidSessionState, match="halted"):
        s.complete()
    assert _row(u, d.effect_id).state == "unknown"
    assert u.sessions.get("s-end").state == "halted"
    # A session whose marks all land ends in the one statement, as before.
    s2 = u.session(session_id="s-end-ok")
    d2 = u.engine.intercept("s-end-ok", "pay", {"order": "o2"}, call_id="c2")
    u.engine.complete(d2.effect_id, {"paid": "o2"})
    s2.complete()
    assert u.sessions.get("s-end-ok").state == "completed" and _row(u, d2.effect_id).state == "committed"


@pytest.mark.parametrize("cuts", [1, 9], ids=["one_cut", "down_past_the_retries"])
@pytest.mark.parametrize("fast", [False, True], ids=["durable_mark", "deferred_mark"])
def test_a_late_finish_whose_record_meets_a_cut_connection_is_recorded_once_the_database_answers(
        db: Any, fast: bool, cuts: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The history checker's seed 3 on PostgreSQL (CI, stop 39): a foreign-looking worker's call was taken over
    and compensated while its tool ran, and the record of its late finish met one of the connections
    ``pg_terminate_backend`` cut. Before: that record was tried once, so the effect stayed ``compensated`` with its
    side effect after its undo. Now it is asked again on a fresh connection, and a database still down past the
    retries keeps it queued (the caller of a durable mark gets ``DatabaseUnavailable``, never a "done") until a
    flush records it."""
    from undolog_core import _mark_queue

    monkeypatch.setattr(_mark_queue, "MARK_RETRY_PAUSES", (0.0, 0.0, 0.0, None))
    u = db.open(fast_commit_mark=fast)
    # The flusher thread would flush the queue too, beside this test's own flushes: under load its record could
    # still be in flight when the state is read (a flaky failure on PostgreSQL). The flushes here are the test's.
    monkeypatch.setattr(u.engine.mark_queue.flusher, "ensure", lambda: None)
    u.register(*_tools([]))
    u.session(session_id="s-cut")
    d = u.engine.intercept("s-cut", "pay", {"order": "o1"}, call_id="c1")
    _taken_over(u, d.effect_id)
    e = t.effect_log
    with u.store.tx() as c:  # recovery compensated it meanwhile (its undo ran while the tool still ran)
        c.execute(e.update().where(e.c.effect_id == d.effect_id).values(state="compensated"))
    real = u.store.effects.record_late_finish
    left = [cuts]

    def cut(*args: Any, **kwargs: Any) -> Any:
        if left[0]:
            left[0] -= 1
            raise errors.DatabaseUnavailable("a write transaction", "terminating connection due to administrator")
        return real(*args, **kwargs)

    monkeypatch.setattr(u.store.effects, "record_late_finish", cut)
    if fast:
        u.engine.complete(d.effect_id, {"paid": "o1"})  # queued: the caller has its answer now
        u.engine.flush_marks()
    elif cuts == 1:
        with pytest.raises(errors.OutcomeConflict):
            u.engine.complete(d.effect_id, {"paid": "o1"})
    else:
        with pytest.raises(errors.DatabaseUnavailable):
            u.engine.complete(d.effect_id, {"paid": "o1"})
    if cuts > 1:
        assert _row(u, d.effect_id).state == "compensated"  # not yet: the database has not answered
        for _ in range(cuts):  # the flusher's next tries, each asking again on a fresh connection
            if left[0]:
                u.engine.flush_marks()
    u.engine.flush_marks()
    row = _row(u, d.effect_id)
    assert row.state == "unknown" and row.result_snapshot == {"paid": "o1"}, row.state
    assert "finished after compensation" in (row.error or "")
    assert u.sessions.get("s-cut").state == "halted"
    [late] = _events(u, "effect.finished_late")
    assert late["state_before"] == "compensated"
    u.close()


@pytest.mark.parametrize("fast", [False, True], ids=["durable_mark", "deferred_mark"])
def test_the_probe_is_asked_on_a_late_finish_and_settles_nothing(db: Any, fast: bool) -> None:
    seen: list[tuple[str, Any]] = []
    u = db.open(fast_commit_mark=fast)
    u.register(*_tools(seen, probe_says={"found": "o1"}))
    u.session(session_id="s-probe")
    d = u.engine.intercept("s-probe", "pay", {"order": "o1"}, call_id="c1")
    _taken_over(u, d.effect_id)
    if fast:
        u.engine.complete(d.effect_id, {"paid": "o1"})
        u.engine.flush_marks()
    else:
        with pytest.raises(errors.OutcomeConflict) as caught:
            u.engine.complete(d.effect_id, {"paid": "o1"})
        assert caught.value.details["probe"] == "happened" and "probe" in caught.value.message
    # Asked with the take-over's epoch (the fencing token above the stalled owner's).
    assert seen == [("probe", 2)]
    [asked] = _events(u, "effect.probe")
    assert asked["subject"] == f"effect:{d.effect_id}" and asked["answer"] == "happened"
    assert asked["after"] == "late_finish" and asked["result"] == {"found": "o1"}
    assert asked["settled"].startswith("nothing")
    assert _row(u, d.effect_id).state == "unknown"  # informs the person; settles nothing
    assert u.recover().reconciled == [] and ("unpay", "o1") not in seen
    assert u.verify_audit().ok


def test_a_probe_that_fails_on_a_late_finish_is_recorded_as_such(db: Any) -> None:
    u = db.open()
    u.register(*_tools([], probe_says=RuntimeError("status endpoint down")))
    u.session(session_id="s-probe-err")
    d = u.engine.intercept("s-probe-err", "pay", {"order": "o1"}, call_id="c1")
    _taken_over(u, d.effect_id)
    with pytest.raises(errors.OutcomeConflict) as caught:
        u.engine.complete(d.effect_id, {"paid": "o1"})
    assert caught.value.details["probe"] == "error"
    [asked] = _events(u, "effect.probe")
    assert asked["answer"] == "error" and "status endpoint down" in asked["error"]


@pytest.mark.parametrize(("outcome", "state", "undo"), [
    ("committed", "committed", "armed"),
    ("compensated", "compensated", "compensated"),
    ("not_happened", "failed", None),
])
def test_a_person_resolves_an_unknown_effect_audited_and_the_session_stays_halted(
        db: Any, outcome: str, state: str, undo: str | None) -> None:
    seen: list[tuple[str, Any]] = []
    u = db.open()
    u.register(*_tools(seen))
    u.session(session_id="s-res")
    eid = _late(u, "s-res", fast=False)
    assert _undo_state(u, eid) == "armed"  # taken over but not compensated yet (recovery was deciding)
    done = u.resolve_effect(eid, outcome=outcome, reason="checked the ledger", actor="ana")
    assert (done.state, done.undo_state, done.session_state) == (state, undo, "halted")
    row = _row(u, eid)
    assert row.state == state and _undo_state(u, eid) == undo
    assert u.sessions.get("s-res").state == "halted"  # resolving does not resume
    [ev] = _events(u, "effect.resolved")
    assert ev["subject"] == f"effect:{eid}" and ev["actor"] == "ana" and ev["reason"] == "checked the ledger"
    assert ev["resolved_as"] == outcome and ev["state_before"] == "unknown" and done.event_id > 0
    # Settled once: it is not unknown any more.
    with pytest.raises(errors.InvalidEffectState, match="not unknown"):
        u.resolve_effect(eid, outcome="committed", reason="again", actor="bo")
    # A rollback afterwards compensates what the person said stands, and only that.
    u.sessions.resume("s-res", actor="ana")
    report = u.rollback("s-res", actor="ana")
    assert report.complete
    assert seen.count(("unpay", "o1")) == (1 if outcome == "committed" else 0)
    assert u.verify_audit().ok


def test_resolve_refuses_bad_input_and_the_sessions_own_principal(db: Any) -> None:
    u = db.open()
    u.register(*_tools([]))
    u.session(session_id="s-self", created_by="key:k1")
    eid = _late(u, "s-self", fast=False)
    with pytest.raises(errors.UndoLogError, match="resolved as one of committed, compensated, not_happened"):
        u.resolve_effect(eid, outcome="maybe", reason="x", actor="ana")
    with pytest.raises(errors.UndoLogError, match="needs a reason"):
        u.resolve_effect(eid, outcome="committed", reason="  ", actor="ana")
    with pytest.raises(errors.EffectNotFound):
        u.resolve_effect("no-such-effect", outcome="committed", reason="x", actor="ana")
    with pytest.raises(errors.SelfDecisionForbidden, match="another person must resolve it"):
        u.resolve_effect(eid, outcome="committed", reason="mine", actor="bot", principal="key:k1")
    [refused] = _events(u, "effect.resolve_refused")
    assert refused["principal"] == "key:k1" and refused["attempted"] == "committed"
    assert _row(u, eid).state == "unknown"
    # Another principal may.
    assert u.resolve_effect(eid, outcome="compensated", reason="undone by hand", actor="ana",
                            principal="key:k2").state == "compensated"


def test_the_cli_resolves_an_unknown_effect(db: Any) -> None:
    u = db.open()
    u.register(*_tools([]))
    u.session(session_id="s-cli")
    eid = _late(u, "s-cli", fast=False)
    env = {"UNDOLOG_APP": None, "UNDOLOG_SCHEMA": None, "UNDOLOG_ACTOR": None, "COLUMNS": "200", **db.env}
    runner = CliRunner()
    r = runner.invoke(cli_app, ["effects", "resolve", eid, "--as", "committed", "--reason", "in the ledger",
                                "--by", "ana", "--json"], env=env, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["state"] == "committed" and out["actor"] == "ana" and out["session_state"] == "halted"
    again = runner.invoke(cli_app, ["effects", "resolve", eid, "--as", "compensated", "--reason", "x"], env=env,
                          catch_exceptions=False)
    assert again.exit_code == 2 and "error[invalid_effect_state]" in again.stderr and "not unknown" in again.stderr
    bad = runner.invoke(cli_app, ["effects", "resolve", eid, "--as", "perhaps", "--reason", "x"], env=env)
    assert bad.exit_code == 2
    missing = runner.invoke(cli_app, ["effects", "resolve", eid, "--as", "committed"], env=env)
    assert missing.exit_code == 2 and "--reason" in missing.output + missing.stderr
