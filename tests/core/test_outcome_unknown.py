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
