"""The storage conformance suite: what every backend must do. CI runs it on SQLite and on PostgreSQL."""

from __future__ import annotations

import datetime as dt
import threading
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core import ApprovalRecord, AwaitingApproval, OrgPolicy, UndoLog, errors
from undolog_core._audit import verify
from undolog_core.storage import (
    ApprovalsSQL,
    AuditSQL,
    PolicySQL,
    RegistrySQL,
    SessionsSQL,
    Storage,
    open_storage,
)
from undolog_core.storage import migrate as _migrate
from undolog_core.storage import schema as t
from undolog_core.storage.audit import GENESIS_HASH, event_hash
from undolog_core.storage.base import Store, utcnow
from undolog_core.storage.records import (
    ContractRevision,
    EffectState,
    RequestState,
    SessionState,
    StateChange,
)
from undolog_core.testing import internals

CORE_TABLES = {
    "undolog_sessions", "undolog_effect_log", "undolog_undo_stack", "undolog_approval_requests",
    "undolog_approval_events", "undolog_tool_registry", "undolog_outbox", "undolog_org_policy", "undolog_audit_head",
    "undolog_recovery_cursor",
}


def test_migrations_create_every_table_and_are_idempotent(db):
    u = db.open()
    with internals(u).read() as c:
        names = set(sa.inspect(c).get_table_names())
    assert CORE_TABLES <= names
    assert _migrate.current(internals(u).sql_engine) == _migrate.head()
    db.open()  # a second open is a no-op
    with internals(u).read() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(t.org_policy)).scalar() == 1


def test_concurrent_first_opens_migrate_once(db):
    errs: list[BaseException] = []

    def opener() -> None:
        try:
            db.open()
        except BaseException as exc:  # noqa: BLE001
            errs.append(exc)

    threads = [threading.Thread(target=opener) for _ in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errs == []
    with db.opened[-1].store.read() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(t.org_policy)).scalar() == 1


def test_durability_settings(undolog):
    with internals(undolog).sql_engine.connect() as c:
        if internals(undolog).is_postgres:
            assert c.exec_driver_sql("SHOW synchronous_commit").scalar() == "on"
        else:
            assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL
    with undolog.store.fast.connect() as c:
        if internals(undolog).is_postgres:
            assert c.exec_driver_sql("SHOW synchronous_commit").scalar() == "off"
        else:
            # NORMAL (no fsync per commit, as OFF, but a checkpoint on it fsyncs): for the fast commit mark only
            assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 1


def _session_row(sid: str, **kw):
    now = utcnow()
    return {"session_id": sid, "state": "active", "tool_calls_total": 0, "on_failure": "rollback",
            "pinned_revisions": {}, "created_at": now, "updated_at": now, **kw}


def test_times_round_trip_as_aware_utc_to_the_microsecond(undolog):
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.timezone(dt.timedelta(hours=5)))
    with internals(undolog).write() as c:
        c.execute(t.sessions.insert().values(**_session_row("s", created_at=when)))
    got = undolog.sessions.get("s").created_at
    assert got == when and got.tzinfo == dt.UTC
    with pytest.raises(sa.exc.StatementError, match="naive"):
        with internals(undolog).write() as c:
            c.execute(t.sessions.insert().values(**_session_row("n", created_at=dt.datetime(2026, 1, 1))))


def test_json_round_trip(undolog):
    doc = {"s": "ü ✓", "n": 1.5, "i": 2**53, "l": [1, None, True], "nested": {"a": {"b": []}}}
    with internals(undolog).write() as c:
        c.execute(t.sessions.insert().values(**_session_row("j", pinned_revisions=doc)))
    assert undolog.sessions.get("j").pinned_revisions == doc


@pytest.mark.parametrize("column,value", [("state", "exploded"), ("on_failure", "shrug")])
def test_check_constraints(undolog, column, value):
    with pytest.raises(sa.exc.IntegrityError):
        with internals(undolog).write() as c:
            c.execute(t.sessions.insert().values(**_session_row("x", **{column: value})))


