"""A tool's own retry policy (``@undolog_tool(retry=...)``): retried in the call driver under the same effect and
idempotency key before the call counts as failed; IRREVERSIBLE tools take none. Also: ``on_failure`` is an enum,
checked when a session is made, and a person's ``respond`` decision in the core."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from undolog_core import (
    ApprovalPending,
    EffectState,
    OnFailure,
    RequestState,
    RetryPolicy,
    ToolTier,
    compensation,
    current_call,
    undolog_tool,
)
from undolog_core.errors import ConfigurationError, InvalidDeclaration


class Flaky:
    """A tool body that raises ``exc`` for its first ``fails`` calls, recording each call's context."""

    def __init__(self, fails: int, exc: type[BaseException] = ConnectionError) -> None:
        self.fails, self.exc, self.seen = fails, exc, []

    def __call__(self, **args: Any) -> dict[str, Any]:
        ctx = current_call()
        self.seen.append((ctx.idempotency_key, ctx.attempt) if ctx else (None, None))
        if len(self.seen) <= self.fails:
            raise self.exc(f"attempt {len(self.seen)} failed")
        return {"ok": True, **args}


def make(undolog: Any, body: Flaky, retry: Any, tier: ToolTier = ToolTier.COMPENSABLE) -> tuple[Any, list[Any]]:
    undone: list[Any] = []

    @compensation("undo_charge")
    def undo_charge(ctx: Any) -> None:
        undone.append(ctx.args)

    kw = {"compensation": "undo_charge"} if tier is ToolTier.COMPENSABLE else {}

    @undolog_tool(tier=tier, retry=retry, **kw)
    def charge(amount: int) -> dict[str, Any]:
        return body(amount=amount)

    undolog.register(charge, undo_charge)
    return charge, undone


def test_compensable_retried_under_the_same_key(undolog: Any) -> None:
    body = Flaky(2)
    charge, undone = make(undolog, body, RetryPolicy(attempts=3, backoff=0.0, on=(ConnectionError,)))
    s = undolog.session()
    assert s.call_sync(charge, amount=5) == {"ok": True, "amount": 5}
    [effect] = undolog.sessions.effects(s.id)
    assert effect["state"] == EffectState.COMMITTED
    # Three attempts, one effect, the same do-{effect_id} key on every one, and the attempt number visible.
    assert body.seen == [(f"do-{effect['effect_id']}", n) for n in (1, 2, 3)]
    assert undone == []


def test_async_retry_and_exhaustion_rolls_back(undolog: Any) -> None:
    body = Flaky(5)
    charge, undone = make(undolog, body, 2)  # retry=2: two attempts with the default backoff, shortened below
    undolog.tool_spec("charge").retry = RetryPolicy(attempts=2, backoff=0.0)
    s = undolog.session()

    async def go() -> None:
        with pytest.raises(ConnectionError) as info:
            await s.call(charge, amount=7)
        assert any("2 attempts" in n for n in info.value.__notes__)

    asyncio.run(go())
    [effect] = undolog.sessions.effects(s.id)
    assert len(body.seen) == 2 and effect["state"] == EffectState.COMPENSATED
    assert undone == [{"amount": 7}]  # the failed call's own compensation, once, after the last attempt


def test_only_the_named_exceptions_are_retried(undolog: Any) -> None:
    body = Flaky(1, exc=ValueError)
    charge, undone = make(undolog, body, RetryPolicy(attempts=3, backoff=0.0, on=(ConnectionError,)))
    s = undolog.session()
    with pytest.raises(ValueError):
        s.call_sync(charge, amount=1)
    assert len(body.seen) == 1 and undone == [{"amount": 1}]


def test_safe_retry_on_the_fast_path(undolog: Any) -> None:
    body = Flaky(1)

    @undolog_tool(tier="safe", retry=RetryPolicy(attempts=2, backoff=0.0))
    def lookup(q: str) -> Any:
        return body(q=q)

    undolog.register(lookup)
    s = undolog.session()
    assert s.call_sync(lookup, q="x") == {"ok": True, "q": "x"}
    assert asyncio.run(s.call(lookup, q="y")) == {"ok": True, "q": "y"}
    assert len(body.seen) == 3 and undolog.sessions.effects(s.id) == []


def test_irreversible_takes_no_retry_and_bad_policies_are_refused(undolog: Any) -> None:
    with pytest.raises(InvalidDeclaration, match="IRREVERSIBLE"):
        undolog_tool(tier="irreversible", retry=2)
    with pytest.raises(InvalidDeclaration, match="IRREVERSIBLE"):
        undolog.register_tool(lambda x: x, name="wire", tier="irreversible", retry=RetryPolicy())
    for bad in ({"attempts": 0}, {"backoff": -1}, {"factor": 0.5}, {"on": ("ConnectionError",)}):
        with pytest.raises(InvalidDeclaration, match="retry"):
            RetryPolicy(**bad)
    with pytest.raises(InvalidDeclaration, match="retry"):
        undolog_tool(tier="safe", retry="often")
    assert RetryPolicy(backoff=1, factor=2, max_backoff=3).delay(3) == 3.0


def test_on_failure_is_checked_when_the_session_is_made(undolog: Any) -> None:
    with pytest.raises(ConfigurationError, match="'rollback', 'continue'.*'bogus'"):
        undolog.session(on_failure="bogus")
    s = undolog.session(on_failure=OnFailure.CONTINUE)
    assert undolog.sessions.get(s.id).on_failure == "continue"


def test_respond_is_its_own_audited_decision(undolog: Any) -> None:
    ran: list[str] = []

    @undolog_tool(tier="irreversible", reason="asks the customer")
    def ask_customer(question: str) -> str:
        ran.append(question)
        return "the tool's own answer"

    undolog.register(ask_customer)
    s = undolog.session()
    with pytest.raises(ApprovalPending) as p:
        s.call_sync(ask_customer, question="Which order?", call_id="c1")
    rid = p.value.approval_request_id
    with pytest.raises(Exception, match="response"):
        undolog.approvals.respond(rid, approver="ana", response=" ")
    rec = undolog.approvals.respond(rid, approver="ana", response="Order A-1042")
    assert rec.state == RequestState.RESPONDED and rec.decided_by == "ana"
    assert [e.action for e in undolog.approvals.events(rid)] == ["requested", "respond"]
    assert undolog.approvals.events(rid)[-1].payload["response"] == "Order A-1042"
    # The re-issued call returns the person's answer; the tool never runs; the session goes on.
    assert s.call_sync(ask_customer, question="Which order?", call_id="c1") == "Order A-1042"
    assert ran == [] and undolog.sessions.get(s.id).state == "active"
    assert undolog.verify_audit().ok


def test_an_attempt_of_unknown_outcome_ends_the_retries(undolog: Any) -> None:
    # A retry that times out may have happened: it is settled as in doubt (like recovery), never tried again.
    body = Flaky(5)
    body.exc = ConnectionError

    def invoke(args: dict[str, Any]) -> Any:
        if len(body.seen) == 1:
            body.seen.append(("second", 2))
            raise TimeoutError("no answer")
        return body(**args)

    charge, undone = make(undolog, body, RetryPolicy(attempts=5, backoff=0.0))
    s = undolog.session()
    d = undolog.driver.decide(s.id, charge, {"amount": 3}, call_id="c1")
    outcome = undolog.driver.run_sync(d, invoke, unknown_on=(TimeoutError,))
    assert isinstance(outcome.error, TimeoutError) and len(body.seen) == 2
    [effect] = undolog.sessions.effects(s.id)
    assert effect["state"] != EffectState.FAILED  # not recorded as a failure that nothing happened in
