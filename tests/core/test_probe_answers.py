"""A Python probe's three answers: ``False`` (did not happen), ``None`` (cannot tell), ``True`` or the result
(happened). Only ``False`` settles a call as not run, and only once its request can no longer land.

Before: ``None`` counted as "did not happen" (an approved IRREVERSIBLE call went back to approved, to run again on
a guess), and "did not happen" compensated a COMPENSABLE call, undoing what never ran (0 -> -5).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core import AwaitingApproval, Execute, ToolTier, compensation, undolog_tool
from undolog_core.storage import schema as t

pytestmark = pytest.mark.storage

# The world: a counter, what the probe answers, and the keys the tool applied.
WORLD: dict[str, Any] = {}


def _probe(ctx: Any) -> Any:
    return WORLD["answer"]


@compensation(name="take_back")
def take_back(ctx: Any) -> None:
    WORLD["counter"] -= ctx.args["n"]
    WORLD["history"].append(WORLD["counter"])


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="take_back", probe=_probe)
def add(n: int) -> int:
    WORLD["counter"] += n
    WORLD["history"].append(WORLD["counter"])
    return int(WORLD["counter"])


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="gone for good", probe=_probe)
def wipe(what: str) -> str:
    return "wiped"


class Lost(Exception):
    """The tool's answer was lost; ``original_gone`` says whether its request can still land."""

    def __init__(self, gone: bool) -> None:
        super().__init__("no answer")
        self.original_gone = gone


@pytest.fixture
def u(undolog: Any) -> Any:
    WORLD.clear()
    WORLD.update(counter=0, history=[0], answer=None)
    undolog.register(add, wipe, take_back)
    return undolog


def _lose(u: Any, sid: str, *, gone: bool) -> Any:
    d = u.driver.decide(sid, "add", {"n": 5})
    assert isinstance(d, Execute)

    def invoke(args: dict[str, Any]) -> Any:
        raise Lost(gone)  # the request never reached the counter

    return d, u.driver.run_sync(d, invoke, unknown_on=(Lost,))


def _probe_events(u: Any) -> list[tuple[str, str]]:
    with u.store.read() as c:
        rows = c.execute(sa.select(t.approval_events.c.payload).where(t.approval_events.c.action == "effect.probe")
                         .order_by(t.approval_events.c.event_id)).scalars().all()
    out = [p if isinstance(p, dict) else json.loads(p) for p in rows]
    return [(p["answer"], p["settled"]) for p in out]


def test_did_not_happen_once_the_request_cannot_land_settles_not_run_without_compensating(u: Any) -> None:
    WORLD["answer"] = False
    s = u.session(agent_id="p")
    d, outcome = _lose(u, s.id, gone=True)
    assert outcome.in_doubt == "not_run"
    assert WORLD["history"] == [0]  # never 0 -> -5
    assert u.sessions.effects(s.id)[-1]["state"] == "failed"
    assert u.sessions.get(s.id).state == "active"  # nothing happened: the session goes on
    assert u.rollback(s.id).steps == []  # its undo entry went with it
    assert WORLD["history"] == [0]
    assert _probe_events(u) == [("not_happened", "not_run")]


def test_did_not_happen_while_the_request_may_still_land_holds_it_until_it_cannot(u: Any, db: Any) -> None:
    WORLD["answer"] = False
    s = u.session(agent_id="p")
    d, outcome = _lose(u, s.id, gone=False)
    assert outcome.in_doubt == "settling"
    assert WORLD["history"] == [0]
    assert u.sessions.effects(s.id)[-1]["state"] == "pending"  # still in flight, held by this process
    other = db.open()  # another process's recovery leaves a live owner's call alone
    other.register(add, wipe, take_back)
    assert other.recover().reconciled == []
    # The original lands after all; once it cannot land any more, the probe says it happened.
    WORLD["counter"] = 5
    WORLD["history"].append(5)
    WORLD["answer"] = 5
    assert u.driver.in_doubt(d.effect_id, original_gone=True) == "committed"
    assert WORLD["history"] == [0, 5]
    assert u.sessions.effects(s.id)[-1]["state"] == "committed"
    assert _probe_events(u) == [("not_happened", "settling"), ("happened", "committed")]


def test_a_probe_that_returns_none_cannot_tell_and_takes_the_no_probe_path(u: Any) -> None:
    WORLD["answer"] = None
    s = u.session(agent_id="p")
    d, outcome = _lose(u, s.id, gone=True)
    assert outcome.in_doubt == "compensated"  # as without a probe: a compensation tolerates "never happened"
    assert u.sessions.get(s.id).state == "halted"
    assert _probe_events(u) == [("cant_tell", "compensated")]


def test_an_irreversible_call_whose_probe_cannot_tell_is_unknown_never_run_again(u: Any) -> None:
    """Before: None put the approved call back to approved, so its re-issue ran it a second time on a guess."""
    WORLD["answer"] = None
    s = u.session(agent_id="p")
    w = u.driver.decide(s.id, "wipe", {"what": "all"}, call_id="w1")
    assert isinstance(w, AwaitingApproval)
    u.approvals.approve(w.approval_request_id, approver="ana")
    d = u.driver.decide(s.id, "wipe", {"what": "all"}, call_id="w1")
    assert isinstance(d, Execute)

    def invoke(args: dict[str, Any]) -> Any:
        raise Lost(True)

    outcome = u.driver.run_sync(d, invoke, unknown_on=(Lost,))
    assert outcome.in_doubt == "unknown"
    assert u.sessions.get(s.id).state == "halted"
    assert _probe_events(u) == [("cant_tell", "unknown")]