def test_call_id_is_unique_per_session(undolog):
    now = utcnow()
    with internals(undolog).write() as c:
        c.execute(t.sessions.insert().values(**_session_row("s")))
    row = {"session_id": "s", "call_id": "c", "tool_name": "x", "tool_revision": 1, "tier": "irreversible",
           "state": "awaiting_approval", "args_snapshot": {}, "args_digest": "d", "recovery_attempts": 0,
           "created_at": now, "updated_at": now}
    with internals(undolog).write() as c:
        c.execute(t.effect_log.insert().values(effect_id="e1", **row))
    with pytest.raises(sa.exc.IntegrityError):
        with internals(undolog).write() as c:
            c.execute(t.effect_log.insert().values(effect_id="e2", **row))
    with pytest.raises(sa.exc.IntegrityError):  # effects belong to a session that exists
        with internals(undolog).write() as c:
            c.execute(t.effect_log.insert().values(effect_id="e3", **{**row, "session_id": "ghost", "call_id": "z"}))


def test_a_failed_transaction_leaves_nothing_behind(undolog):
    with pytest.raises(RuntimeError):
        with internals(undolog).write() as c:
            c.execute(t.sessions.insert().values(**_session_row("half")))
            raise RuntimeError("crash mid-transaction")
    with pytest.raises(errors.SessionNotFound):
        undolog.sessions.get("half")


def test_concurrent_appends_keep_every_chain_intact(undolog):
    def writer(k: int) -> None:
        for i in range(10):
            with internals(undolog).write() as c:
                undolog.store.audit.append_event_in(c, subject=f"w{k}", action="test", actor=f"w{k}", payload={"i": i})

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    report = undolog.verify_audit()
    assert report.ok and report.events_checked == 40


def test_a_transaction_holding_a_chain_does_not_stop_another_from_appending(undolog):
    """Issue 13: concurrent writers do not queue on one head row. One transaction appends and stays open; another
    appends and commits meanwhile (on PostgreSQL to another chain, without waiting; SQLite has one writer at a time
    and is checked for the chain alone). Both chains verify, and a transaction's appends all go to one chain."""
    st = _storage(undolog)
    if not internals(undolog).is_postgres:
        with internals(undolog).write() as c:
            ids = [st.audit.append_event_in(c, subject="s", action="test", actor="a", payload={"i": i}) for i in range(3)]
        assert ids == [ids[0], ids[0] + 1, ids[0] + 2] and verify(st).ok
        return
    holding = threading.Event()
    release = threading.Event()

    def slow() -> None:
        with internals(undolog).write() as c:
            st.audit.append_event_in(c, subject="slow", action="test.slow", actor="a", payload={})
            holding.set()
            release.wait(10)
            st.audit.append_event_in(c, subject="slow", action="test.slow2", actor="a", payload={})

    th = threading.Thread(target=slow)
    th.start()
    assert holding.wait(10)
    try:
        with internals(undolog).write() as c:
            # Would wait for the slow transaction's commit if it had to lock the same head: 2 s is plenty to fail.
            c.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
            st.audit.append_event_in(c, subject="fast", action="test.fast", actor="b", payload={})
    finally:
        release.set()
        th.join()
    with st.audit.chain() as chain:
        by_action = {ev.action: n for n, ev in chain.events()}
    assert by_action["test.slow"] == by_action["test.slow2"] != by_action["test.fast"]
    report = verify(st)
    assert report.ok, report.problem
    assert len([h for h in report.heads if h[1]]) >= 2


def test_bad_urls_are_clear_errors(tmp_path):
    with pytest.raises(errors.ConfigurationError, match="unsupported database URL"):
        Store("mysql://x")
    with pytest.raises(errors.ConfigurationError, match="in-memory"):
        Store("sqlite:///:memory:")
    with pytest.raises(errors.ConfigurationError, match="does not exist"):
        Store(f"sqlite:///{tmp_path}/missing/dir/x.db")
    with pytest.raises(errors.ConfigurationError, match="lease_seconds"):
        UndoLog(Store(f"sqlite:///{tmp_path}/ok.db"), lease_seconds=0)


def test_default_url_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("UNDOLOG_DATABASE_URL", f"sqlite:///{tmp_path}/env.db")
    assert Store().url.endswith("env.db")
    monkeypatch.delenv("UNDOLOG_DATABASE_URL")
    monkeypatch.chdir(tmp_path)
    assert Store().url == "sqlite:///undolog.db"
    assert Store("postgresql://u@h/db").url == "postgresql+psycopg://u@h/db"


