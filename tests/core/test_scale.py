"""Many workers on one database: batched sweeps and recovery handle each row exactly once, the audit chain stays
whole across batches, gc archives settled sessions, and the lists stay an index walk in a large store."""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from tests.support import scale_app
from undolog_core import ApprovalPending, ToolTier, compensation, undolog_tool
from undolog_core._gc import GC_BATCH, collect, parse_age
from undolog_core._recovery import RECOVER_BATCH
from undolog_core.errors import ConfigurationError, UndoLogError
from undolog_core.storage import schema as t
from undolog_core.storage.approvals import EXPIRE_BATCH
from undolog_core.storage.base import utcnow
from undolog_core.testing import internals

# Scale: many workers, large stores (its own step in CI).
pytestmark = pytest.mark.perf

ROOT = Path(__file__).resolve().parents[2]


def _env(db: Any, state: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, **db.env, "SCALE_STATE": str(state), "PYTHONPATH": str(ROOT), **extra}


def _raise_requests(u: Any, n: int, per_session: int = 1, tool: str = "scale_close") -> list[str]:
    ids = []
    for i in range(0, n, per_session):
        s = u.session(agent_id=f"gated-{i}")
        for k in range(per_session):
            try:
                s.call_sync(tool, n=i + k, call_id=f"g{k}")
            except ApprovalPending as p:
                ids.append(p.approval_request_id)
    return ids


def _count(u: Any, q: Any) -> Any:
    with internals(u).read() as conn:
        return conn.execute(q).all()


# -- the Done-when test: 4 processes, new batch sizes, each row exactly once ---------------------------------


def test_four_processes_recover_and_expire_each_row_exactly_once(db, tmp_path, monkeypatch):
    """Four processes run recover(), expire_due() and lapse_due() at the same moment over more rows than one batch
    holds: every in-flight effect is compensated exactly once, every due request timed out exactly once and every
    approval never re-issued expired exactly once, with one audit event and one outbox row each, and the audit
    chains verify."""
    n_effects, n_requests = RECOVER_BATCH + 30, EXPIRE_BATCH + 10
    monkeypatch.setenv("SCALE_STATE", str(tmp_path))
    u = db.open()
    u.register(scale_app.scale_charge, scale_app.scale_undo, scale_app.scale_close)
    seeded = subprocess.run([sys.executable, "-m", "tests.support.scale_app", "seed", str(n_effects)],
                            env=_env(db, tmp_path), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert seeded.returncode == -signal.SIGKILL, seeded.stderr
    # Approved calls never re-issued: they lapse once approved_ttl_seconds is 1.
    to_lapse = _raise_requests(u, n_requests, per_session=1)
    for rid in to_lapse:
        u.approvals.approve(rid, approver="ana")
    u.policy.set(actor="test", approval_timeout_seconds=1, approved_ttl_seconds=1)
    # Two requests per session for some: one times out, the other is cancelled with its session's halt.
    ids = _raise_requests(u, n_requests, per_session=1)
    pairs = _raise_requests(u, 20, per_session=2)
    time.sleep(1.1)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.scale_app", "sweep"],
                              env=_env(db, tmp_path, SCALE_GO=str(go)), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    time.sleep(1.0)  # let them open (and migrate-check) before the start line
    go.touch()
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(not o["errors"] for o in outs), [o["errors"] for o in outs]

    # Recovery: each effect reconciled by exactly one process, each compensation ran exactly once.
    reconciled = [eid for o in outs for eid in o["reconciled"]]
    assert len(reconciled) == len(set(reconciled)) == n_effects
    ran = collections.Counter(r["key"] for r in scale_app.runs())
    assert len(ran) == n_effects and set(ran.values()) == {1}, ran.most_common(3)
    e, uu = t.effect_log, t.undo_stack
    assert dict(_count(u, sa.select(e.c.state, sa.func.count()).where(e.c.tool_name == "scale_charge")
                       .group_by(e.c.state))) == {"compensated": n_effects}
    assert dict(_count(u, sa.select(uu.c.state, sa.func.count()).group_by(uu.c.state))) == {
        "compensated": n_effects}

    # Expiry: each due request timed out once (or, the second of a session, cancelled once).
    expired = [rid for o in outs for rid in o["expired"]]
    assert len(expired) == len(set(expired)) == n_requests + 10
    r, ev, ob = t.approval_requests, t.approval_events, t.outbox
    states = dict(_count(u, sa.select(r.c.state, sa.func.count()).group_by(r.c.state)))
    assert states == {"timed_out": n_requests + 10, "cancelled": 10, "expired": n_requests}
    per_request = collections.Counter(
        (x.approval_request_id, x.action) for x in _count(u, sa.select(ev.c.approval_request_id, ev.c.action)
                                                             .where(ev.c.approval_request_id.isnot(None))))
    assert set(per_request.values()) == {1}
    assert sum(1 for (_, a) in per_request if a == "timeout") == n_requests + 10
    # Lapse: each approved request expired by exactly one process, one event and one outbox row each.
    lapsed = [rid for o in outs for rid in o["lapsed"]]
    assert len(lapsed) == len(set(lapsed)) == n_requests and set(lapsed) == set(to_lapse)
    assert {rid for (rid, a) in per_request if a == "expire"} == set(to_lapse)
    lapsed_rows = _count(u, sa.select(sa.func.count()).select_from(ob).where(ob.c.event_type == "approval.expired"))
    assert lapsed_rows[0][0] == n_requests
    assert sum(1 for (_, a) in per_request if a == "cancel") == 10
    assert set(expired) == {rid for (rid, a) in per_request if a == "timeout"}
    assert set(ids) <= set(expired) and len(set(pairs) & set(expired)) == 10
    timed_out_rows = _count(u, sa.select(sa.func.count()).select_from(ob)
                            .where(ob.c.event_type == "approval.timed_out"))[0][0]
    assert timed_out_rows == n_requests + 10
    assert u.verify_audit().ok


# -- batches keep the audit chain and the per-request semantics ----------------------------------------------


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="closes an account")
def close_account(n: int) -> dict[str, Any]:
    return {"closed": n}


