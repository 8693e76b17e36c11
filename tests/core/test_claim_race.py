"""Two callers of one approved IRREVERSIBLE call in one process: the loser of the claim must not unregister the
winner's running call.

Found through the MCP gateway on PostgreSQL: five clients asking an approved call at once ran it once, but the
losers answered "was interrupted by a crash; run `undolog recover`" while it ran. The caller that lost the claim
had dropped the effect from this process's in-flight set, which the winner had put it in: this process then
vouched for it no more (its lease is no longer renewed, and another process's recovery may take it for crashed
while it runs).
"""

from __future__ import annotations

import pytest

from undolog_core import ApprovalPending, ToolTier, UndoLog, undolog_tool
from undolog_core._tools import canonical_json, sha256_hex
from undolog_core.errors import InvalidEffectState


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
    row = engine.store.find_irreversible(s.id, "wipe", "c1", sha256_hex(canonical_json({"name": "x"})))
    sc = engine._session(s.id)
    winner = engine._claim_run(sc, spec, row)
    with pytest.raises(InvalidEffectState, match="claimed by another caller"):
        engine._claim_run(sc, spec, row)
    assert winner.effect_id in engine.leases.inflight  # still this process's, renewed while it runs
    with pytest.raises(InvalidEffectState, match="running right now"):
        await s.call(wipe, name="x", call_id="c1")