def test_a_compensable_effect_is_never_stored_without_its_undo_entry(undolog):
    from tests.support.toolkit import setup

    _world, tools = setup(undolog)
    s = undolog.session(agent_id="pairs")
    d = undolog.engine.intercept(s.id, "send_refund_email", {"user_id": "u1", "amount": 3})
    with internals(undolog).read() as c:
        pair = c.execute(
            sa.select(t.effect_log.c.seq, t.undo_stack.c.undo_id, t.undo_stack.c.compensation_name,
                      t.undo_stack.c.compensation_version)
            .select_from(t.effect_log.join(t.undo_stack, t.undo_stack.c.undo_id == t.effect_log.c.seq))
            .where(t.effect_log.c.effect_id == d.effect_id)
        ).one()
    assert pair.undo_id == pair.seq and (pair.compensation_name, pair.compensation_version) == ("cancel_refund_email", 1)
    # The one-statement pre-write of a session that does not take writes writes neither row.
    now = utcnow()
    assert undolog.engine.hot.prewrite(
        "no-such-session", 0, "e-orphan", "c", "send_refund_email", 1, "{}", "d", "o", now.timestamp(),
        now.timestamp() + 30, "cancel_refund_email", 1,
    ) is False
    # The general path (here: the first call of a tool registered after the session began, which pins it in the
    # same transaction) writes both rows too, on every database; no database-level trigger is needed for that
    # (SQLite's was replaced by the pre-write view in revision 0010, PostgreSQL never had one).
    from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("cf_late_undo"))
    def cf_late_tool(n: int) -> int:
        return n

    @compensation("cf_late_undo")
    def cf_late_undo(ctx: Any) -> None:
        return None

    undolog.register(cf_late_tool, cf_late_undo)
    late = undolog.engine.intercept(s.id, "cf_late_tool", {"n": 1})
    with internals(undolog).read() as c:
        comp = c.execute(
            sa.select(t.undo_stack.c.compensation_name)
            .select_from(t.effect_log.join(t.undo_stack, t.undo_stack.c.undo_id == t.effect_log.c.seq))
            .where(t.effect_log.c.effect_id == late.effect_id)
        ).scalar_one()
    assert comp == "cf_late_undo"
    with internals(undolog).read() as c:
        effects = c.execute(sa.select(sa.func.count()).select_from(t.effect_log)
                            .where(t.effect_log.c.effect_id.in_(["e-orphan", "e-unknown"]))).scalar()
        orphans = c.execute(sa.select(sa.func.count()).select_from(
            t.undo_stack.outerjoin(t.effect_log, t.effect_log.c.seq == t.undo_stack.c.undo_id))
            .where(t.effect_log.c.seq.is_(None))).scalar()
    assert (effects, orphans) == (0, 0)


# -- the Storage interface: every service's statements, called directly --------------------------------------------
# These tests are the contract of ``undolog_core.storage.Storage`` for the approvals, audit, registry, policy and
# session statements; they run unchanged on SQLite and PostgreSQL.


def _storage(u: UndoLog) -> Storage:
    assert isinstance(u.store, Storage)
    return u.store


def _awaiting(u: UndoLog, session_id: str, user: str = "u1", call_id: str | None = None) -> ApprovalRecord:
    """A real pending approval request, made by the engine for an IRREVERSIBLE call."""
    d = u.engine.intercept(session_id, "delete_user_account", {"user_id": user}, call_id=call_id)
    assert isinstance(d, AwaitingApproval)
    rec = _storage(u).approvals.get_request(d.approval_request_id)
    assert rec is not None and rec.state is RequestState.PENDING
    return rec


def _world(u: UndoLog) -> None:
    from tests.support.toolkit import setup

    setup(u)


def _count(u: UndoLog, table: sa.Table, *where: Any) -> int:
    with internals(u).read() as c:
        return int(c.execute(sa.select(sa.func.count()).select_from(table).where(*where)).scalar_one())


def test_storage_is_one_object_with_every_service_statement(db):
    u = db.open()
    st = _storage(u)
    assert isinstance(st.approvals, ApprovalsSQL) and isinstance(st.sessions, SessionsSQL)
    assert isinstance(st.audit, AuditSQL) and isinstance(st.registry, RegistrySQL)
    assert isinstance(st.policy, PolicySQL)
    assert isinstance(st, Store)
    assert st.schema_revision() == Storage.head_revision()
    fresh = open_storage(db.url, schema=db.schema)
    try:
        assert isinstance(fresh, Storage) and fresh.policy.get() == st.policy.get()
    finally:
        fresh.dispose()
    with pytest.raises(errors.ConfigurationError, match="Storage"):
        UndoLog(Store(db.url, schema=db.schema))


