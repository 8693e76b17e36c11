"""Contracts: fingerprints, immutable revisions, session pinning, revalidation, approvals bound to the contract."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa

from undolog_core import ApprovalPending, ToolTier, errors, undolog_tool
from undolog_core.storage import schema as t
from undolog_core.testing import internals


def make(reason: str, tier=ToolTier.IRREVERSIBLE):
    @undolog_tool(tier=tier, reason=reason, risk_tags=["pii"])
    def delete_user_account(user_id: str) -> dict:
        return {"deleted": user_id}

    return delete_user_account


def registry_rows(u):
    with internals(u).read() as c:
        return [r._mapping for r in c.execute(sa.select(t.tool_registry).order_by(t.tool_registry.c.revision))]


def test_fingerprint_is_stable_and_changes_make_revisions(db):
    u = db.open()
    [a] = u.register(make("Deletes the user"), registered_by="dev:ana")
    [b] = db.open().register(make("Deletes the user"))
    assert a.fingerprint == b.fingerprint and a.revision == b.revision == 1
    assert len(registry_rows(u)) == 1
    [c] = db.open().register(make("Deletes the user and their invoices"), registered_by="dev:bo")
    assert c.revision == 2 and c.fingerprint != a.fingerprint
    rows = registry_rows(u)
    assert [(r["revision"], r["previous_fingerprint"], r["registered_by"]) for r in rows] == [
        (1, None, "dev:ana"), (2, a.fingerprint, "dev:bo")
    ]
    assert rows[1]["contract"]["reason"] == "Deletes the user and their invoices"


def test_registry_tier_check_constraint(undolog):
    with pytest.raises(sa.exc.IntegrityError):
        with internals(undolog).write() as c:
            c.execute(t.tool_registry.insert().values(
                tool_name="x", revision=1, tier="dangerous", fingerprint="f", contract={},
                registered_at=dt.datetime.now(dt.UTC), registered_by="me"))


async def test_resumed_session_refuses_a_changed_tool_until_revalidated(db):
    u1 = db.open()
    u1.register(make("v1"))
    s = u1.session(agent_id="bot")
    sid = s.id
    u1.close()
    u2 = db.open()  # a new process with a changed contract
    [spec] = u2.register(make("v2: also removes backups"))
    resumed = u2.session(session_id=sid)
    with pytest.raises(errors.ContractChanged, match="revalidate"):
        await resumed.call("delete_user_account", user_id="u1", call_id="c1")
    with internals(u2).read() as c:
        assert c.execute(sa.select(sa.func.count()).select_from(t.approval_requests)).scalar() == 0
    changed = resumed.revalidate(actor="ana")
    assert changed == {"delete_user_account": {"from": 1, "to": 2}}
    with pytest.raises(ApprovalPending):
        await resumed.call("delete_user_account", user_id="u1", call_id="c1")
    with internals(u2).read() as c:
        actions = c.execute(sa.select(t.approval_events.c.action)).scalars().all()
    assert "session.revalidate" in actions


async def test_a_contract_changed_in_the_same_process_is_not_bypassed_by_the_old_function(db):
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_note")
    def write_note(text: str) -> str:
        return "v1:" + text

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="undo_note", reason="now also emails the note")
    def write_note_v2(text: str, to: str = "team") -> str:
        return "v2:" + text

    from undolog_core import compensation

    @compensation("undo_note")
    def undo_note(ctx) -> None:
        return None

    u = db.open()
    u.register(write_note, undo_note)
    s = u.session(agent_id="bot")
    assert await s.call(write_note, text="a") == "v1:a"
    [v2] = u.register((write_note_v2, write_note_v2.__undolog_spec__, {"name": "write_note"}))
    assert v2.revision == 2
    # The old function object names the tool, and the tool's contract changed under the running session.
    with pytest.raises(errors.ContractChanged, match="revalidate"):
        await s.call(write_note, text="b")
    with pytest.raises(errors.ContractChanged):
        s.call_sync(write_note_v2, text="b")
    s.revalidate(actor="ana")
    assert await s.call(write_note, text="c") == "v2:c"
    assert [e["args_snapshot"] for e in u.sessions.effects(s.id)] == [{"text": "a"}, {"text": "c", "to": "team"}]


async def test_contract_change_cancels_bound_pending_approval(db):
    u1 = db.open()
    u1.register(make("v1"))
    s = u1.session()
    with pytest.raises(ApprovalPending) as p:
        await s.call("delete_user_account", user_id="u1", call_id="c1")
    u2 = db.open()
    u2.register(make("v2"))
    rec = u2.approvals.get(p.value.approval_request_id)
    assert rec.state == "cancelled" and "contract" in rec.decision_reason
    with pytest.raises(errors.ApprovalAlreadyDecided):
        u2.approvals.approve(rec.approval_request_id, approver="ana")
    assert u2.sessions.get(s.id).state == "active"


def test_policy_is_audited_and_validated(undolog):
    p = undolog.policy.set(actor="admin:ana", approval_timeout_seconds=900, context_calls=3)
    assert (p.approval_timeout_seconds, p.context_calls, p.auto_approve_on_timeout) == (900, 3, False)
    for bad in ({"approval_timeout_seconds": 0}, {"approval_timeout_seconds": "soon"},
                {"auto_approve_on_timeout": "maybe"}, {"nonsense": 1}):
        with pytest.raises(errors.PolicyInvalid):
            undolog.policy.set(actor="admin", **bad)
    assert undolog.policy.get() == p
    with internals(undolog).read() as c:
        ev = c.execute(sa.select(t.approval_events).where(t.approval_events.c.action == "policy.set")).all()
    assert len(ev) == 1 and ev[0].actor == "admin:ana"
