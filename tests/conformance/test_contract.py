"""The written storage contract (``undolog_core/storage/contract.py``) held against each database's repositories.

Two kinds of test: the shape (every repository ``Storage`` exposes satisfies its Protocol, method by method with
the same parameters, and the store satisfies ``StoreProtocol``), and the guarantees the Protocols' docstrings
write down (which transaction a method joins, one place per write, who claims an outbox row). Run on both
databases (``storage`` by directory).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core import ToolTier, UndoLog, compensation, errors, undolog_tool
from undolog_core._outbox import OutboxEvent
from undolog_core.storage import Storage, contract
from undolog_core.storage import schema as t
from undolog_core.storage.audit import PendingEvent
from undolog_core.storage.base import new_id, utcnow
from undolog_core.storage.records import ContractRevision
from undolog_core.storage.schema import EffectState


def _storage(u: UndoLog) -> Storage:
    assert isinstance(u.store, Storage)
    return u.store


def _count(st: Storage, table: sa.Table) -> int:
    with st.read() as c:
        return int(c.execute(sa.select(sa.func.count()).select_from(table)).scalar_one())


def _protocol_methods(proto: type[Any]) -> list[str]:
    return sorted(n for n, v in vars(proto).items()
                  if not n.startswith("_") and (callable(v) or isinstance(v, property)))


def _parameters(fn: Any) -> list[tuple[str, Any, bool]]:
    # (name, kind, has a default) without ``self``: a staticmethod implementing a method matches it.
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in params]


class _Boom(Exception):
    pass


# -- the shape -------------------------------------------------------------------------------------


def test_every_repository_the_storage_exposes_satisfies_its_protocol(db):
    st = _storage(db.open())
    assert isinstance(st, contract.StoreProtocol)
    for name, proto in contract.REPOSITORIES.items():
        repo = getattr(st, name)
        assert isinstance(repo, proto), f"storage.{name} ({type(repo).__name__}) does not satisfy {proto.__name__}"


@pytest.mark.parametrize("name", sorted(contract.REPOSITORIES))
def test_each_repository_method_has_the_parameters_its_protocol_writes_down(db, name):
    st = _storage(db.open())
    proto, repo = contract.REPOSITORIES[name], getattr(st, name)
    methods = _protocol_methods(proto)
    assert methods, f"{proto.__name__} declares no method"
    for method in methods:
        want, got = getattr(proto, method), getattr(repo, method)
        assert _parameters(got) == _parameters(want), f"storage.{name}.{method}: {inspect.signature(got)} " \
                                                      f"differs from the contract's {inspect.signature(want)}"
    # What a repository offers beyond its contract is private: callers code against the Protocol.
    public = sorted(n for n in dir(repo) if not n.startswith("_"))
    assert public == methods, f"storage.{name} has public methods outside {proto.__name__}: " \
                              f"{sorted(set(public) - set(methods))}"


def test_the_store_protocol_matches_the_store(db):
    st = _storage(db.open())
    for method in _protocol_methods(contract.StoreProtocol):
        if method == "is_postgres":
            assert st.is_postgres == (db.kind == "postgres")
            continue
        assert _parameters(getattr(st, method)) == _parameters(getattr(contract.StoreProtocol, method)), method


def test_repositories_are_listed_once_and_hold_the_same_store(db):
    st = _storage(db.open())
    repos = [getattr(st, n) for n in contract.REPOSITORIES]
    assert len({id(r) for r in repos}) == len(repos)
    assert all(r._store is st for r in repos)
    # The repositories that write another's rows hold that very instance (one place per write).
    assert st.audit._outbox is st.outbox
    assert st.policy._audit is st.audit and st.archive._audit is st.audit
    assert st.sessions._audit is st.audit and st.sessions._outbox is st.outbox


# -- the guarantees --------------------------------------------------------------------------------


def test_an_in_method_commits_or_rolls_back_with_the_caller(db):
    st = _storage(db.open())
    events, outbox = _count(st, t.approval_events), _count(st, t.outbox)
    with pytest.raises(_Boom), st.tx() as conn:
        st.audit.append_event_in(conn, subject="s", action="test.lost", actor="a", payload={},
                                 outbox=[("test.lost", {"n": 1})])
        st.audit.append_events_in(conn, [PendingEvent("s", "test.lost2", "a", {}, outbox=[("test.lost2", {})])])
        st.outbox.write_in(conn, [("test.lost3", {})])
        st.outbox.write_many_in(conn, [("test.lost4", {}), ("test.lost5", {})])
        raise _Boom
    assert (_count(st, t.approval_events), _count(st, t.outbox)) == (events, outbox)
    with st.tx() as conn:
        st.audit.append_event_in(conn, subject="s", action="test.kept", actor="a", payload={},
                                 outbox=[("test.kept", {"n": 1})])
        st.outbox.write_many_in(conn, [("test.kept2", {}), ("test.kept3", {})])
        st.outbox.write_in(conn, [])
    assert (_count(st, t.approval_events), _count(st, t.outbox)) == (events + 1, outbox + 3)


def test_outbox_drain_hands_each_row_over_once_and_not_at_all_when_the_handler_raises(db):
    st = _storage(db.open())
    st.outbox.drain(lambda conn, events: None, OutboxEvent, limit=10_000)  # what opening queued
    with st.tx() as conn:
        st.outbox.write_in(conn, [("test.one", {"risk_tags": ["pii"]}), ("test.two", {})])

    def fail(conn: Any, events: Sequence[OutboxEvent]) -> None:
        raise _Boom

    with pytest.raises(_Boom):
        st.outbox.drain(fail, OutboxEvent, limit=10)
    seen: list[OutboxEvent] = []
    assert st.outbox.drain(lambda conn, events: seen.extend(events), OutboxEvent, limit=1) == 1
    assert st.outbox.drain(lambda conn, events: seen.extend(events), OutboxEvent, limit=10) == 1
    assert st.outbox.drain(lambda conn, events: seen.extend(events), OutboxEvent, limit=10) == 0
    assert [(e.event_type, e.risk_tags) for e in seen] == [("test.one", ["pii"]), ("test.two", [])]
    assert seen[0].outbox_id < seen[1].outbox_id


def test_a_policy_change_and_its_audit_event_are_one_write(db):
    st = _storage(db.open())
    events = _count(st, t.approval_events)
    before, after = st.policy.set({"context_calls": 7}, actor="admin", now=utcnow())
    assert after.context_calls == 7 and st.policy.get() == after and before != after
    with st.read() as conn:
        assert st.policy.get_in(conn) == after
        last = conn.execute(sa.select(t.approval_events.c.action, t.approval_events.c.actor)
                            .order_by(t.approval_events.c.event_id.desc()).limit(1)).one()
    assert (tuple(last), _count(st, t.approval_events)) == (("policy.set", "admin"), events + 1)
    with pytest.raises(sa.exc.SQLAlchemyError):  # a bad column: neither the row nor the event is written
        st.policy.set({"no_such_setting": 1}, actor="admin", now=utcnow())
    assert st.policy.get() == after and _count(st, t.approval_events) == events + 1


def test_registry_revisions_are_written_once_and_numbered_without_gaps(db):
    st = _storage(db.open())
    now = utcnow()
    v = [ContractRevision("contract_tool", "safe", c * 64, {"args_schema": {"n": i}}, None, None)
         for i, c in enumerate("abc")]
    got = [st.registry.register([x], actor="ci", now=now)[0][0] for x in (v[0], v[0], v[1], v[2], v[2])]
    assert [(r.revision, r.created) for r in got] == [(1, True), (1, False), (2, True), (3, True), (3, False)]
    assert [h["revision"] for h in st.registry.history("contract_tool")] == [1, 2, 3]
    assert st.registry.arguments_jsonschema_of("contract_tool", 2) == {"n": 1}
    assert st.registry.history("no_such_tool") == [] and st.registry.contract_of("no_such_tool", 1) is None


def test_archive_of_nothing_writes_nothing(db):
    st = _storage(db.open())
    events = _count(st, t.approval_events)
    assert st.archive.settled_sessions(utcnow(), limit=10) == []
    batch = st.archive.archive_sessions(["no-such-session"], utcnow(), run_id="r0", actor="ana", now=utcnow())
    assert (batch.sessions, batch.effects, batch.undo_entries) == ([], 0, 0)
    assert st.archive.archived("no-such-session") == [] and _count(st, t.approval_events) == events


def test_audit_chain_reads_one_snapshot_and_locked_heads_are_its_heads(db):
    st = _storage(db.open())
    st.audit.append_event(subject="s", action="test.snap", actor="a", payload={})
    with st.audit.chain() as chain:
        before = list(chain.events())
        st.audit.append_event(subject="s", action="test.after", actor="a", payload={})  # not seen by this snapshot
        heads = chain.heads()
    assert max(e.event_id for _, e in before) == max(h.last_event_id for h in heads)
    locked = st.audit.locked_heads()
    assert max(h.last_event_id for h in locked) == max(h.last_event_id for h in heads) + 1


def test_a_decision_on_no_request_raises_and_writes_nothing(db):
    st = _storage(db.open())
    events = _count(st, t.approval_events)
    with pytest.raises(errors.ApprovalNotFound):
        st.approvals.decide_request("no-such-request", action="approve", approver="ana", reason=None, now=utcnow())
    assert st.approvals.get_request("no-such-request") is None
    assert st.approvals.request_events("no-such-request") == [] and _count(st, t.approval_events) == events
    with st.tx() as conn:
        assert st.approvals.cancel_request_in(conn, "no-such-request", "no-such-effect", "test", utcnow()) is False
        assert st.approvals.cancel_pending_in(conn, "no-such-session", "test", utcnow()) == 0
    assert _count(st, t.approval_events) == events


# -- store.sessions ----------------------------------------------------------------------------------


def _new_session(st: Storage, sid: str) -> None:
    now = utcnow()
    st.sessions.get_or_create_session(sid, create=True, values={
        "agent_id": "conf", "state": "active", "tool_calls_total": 0, "on_failure": "rollback",
        "pinned_revisions": {}, "created_at": now, "updated_at": now})


def test_sessions_create_once_and_a_second_creator_gets_the_first_row(db):
    st = _storage(db.open())
    _new_session(st, "conf-create")
    again = st.sessions.get_or_create_session("conf-create", create=True, values={
        "agent_id": "other", "state": "active", "on_failure": "halt", "pinned_revisions": {},
        "created_at": utcnow(), "updated_at": utcnow()})
    assert again.agent_id == "conf" and again.on_failure == "rollback"
    assert st.sessions.get_or_create_session("conf-missing", create=False, values={}) is None
    st.sessions.add_call_count("conf-create", 3, missing={})
    rec = st.sessions.get_session("conf-create")
    assert rec is not None and rec.tool_calls_total == 3


def test_sessions_in_methods_commit_or_roll_back_with_the_caller(db):
    st = _storage(db.open())
    _new_session(st, "conf-halt")
    outbox = _count(st, t.outbox)
    with pytest.raises(_Boom), st.tx() as conn:
        st.sessions.halt_in(conn, "conf-halt", "lost", utcnow())
        st.sessions.write_intent_in(conn, "conf-halt", exists=False, actor="a", reason=None, owner="o",
                                    lease_until=utcnow(), now=utcnow())
        raise _Boom
    rec = st.sessions.get_session("conf-halt")
    assert rec is not None and rec.state == "active" and _count(st, t.outbox) == outbox
    with st.tx() as conn:
        assert st.sessions.rollback_intent_in(conn, "conf-halt") is None
        st.sessions.write_intent_in(conn, "conf-halt", exists=False, actor="a", reason=None, owner="o",
                                    lease_until=utcnow(), now=utcnow())
    rec = st.sessions.get_session("conf-halt")
    assert rec is not None and rec.state == "rolling_back"
    # The intent changes owner by compare-and-swap: of two claims from what both saw, one wins.
    assert st.sessions.claim_intent("conf-halt", "o", "r1", utcnow()) is True
    assert st.sessions.claim_intent("conf-halt", "o", "r2", utcnow()) is False
    with st.tx() as conn:
        st.sessions.halt_in(conn, "conf-halt", "kept", utcnow())
        st.sessions.end_intent_in(conn, "conf-halt", owner="r2")  # not its owner: the intent stays
        assert st.sessions.rollback_intent_in(conn, "conf-halt").owner == "r1"
    rec = st.sessions.get_session("conf-halt")
    assert rec is not None and rec.state == "halted" and rec.halted_reason == "kept"
    assert _count(st, t.outbox) == outbox + 1


def test_sessions_state_moves_only_as_the_state_table_allows(db):
    st = _storage(db.open())
    _new_session(st, "conf-state")
    # completed -> active is no move of states.SESSION: nothing is written, whatever ``allowed`` says.
    assert st.sessions.set_session_state("conf-state", "completed", allowed=["active"], now=utcnow()) is True
    assert st.sessions.set_session_state("conf-state", "active", allowed=["completed"], now=utcnow()) is False
    rec = st.sessions.get_session("conf-state")
    assert rec is not None and rec.state == "completed"
    with pytest.raises(errors.InvalidSessionState):
        st.sessions.resume_session("conf-state", actor="a", reason=None, now=utcnow())
    with pytest.raises(errors.SessionNotFound):
        st.sessions.resume_session("conf-nobody", actor="a", reason=None, now=utcnow())
    with st.tx() as conn:  # a session that ended refuses the call's guard and says why
        refused = st.sessions.guard_in(conn, "conf-state", 1, None)
    assert refused is not None and refused.state == "completed"


# -- store.undo --------------------------------------------------------------------------------------


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="contract_undo")
def contract_write(x: int) -> int:
    return x


@compensation("contract_undo")
def contract_undo(ctx: object) -> None:
    return None


def _undo_row(st: Storage, effect_id: str) -> dict[str, Any]:
    with st.read() as c:
        row = c.execute(sa.select(t.undo_stack).where(t.undo_stack.c.effect_id == effect_id)).one()
    return dict(row._mapping)


def _effect_seq(st: Storage, effect_id: str) -> int:
    with st.read() as c:
        return int(c.execute(sa.select(t.effect_log.c.seq).where(t.effect_log.c.effect_id == effect_id))
                   .scalar_one())


def test_the_undo_entry_is_one_row_whichever_path_arms_it(db):
    """The hot path's raw pre-write and ``store.undo.arm_in`` (the general path's) write the same entry."""
    u = db.open()
    u.register(contract_write, contract_undo)
    st = _storage(u)
    spec = u.tool_spec("contract_write")
    sid = u.session(session_id=new_id()).id
    hot_id, general_id = new_id(), new_id()
    now = utcnow()
    assert u.engine.hot.prewrite(sid, 0, hot_id, "c-hot", spec.name, spec.revision, '{"x":1}', "d" * 64,
                                 u.leases.owner, now.timestamp(), now.timestamp() + 30, "contract_undo", 1)
    with st.tx() as conn:
        seq = st.effects.insert_effect_in(conn, {
            "effect_id": general_id, "session_id": sid, "call_id": "c-general", "tool_name": spec.name,
            "tool_revision": spec.revision, "tier": "compensable", "state": "pending", "args_snapshot": {"x": 1},
            "args_digest": "d" * 64, "owner": u.leases.owner, "lease_until": now, "recovery_attempts": 0,
            "created_at": now, "updated_at": now})
        st.undo.arm_in(conn, undo_id=seq, effect_id=general_id, session_id=sid, compensation_name="contract_undo",
                       compensation_version=1, args_snapshot={"x": 1}, now=now)
    hot, general = _undo_row(st, hot_id), _undo_row(st, general_id)
    assert hot["undo_id"] == _effect_seq(st, hot_id) and general["undo_id"] == seq
    for row in (hot, general):
        assert row["created_at"] == row["updated_at"]
    skip = {"undo_id", "effect_id", "created_at", "updated_at"}
    assert {k: v for k, v in hot.items() if k not in skip} == {k: v for k, v in general.items() if k not in skip}
    assert general["state"] == "armed" and general["attempts"] == 0 and general["owner"] is None


def test_undo_in_methods_join_the_caller_and_move_only_armed_entries(db):
    u = db.open()
    u.register(contract_write, contract_undo)
    st = _storage(u)
    spec = u.tool_spec("contract_write")
    sid = u.session(session_id=new_id()).id
    ids = [new_id() for _ in range(3)]
    for i, eid in enumerate(ids):
        now = utcnow().timestamp()
        assert u.engine.hot.prewrite(sid, 0, eid, f"c{i}", spec.name, spec.revision, '{"x":1}', "d" * 64,
                                     u.leases.owner, now, now + 30, "contract_undo", 1)
    seqs = [_effect_seq(st, eid) for eid in ids]
    until = utcnow()
    with pytest.raises(_Boom), st.tx() as conn:
        st.undo.drop_armed_in(conn, ids[0])
        assert st.undo.claim_armed_in(conn, seqs, "o", until, utcnow()) == set(seqs[1:])
        raise _Boom
    assert [e["state"] for e in st.undo.undo_plan(sid)] == ["armed"] * 3  # nothing of it stands
    assert st.undo.claim_undo(seqs[2], seen_state="armed", seen_owner=None, owner="walk", lease_until=until)
    with st.tx() as conn:
        assert st.undo.claim_armed_in(conn, seqs, "o", until, utcnow()) == {seqs[0], seqs[1]}  # the walk keeps its
        st.undo.drop_armed_in(conn, ids[2])  # claimed: not armed, not dropped
        assert st.undo.state_of_effect_in(conn, ids[2]) == "compensating"
        assert sorted(r.undo_id for r in st.undo.compensating_in(conn)) == sorted(seqs)
        st.undo.compensated_in(conn, seqs[0], utcnow())
        st.undo.undo_failed_in(conn, seqs[1], utcnow())
        st.undo.compensated_in(conn, seqs[1], utcnow())  # compensation_failed -> compensated: no such move
    assert {e["undo_id"]: e["state"] for e in st.undo.undo_plan(sid)} == {
        seqs[2]: "compensating", seqs[1]: "compensation_failed"}
    assert st.undo.put_undo_args(ids[2], {"x": 2}) is False  # only an armed entry takes a gateway's capture
    with st.read() as conn:
        assert st.undo.state_of_effect_in(conn, "no-such-effect") is None


# -- store.effects, store.recovery, store.owners -----------------------------------------------------------


def _prewritten(u: UndoLog, call_id: str) -> tuple[str, str]:
    spec = u.tool_spec("contract_write")
    sid = u.session(session_id=new_id()).id
    eid, now = new_id(), utcnow().timestamp()
    assert u.engine.hot.prewrite(sid, 0, eid, call_id, spec.name, spec.revision, '{"x":1}', "d" * 64,
                                 u.leases.owner, now, now + 30, "contract_undo", 1)
    return sid, eid


def test_effects_a_call_id_is_written_once_and_a_mark_lands_only_for_its_owner(db):
    from undolog_core.storage.pool import IntegrityConflict

    u = db.open()
    u.register(contract_write, contract_undo)
    st = _storage(u)
    sid, eid = _prewritten(u, "c-once")
    effects = _count(st, t.effect_log)
    with pytest.raises(IntegrityConflict), st.tx() as conn:
        st.effects.insert_effect_in(conn, dict(st.effects.effect(eid)._mapping, effect_id=new_id(), seq=None))
    assert _count(st, t.effect_log) == effects and st.effects.call_exists(sid, "c-once")
    # Another owner's mark lands nowhere and says what it met; the owner's own mark commits it, once.
    assert st.effects.mark_committed(eid, "1", utcnow(), fast=False, owner="someone-else") == "pending"
    assert st.effects.mark_committed(eid, "1", utcnow(), fast=False, owner=u.leases.owner) is None
    assert st.effects.mark_committed(eid, "2", utcnow(), fast=False) == "committed"
    assert st.effects.effect(eid).result_snapshot == 1
    assert eid not in {r.effect_id for r in st.effects.in_flight().effects}


def test_recovery_verdict_is_one_transaction_and_applies_only_in_flight(db):
    u = db.open()
    u.register(contract_write, contract_undo)
    st = _storage(u)
    sid, eid = _prewritten(u, "c-verdict")
    events = _count(st, t.approval_events)
    st.recovery.settle_effect(eid, EffectState.FAILED, error="did not happen", drop_undo=True, halt=(sid, "checked"),
                              event=PendingEvent(f"effect:{eid}", "effect.probe", "undolog", {"answer": "no"}))
    row = st.effects.effect(eid)
    rec = st.sessions.get_session(sid)
    assert row.state == "failed" and st.undo.undo_plan(sid) == [] and rec is not None and rec.state == "halted"
    assert _count(st, t.approval_events) == events + 1
    # Not in flight any more: a later verdict leaves the effect as it is.
    st.recovery.settle_effect(eid, EffectState.COMMITTED, result={"late": True})
    assert st.effects.effect(eid).state == "failed"


def test_owners_file_one_rollback_at_a_time(db):
    st = _storage(db.open())
    _new_session(st, "conf-owned")
    st.owners.hold_sessions("proc-a", ["conf-owned"], until=utcnow())
    assert st.owners.session_owner("conf-owned").owner == "proc-a"
    assert st.owners.file_rollback("conf-owned", actor="ana", reason=None, now=utcnow()) is True
    assert st.owners.file_rollback("conf-owned", actor="bo", reason=None, now=utcnow()) is False
    assert [r.session_id for r in st.owners.filed_rollbacks("proc-a")] == ["conf-owned"]
    st.owners.answer_rollback("conf-owned", {"complete": True})
    assert st.owners.filed_rollbacks("proc-a") == []
    assert st.owners.rollback_answer("conf-owned").rollback_report == {"complete": True}
    st.owners.close_rollback("conf-owned")
    assert st.owners.file_rollback("conf-owned", actor="bo", reason=None, now=utcnow()) is True