def test_approve_moves_request_effect_and_session_in_one_transaction(undolog):
    _world(undolog)
    st = _storage(undolog)
    s = undolog.session(agent_id="conf")
    rec = _awaiting(undolog, s.id)
    assert st.sessions.get_session(s.id).state is SessionState.AWAITING_APPROVAL  # type: ignore[union-attr]
    outbox_before = _count(undolog, t.outbox)
    changes = st.approvals.decide_request(rec.approval_request_id, action="approve", approver="ana", reason="ok", now=utcnow())
    assert changes == [StateChange(s.id, SessionState.ACTIVE)]
    got = st.approvals.get_request(rec.approval_request_id)
    assert got is not None and got.state is RequestState.APPROVED and got.decided_by == "ana"
    assert got.approved_args == rec.proposed_args
    assert st.sessions.get_session(s.id).state is SessionState.ACTIVE  # type: ignore[union-attr]
    (effect,) = st.sessions.session_effects(s.id)
    assert effect["state"] == EffectState.APPROVED
    requested, event = st.approvals.request_events(rec.approval_request_id)  # the engine audited the request itself
    assert requested.action == "requested"
    assert (event.action, event.actor, event.payload) == ("approve", "ana", {"reason": "ok"})
    with internals(undolog).read() as c:
        types = c.execute(sa.select(t.outbox.c.event_type).order_by(t.outbox.c.outbox_id)).scalars().all()
    assert types[outbox_before:] == ["approval.decided"]
    assert st.approvals.list_requests(state=RequestState.APPROVED, session_id=s.id) == [got]
    assert st.approvals.list_requests(state=RequestState.PENDING, session_id=s.id) == []


def test_modify_binds_the_edited_arguments_and_audits_both_sets(undolog):
    _world(undolog)
    st = _storage(undolog)
    s = undolog.session()
    rec = _awaiting(undolog, s.id)
    st.approvals.decide_request(rec.approval_request_id, action="modify", approver="ana", reason=None,
                      approved_args={"user_id": "u2"}, now=utcnow())
    got = st.approvals.get_request(rec.approval_request_id)
    assert got is not None and got.approved_args == {"user_id": "u2"} and got.state is RequestState.APPROVED
    _, event = st.approvals.request_events(rec.approval_request_id)
    assert event.payload == {"reason": None, "args": {"user_id": "u2"}, "proposed_args": {"user_id": "u1"}}
    with pytest.raises(errors.UndoLogError, match="edited arguments"):
        st.approvals.decide_request(rec.approval_request_id, action="modify", approver="ana", reason=None, now=utcnow())


def test_reject_halts_the_session_and_cancels_its_other_requests(undolog):
    _world(undolog)
    st = _storage(undolog)
    s = undolog.session()
    first = _awaiting(undolog, s.id, "u1", call_id="c1")
    second = _awaiting(undolog, s.id, "u2", call_id="c2")
    changes = st.approvals.decide_request(first.approval_request_id, action="reject", approver="bo", reason="no", now=utcnow())
    assert changes == [StateChange(s.id, SessionState.HALTED)]
    sess = st.sessions.get_session(s.id)
    assert sess is not None and sess.state is SessionState.HALTED and "rejected by bo: no" in (sess.halted_reason or "")
    assert st.approvals.get_request(first.approval_request_id).state is RequestState.REJECTED  # type: ignore[union-attr]
    other = st.approvals.get_request(second.approval_request_id)
    assert other is not None and other.state is RequestState.CANCELLED and other.decided_by == "undolog"
    assert [e.action for e in st.approvals.request_events(second.approval_request_id)] == ["requested", "cancel"]
    states = {e["call_id"]: e["state"] for e in st.sessions.session_effects(s.id)}
    assert states == {"c1": EffectState.REJECTED, "c2": EffectState.CANCELLED}
    with internals(undolog).read() as c:
        types = c.execute(sa.select(t.outbox.c.event_type)).scalars().all()
    assert "session.halted" in types and "approval.decided" in types
    # A settled request is not cancelled twice, and no second event is written for it.
    with internals(undolog).write() as c:
        assert st.approvals.cancel_request_in(c, second.approval_request_id, second.effect_id, "again", utcnow()) is False
    assert len(st.approvals.request_events(second.approval_request_id)) == 2


