"""The call driver's ``unknown_on``: an approved IRREVERSIBLE call without a probe whose outcome was lost is
``unknown`` and halts its session, on the sync and the async twin alike.

The desk's proxy uses it when an upstream times out (tests/server/test_security.py drives that end to end).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from undolog_core import AwaitingApproval, Execute, errors

from ..support.toolkit import setup


def _approved(undolog: Any, sid: str, call_id: str) -> Execute:
    w = undolog.driver.decide(sid, "delete_user_account", {"user_id": call_id}, call_id=call_id)
    assert isinstance(w, AwaitingApproval)
    undolog.approvals.approve(w.approval_request_id, approver="ana")
    d = undolog.driver.decide(sid, "delete_user_account", {"user_id": call_id}, call_id=call_id)
    assert isinstance(d, Execute)
    return d


def _lost(args: dict[str, Any]) -> Any:
    raise TimeoutError("the upstream did not answer")


@pytest.mark.parametrize("twin", ["sync", "async"])
def test_an_unknown_outcome_is_recorded_unknown_and_halts_never_rolled_back(undolog: Any, twin: str) -> None:
    setup(undolog)
    s = undolog.session(agent_id="unknown")
    d = _approved(undolog, s.id, "d1")
    if twin == "sync":
        outcome = undolog.driver.run_sync(d, _lost, unknown_on=(TimeoutError,))
    else:
        outcome = asyncio.run(undolog.driver.run_async(d, _lost, unknown_on=(TimeoutError,)))
    assert outcome.in_doubt == "unknown" and isinstance(outcome.error, TimeoutError) and outcome.rollback is None
    effect = undolog.sessions.effects(s.id)[-1]
    assert effect["state"] == "unknown"
    assert undolog.sessions.get(s.id).state == "halted"
    # Never re-run blindly: the re-issue says the outcome is unknown.
    with pytest.raises(errors.OutcomeUnknown):
        undolog.driver.decide(s.id, "delete_user_account", {"user_id": "d1"}, call_id="d1")


def test_other_errors_still_fail(undolog: Any) -> None:
    setup(undolog)
    s = undolog.session(agent_id="failed")
    d = _approved(undolog, s.id, "d2")
    outcome = undolog.driver.run_sync(d, lambda args: 1 / 0, unknown_on=(TimeoutError,))
    assert outcome.in_doubt is None and isinstance(outcome.error, ZeroDivisionError)
    assert undolog.sessions.effects(s.id)[-1]["state"] == "failed"


class _StillOut(TimeoutError):
    """A timeout whose request is still out: its caller settles the call on the tool's late answer."""

    settles_later = True


def test_an_outcome_its_caller_settles_later_is_left_in_flight_then_settled_on_the_late_answer(undolog: Any) -> None:
    """The MCP gateway's path after a timeout (it cancels upstream and waits for the answer): nothing is settled
    while the request may still land, then the late answer is recorded through the same driver."""
    setup(undolog)
    s = undolog.session(agent_id="late")
    d = _approved(undolog, s.id, "d3")

    def still_out(args: dict[str, Any]) -> Any:
        raise _StillOut("no answer yet; asked to cancel")

    outcome = asyncio.run(undolog.driver.run_async(d, still_out, unknown_on=(TimeoutError,)))
    assert outcome.in_doubt == "settling" and isinstance(outcome.error, _StillOut)
    assert undolog.sessions.effects(s.id)[-1]["state"] == "running"  # in flight, held here
    assert undolog.sessions.get(s.id).state == "active"
    late = asyncio.run(undolog.driver.run_async(d, lambda args: "deleted", unknown_on=(TimeoutError,)))
    assert late.ok and undolog.sessions.effects(s.id)[-1]["state"] == "committed"
