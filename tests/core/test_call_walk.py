"""The one call walk (``undolog_core._walk``) does no I/O: it asks its driver loop for each step and is sent the
answer, so its decisions are read here by driving it by hand (issue #35, step 4)."""

from __future__ import annotations

from typing import Any

import pytest

from undolog_core import RetryPolicy, ToolTier
from undolog_core._decisions import Execute
from undolog_core._walk import CallWalk, Op, Outcome


class Flow(BaseException):
    """A framework's control flow (LangGraph's GraphBubbleUp)."""


class Lost(Exception):
    """An exception that leaves the call's outcome unknown."""


D = Execute("e1", {"a": 1}, "do-e1", ToolTier.COMPENSABLE, "refund", None, "s1")


def _walk(policy: RetryPolicy | None = None, rollback: bool = True) -> CallWalk:
    return CallWalk(D, (Flow,), (Lost,), rollback=rollback, note=True, policy=policy)


def _drive(walk: Any, answers: dict[Op, Any], attempts: list[BaseException | Any]) -> tuple[list[Op], Any]:
    """Drive ``walk`` as a loop would, with canned answers; ``attempts`` are what each INVOKE raises or returns."""
    asked: list[Op] = []
    try:
        op, _arg = next(walk)
        while True:
            asked.append(op)
            if op is Op.INVOKE:
                got = attempts.pop(0)
                op, _arg = walk.throw(got) if isinstance(got, BaseException) else walk.send(got)
            else:
                op, _arg = walk.send(answers.get(op))
    except StopIteration as done:
        return asked, done.value


def test_a_failure_is_recorded_then_rolled_back_by_policy() -> None:
    exc = ValueError("declined")
    asked, (value, out) = _drive(_walk().raised(exc), {Op.RECORD: "rollback", Op.ROLLBACK: "report"}, [])
    assert asked == [Op.RECORD, Op.ROLLBACK]
    assert value is None and isinstance(out, Outcome) and out.error is exc and out.rollback == "report"


def test_a_session_that_continues_or_a_caller_that_rolls_back_itself_gets_no_rollback() -> None:
    asked, (_, out) = _drive(_walk().raised(ValueError("x")), {Op.RECORD: "continue"}, [])
    assert asked == [Op.RECORD] and out.rollback is None
    asked, (_, out) = _drive(_walk(rollback=False).raised(ValueError("x")), {Op.RECORD: "rollback"}, [])
    assert asked == [Op.RECORD] and out.rollback is None


def test_a_retry_that_succeeds_hands_the_value_back() -> None:
    policy = RetryPolicy(attempts=3, backoff=0.0, on=(ValueError,))
    asked, result = _drive(_walk(policy).raised(ValueError("busy")), {}, [ValueError("busy"), 42])
    assert asked == [Op.SLEEP, Op.INVOKE, Op.SLEEP, Op.INVOKE] and result == (42, None)


def test_retries_that_all_fail_record_the_last_error_noted() -> None:
    policy = RetryPolicy(attempts=2, backoff=0.0, on=(ValueError,))
    last = ValueError("still busy")
    asked, (_, out) = _drive(_walk(policy).raised(ValueError("busy")), {Op.RECORD: "continue"}, [last])
    assert asked == [Op.SLEEP, Op.INVOKE, Op.RECORD] and out.error is last
    assert any("failed on each of 2 attempts" in n for n in last.__notes__)


def test_an_unknown_outcome_is_settled_never_retried_or_recorded() -> None:
    policy = RetryPolicy(attempts=3, backoff=0.0, on=(Exception,))
    lost = Lost("timeout")
    asked, (_, out) = _drive(_walk(policy).raised(lost), {Op.SETTLE: "compensated"}, [])
    assert asked == [Op.SETTLE] and out.error is lost and out.in_doubt == "compensated"
    # A retry whose outcome is unknown ends the retries: settled as in doubt.
    asked, (_, out) = _drive(_walk(policy).raised(ValueError("x")), {Op.SETTLE: "unknown"}, [Lost("t")])
    assert asked == [Op.SLEEP, Op.INVOKE, Op.SETTLE] and out.in_doubt == "unknown"


def test_control_flow_is_released_and_raised_as_itself() -> None:
    flow = Flow()
    with pytest.raises(Flow) as raised:
        _drive(_walk().raised(flow), {}, [])
    assert raised.value is flow


def test_a_failure_reported_as_a_value_keeps_the_value() -> None:
    asked, out = _drive(_walk().failed("refund failed: declined", value="msg"), {Op.RECORD: "rollback",
                                                                                 Op.ROLLBACK: "report"}, [])
    assert asked == [Op.RECORD, Op.ROLLBACK]
    assert out == Outcome(value="msg", error=None, rollback="report", failure="refund failed: declined")