def test_a_request_is_decided_once_when_two_decisions_race(db):
    u = db.open()
    _world(u)
    s = u.session()
    rec = _awaiting(u, s.id)
    # Two UndoLogs: two pools, as two processes would have (on SQLite the file's write lock decides, on
    # PostgreSQL the request's row lock).
    stores = [_storage(u), _storage(db.open())]
    barrier = threading.Barrier(len(stores))
    outcomes: list[str] = []

    def decide(st: Storage, action: str) -> None:
        barrier.wait()
        try:
            st.approvals.decide_request(rec.approval_request_id, action=action, approver=action, reason="race", now=utcnow())
            outcomes.append(action)
        except errors.ApprovalAlreadyDecided:
            outcomes.append("refused")

    threads = [threading.Thread(target=decide, args=(st, a)) for st, a in zip(stores, ("approve", "reject"), strict=True)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(outcomes) == 2 and outcomes.count("refused") == 1
    winner = next(o for o in outcomes if o != "refused")
    got = stores[0].approvals.get_request(rec.approval_request_id)
    assert got is not None and got.state is (RequestState.APPROVED if winner == "approve" else RequestState.REJECTED)
    assert [e.action for e in stores[0].approvals.request_events(rec.approval_request_id)] == ["requested", winner]
    assert u.verify_audit().ok


def test_expiry_applies_the_policy_once(undolog):
    _world(undolog)
    st = _storage(undolog)
    later = utcnow() + dt.timedelta(days=40)  # past any timeout the policy allows
    s1 = undolog.session()
    timed = _awaiting(undolog, s1.id)
    assert st.approvals.due_request_ids(utcnow()) == []
    assert st.approvals.due_request_ids(later) == [timed.approval_request_id]
    assert st.approvals.expire_request(timed.approval_request_id, utcnow()) is None  # not due yet: nothing happens
    assert st.approvals.expire_request(timed.approval_request_id, later) == [StateChange(s1.id, SessionState.HALTED)]
    assert st.approvals.expire_request(timed.approval_request_id, later) is None  # applied exactly once
    got = st.approvals.get_request(timed.approval_request_id)
    assert got is not None and got.state is RequestState.TIMED_OUT and got.decided_by == "undolog:timeout"
    assert st.sessions.get_session(s1.id).state is SessionState.HALTED  # type: ignore[union-attr]

    with internals(undolog).write() as c:
        c.execute(t.org_policy.update().values(auto_approve_on_timeout=True))
    s2 = undolog.session()
    auto = _awaiting(undolog, s2.id)
    changes = st.approvals.expire_request(auto.approval_request_id, later)
    assert changes == [StateChange(s2.id, SessionState.ACTIVE)]
    got = st.approvals.get_request(auto.approval_request_id)
    assert got is not None and got.state is RequestState.AUTO_APPROVED and got.approved_args == auto.proposed_args
    assert [(e.action, e.actor) for e in st.approvals.request_events(auto.approval_request_id)][1:] == [
        ("auto_approve", "undolog:timeout-policy")
    ]


def test_audit_append_and_its_outbox_rows_commit_together_or_not_at_all(undolog):
    st = _storage(undolog)
    first = st.audit.append_event(subject="s", action="test.one", actor="a", payload={"n": 1})
    with internals(undolog).write() as c:
        second = st.audit.append_event_in(c, subject="s", action="test.two", actor="b", payload={"n": 2},
                                    outbox=[("test.happened", {"n": 2})])
    assert second == first + 1
    assert _count(undolog, t.outbox, t.outbox.c.event_type == "test.happened") == 1
    with pytest.raises(RuntimeError):
        with internals(undolog).write() as c:
            st.audit.append_event_in(c, subject="s", action="test.lost", actor="c", payload={},
                               outbox=[("test.lost", {})])
            raise RuntimeError("the caller's transaction fails after the append")
    assert _count(undolog, t.approval_events, t.approval_events.c.action == "test.lost") == 0
    assert _count(undolog, t.outbox, t.outbox.c.event_type == "test.lost") == 0
    # The chain as stored recomputes, and the head names its last event. A lone writer appends to chain 1.
    with st.audit.chain() as chain:
        found = list(chain.events())
        heads = chain.heads()
    assert {n for n, _ in found} == {1}
    events = [ev for _, ev in found]
    head = (heads[0].last_event_id, heads[0].last_hash)
    prev = GENESIS_HASH
    for ev in events:
        assert ev.prev_hash == prev
        assert ev.hash == event_hash(event_id=ev.event_id, approval_request_id=ev.approval_request_id,
                                     subject=ev.subject, action=ev.action, actor=ev.actor, payload=ev.payload,
                                     created_at=ev.created_at, prev_hash=ev.prev_hash)
        prev = ev.hash
    assert head == (events[-1].event_id, events[-1].hash) and events[-1].action == "test.two"
    assert verify(st).ok


def test_registry_revisions_are_immutable(undolog):
    st = _storage(undolog)
    now = utcnow()
    v1 = ContractRevision("tool_x", "safe", "f" * 64, {"args_schema": {"type": "object"}, "v": 1}, None, None)
    v2 = ContractRevision("tool_x", "compensable", "e" * 64, {"args_schema": {"type": "object"}, "v": 2}, "undo_x", 1)
    (r1,), changes = st.registry.register([v1], actor="ci", now=now)
    assert (r1.revision, r1.created, changes) == (1, True, [])
    (again,), _ = st.registry.register([v1], actor="someone-else", now=utcnow())
    assert (again.revision, again.created) == (1, False)  # the same contract is the same revision
    (r2,), _ = st.registry.register([v2], actor="ci", now=utcnow())
    assert (r2.revision, r2.created) == (2, True)
    history = st.registry.history("tool_x")
    assert [(h["revision"], h["fingerprint"], h["previous_fingerprint"], h["registered_by"]) for h in history] == [
        (1, "f" * 64, None, "ci"), (2, "e" * 64, "f" * 64, "ci")
    ]
    assert st.registry.contract_of("tool_x", 1) == v1.contract and st.registry.contract_of("tool_x", 2) == v2.contract
    assert st.registry.contract_of("tool_x", 3) is None
    assert st.registry.arguments_jsonschema_of("tool_x", 2) == {"type": "object"} and st.registry.arguments_jsonschema_of("x", 1) is None
    # Going back to the first contract is a third revision, never a rewrite of the first.
    (r3,), _ = st.registry.register([v1], actor="ci", now=utcnow())
    assert r3.revision == 3 and st.registry.history("tool_x")[0] == history[0]


def test_a_new_contract_cancels_the_approvals_bound_to_the_old_one(undolog):
    _world(undolog)
    st = _storage(undolog)
    s = undolog.session()
    rec = _awaiting(undolog, s.id)
    changed = ContractRevision("delete_user_account", "irreversible", "0" * 64, {"args_schema": {}}, None, None)
    (rev,), changes = st.registry.register([changed], actor="ci", now=utcnow())
    assert rev.revision == 2
    assert changes == [StateChange(s.id, SessionState.ACTIVE)]
    got = st.approvals.get_request(rec.approval_request_id)
    assert got is not None and got.state is RequestState.CANCELLED and "changed" in (got.decision_reason or "")
    assert st.sessions.get_session(s.id).state is SessionState.ACTIVE  # type: ignore[union-attr]


def test_policy_is_one_row_changed_with_an_audit_event(undolog):
    st = _storage(undolog)
    before = st.policy.get()
    was, now_is = st.policy.set({"context_calls": 3}, actor="admin", now=utcnow())
    assert was == before and now_is == OrgPolicy(before.approval_timeout_seconds, before.auto_approve_on_timeout, 3)
    assert st.policy.get() == now_is
    with internals(undolog).read() as c:
        assert st.policy.get_in(c) == now_is
        event = c.execute(sa.select(t.approval_events).where(t.approval_events.c.action == "policy.set")).one()
    assert event.actor == "admin" and event.subject == "policy"
    with pytest.raises(sa.exc.IntegrityError):
        with internals(undolog).write() as c:
            c.execute(t.org_policy.insert().values(policy_id=2, approval_timeout_seconds=1,
                                                   auto_approve_on_timeout=False, context_calls=1,
                                                   updated_at=utcnow(), updated_by="x"))
    assert _count(undolog, t.org_policy) == 1


def test_session_halt_resume_and_state_changes(undolog):
    st = _storage(undolog)
    s = undolog.session(agent_id="conf", session_id="conf-halt")  # an id given: in the store at once
    assert st.sessions.get_session("nope") is None
    with internals(undolog).write() as c:
        st.sessions.halt_in(c, s.id, "a person must look", utcnow())
    rec = st.sessions.get_session(s.id)
    assert rec is not None and rec.state is SessionState.HALTED and rec.halted_reason == "a person must look"
    assert st.sessions.list_sessions(state=SessionState.HALTED) == [rec]
    assert _count(undolog, t.outbox, t.outbox.c.event_type == "session.halted") == 1
    changes = st.sessions.resume_session(s.id, actor="ana", reason="looked", now=utcnow())
    assert changes == [StateChange(s.id, SessionState.ACTIVE)]  # no request pending: it stays active
    rec = st.sessions.get_session(s.id)
    assert rec is not None and rec.state is SessionState.ACTIVE and rec.halted_reason is None
    with pytest.raises(errors.InvalidSessionState):
        st.sessions.resume_session(s.id, actor="ana", reason=None, now=utcnow())
    with pytest.raises(errors.SessionNotFound):
        st.sessions.resume_session("nope", actor="ana", reason=None, now=utcnow())
    with internals(undolog).read() as c:
        resumes = c.execute(sa.select(t.approval_events.c.payload)
                            .where(t.approval_events.c.action == "session.resume")).scalars().all()
    assert resumes == ['{"reason":"looked","was_halted_because":"a person must look"}']
    # A state change is conditional on the states it is allowed from.
    assert st.sessions.set_session_state(s.id, SessionState.COMPLETED, allowed=[SessionState.HALTED], now=utcnow()) is False
    assert st.sessions.set_session_state(s.id, SessionState.COMPLETED, allowed=[SessionState.ACTIVE], now=utcnow()) is True
    # An ended session is not halted again.
    with internals(undolog).write() as c:
        st.sessions.halt_in(c, s.id, "too late", utcnow())
    assert st.sessions.get_session(s.id).state is SessionState.COMPLETED  # type: ignore[union-attr]


def test_session_revalidate_repins_and_audits(undolog):
    st = _storage(undolog)
    s = undolog.session(session_id="conf-revalidate")  # an id given: in the store at once
    st.registry.register([ContractRevision("tool_y", "safe", "a" * 64, {"args_schema": {}}, None, None)],
                          actor="ci", now=utcnow())
    st.registry.register([ContractRevision("tool_y", "safe", "b" * 64, {"args_schema": {}}, None, None)],
                          actor="ci", now=utcnow())
    changed, pins = st.sessions.revalidate_session(s.id, actor="ana", current={}, now=utcnow())
    assert changed == {"tool_y": {"from": None, "to": 2}} and pins["tool_y"] == 2
    assert st.sessions.get_session(s.id).pinned_revisions == pins  # type: ignore[union-attr]
    changed, pins = st.sessions.revalidate_session(s.id, actor="ana", current={"tool_y": 1}, now=utcnow())
    assert changed == {"tool_y": {"from": 2, "to": 1}} and pins == {"tool_y": 1}
    assert _count(undolog, t.approval_events, t.approval_events.c.action == "session.revalidate") == 2
    with pytest.raises(errors.SessionNotFound):
        st.sessions.revalidate_session("nope", actor="ana", current={}, now=utcnow())


def test_refresh_awaiting_follows_the_pending_requests(undolog):
    _world(undolog)
    st = _storage(undolog)
    s = undolog.session()
    rec = _awaiting(undolog, s.id)
    with internals(undolog).write() as c:
        assert st.sessions.refresh_changes_in(c, s.id, utcnow()) == []  # already awaiting: nothing changes
        assert st.approvals.cancel_pending_in(c, s.id, "test", utcnow()) == 1
        assert st.sessions.refresh_changes_in(c, s.id, utcnow()) == [StateChange(s.id, SessionState.ACTIVE)]
        assert st.sessions.refresh_changes_in(c, s.id, utcnow()) == []
    assert st.sessions.get_session(s.id).state is SessionState.ACTIVE  # type: ignore[union-attr]
    assert st.approvals.get_request(rec.approval_request_id).state is RequestState.CANCELLED  # type: ignore[union-attr]


def test_state_enums_are_the_stored_strings():
    assert t.SESSION_STATES == ("active", "awaiting_approval", "halted", "rolling_back", "rolled_back", "completed")
    assert t.REQUEST_STATES == ("pending", "approved", "rejected", "timed_out", "auto_approved", "cancelled", "expired",
                                "responded")
    assert t.UNDO_STATES == ("armed", "compensating", "compensated", "compensation_failed")
    assert set(t.EFFECT_STATES) == {s.value for s in EffectState} and "released" in t.EFFECT_STATES
    assert "expired" in t.EFFECT_STATES
