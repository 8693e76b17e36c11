"""Each tier's call path and every state transition it makes, on the configured database."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa

from undolog_core import (
    ApprovalPending,
    ApprovalRejected,
    ApprovalTimedOut,
    ArgumentsInvalid,
    AwaitingApproval,
    Completed,
    Execute,
    SessionHalted,
    ToolNotClassified,
    ToolTier,
    errors,
    undolog_tool,
)
from undolog_core.storage import schema as t
from undolog_core.testing import internals

from ..support.toolkit import setup


def rows(undolog, table, **where):
    q = sa.select(table)
    for k, v in where.items():
        q = q.where(table.c[k] == v)
    with internals(undolog).read() as c:
        return [r._mapping for r in c.execute(q)]


async def test_safe_runs_at_once_and_logs_nothing(undolog):
    world, tools = setup(undolog)
    async with undolog.session(agent_id="bot") as s:
        assert await s.call(tools["search_knowledge_base"], query="refunds") == ["article about refunds"]
        assert await s.call("search_knowledge_base", query="x") == ["article about x"]
    assert rows(undolog, t.effect_log) == []
    assert undolog.sessions.get(s.id).tool_calls_total == 2  # flushed when the session block ended


async def test_compensable_prewrite_then_commit_with_result(undolog):
    world, tools = setup(undolog)
    seen = {}

    def spy(user_id: str, amount: int):
        # While the tool runs, its effect row and undo entry are already durable.
        seen["effects"] = rows(undolog, t.effect_log)
        seen["undo"] = rows(undolog, t.undo_stack)
        return tools["send_refund_email"](user_id=user_id, amount=amount)

    undolog.register_tool(spy, name="spy_send", tier=ToolTier.COMPENSABLE, compensation="cancel_refund_email")
    async with undolog.session() as s:
        out = await s.call("spy_send", user_id="u1", amount=25)
    [eff] = seen["effects"]
    assert eff["state"] == "pending" and eff["tier"] == "compensable" and eff["args_snapshot"] == {"user_id": "u1", "amount": 25}
    [undo] = seen["undo"]
    assert (undo["compensation_name"], undo["compensation_version"], undo["state"]) == ("cancel_refund_email", 1, "armed")
    assert undo["args_snapshot"] == {"user_id": "u1", "amount": 25}
    [after] = rows(undolog, t.effect_log)
    assert after["state"] == "committed" and after["result_snapshot"] == out
    assert after["owner"] is None and after["lease_until"] is None
    assert out["message_id"] == f"do-{after['effect_id']}"  # the tool saw its own idempotency key


async def test_compensable_failure_rolls_back_including_itself(undolog):
    world, tools = setup(undolog)
    async with undolog.session() as s:
        await s.call(tools["lock_account"], user_id="u2")
        world.fail_send = 1
        with pytest.raises(RuntimeError, match="smtp exploded") as info:
            await s.call(tools["send_refund_email"], user_id="u1", amount=5)
    assert any("rolled back" in n for n in info.value.__notes__)
    # LIFO: the failed send (which may have half-happened) is compensated first, then the lock.
    assert [w for w, _ in world.calls if w in ("cancel", "unlock")] == ["cancel", "unlock"]
    assert all(m["state"] == "recalled" for m in world.outbox.values())
    assert world.accounts["u2"]["locked"] is False
    states = {r["tool_name"]: r["state"] for r in rows(undolog, t.effect_log)}
    assert states == {"lock_account": "compensated", "send_refund_email": "compensated"}
    failed = rows(undolog, t.effect_log, tool_name="send_refund_email")[0]
    assert "smtp exploded" in failed["error"]
    assert undolog.sessions.get(s.id).state == "rolled_back"


async def test_failure_with_continue_policy_leaves_decision_to_caller(undolog):
    world, tools = setup(undolog)
    s = undolog.session(on_failure="continue")
    world.fail_send = 1
    with pytest.raises(RuntimeError):
        await s.call(tools["send_refund_email"], user_id="u1", amount=5)
    assert rows(undolog, t.effect_log)[0]["state"] == "failed"
    assert world.count("cancel") == 0
    assert undolog.sessions.get(s.id).state == "active"
    report = await s.rollback()
    assert [st.outcome for st in report.steps] == ["compensated"]


def test_sync_twin(undolog):
    world, tools = setup(undolog)
    with undolog.session() as s:
        assert s.call_sync(tools["search_knowledge_base"], query="q") == ["article about q"]
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=3)
        s.call_sync(tools["lock_account"], user_id="u1")  # an async tool from sync code
        report = s.rollback_sync()
    assert [st.tool_name for st in report.steps] == ["lock_account", "send_refund_email"]
    assert world.accounts["u1"]["locked"] is False


async def test_exception_leaving_session_rolls_back_and_reraises_unchanged(undolog):
    world, tools = setup(undolog)

    class Boom(Exception):
        pass

    err = Boom("agent crashed")
    with pytest.raises(Boom) as info:
        async with undolog.session() as s:
            await s.call(tools["send_refund_email"], user_id="u1", amount=1)
            raise err
    assert info.value is err
    assert undolog.sessions.get(s.id).state == "rolled_back"
    assert world.count("cancel") == 1


async def test_bad_arguments_refused_before_anything_is_logged(undolog):
    world, tools = setup(undolog)
    s = undolog.session()
    with pytest.raises(ArgumentsInvalid) as info:
        await s.call(tools["send_refund_email"], user_id="u1", amount="lots")
    assert info.value.fields == ["amount"] and "amount" in str(info.value)
    with pytest.raises(ArgumentsInvalid) as info:
        await s.call(tools["delete_user_account"], userid="u1")
    assert set(info.value.fields) == {"user_id", "userid"}
    assert rows(undolog, t.effect_log) == [] and rows(undolog, t.approval_requests) == []
    assert world.calls == []


def test_unclassified_and_reserved(undolog):
    def plain(x: int) -> int:
        return x

    with pytest.raises(ToolNotClassified, match="plain"):
        undolog.register(plain)
    with pytest.raises(errors.InvalidDeclaration, match="call_id"):

        @undolog_tool(tier=ToolTier.SAFE)
        def bad(call_id: str) -> None: ...

    with pytest.raises(errors.InvalidDeclaration, match="compensation"):
        undolog_tool(tier=ToolTier.COMPENSABLE)
    with pytest.raises(errors.InvalidDeclaration, match="risk_level"):
        undolog_tool(risk_level="extreme")
    with pytest.raises(errors.InvalidDeclaration, match="contradicts"):
        undolog_tool(tier="safe", risk_level="high")
    s = undolog.session()
    with pytest.raises(ToolNotClassified):
        s.call_sync(plain, x=1)


def test_risk_levels_map_to_tiers(undolog):
    world, tools = setup(undolog)
    assert undolog.tool_spec("wire_transfer").tier is ToolTier.IRREVERSIBLE
    assert ToolTier.from_risk_level("low") is ToolTier.SAFE
    assert ToolTier.from_risk_level("medium") is ToolTier.COMPENSABLE
    assert ToolTier.COMPENSABLE.risk_level == "medium"


def test_composites_inherit_the_highest_tier(undolog):
    world, tools = setup(undolog)

    @undolog_tool(composite_of=["search_knowledge_base", "delete_user_account"], reason="cleanup")
    def offboard(user_id: str) -> None: ...

    @undolog_tool(tier=ToolTier.SAFE, composite_of=["delete_user_account"])
    def sneaky(user_id: str) -> None: ...

    undolog.register(offboard)
    assert undolog.tool_spec("offboard").tier is ToolTier.IRREVERSIBLE
    with pytest.raises(errors.InvalidDeclaration, match="may not declare a lower"):
        undolog.register(sneaky)


async def test_irreversible_waits_then_runs_once_after_approval(undolog):
    world, tools = setup(undolog)
    s = undolog.session(agent_id="bot")
    await s.call(tools["search_knowledge_base"], query="delete")
    await s.call(tools["send_refund_email"], user_id="u1", amount=2)
    with pytest.raises(ApprovalPending) as info:
        await s.call(tools["delete_user_account"], user_id="u1", call_id="c-7")
    p = info.value
    assert world.count("delete") == 0
    assert undolog.sessions.get(s.id).state == "awaiting_approval"
    [req] = undolog.approvals.pending()
    assert req.approval_request_id == p.approval_request_id and req.effect_id == p.effect_id
    assert req.proposed_args == {"user_id": "u1"} and req.reason == "Deletes every record of the user"
    assert req.risk_tags == ["pii"] and req.state == "pending"
    assert [c["tool_name"] for c in req.agent_context] == ["search_knowledge_base", "send_refund_email"]
    assert req.timeout_at > dt.datetime.now(dt.UTC) + dt.timedelta(minutes=50)
    # Re-issuing before a decision: the same request, never a second one.
    with pytest.raises(ApprovalPending) as again:
        await s.call(tools["delete_user_account"], user_id="u1", call_id="c-7")
    assert again.value.approval_request_id == p.approval_request_id
    assert len(rows(undolog, t.approval_requests)) == 1
    rec = undolog.approvals.approve(p.approval_request_id, approver="ana")
    assert rec.state == "approved" and rec.decided_by == "ana"
    assert rows(undolog, t.effect_log, effect_id=p.effect_id)[0]["state"] == "approved"
    assert undolog.sessions.get(s.id).state == "active"
    out = await s.call(tools["delete_user_account"], user_id="u1", call_id="c-7")
    assert out == {"deleted": "u1"} and "u1" not in world.accounts
    assert world.calls[-1] == ("delete", ("u1", f"do-{p.effect_id}"))
    # The same call again replays the stored result; the tool does not run twice.
    assert await s.call(tools["delete_user_account"], user_id="u1", call_id="c-7") == {"deleted": "u1"}
    assert world.count("delete") == 1
    assert rows(undolog, t.effect_log, effect_id=p.effect_id)[0]["state"] == "committed"
    assert [e.action for e in undolog.approvals.events(p.approval_request_id)] == ["requested", "approve"]


async def test_modify_runs_the_edited_arguments(undolog):
    world, tools = setup(undolog)
    s = undolog.session()
    with pytest.raises(ApprovalPending) as info:
        await s.call(tools["wire_transfer"], to="acct-1", cents=10_000, call_id="w1")
    rid = info.value.approval_request_id
    with pytest.raises(ArgumentsInvalid) as bad:
        undolog.approvals.modify(rid, approver="ana", args={"to": "acct-1", "cents": "a lot"})
    assert bad.value.fields == ["cents"]
    assert undolog.approvals.get(rid).state == "pending"  # a bad edit changes nothing
    rec = undolog.approvals.modify(rid, approver="ana", args={"to": "acct-1", "cents": 500}, reason="cap it")
    assert rec.state == "approved" and rec.approved_args == {"to": "acct-1", "cents": 500}
    # The agent re-issues what it proposed; the approved edit is what runs.
    assert await s.call(tools["wire_transfer"], to="acct-1", cents=10_000, call_id="w1") == {"sent": 500}
    assert world.calls == [("wire", ("acct-1", 500))]
    ev = undolog.approvals.events(rid)
    assert [e.action for e in ev] == ["requested", "modify"] and ev[1].payload["args"]["cents"] == 500
    with pytest.raises(errors.CallIdConflict):
        await s.call(tools["wire_transfer"], to="acct-2", cents=1, call_id="w1")


async def test_reject_halts_and_cancels_the_sessions_other_requests(undolog):
    world, tools = setup(undolog)
    s = undolog.session()
    with pytest.raises(ApprovalPending) as a:
        await s.call(tools["delete_user_account"], user_id="u1", call_id="a")
    with pytest.raises(ApprovalPending) as b:
        await s.call(tools["wire_transfer"], to="x", cents=1, call_id="b")
    undolog.approvals.reject(a.value.approval_request_id, approver="ana", reason="customer asked to keep it")
    assert undolog.approvals.get(b.value.approval_request_id).state == "cancelled"
    rec = undolog.sessions.get(s.id)
    assert rec.state == "halted" and "customer asked to keep it" in rec.halted_reason
    with pytest.raises(ApprovalRejected, match="customer asked to keep it"):
        await s.call(tools["delete_user_account"], user_id="u1", call_id="a")
    with pytest.raises(SessionHalted):
        await s.call(tools["send_refund_email"], user_id="u1", amount=1)
    await s.call(tools["search_knowledge_base"], query="still fine")  # SAFE calls still run
    with pytest.raises(errors.ApprovalAlreadyDecided):
        undolog.approvals.approve(a.value.approval_request_id, approver="bob")
    assert world.count("delete") == 0 and world.count("wire") == 0
    undolog.sessions.resume(s.id, actor="ana", reason="looked at it")
    await s.call(tools["send_refund_email"], user_id="u1", amount=1)


async def test_timeout_fails_closed_by_sweep_and_on_read(undolog):
    world, tools = setup(undolog)
    undolog.policy.set(actor="admin", approval_timeout_seconds=1)
    s1, s2 = undolog.session(), undolog.session()
    with pytest.raises(ApprovalPending) as a:
        await s1.call(tools["delete_user_account"], user_id="u1", call_id="a")
    with pytest.raises(ApprovalPending) as b:
        await s2.call(tools["delete_user_account"], user_id="u2", call_id="b")
    later = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=5)
    expired = undolog.approvals.expire_due(now=later)
    assert sorted(expired) == sorted([a.value.approval_request_id, b.value.approval_request_id])
    assert undolog.approvals.expire_due(now=later) == []  # each timeout is applied once
    assert undolog.approvals.get(a.value.approval_request_id).state == "timed_out"
    assert undolog.sessions.get(s1.id).state == "halted"
    with pytest.raises(ApprovalTimedOut):
        await s1.call(tools["delete_user_account"], user_id="u1", call_id="a")
    assert world.count("delete") == 0
    # Timeout checked on read too: no sweeper ran for this one.
    undolog.policy.set(actor="admin", approval_timeout_seconds=1)
    s3 = undolog.session()
    with pytest.raises(ApprovalPending) as c:
        await s3.call(tools["wire_transfer"], to="x", cents=1, call_id="c")
    _age(undolog, c.value.approval_request_id)
    assert undolog.approvals.get(c.value.approval_request_id).state == "timed_out"
    s4 = undolog.session()
    with pytest.raises(ApprovalPending) as d:
        await s4.call(tools["wire_transfer"], to="y", cents=1, call_id="d")
    _age(undolog, d.value.approval_request_id)
    with pytest.raises(ApprovalTimedOut):  # ...and when the call is re-issued
        await s4.call(tools["wire_transfer"], to="y", cents=1, call_id="d")
    with pytest.raises(errors.ApprovalAlreadyDecided):
        undolog.approvals.approve(d.value.approval_request_id, approver="late")
    acts = [e.action for e in undolog.approvals.events(d.value.approval_request_id)]
    assert acts == ["requested", "timeout"]


def _age(undolog, rid):
    with internals(undolog).write() as c:
        c.execute(
            t.approval_requests.update().where(t.approval_requests.c.approval_request_id == rid)
            .values(timeout_at=dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1))
        )


async def test_auto_approve_on_timeout_is_a_distinct_event(undolog):
    world, tools = setup(undolog)
    undolog.policy.set(actor="admin", auto_approve_on_timeout=True)
    s = undolog.session()
    with pytest.raises(ApprovalPending) as p:
        await s.call(tools["wire_transfer"], to="x", cents=7, call_id="w")
    _age(undolog, p.value.approval_request_id)
    assert undolog.approvals.expire_due() == [p.value.approval_request_id]
    rec = undolog.approvals.get(p.value.approval_request_id)
    assert rec.state == "auto_approved" and rec.decided_by == "undolog:timeout-policy"
    assert [e.action for e in undolog.approvals.events(rec.approval_request_id)] == ["requested", "auto_approve"]
    assert await s.call(tools["wire_transfer"], to="x", cents=7, call_id="w") == {"sent": 7}


def test_engine_api_for_adapters(undolog):
    world, tools = setup(undolog)
    eng = undolog.engine
    d = eng.intercept("thread-1", "search_knowledge_base", {"query": "q"})
    assert isinstance(d, Execute) and d.effect_id is None and d.idempotency_key is None
    d = eng.intercept("thread-1", "send_refund_email", {"user_id": "u1", "amount": 4}, call_id="tc-1")
    assert isinstance(d, Execute) and d.idempotency_key == f"do-{d.effect_id}"
    eng.complete(d.effect_id, {"ok": True})
    again = eng.intercept("thread-1", "send_refund_email", {"user_id": "u1", "amount": 4}, call_id="tc-1")
    assert isinstance(again, Completed) and again.result == {"ok": True}
    with pytest.raises(errors.CallIdConflict):
        eng.intercept("thread-1", "send_refund_email", {"user_id": "u1", "amount": 5}, call_id="tc-1")
    w = eng.intercept("thread-1", "delete_user_account", {"user_id": "u1"}, call_id="tc-2")
    assert isinstance(w, AwaitingApproval) and w.retry_after > 0
    undolog.approvals.approve(w.approval_request_id, approver="ana")
    run = eng.intercept("thread-1", "delete_user_account", {"user_id": "u1"}, call_id="tc-2")
    assert isinstance(run, Execute) and run.args == {"user_id": "u1"}
    undolog.driver.fail(run.effect_id, RuntimeError("api down"))
    assert undolog.sessions.get("thread-1").state == "rolled_back"
    with pytest.raises(errors.SessionClosed):
        eng.intercept("thread-1", "send_refund_email", {"user_id": "u1", "amount": 4}, call_id="tc-3")
    with pytest.raises(errors.ToolNotRegistered):
        eng.intercept("thread-1", "nope", {})


def test_find_for_call_matches_tool_and_argument_digest(undolog):
    world, tools = setup(undolog)
    w = undolog.engine.intercept("k1", "delete_user_account", {"user_id": "u1"})
    rec = undolog.approvals.find_for_call("k1", "delete_user_account", {"user_id": "u1"})
    assert rec is not None and rec.approval_request_id == w.approval_request_id
    assert undolog.approvals.find_for_call("k1", "delete_user_account", {"user_id": "u2"}) is None
    # Without a call id, a new kickoff re-issuing the same action finds the same request.
    again = undolog.engine.intercept("k1", "delete_user_account", {"user_id": "u1"})
    assert again.approval_request_id == w.approval_request_id


def test_schema_declared_tool_passes_on_only_given_arguments(undolog):
    schema = {"type": "object", "properties": {"account": {"type": "string"}, "notify": {"type": "boolean"}},
              "required": ["account"], "additionalProperties": False}
    undolog.register_tool(None, name="close_account", tier="irreversible", reason="closes it", args_schema=schema)
    w = undolog.engine.intercept("s", "close_account", {"account": "x"}, call_id="c")
    assert undolog.approvals.get(w.approval_request_id).proposed_args == {"account": "x"}
    with pytest.raises(ArgumentsInvalid) as bad:
        undolog.approvals.modify(w.approval_request_id, approver="ana", args={"account": "x", "notify": "loud"})
    assert bad.value.fields == ["notify"]
    undolog.approvals.approve(w.approval_request_id, approver="ana")
    run = undolog.engine.intercept("s", "close_account", {"account": "x"}, call_id="c")
    assert isinstance(run, Execute) and run.args == {"account": "x"}
    with pytest.raises(ArgumentsInvalid, match="surprise"):
        undolog.engine.intercept("s", "close_account", {"account": "x", "surprise": 1})


def test_rerun_of_a_completed_call_on_a_halted_session_returns_its_result(undolog):
    world, tools = setup(undolog)
    eng = undolog.engine
    d = eng.intercept("t", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="a")
    eng.complete(d.effect_id, {"ok": 1})
    w = eng.intercept("t", "delete_user_account", {"user_id": "u1"}, call_id="b")
    undolog.approvals.reject(w.approval_request_id, approver="ana", reason="no")
    again = eng.intercept("t", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="a")
    assert isinstance(again, Completed) and again.result == {"ok": 1}
    with pytest.raises(SessionHalted):
        eng.intercept("t", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="new")


def test_reissue_of_a_call_undone_by_a_rollback_is_refused_as_closed(undolog):
    """A call released by a framework interrupt, then undone by a rollback made meanwhile: its re-issue (a LangGraph
    resume) has no result to give and must not run; it is refused with the session's own error (SessionClosed, what
    adapters turn into a refusal the model reads), not an InvalidEffectState that crashes the graph."""
    world, tools = setup(undolog)
    eng = undolog.engine
    d = eng.intercept("t", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="a")
    eng.release(d.effect_id)
    assert undolog.rollback("t").complete
    with pytest.raises(errors.SessionClosed):
        eng.intercept("t", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="a")
    assert [e["state"] for e in undolog.sessions.effects("t")] == ["compensated"]


def test_released_call_is_left_by_recovery_and_rerun_by_its_reissue(undolog):
    world, tools = setup(undolog)
    eng = undolog.engine
    d = eng.intercept("t", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="a")
    eng.release(d.effect_id)  # the tool raised a framework interrupt
    assert undolog.recover().reconciled == []
    again = eng.intercept("t", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="a")
    assert isinstance(again, Execute) and again.effect_id == d.effect_id and again.idempotency_key == d.idempotency_key
    eng.complete(again.effect_id, {"ok": 2})
    assert eng.intercept("t", "send_refund_email", {"user_id": "u1", "amount": 1}, call_id="a").result == {"ok": 2}
    with pytest.raises(errors.InvalidEffectState):
        eng.release(d.effect_id)


def test_match_digest_picks_up_an_approved_call_under_a_new_call_id(undolog):
    world, tools = setup(undolog)
    eng = undolog.engine
    w = eng.intercept("k", "delete_user_account", {"user_id": "u1"}, call_id="kickoff1-call")
    undolog.approvals.approve(w.approval_request_id, approver="ana")
    run = eng.intercept("k", "delete_user_account", {"user_id": "u1"}, call_id="kickoff2-call", match_digest=True)
    assert isinstance(run, Execute) and run.effect_id == w.effect_id


def test_concurrent_creation_of_one_session(db):
    import threading

    us = [db.open() for _ in range(4)]
    errs = []

    def create(u):
        try:
            u.engine.ensure_session("same")
        except Exception as exc:  # noqa: BLE001
            errs.append(exc)

    threads = [threading.Thread(target=create, args=(u,)) for u in us]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errs == [] and us[0].sessions.get("same").state == "active"