def test_a_batch_of_timeouts_is_one_chain_that_verifies_and_catches_an_edit(db):
    u = db.open()
    u.register(close_account)
    u.policy.set(actor="test", approval_timeout_seconds=1)
    s = u.session(agent_id="two-pending")
    ids = []
    for k in range(2):
        try:
            s.call_sync("close_account", n=k, call_id=f"c{k}")
        except ApprovalPending as p:
            ids.append(p.approval_request_id)
    others = [u.session(agent_id=f"a{i}") for i in range(5)]
    for o in others:
        with pytest.raises(ApprovalPending):
            o.call_sync("close_account", n=1, call_id="c")
    later = utcnow() + dt.timedelta(seconds=5)
    expired = u.approvals.expire_due(later)
    # The first request of the two-request session timed out; the second was cancelled by that halt.
    assert ids[0] in expired and ids[1] not in expired and len(expired) == 6
    assert u.approvals.get(ids[1]).state == "cancelled"
    assert "timed out" in u.approvals.get(ids[1]).decision_reason
    assert u.sessions.get(s.id).state == "halted"
    assert u.sessions.get(s.id).halted_reason == f"approval {ids[0]} (close_account) timed out without a decision"
    assert u.approvals.expire_due(later) == []  # exactly once
    report = u.verify_audit()
    assert report.ok and report.events_checked >= 7
    # An edit behind the triggers' back is still caught inside a batch.
    ev = t.approval_events
    with internals(u).sql_engine.begin() as conn:
        if internals(u).is_postgres:
            conn.exec_driver_sql("ALTER TABLE undolog_approval_events DISABLE TRIGGER USER")
        else:
            conn.exec_driver_sql("DROP TRIGGER IF EXISTS undolog_events_no_update")
        victim = conn.execute(sa.select(ev.c.event_id).where(ev.c.action == "cancel")).scalar_one()
        conn.execute(ev.update().where(ev.c.event_id == victim).values(actor="mallory"))
    assert not u.verify_audit().ok


# -- recovery's batch path hands what it cannot finish to the one-by-one path ----------------------------------

_FLAKY: list[str] = []


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_flaky")
def flaky(n: int) -> dict[str, Any]:
    return {"n": n}


@compensation("undo_flaky")
def undo_flaky(ctx: Any) -> None:
    _FLAKY.append(ctx.idempotency_key)
    if ctx.args["n"] == 1:
        raise RuntimeError("the refund service is down")


def test_a_failing_compensation_in_a_batch_counts_toward_the_dead_letter_and_the_rest_finish(db, monkeypatch):
    u = db.open()
    u.register(flaky, undo_flaky)
    monkeypatch.setattr(u.saga, "backoff_seconds", 0.0)
    sids = []
    for n in range(3):
        s = u.session(agent_id=f"s{n}")
        sids.append(s.id)
        u.driver.decide(s.id, "flaky", {"n": n}, call_id="c")
    # The calls look abandoned: their owner is a process that is gone.
    with internals(u).write() as conn:
        conn.execute(t.effect_log.update().values(owner="ghost|1|1|x", lease_until=utcnow()))
    report = u.recover()
    outcomes = {r["effect_id"]: r["outcome"] for r in report.reconciled}
    assert sorted(outcomes.values()) == ["compensated", "compensated"]
    assert len(report.errors) == 1 and "refund service is down" in report.errors[0]
    assert _FLAKY.count("undo-" + str(_count(u, sa.select(t.undo_stack.c.undo_id)
                                              .where(t.undo_stack.c.session_id == sids[1]))[0][0])) == 3
    for sid in sids:
        assert u.sessions.get(sid).state == "halted"


# -- gc --------------------------------------------------------------------------------------------------------


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_refund")
def refund(n: int) -> dict[str, Any]:
    return {"refunded": n}


@compensation("undo_refund")
def undo_refund(ctx: Any) -> None:
    pass


