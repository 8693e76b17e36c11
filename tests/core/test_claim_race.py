"""Two callers of one approved IRREVERSIBLE call in one process: the loser of the claim must not unregister the
winner's running call.

Found through the MCP gateway on PostgreSQL: five clients asking an approved call at once ran it once, but the
losers answered "was interrupted by a crash; run `undolog recover`" while it ran. The caller that lost the claim
had dropped the effect from this process's in-flight set, which the winner had put it in: this process then
vouched for it no more (its lease is no longer renewed, and another process's recovery may take it for crashed
while it runs).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from undolog_core import ApprovalPending, ToolTier, UndoLog, undolog_tool
from undolog_core._json import canonical_json, sha256_hex
from undolog_core.errors import InvalidEffectState
from undolog_core.storage.base import utcnow


async def test_the_loser_of_a_claim_leaves_the_winners_call_in_flight(undolog: UndoLog) -> None:
    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="wipes it")
    def wipe(name: str) -> str:
        return f"wiped {name}"

    undolog.register(wipe)
    s = undolog.session()
    with pytest.raises(ApprovalPending) as p:
        await s.call(wipe, name="x", call_id="c1")
    undolog.approvals.approve(p.value.approval_request_id, approver="ana")
    engine = undolog.driver.engine
    spec = undolog.registry.tools["wipe"]
    # Both callers read the approved row before either claims it (the race, made explicit).
    row = engine.store.effects.find_irreversible(s.id, "wipe", "c1", sha256_hex(canonical_json({"name": "x"})))
    sc = engine.table.written_record(s.id)
    winner = engine.gate._claim_run(sc, spec, row)
    with pytest.raises(InvalidEffectState, match="claimed by another caller"):
        engine.gate._claim_run(sc, spec, row)
    assert winner.effect_id in engine.leases.inflight  # still this process's, renewed while it runs
    with pytest.raises(InvalidEffectState, match="running right now"):
        await s.call(wipe, name="x", call_id="c1")


async def test_the_loser_of_a_claim_won_elsewhere_does_not_vouch_for_it(db: Any) -> None:
    """The winner is another UndoLog (another process, as far as owners go): the loser put the effect in its own
    in-flight set before claiming, and must take it out again, or it renews the lease of a call it does not run
    (and its own recovery answers 'running right now' for a call another process may have finished or crashed in)."""
    here, there = db.open(), db.open()

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="wipes it")
    def wipe(name: str) -> str:
        return f"wiped {name}"

    here.register(wipe)
    there.register(wipe)
    s = here.session()
    with pytest.raises(ApprovalPending) as p:
        await s.call(wipe, name="x", call_id="c1")
    here.approvals.approve(p.value.approval_request_id, approver="ana")
    row = here.driver.engine.store.effects.find_irreversible(s.id, "wipe", "c1", sha256_hex(canonical_json({"name": "x"})))
    far, near = there.driver.engine, here.driver.engine
    won = far.gate._claim_run(far.table.written_record(s.id), there.registry.tools["wipe"], row)
    with pytest.raises(InvalidEffectState, match="claimed by another caller"):
        near.gate._claim_run(near.table.written_record(s.id), here.registry.tools["wipe"], row)
    assert won.effect_id in there.driver.engine.leases.inflight
    assert won.effect_id not in here.driver.engine.leases.inflight
    with pytest.raises(InvalidEffectState, match="running in another process"):  # and a re-issue here says so
        await s.call(wipe, name="x", call_id="c1")


async def test_an_approval_that_lapses_between_the_read_and_the_claim_asks_again(undolog: UndoLog,
                                                                               monkeypatch: Any) -> None:
    """The sweeper lapses an approval (approved_ttl_seconds) between the re-issue's read of the approved call and its
    claim: the re-issue raises a new request, as a re-issue after the lapse does, not a 409 'claimed by another
    caller' for a claim nobody won; the tool never runs on the lapsed approval."""
    ran: list[str] = []

    @undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="wipes it")
    def wipe(name: str) -> str:
        ran.append(name)
        return f"wiped {name}"

    undolog.register(wipe)
    s = undolog.session()
    with pytest.raises(ApprovalPending) as p:
        await s.call(wipe, name="x", call_id="c1")
    first = p.value.approval_request_id
    undolog.approvals.approve(first, approver="ana")
    engine = undolog.driver.engine
    resume = engine.gate._resume_irreversible
    swept: list[str] = []

    def sweeper_first(*a: Any, **kw: Any) -> Any:
        if not swept:  # the sweeper's lapse commits in between (its own transaction, as another process's would)
            undolog.policy.set(actor="test", approved_ttl_seconds=1)
            swept.extend(undolog.approvals.lapse([first], now=utcnow() + dt.timedelta(seconds=5)))
        return resume(*a, **kw)

    monkeypatch.setattr(engine.gate, "_resume_irreversible", sweeper_first)
    with pytest.raises(ApprovalPending) as again:
        await s.call(wipe, name="x", call_id="c1")
    assert swept == [first]
    assert again.value.approval_request_id != first
    assert undolog.approvals.get(first).state == "expired" and ran == []
