"""Review of issue 2: each test pins down one behaviour the issue requires (some failed when written)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core import (
    ApprovalPending,
    ToolTier,
    UndoLogError,
    compensation,
    current_call,
    errors,
    undolog_tool,
)
from undolog_core.storage import schema as t
from undolog_core.testing import internals

from ..support.toolkit import World, setup


def rows(undolog: Any, table: Any, **where: Any) -> list[Any]:
    q = sa.select(table)
    for k, v in where.items():
        q = q.where(table.c[k] == v)
    with internals(undolog).read() as c:
        return [r._mapping for r in c.execute(q)]


# -- 1. two rollbacks of one session at once must not run a compensation twice ----------------------


def _slow_world_tools(world: World, gate: threading.Event | None = None, delay: float = 0.2) -> tuple[Any, ...]:
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="slow_undo")
    def slow_send(n: int) -> dict[str, Any]:
        world.log("send", n)
        return {"n": n}

    @compensation("slow_undo")
    async def slow_undo(ctx: Any) -> None:
        world.log("undo_start", ctx.args["n"])
        if gate is not None:
            # Set by the test when done; 60 s at most (10 s before: a loaded machine's test could still be checking).
            await asyncio.to_thread(gate.wait, 60)
        else:
            await asyncio.sleep(delay)
        world.log("undo", ctx.args["n"])

    return slow_send, slow_undo


async def test_concurrent_rollbacks_of_one_session_compensate_each_effect_once(undolog):
    world = World()
    send, undo = _slow_world_tools(world)
    undolog.register(send, undo)
    s = undolog.session(agent_id="bot")
    await s.call(send, n=1)
    await s.call(send, n=2)
    results = await asyncio.gather(undolog.arollback(s.id), undolog.arollback(s.id), return_exceptions=True)
    # One rollback does the work; the other waits, reports "already rolled back", or is refused clearly.
    for r in results:
        assert not isinstance(r, Exception) or isinstance(r, UndoLogError), r
    assert world.count("undo") == 2, world.calls  # each compensation exactly once


def test_concurrent_sync_rollbacks_from_two_threads_compensate_once(undolog):
    world = World()
    send, undo = _slow_world_tools(world)
    undolog.register(send, undo)
    s = undolog.session(agent_id="bot")
    s.call_sync(send, n=1)
    out: list[Any] = []

    def go() -> None:
        try:
            out.append(undolog.rollback(s.id))
        except Exception as exc:  # noqa: BLE001
            out.append(exc)

    ths = [threading.Thread(target=go) for _ in range(2)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(30)
    assert world.count("undo") == 1, world.calls


# -- 2. recover() must leave a rollback that is running in this very process alone ------------------


def test_recover_leaves_a_live_rollback_in_this_process_alone(undolog):
    world = World()
    gate = threading.Event()
    send, undo = _slow_world_tools(world, gate=gate)
    undolog.register(send, undo)
    s = undolog.session(agent_id="bot")
    s.call_sync(send, n=1)
    th = threading.Thread(target=lambda: undolog.rollback(s.id))
    th.start()
    try:
        deadline = time.monotonic() + 30  # bounded, generous (4 s before): the rollback's thread may start late
        while time.monotonic() < deadline:
            if world.count("undo_start"):
                break
            time.sleep(0.02)
        assert world.count("undo_start") == 1
        report = {}

        def sweep() -> None:
            report["r"] = undolog.recover()

        sw = threading.Thread(target=sweep)
        sw.start()
        sw.join(2)  # a sweeper must not block on, nor take over, a live rollback
        assert world.count("undo_start") == 1, "recover() re-ran a compensation that is running right now"
    finally:
        gate.set()
        th.join(30)
    sw.join(30)
    assert world.count("undo") == 1, world.calls
    assert report["r"].rollbacks_resumed == []


# -- 3. a live call of another UndoLog in the same process is not "dead" --------------------------


def test_recover_by_another_instance_in_the_same_process_leaves_a_live_call_alone(db):
    a = db.open()
    b = db.open()
    world_a, tools_a = setup(a)
    world_b, _ = setup(b)
    a.session(session_id="s1")
    d = a.engine.intercept("s1", "send_refund_email", {"user_id": "u1", "amount": 5}, call_id="c1")
    # The tool is running in instance `a` right now (lease fresh, renewed); instance b sweeps.
    report = b.recover()
    assert report.reconciled == [] and report.left_alive == 1, report
    assert rows(a, t.effect_log, effect_id=d.effect_id)[0]["state"] == "pending"
    a.engine.complete(d.effect_id, {"ok": True})
    assert rows(a, t.effect_log, effect_id=d.effect_id)[0]["state"] == "committed"


# -- 4. a failing call while another call of the session is in flight ---------------------------


async def test_failure_during_a_parallel_call_does_not_leave_the_session_active(undolog):
    world = World()

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_p")
    async def slow_ok(n: int) -> int:
        await asyncio.sleep(0.3)
        world.log("slow_ok", n)
        return n

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_p")
    async def fails_fast(n: int) -> int:
        world.log("fails_fast", n)
        raise RuntimeError("boom")

    @compensation("undo_p")
    def undo_p(ctx: Any) -> None:
        world.log("undo", ctx.args["n"])

    undolog.register(slow_ok, fails_fast, undo_p)
    s = undolog.session(agent_id="bot")  # default policy: a failure rolls the session back
    res = await asyncio.gather(s.call(slow_ok, n=1), s.call(fails_fast, n=2), return_exceptions=True)
    assert isinstance(res[1], RuntimeError) and str(res[1]) == "boom"  # the user's exception, unchanged
    state = undolog.sessions.get(s.id).state
    # The default policy could not roll back while slow_ok was running; the session must not carry on as if
    # nothing failed: rolled back, or at least halted for a person.
    assert state in ("rolled_back", "halted"), state
    with pytest.raises(UndoLogError):
        await s.call(fails_fast, n=3)


# -- 5. bad call_id / session_id values are refused with a clear error naming them ------------------


@pytest.mark.parametrize("bad", ["x" * 300, 123, ""])
def test_bad_call_id_is_refused_clearly_before_anything_runs(undolog, bad):
    world, tools = setup(undolog)
    s = undolog.session(agent_id="bot")
    with pytest.raises(UndoLogError) as ei:
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=1, call_id=bad)
    assert "call_id" in str(ei.value)
    assert world.count("send") == 0
    assert rows(undolog, t.effect_log, session_id=s.id) == []


def test_empty_call_id_does_not_lose_deduplication(undolog):
    # Whatever "" means, re-issuing the same call with the same call_id must never run the tool twice.
    world, tools = setup(undolog)
    s = undolog.session(agent_id="bot")
    for _ in range(2):
        try:
            s.call_sync(tools["send_refund_email"], user_id="u1", amount=1, call_id="")
        except UndoLogError:
            pass
    assert world.count("send") <= 1, world.calls


def test_too_long_session_id_is_refused_clearly(undolog):
    with pytest.raises(UndoLogError) as ei:
        undolog.session(session_id="z" * 300)
    assert "session_id" in str(ei.value)


# -- 6. a value JSON cannot hold (NaN) in a result or an argument -------------------------------


def _nan_tools(world: World) -> tuple[Any, ...]:
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_score")
    def score(x: float) -> dict[str, Any]:
        world.log("score", x)
        return {"score": float("nan")}

    @compensation("undo_score")
    def undo_score(ctx: Any) -> None:
        world.log("undo", ctx.args)

    return score, undo_score


def test_a_nan_in_the_result_does_not_lose_the_outcome_of_a_call_that_ran(undolog):
    world = World()
    score, undo = _nan_tools(world)
    undolog.register(score, undo)
    s = undolog.session(agent_id="bot")
    try:
        s.call_sync(score, x=1.0, call_id="c1")
    except Exception as exc:  # noqa: BLE001
        # If it is refused at all, it must be a clear UndoLog error, not a raw driver error.
        assert isinstance(exc, UndoLogError), f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    assert world.count("score") == 1
    eff = rows(undolog, t.effect_log, session_id=s.id)[0]
    # The tool ran: the log must say so (committed), never leave it "pending" for recovery to compensate.
    assert eff["state"] in ("committed", "failed"), eff["state"]


def test_a_nan_argument_is_refused_clearly_or_logged(undolog):
    world = World()
    score, undo = _nan_tools(world)
    undolog.register(score, undo)
    s = undolog.session(agent_id="bot")
    try:
        s.call_sync(score, x=float("nan"))
    except Exception as exc:  # noqa: BLE001
        assert isinstance(exc, UndoLogError), f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        assert world.count("score") == 0


# -- 7. an argument that has no JSON snapshot -------------------------------------------------------


class Client:
    pass


def test_an_argument_without_a_json_snapshot_is_a_clear_error(undolog):
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_c")
    def with_client(client: Client, n: int) -> int:
        return n

    @compensation("undo_c")
    def undo_c(ctx: Any) -> None: ...

    try:
        undolog.register(with_client, undo_c)
    except UndoLogError:
        return  # refused at registration: fine
    s = undolog.session(agent_id="bot")
    with pytest.raises(UndoLogError) as ei:
        s.call_sync(with_client, client=Client(), n=1)
    assert "client" in str(ei.value)


# -- 8. the sync twin exposes current_call() to an async tool even under a running loop ----------


async def test_call_sync_of_an_async_tool_under_a_running_loop_sees_its_idempotency_key(undolog):
    seen: list[Any] = []

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_k")
    async def keyed(n: int) -> str:
        c = current_call()
        seen.append(c.idempotency_key if c else None)
        return "ok"

    @compensation("undo_k")
    def undo_k(ctx: Any) -> None: ...

    undolog.register(keyed, undo_k)
    s = undolog.session(agent_id="bot")
    await s.call(keyed, n=1)  # async path
    s.call_sync(keyed, n=2)  # sync twin, called from code that runs under an event loop
    assert seen[0] and seen[0].startswith("do-")
    assert seen[1] and seen[1].startswith("do-"), seen


def test_call_sync_of_an_async_tool_without_a_loop_sees_its_idempotency_key(undolog):
    seen: list[Any] = []

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_k2")
    async def keyed2(n: int) -> str:
        c = current_call()
        seen.append(c.idempotency_key if c else None)
        return "ok"

    @compensation("undo_k2")
    def undo_k2(ctx: Any) -> None: ...

    undolog.register(keyed2, undo_k2)
    s = undolog.session(agent_id="bot")
    s.call_sync(keyed2, n=1)
    assert seen[0] and seen[0].startswith("do-")


# -- 9. a refused IRREVERSIBLE re-issue must not swallow the session's SAFE call count --------------


def test_refused_approved_reissue_keeps_the_safe_call_count(undolog):
    world, tools = setup(undolog)
    s = undolog.session(agent_id="bot")
    with pytest.raises(ApprovalPending) as a:
        s.call_sync(tools["delete_user_account"], user_id="u1", call_id="a")
    with pytest.raises(ApprovalPending) as b:
        s.call_sync(tools["wire_transfer"], to="x", cents=5, call_id="b")
    undolog.approvals.approve(a.value.approval_request_id, approver="ana")
    undolog.approvals.reject(b.value.approval_request_id, approver="ana", reason="no")
    assert undolog.sessions.get(s.id).state == "halted"
    for i in range(3):
        s.call_sync(tools["search_knowledge_base"], query=str(i))  # SAFE calls still run on a halted session
    with pytest.raises(errors.SessionHalted):
        s.call_sync(tools["delete_user_account"], user_id="u1", call_id="a")
    assert world.count("delete") == 0
    undolog.engine.flush_counts(s.id)
    # 2 approval requests + 3 SAFE calls were made (the refused re-issue may or may not count).
    assert undolog.sessions.get(s.id).tool_calls_total >= 5


# -- passing coverage: approvals are bound to the right call --------------------------------------


def test_modify_runs_the_approved_arguments_once_and_binds_to_its_own_call(undolog):
    world, tools = setup(undolog)
    s = undolog.session(agent_id="bot")
    with pytest.raises(ApprovalPending) as p1:
        s.call_sync(tools["wire_transfer"], to="bob", cents=500, call_id="w1")
    with pytest.raises(ApprovalPending) as p2:
        s.call_sync(tools["wire_transfer"], to="bob", cents=500, call_id="w2")
    assert p1.value.approval_request_id != p2.value.approval_request_id
    with pytest.raises(errors.ArgumentsInvalid) as bad:
        undolog.approvals.modify(p1.value.approval_request_id, approver="ana", args={"to": "bob", "cents": "lots"})
    assert "cents" in str(bad.value)
    undolog.approvals.modify(p1.value.approval_request_id, approver="ana", args={"to": "bob", "cents": 50})
    # w2 is still waiting: approving w1 did not approve w2.
    with pytest.raises(ApprovalPending):
        s.call_sync(tools["wire_transfer"], to="bob", cents=500, call_id="w2")
    assert s.call_sync(tools["wire_transfer"], to="bob", cents=500, call_id="w1") == {"sent": 50}
    assert s.call_sync(tools["wire_transfer"], to="bob", cents=500, call_id="w1") == {"sent": 50}
    assert world.calls.count(("wire", ("bob", 50))) == 1 and ("wire", ("bob", 500)) not in world.calls
    with pytest.raises(errors.CallIdConflict):
        s.call_sync(tools["wire_transfer"], to="eve", cents=50, call_id="w1")
    assert [e.action for e in undolog.approvals.events(p1.value.approval_request_id)] == ["requested", "modify"]


def test_call_id_reused_across_tiers_is_a_conflict(undolog):
    world, tools = setup(undolog)
    s = undolog.session(agent_id="bot")
    s.call_sync(tools["send_refund_email"], user_id="u1", amount=1, call_id="k")
    with pytest.raises(errors.CallIdConflict):
        s.call_sync(tools["delete_user_account"], user_id="u1", call_id="k")
    with pytest.raises(ApprovalPending):
        s.call_sync(tools["delete_user_account"], user_id="u1", call_id="k2")
    with pytest.raises(errors.CallIdConflict):
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=1, call_id="k2")
    assert world.count("send") == 1 and world.count("delete") == 0


# -- property: any interleaving keeps the invariants -----------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("comp"), st.integers(0, 3)),
        st.tuples(st.just("irr"), st.integers(0, 3)),
        st.tuples(st.just("approve"), st.integers(0, 3)),
        st.tuples(st.just("modify"), st.integers(0, 3)),
        st.tuples(st.just("reject"), st.integers(0, 3)),
        st.tuples(st.just("rollback"), st.just(0)),
        st.tuples(st.just("resume"), st.just(0)),
        st.tuples(st.just("safe"), st.just(0)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(ops=OPS)
def test_property_any_interleaving_keeps_the_invariants(undolog, ops):
    world = World()
    ran: dict[str, int] = {}

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="p_undo")
    def p_send(k: str) -> str:
        ran[current_call().call_id] = ran.get(current_call().call_id, 0) + 1  # type: ignore[union-attr]
        return k

    @compensation("p_undo")
    def p_undo(ctx: Any) -> None:
        world.log("undo", ctx.idempotency_key)

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="gone for good")
    def p_delete(k: str, n: int = 1) -> str:
        ran[current_call().call_id] = ran.get(current_call().call_id, 0) + 1  # type: ignore[union-attr]
        return k

    @undolog_tool(tier=ToolTier.SAFE)
    def p_read(k: str) -> str:
        return k

    if "p_send" not in undolog.registry.tools:
        undolog.register(p_send, p_undo, p_delete, p_read)
    else:  # re-bind this example's closures under the same contracts
        undolog.registry.tools["p_send"].fn = p_send
        undolog.registry.tools["p_delete"].fn = p_delete
        undolog.registry.compensations["p_undo"] = (p_undo, 1)
        undolog.registry.by_fn[p_send] = undolog.registry.tools["p_send"]
        undolog.registry.by_fn[p_delete] = undolog.registry.tools["p_delete"]
        undolog.registry.by_fn[p_read] = undolog.registry.tools["p_read"]

    s = undolog.session(agent_id="prop")
    requests: dict[int, str] = {}
    rejected_calls: set[str] = set()
    for op, i in ops:
        try:
            if op == "comp":
                s.call_sync(p_send, k=f"c{i}", call_id=f"c{i}")
            elif op == "irr":
                s.call_sync(p_delete, k=f"d{i}", call_id=f"d{i}")
            elif op == "safe":
                s.call_sync(p_read, k="x")
            elif op in ("approve", "modify", "reject") and i in requests:
                rid = requests[i]
                if op == "approve":
                    undolog.approvals.approve(rid, approver="ana")
                elif op == "modify":
                    undolog.approvals.modify(rid, approver="ana", args={"k": f"d{i}", "n": 2})
                else:
                    undolog.approvals.reject(rid, approver="ana", reason="no")
                    rejected_calls.add(f"d{i}")
            elif op == "rollback":
                s.rollback_sync()
            elif op == "resume":
                s.resume(actor="ana")
        except ApprovalPending as p:
            requests[i] = p.approval_request_id
        except UndoLogError:
            pass  # refusals are fine; the invariants below are what matters

    # No call_id ran twice; a rejected call never ran.
    assert all(n == 1 for n in ran.values()), ran
    assert not (rejected_calls & set(ran)), (rejected_calls, ran)
    # Each compensation ran at most once (its key is unique per undo entry).
    keys = [d for w, d in world.calls if w == "undo"]
    assert len(keys) == len(set(keys)), keys
    # The audit chain verifies.
    assert undolog.verify_audit().ok
    # The session is awaiting_approval exactly while one of its requests is pending.
    rec = undolog.sessions.get(s.id)
    pending = [r for r in rows(undolog, t.approval_requests, session_id=s.id) if r["state"] == "pending"]
    if rec.state in ("active", "awaiting_approval"):
        assert (rec.state == "awaiting_approval") == bool(pending), (rec.state, len(pending))
    else:
        assert not pending or rec.state == "halted", (rec.state, len(pending))
    # Every effect of a rolled-back session that has an undo entry is compensated.
    if rec.state == "rolled_back":
        undo = rows(undolog, t.undo_stack, session_id=s.id)
        assert all(u["state"] == "compensated" for u in undo), [u["state"] for u in undo]