def test_gc_archives_settled_sessions_only_and_records_it(db):
    u = db.open()
    u.register(refund, undo_refund, close_account)
    done = u.session(agent_id="done")
    for k in range(3):
        done.call_sync("refund", n=k)
    done.complete()
    undone = u.session(agent_id="undone")
    undone.call_sync("refund", n=1)
    u.rollback(undone.id)
    idle = u.session(agent_id="idle")
    idle.call_sync("refund", n=2)
    waiting = u.session(agent_id="waiting")
    waiting.call_sync("refund", n=3)
    with pytest.raises(ApprovalPending):
        waiting.call_sync("close_account", n=3, call_id="x")
    halted = u.session(agent_id="halted")
    halted.call_sync("refund", n=4)
    u.store.sessions.halt_session(halted.id, "a person must look")
    events_before = u.verify_audit().events_checked

    # Nothing is old enough yet.
    assert collect(u.store, parse_age("30d"), actor="ana").sessions == 0
    later = utcnow() + dt.timedelta(days=31)
    dry = collect(u.store, parse_age("30d"), actor="ana", now=later, dry_run=True)
    assert dry.sessions == 3 and dry.effects == 0
    report = collect(u.store, parse_age("30d"), actor="ana", now=later)
    assert report.sessions == 3 and report.effects == 5 and report.undo_entries == 5
    assert report.closed == [idle.id]

    e = t.effect_log
    left = dict(_count(u, sa.select(e.c.session_id, sa.func.count()).group_by(e.c.session_id)))
    assert left == {waiting.id: 2, halted.id: 1}
    archived = u.store.archive.archived(done.id)
    assert [a["kind"] for a in archived].count("effect") == 3 and [a["kind"] for a in archived].count("undo") == 3
    assert {a["row"]["call_id"] for a in archived if a["kind"] == "effect"} == {
        x["row"]["call_id"] for x in archived if x["kind"] == "effect"}
    # The idle active session is closed: nothing runs in it any more (its call ids are archived).
    assert u.sessions.get(idle.id).state == "completed"
    with pytest.raises(UndoLogError):
        idle.call_sync("refund", n=2)
    # Recorded in the audit trail; no audit event was removed; the chain verifies.
    audit = u.verify_audit()
    assert audit.ok and audit.events_checked == events_before + 1
    ev = t.approval_events
    (payload,) = _count(u, sa.select(ev.c.payload).where(ev.c.action == "gc.archive"))[0]
    assert json.loads(payload)["effects"] == 5 and json.loads(payload)["closed"] == [idle.id]
    # A second run finds nothing more.
    assert collect(u.store, parse_age("30d"), actor="ana", now=later).sessions == 0


def test_gc_from_the_cli_and_bad_ages(db):
    u = db.open()
    u.register(refund, undo_refund)
    s = u.session(agent_id="done")
    s.call_sync("refund", n=1)
    s.complete()
    env = {**os.environ, **db.env, "PYTHONPATH": str(ROOT)}
    cli = [sys.executable, "-m", "undolog_core.cli"]
    bad = subprocess.run([*cli, "gc", "--older-than", "30 days"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "error[configuration_error]" in bad.stderr and "30d" in bad.stderr
    time.sleep(0.01)
    out = subprocess.run([*cli, "gc", "--older-than", "0s", "--as", "ana", "--json"], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["sessions"] == 1 and got["effects"] == 1 and got["undo_entries"] == 1
    with pytest.raises(ConfigurationError):
        parse_age("-3d")
    assert GC_BATCH >= 100


# -- a large store: the lists stay an index walk -----------------------------------------------------------


def _seed_bulk(u: Any, n_effects: int, per_session: int = 10) -> None:
    """Bulk-insert ``n_effects`` committed COMPENSABLE effects in sessions of ``per_session``, and 30 pending
    approval requests, straight in SQL (the API would take hours for a million)."""
    n_sessions = n_effects // per_session
    with internals(u).sql_engine.begin() as conn:
        if internals(u).is_postgres:
            conn.exec_driver_sql(f"""
                INSERT INTO undolog_sessions (session_id, agent_id, state, tool_calls_total, on_failure,
                    pinned_revisions, created_at, updated_at)
                SELECT 'bulk-' || g, 'bulk', 'completed', {per_session}, 'rollback', '{{}}',
                       now() - (g || ' seconds')::interval, now() - (g || ' seconds')::interval
                FROM generate_series(1, {n_sessions}) g""")
            conn.exec_driver_sql(f"""
                INSERT INTO undolog_effect_log (effect_id, session_id, call_id, tool_name, tool_revision, tier,
                    state, args_snapshot, args_digest, result_snapshot, recovery_attempts, created_at, updated_at)
                SELECT md5(g::text), 'bulk-' || (g / {per_session} + 1), 'c' || g, 'refund', 1, 'compensable',
                       'committed', '{{"n": 1}}', md5(g::text), '{{}}', 0, now(), now()
                FROM generate_series(0, {n_effects - 1}) g""")
            conn.exec_driver_sql("ANALYZE undolog_sessions; ANALYZE undolog_effect_log")
        else:
            conn.exec_driver_sql(f"""
                WITH RECURSIVE g(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM g WHERE i < {n_sessions})
                INSERT INTO undolog_sessions (session_id, agent_id, state, tool_calls_total, on_failure,
                    pinned_revisions, created_at, updated_at)
                SELECT 'bulk-' || i, 'bulk', 'completed', {per_session}, 'rollback', '{{}}',
                       strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || i || ' seconds'),
                       strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || i || ' seconds')
                FROM g""")
            conn.exec_driver_sql(f"""
                WITH RECURSIVE g(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM g WHERE i < {n_effects - 1})
                INSERT INTO undolog_effect_log (effect_id, session_id, call_id, tool_name, tool_revision, tier,
                    state, args_snapshot, args_digest, result_snapshot, recovery_attempts, created_at, updated_at)
                SELECT printf('%032x', i), 'bulk-' || (i / {per_session} + 1), 'c' || i, 'refund', 1,
                       'compensable', 'committed', '{{"n": 1}}', printf('%064x', i), '{{}}', 0,
                       strftime('%Y-%m-%d %H:%M:%f', 'now'), strftime('%Y-%m-%d %H:%M:%f', 'now')
                FROM g""")
            conn.exec_driver_sql("ANALYZE")


class _Sent(Exception):
    """Stops a statement before it reaches the database (``_plan``), with what would have been sent."""


def _plan(u: Any, stmt: Any, *, binds: bool = False) -> str:
    """The plan of ``stmt``; ``binds``: planned with its parameters bound as the application sends them (a partial
    index's predicate is proved from the statement's text only), else with them written into its text."""
    prefix = "EXPLAIN " if internals(u).is_postgres else "EXPLAIN QUERY PLAN "
    if binds:
        def stop(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool) -> None:
            if statement.lstrip().upper().startswith("SELECT"):  # not the read's own BEGIN (SQLite)
                raise _Sent(statement, parameters)

        with internals(u).read() as conn:
            sa.event.listen(conn, "before_cursor_execute", stop)
            try:
                conn.execute(stmt)
            except _Sent as sent:
                statement, parameters = sent.args
            finally:
                sa.event.remove(conn, "before_cursor_execute", stop)
        with internals(u).read() as conn:
            if not internals(u).is_postgres:
                return "\n".join(str(r[-1]) for r in conn.exec_driver_sql(prefix + statement, parameters).all())
            # PostgreSQL: the generic plan, what a statement psycopg has prepared (from its sixth run) may get: made
            # without the parameters' values, so only the statement's text can prove a partial index's predicate.
            import psycopg.sql

            order: list[str] = []

            def number(m: Any) -> str:
                if m.group(1) not in order:
                    order.append(m.group(1))
                return f"${order.index(m.group(1)) + 1}"

            raw = conn.connection.dbapi_connection
            text = re.sub(r"%\((\w+)\)s", number, statement)
            args = ", ".join(psycopg.sql.Literal(parameters[k]).as_string(raw) for k in order)
            conn.exec_driver_sql(f"PREPARE undolog_plan_probe AS {text}")
            conn.exec_driver_sql("SET LOCAL plan_cache_mode = force_generic_plan")
            try:
                return "\n".join(str(r[-1]) for r in conn.exec_driver_sql(
                    f"EXPLAIN EXECUTE undolog_plan_probe({args})".replace("%", "%%")).all())
            finally:
                conn.exec_driver_sql("DEALLOCATE undolog_plan_probe")
    with internals(u).read() as conn:
        compiled = stmt.compile(dialect=conn.dialect, compile_kwargs={"literal_binds": True})
        return "\n".join(str(r[-1]) for r in conn.exec_driver_sql(prefix + str(compiled)).all())


def _lists_stay_fast(db: Any, n_effects: int) -> None:
    from tests.server.conftest import make_desk

    desk = make_desk(db)
    u = desk.undolog
    u.register(refund, undo_refund)
    try:
        _seed_bulk(u, n_effects)
        for _ in range(30):
            desk.pending()
        # The queue's and the sessions list's statements walk an index instead of sorting the table.
        r, s = t.approval_requests, t.sessions
        queue = (sa.select(r).where(r.c.state == "pending")
                 .order_by(r.c.created_at.desc(), r.c.approval_request_id.desc()).limit(200))
        sessions = sa.select(s).order_by(s.c.created_at.desc(), s.c.session_id).limit(200)
        for stmt, table in ((queue, "undolog_approval_requests"), (sessions, "undolog_sessions")):
            plan = _plan(u, stmt)
            if internals(u).is_postgres:
                assert f"Seq Scan on {table}" not in plan, plan
            else:
                assert "USING INDEX" in plan or "USING COVERING INDEX" in plan, plan
        # The pages answer, within a bound generous enough for a loaded CI machine (no timing assertion).
        c = desk.client("approver")
        ui = _login_ui(desk)
        for path, client in (("/v1/approvals?state=pending", c), ("/v1/sessions", c), ("/ui/", ui),
                             ("/ui/sessions", ui), ("/ui/sessions/bulk-7", ui)):
            t0 = time.perf_counter()
            resp = client.get(path, timeout=60)
            assert resp.status_code == 200, (path, resp.text[:300])
            # Printed, not asserted (-s shows it): the README quotes these.
            print(f"{n_effects} effects, {db.kind}: GET {path} {1000 * (time.perf_counter() - t0):.0f} ms")
        assert len(c.get("/v1/approvals?state=pending").json()) == 30
    finally:
        desk.close()


def _login_ui(desk: Any) -> Any:
    import re

    import httpx

    c = httpx.Client(base_url=desk.url, follow_redirects=False, timeout=60)
    page = c.get("/ui/login")
    m = re.search(r'name="csrf_token" value="([0-9a-f]+)"', page.text)
    assert m, page.text[:300]
    r = c.post("/ui/login", data={"api_key": desk.token("approver"), "csrf_token": m.group(1)})
    assert r.status_code == 303, r.text
    return c


def test_the_lists_stay_an_index_walk_with_many_effects(db):
    _lists_stay_fast(db, 50_000)


@pytest.mark.long
def test_the_lists_stay_an_index_walk_with_a_million_effects(db):
    _lists_stay_fast(db, 1_000_000)


@pytest.mark.postgres_only
def test_a_sweep_leaves_a_request_whose_session_a_decision_holds_instead_of_waiting_for_it(db):
    """A decision locks session, then request, then an audit head. A sweep that claimed the request and then waited
    for the session row would deadlock with it (PostgreSQL aborts one: a 500 or a failed sweep). The sweeps
    (timeouts and lapsed approvals) take the session rows SKIP LOCKED and leave a busy session's requests to the
    next sweep."""
    import threading

    u = db.open()
    u.register(close_account)
    s = u.session(agent_id="busy")
    with pytest.raises(ApprovalPending) as p:
        s.call_sync("close_account", n=1, call_id="c")
    rid = p.value.approval_request_id
    other = u.session(agent_id="idle")
    with pytest.raises(ApprovalPending) as q:
        other.call_sync("close_account", n=2, call_id="c")
    later = utcnow() + dt.timedelta(hours=2)
    holding, release = threading.Event(), threading.Event()

    def decision_in_progress() -> None:  # what ApprovalsSQL.decide holds first
        with internals(u).write() as conn:
            conn.execute(sa.select(t.sessions.c.session_id).where(t.sessions.c.session_id == s.id).with_for_update())
            holding.set()
            release.wait(30)

    th = threading.Thread(target=decision_in_progress)
    th.start()
    assert holding.wait(10)
    got: list[list[str]] = []
    sweep = threading.Thread(target=lambda: got.append(u.approvals.expire_due(later)))
    sweep.start()
    sweep.join(20)
    stuck = sweep.is_alive()
    release.set()
    th.join()
    sweep.join()
    assert not stuck, "the sweep waited for the session row a decision holds"
    assert got == [[q.value.approval_request_id]]  # the idle session's request only
    assert u.approvals.expire_due(later) == [rid]  # the next sweep takes it
    assert u.verify_audit().ok


def _bench_scale() -> Any:
    """``benchmarks/scale.py`` as a module (it quietens the ``undolog`` logger for its runs: restored here)."""
    import importlib.util
    import logging

    level = logging.getLogger("undolog").level
    spec = importlib.util.spec_from_file_location("undolog_bench_scale", ROOT / "benchmarks" / "scale.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    finally:
        logging.getLogger("undolog").setLevel(level)
    return mod


@contextlib.contextmanager
def _compiles(u: Any) -> Iterator[list[str]]:
    """The statements SQLAlchemy compiles for ``u``'s durable engine inside the block (misses of its cache)."""
    from sqlalchemy import event
    from sqlalchemy.engine.default import CACHE_MISS

    compiled: list[str] = []

    def seen(conn: Any, cursor: Any, statement: str, params: Any, context: Any, executemany: bool) -> None:
        if context is not None and context.cache_hit is CACHE_MISS:
            compiled.append(statement)

    event.listen(internals(u).sql_engine, "after_cursor_execute", seen)
    try:
        yield compiled
    finally:
        event.remove(internals(u).sql_engine, "after_cursor_execute", seen)


def test_the_expire_benchmark_times_warm_sweepers_that_compile_nothing_in_the_timed_sweep(db):
    """benchmarks/scale.py times one sweep per worker process. A process's first real sweep compiles every statement
    of the batch (SQLAlchemy, psycopg) and fills its database backend's caches: 15-35 ms of CPU per process, paid
    inside the timed window once per worker, which made 8 workers slower than 4 on 2 cores while warm sweepers
    spend the same CPU per timeout at 4 and 8. Its warm-up (``warm_sweeper``) now sweeps requests of its own first,
    as a running server's sweeper has: the timed sweep compiles nothing. The old warm-up (the claim only) shows
    the count is live."""
    scale = _bench_scale()
    u = db.open()
    u.register(close_account)
    u.policy.set(actor="test", approval_timeout_seconds=1)
    later = utcnow() + dt.timedelta(seconds=5)

    # The old warm-up: only the claim statement (nothing is due in 2000); the timed sweep compiles the rest.
    cold_ids = _raise_requests(u, 3, tool="close_account")
    cold = db.open()
    assert internals(cold).sql_engine is not internals(u).sql_engine  # a sweeper process of its own: its own statement cache
    assert scale.warm_sweeper(cold, [], now=later) == []
    with _compiles(cold) as compiled:
        assert sorted(cold.approvals.expire_due(later)) == sorted(cold_ids)
    assert len(compiled) >= 5, compiled  # the updates, the outbox and event inserts, ...

    # The benchmark's warm-up: two due requests of its own (it compiles the batch); then the timed sweep of many
    # sessions compiles nothing.
    ids = _raise_requests(u, 7, tool="close_account")
    mine, rest = ids[:scale.WARM_REQUESTS], ids[scale.WARM_REQUESTS:]
    warm = db.open()
    with _compiles(warm) as warming:
        assert scale.warm_sweeper(warm, mine, now=later) == mine
    assert len(warming) >= 5, warming
    with _compiles(warm) as compiled:
        assert sorted(warm.approvals.expire_due(later)) == sorted(rest)
    assert compiled == []
    assert u.verify_audit().ok


def test_a_sweep_claim_walks_the_timeout_index_and_stops_at_the_batch(db):
    """Each batch of a sweep claims the oldest due requests. Ordered by (timeout_at, id), no index gave that order
    and every claim sorted (PostgreSQL: an incremental sort here, a full sort of the whole backlog when its
    estimates were stale, as on the benchmark's freshly filled table; SQLite: a temporary B-tree). Ordered by
    timeout_at, the due index (pending requests by timeout_at) gives it: the plan has no sort, the walk stops at
    the batch. The claim is planned as the sweep sends it, its clock a bound parameter: the partial index's
    predicate is matched by the statement's own text (``state = 'pending'`` written in it), which a bound state
    would not prove (SQLite then read the table through another index)."""
    u = db.open()
    u.register(refund, undo_refund)
    n = 5_000
    _seed_bulk(u, n)
    with internals(u).sql_engine.begin() as conn:
        if internals(u).is_postgres:
            conn.exec_driver_sql(f"""
                INSERT INTO undolog_approval_requests (approval_request_id, effect_id, session_id, call_id, tool_name,
                    tool_revision, tool_fingerprint, proposed_args, action_digest, risk_tags, agent_context, state,
                    timeout_at, created_at)
                SELECT 'r' || g, md5(g::text), 'bulk-' || (g / 10 + 1), 'c' || g, 'refund', 1, 'f', '{{}}', 'd',
                       '[]', '[]', 'pending', now() - (g || ' seconds')::interval, now() - interval '1 day'
                FROM generate_series(0, {n - 1}) g""")
            conn.exec_driver_sql("ANALYZE undolog_approval_requests")
        else:
            conn.exec_driver_sql(f"""
                WITH RECURSIVE g(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM g WHERE i < {n - 1})
                INSERT INTO undolog_approval_requests (approval_request_id, effect_id, session_id, call_id, tool_name,
                    tool_revision, tool_fingerprint, proposed_args, action_digest, risk_tags, agent_context, state,
                    timeout_at, created_at)
                SELECT 'r' || i, printf('%032x', i), 'bulk-' || (i / 10 + 1), 'c' || i, 'refund', 1, 'f', '{{}}', 'd',
                       '[]', '[]', 'pending', strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || i || ' seconds'),
                       strftime('%Y-%m-%d %H:%M:%f', 'now', '-1 days')
                FROM g""")
            conn.exec_driver_sql("ANALYZE")
    plan = _plan(u, u.store.for_update(u.store.approvals.due_claim(utcnow()), skip_locked=True), binds=True)
    if internals(u).is_postgres:
        assert "Sort" not in plan and "ix_undolog_approval_due" in plan, plan
    else:
        assert "TEMP B-TREE" not in plan and "ix_undolog_approval_due" in plan, plan
    # The batch is still the oldest due requests, in (timeout_at, id) order.
    with internals(u).read() as conn:
        rows = conn.execute(u.store.approvals.due_claim(utcnow(), limit=3)).all()
    assert [x.approval_request_id for x in rows] == [f"r{n - 1}", f"r{n - 2}", f"r{n - 3}"]


def test_the_sweeps_statements_write_the_due_index_predicate_itself(db):
    """The due index is used only if the claim's WHERE proves its predicate from the statement's text (a generic
    plan has no parameter values). Both come from ``schema.DUE_PREDICATE``: the index as declared (and as created,
    on SQLite), the claim as compiled for this database, and PostgreSQL's slot-and-due probe carry that string."""
    from undolog_core.storage.approvals import _SLOT_AND_DUE

    u = db.open()
    index = next(i for i in t.approval_requests.indexes if i.name == "ix_undolog_approval_due")
    dialect = "postgresql" if internals(u).is_postgres else "sqlite"
    assert str(index.dialect_options[dialect]["where"]) == t.DUE_PREDICATE
    with internals(u).read() as conn:
        if not internals(u).is_postgres:  # (PostgreSQL keeps a parsed predicate, not its text: the plan tests cover it)
            made = conn.exec_driver_sql(
                "SELECT sql FROM sqlite_master WHERE name = 'ix_undolog_approval_due'").scalar_one()
            assert made.endswith(f"WHERE {t.DUE_PREDICATE}"), made
        claim = str(u.store.for_update(u.store.approvals.due_claim(utcnow()), skip_locked=True).compile(dialect=conn.dialect))
    assert f"WHERE {t.DUE_PREDICATE} AND " in claim, claim
    assert f"WHERE {t.DUE_PREDICATE} AND " in _SLOT_AND_DUE.text


@pytest.mark.postgres_only
def test_at_most_sweep_slots_sweepers_claim_at_once_and_a_dead_holder_frees_its_slot(db):
    """On PostgreSQL at most ``SWEEP_SLOTS`` sweep batches run at once per schema (transaction advisory locks): with
    every slot held, a sweep claims nothing and returns (the holders finish the work); when a holder's connection
    dies its slot is free again and the next sweep times each due request out once."""
    from undolog_core.storage.approvals import SWEEP_SLOTS

    u = db.open()
    u.register(close_account)
    ids = _raise_requests(u, 3, tool="close_account")
    later = utcnow() + dt.timedelta(hours=2)
    key = u.store.approvals.sweep_slot_key()
    holders = []
    for slot in range(SWEEP_SLOTS):  # other sweepers, each in a batch holding one slot
        c = internals(u).sql_engine.connect()
        c.exec_driver_sql(f"SELECT pg_advisory_xact_lock({key}, {slot})")
        holders.append((c, c.exec_driver_sql("SELECT pg_backend_pid()").scalar()))
    victim = holders[1]
    try:
        assert u.approvals.expire_due(later) == []  # every slot held: nothing claimed
        pending = _count(u, sa.select(sa.func.count()).select_from(t.approval_requests)
                         .where(t.approval_requests.c.state == "pending"))
        assert pending == [(3,)]
        with internals(u).sql_engine.connect() as watch:  # a holder dies: its transaction and its lock end with it
            watch.exec_driver_sql(f"SELECT pg_terminate_backend({victim[1]})")
            for _ in range(200):  # until its lock is gone (a wait, not a timing assertion)
                held = watch.exec_driver_sql(
                    f"SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = {key} "
                    "AND objsubid = 2").scalar()
                if held == SWEEP_SLOTS - 1:
                    break
                time.sleep(0.05)
            assert held == SWEEP_SLOTS - 1
        assert sorted(u.approvals.expire_due(later)) == sorted(ids)
    finally:
        for c, pid in holders:
            if pid == victim[1]:
                c.invalidate()  # its backend is gone: not back into the pool
            else:
                c.close()
    assert u.approvals.expire_due(later) == []  # each once
    events = _count(u, sa.select(t.approval_events.c.approval_request_id)
                    .where(t.approval_events.c.action == "timeout"))
    assert sorted(r[0] for r in events) == sorted(ids)
    assert u.verify_audit().ok


def _requests_scans(u: Any) -> tuple[int, int]:
    """(scans, index entries read) of the approval requests' table and indexes so far, from the cumulative
    statistics (read in a transaction of its own: a fresh snapshot of them)."""
    with internals(u).sql_engine.connect() as conn:
        row = conn.exec_driver_sql(
            "SELECT coalesce(seq_scan, 0) + coalesce(idx_scan, 0), "
            "(SELECT coalesce(sum(idx_tup_read), 0) FROM pg_stat_user_indexes i WHERE i.relid = st.relid) "
            "FROM pg_stat_user_tables st WHERE st.relid = 'undolog_approval_requests'::regclass").one()
        conn.rollback()
    return int(row[0]), int(row[1])


def _flush_stats(u: Any) -> None:
    """Every pooled connection of ``u`` reports its pending statistics now (PostgreSQL 15+: before it answers)."""
    conns = [internals(u).sql_engine.connect() for _ in range(max(1, internals(u).sql_engine.pool.checkedin()))]
    for c in conns:
        c.exec_driver_sql("SELECT pg_stat_force_next_flush()")
        c.commit()
        c.close()


@pytest.mark.postgres_only
def test_a_sweeper_that_finds_every_slot_held_stops_without_reading_the_requests(db):
    """A sweeper beyond ``SWEEP_SLOTS`` adds no work to the ones sweeping: finding every slot held, it stops before
    it reads anything of the requests (no walk of the due index over the rows the holders are timing out, no
    buffer locks on its pages). It used to ask whether anything was due first: one index scan of the due index per
    extra sweeper, counted here in the cumulative statistics (its backend made to report them before and after)."""
    from undolog_core.storage.approvals import SWEEP_SLOTS

    u = db.open()
    u.register(close_account)
    ids = _raise_requests(u, 3, tool="close_account")
    later = utcnow() + dt.timedelta(hours=2)
    extra = db.open()  # the extra sweeper: a process of its own, its own connections
    assert extra.approvals.expire_due(utcnow() - dt.timedelta(days=1)) == []  # connected, nothing due then
    key = u.store.approvals.sweep_slot_key()
    holders = []
    for slot in range(SWEEP_SLOTS):  # the sweepers at work, each in a batch holding one slot
        c = internals(u).sql_engine.connect()
        c.exec_driver_sql(f"SELECT pg_advisory_xact_lock({key}, {slot})")
        holders.append(c)
    try:
        _flush_stats(extra)
        before = _requests_scans(u)
        assert extra.approvals.expire_due(later) == []
        _flush_stats(extra)
        after = _requests_scans(u)
    finally:
        for c in holders:
            c.rollback()
            c.close()
    assert after == before, (before, after)
    # With a slot free the same sweeper times every due request out, once.
    assert sorted(extra.approvals.expire_due(later)) == sorted(ids)
    assert u.approvals.expire_due(later) == []
    assert u.verify_audit().ok


def test_the_expire_benchmark_says_not_slower_beyond_its_spread_only_when_its_own_spread_is_narrow():
    """benchmarks/scale.py reads "more workers never slower" against the base count paired with itself: a median
    under 1.0 passes as within the measurement's spread only when that spread is within the tolerance, and never
    when it is below the spread; with a spread wider than the tolerance no verdict is given, whatever the median."""
    scale = _bench_scale()
    tol = scale.EXPIRE_TOLERANCE
    assert scale.expire_verdict(1.02, 1.0 - tol / 2) == "not slower"
    assert scale.expire_verdict(1.20, 0.5).startswith("cannot tell")
    assert scale.expire_verdict(0.97, 1.0 - tol / 2) == "not slower beyond the measurement's own spread"
    assert scale.expire_verdict(0.97, 1.0 - 2 * tol).startswith("cannot tell")
    assert scale.expire_verdict(0.90, 1.0 - tol / 2) == "SLOWER"
    assert scale.expire_verdict(0.90, 1.0 - tol / 2, what="more") == "MORE"


def _seed_due(u: Any, n: int, per_session: int = 10) -> None:
    """``n`` pending requests past their timeout over the bulk sessions and effects (``_seed_bulk``), inserted in SQL
    AFTER the tables were analyzed: the statistics say there are none, as with a backlog newer than them."""
    with internals(u).sql_engine.begin() as conn:
        conn.exec_driver_sql(f"""
            INSERT INTO undolog_approval_requests (approval_request_id, effect_id, session_id, call_id, tool_name,
                tool_revision, tool_fingerprint, proposed_args, action_digest, risk_tags, agent_context, state,
                timeout_at, created_at)
            SELECT 'r' || g, md5(g::text), 'bulk-' || (g / {per_session} + 1), 'c' || g, 'refund', 1, 'f', '{{}}',
                   'd', '[]', '[]', 'pending', now() - (g || ' seconds')::interval, now() - interval '1 day'
            FROM generate_series(0, {n - 1}) g""")


@contextlib.contextmanager
def _index_reads(u: Any) -> Iterator[list[dict[str, int]]]:
    """The index entries each transaction read from the approval requests' indexes, per index, counted in the
    transaction itself just before it commits (pg_stat_get_xact_tuples_returned of each index)."""
    read: list[dict[str, int]] = []

    def count_reads(conn: Any) -> None:
        cur = conn.connection.dbapi_connection.execute(
            "SELECT c.relname, pg_stat_get_xact_tuples_returned(c.oid) FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = 'undolog_approval_requests'::regclass")
        read.append({name: int(k) for name, k in cur.fetchall()})

    sa.event.listen(internals(u).sql_engine, "commit", count_reads)
    try:
        yield read
    finally:
        sa.event.remove(internals(u).sql_engine, "commit", count_reads)


@pytest.mark.postgres_only
def test_a_sweep_batch_reads_about_its_batch_of_the_backlog_whatever_the_statistics(db):
    """A sweep batch reads its batch, not the backlog. With statistics older than the backlog (analyzed before the
    due requests came) PostgreSQL estimated a handful of pending rows: the claim read every due row through a
    bitmap scan and sorted them, and the batch's updates by id and its lookup of the sessions' other pending
    requests read every pending row through the (state, ..) indexes, so a batch's cost grew with the backlog (per
    batch of 50 here: 6,727 index entries read for 2,000 due). The same for a batch restricted to ids
    (``approvals.expire(ids)``): 2,052 entries of the (state, ..) indexes before, 52 now. Counted, not
    timed."""
    u = db.open()
    u.register(refund, undo_refund)
    n, batch = 2_000, 50
    _seed_bulk(u, n)
    _seed_due(u, n)
    now = utcnow()
    with _index_reads(u) as read:
        got, _ = u.store.approvals.expire_batch(now, limit=batch)
    assert len(got) == batch // 10  # one timed out per session of ten, the other nine cancelled with it
    # Now: the claim's walk (50), and the sessions' other requests through the session index, read once per
    # request the batch changes (10 a session here).
    assert sum(read[-1].values()) < 30 * batch, read[-1]
    by_state = {k: v for k, v in read[-1].items() if "state" in k}
    assert sum(by_state.values()) < 2 * batch, by_state
    ids = [f"r{i}" for i in range(1_000, 1_000 + batch)]  # five whole sessions, by id
    with _index_reads(u) as read:
        got, _ = u.store.approvals.expire_batch(now, only=ids)
    assert len(got) == batch // 10
    by_state = {k: v for k, v in read[-1].items() if "state" in k}
    assert sum(by_state.values()) < 2 * batch, by_state


@contextlib.contextmanager
def _index_blocks(u: Any) -> Iterator[list[dict[str, int]]]:
    """The blocks each transaction fetched from the approval requests' indexes whose key has ``timeout_at``
    (``due``) and from their primary key (``pkey``): pg_stat_get_xact_blocks_fetched when the transaction begins and
    just before it commits (the backend's counts not yet reported include earlier transactions'). An index
    insertion descends the index, so it fetches blocks of it."""
    fetched: list[dict[str, int]] = []
    began: dict[str, int] = {}

    def counts(conn: Any) -> dict[str, int]:
        cur = conn.connection.dbapi_connection.execute(
            "SELECT CASE WHEN i.indisprimary THEN 'pkey' ELSE 'due' END, "
            "sum(pg_stat_get_xact_blocks_fetched(c.oid)) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE i.indrelid = 'undolog_approval_requests'::regclass AND (i.indisprimary OR "
            "pg_get_indexdef(i.indexrelid) LIKE '%timeout_at%') GROUP BY 1")
        return {kind: int(k) for kind, k in cur.fetchall()}

    def begin(conn: Any) -> None:
        began.clear()
        began.update(counts(conn))

    def commit(conn: Any) -> None:
        fetched.append({k: v - began.get(k, 0) for k, v in counts(conn).items()})

    sa.event.listen(internals(u).sql_engine, "begin", begin)
    sa.event.listen(internals(u).sql_engine, "commit", commit)
    try:
        yield fetched
    finally:
        sa.event.remove(internals(u).sql_engine, "begin", begin)
        sa.event.remove(internals(u).sql_engine, "commit", commit)


@pytest.mark.postgres_only
def test_settling_a_due_request_writes_nothing_into_the_due_index(db):
    """The sweep's due index holds pending requests only (``ix_undolog_approval_due``, revision 0011). It was
    ``(state, timeout_at)`` over every request: each request a batch timed out or cancelled took one more entry
    there, which no query reads (per batch of 250 here: 513 blocks of that index fetched, two per insertion). Now
    a settled row is outside the index's predicate: the batch fetches only the blocks of the claim's walk (6). The
    primary key, which every such update still writes, shows the count sees insertions. Counted, not timed."""
    u = db.open()
    u.register(refund, undo_refund)
    n = 2_000
    _seed_bulk(u, n)
    _seed_due(u, n)
    with _index_blocks(u) as fetched:
        got, _ = u.store.approvals.expire_batch(utcnow(), limit=EXPIRE_BATCH)
    assert len(got) == EXPIRE_BATCH // 10  # one timed out per session of ten, the nine others cancelled with it
    assert fetched[-1]["pkey"] >= EXPIRE_BATCH, fetched[-1]  # an entry per row changed (and the lookups by key)
    assert fetched[-1]["due"] < 20, fetched[-1]  # the claim's walk over 250 entries: a few leaf pages
    # And the index the claim walked is the partial one, in the plan PostgreSQL may cache for the sweep.
    plan = _plan(u, u.store.for_update(u.store.approvals.due_claim(utcnow()), skip_locked=True), binds=True)
    assert "ix_undolog_approval_due" in plan and "Sort" not in plan, plan
    with internals(u).read() as conn:
        left = conn.execute(sa.select(sa.func.count()).select_from(t.approval_requests)
                            .where(t.approval_requests.c.state == "pending")).scalar_one()
    assert left == n - EXPIRE_BATCH
