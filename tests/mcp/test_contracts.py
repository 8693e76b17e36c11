"""Contracts an MCP client can live with: what the gateway fingerprints, and what a client is told when its
session stops taking calls (rolled back, halted, a real contract change), through the real gateway subprocess and
the real CLI. An MCP client cannot revalidate or resume a session: a person does, and the refusal says how.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mcp import types
from mcp.client.session import ClientSession
from mcp.shared.context import RequestContext

from undolog_core import SessionState
from undolog_mcp import Gateway, load_config

from .test_gateway import cli, gateway, only_session, text, write_config

pytestmark = pytest.mark.reads_store

META = "dev.undolog/call"


def _tool(description: str, *, annotations: types.ToolAnnotations | None = None,
          schema: dict[str, Any] | None = None) -> types.Tool:
    return types.Tool(name="close_ticket", description=description, annotations=annotations,
                      inputSchema=schema or {"type": "object", "properties": {"id": {"type": "integer"}},
                                             "required": ["id"]})


def test_a_reworded_description_or_new_annotations_are_no_new_contract(db: Any) -> None:
    """Before: the reason defaulted to the upstream's description, and description and annotations were
    fingerprinted: an upstream that reworded a tool (or listed it otherwise when started again) made a new revision,
    refusing the session's next call until `session.revalidate(...)`, which no MCP client can call."""
    cfg = load_config({"upstreams": {"tickets": {"url": "http://127.0.0.1:9/mcp"}},
                       "tools": {"tickets": {"close_ticket": {"tier": "irreversible"}}}})
    gw = Gateway(cfg, db.open())
    first = gw.register({"tickets": [_tool("Close a ticket.")]}).tools["close_ticket"].spec
    assert first is not None and first.reason == "tickets/close_ticket"  # the config's, not the upstream's words
    reworded = gw.register({"tickets": [_tool("Closes a ticket (v2 wording).", annotations=types.ToolAnnotations(
        destructiveHint=False, title="Close"))]}).tools["close_ticket"].spec
    assert reworded is not None and reworded.revision == first.revision
    changed = gw.register({"tickets": [_tool("Close a ticket.", schema={
        "type": "object", "properties": {"id": {"type": "integer"}, "reason": {"type": "string"}},
        "required": ["id"]})]}).tools["close_ticket"].spec
    assert changed is not None and changed.revision != first.revision  # a real change is one


async def test_a_real_contract_change_is_refused_naming_what_a_person_runs(db: Any, tmp_path: Path) -> None:
    # close_ticket takes a new argument once upgrade_tools ran (and the upstream says its tools changed): the
    # session was validated against the old contract.
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "safe"
        [tools.tickets.upgrade_tools]
        tier = "safe"
    """)
    async with gateway(db, cfg) as client:
        assert not (await client.call_tool("close_ticket", {"id": 1})).isError
        assert not (await client.call_tool("upgrade_tools", {})).isError
        await client.call_tool("search_tickets", {"q": "x"})  # the next call lists the changed tools anew
        refused = await client.call_tool("close_ticket", {"id": 1})
        sid = only_session(db.open()).session_id
        assert refused.isError and (refused.meta or {})[META]["error"] == "contract_changed", text(refused)
        assert f"undolog sessions revalidate {sid}" in text(refused) and "Revalidate button" in text(refused)
        done = cli(db, "sessions", "revalidate", sid)  # pins each tool to its newest stored revision
        assert done.returncode == 0, done.stdout + done.stderr
        again = await client.call_tool("close_ticket", {"id": 1})
        assert not again.isError, text(again)


async def test_after_a_completed_rollback_the_next_call_starts_a_new_session_and_says_both(db: Any,
                                                                                         tmp_path: Path) -> None:
    """Before: a rolled-back session refused every later call of its client, for as long as it stayed connected."""
    cfg = write_config(tmp_path)
    async with gateway(db, cfg) as client:
        await client.call_tool("reserve_seat", {"seat": "1A"})
        old = only_session(db.open()).session_id
        out = cli(db, "--app", str(cfg), "sessions", "rollback", old)
        assert out.returncode == 0, out.stdout + out.stderr
        again = await client.call_tool("reserve_seat", {"seat": "2B"})
        assert not again.isError, text(again)
        told = (again.meta or {})[META]
        assert told["previous_session"] == old and told["session"] != old
        assert old in text(again) and told["session"] in text(again)
        later = await client.call_tool("reserve_seat", {"seat": "3C"})  # the new session goes on, said once
        assert not later.isError and "previous_session" not in (later.meta or {}).get(META, {})
    u = db.open()
    assert u.sessions.get(old).state == SessionState.ROLLED_BACK
    new = u.sessions.get(told["session"])
    assert new.state == SessionState.ACTIVE and [e["args_snapshot"]["seat"] for e in
                                                  u.sessions.effects(new.session_id)] == ["2B", "3C"]


async def test_a_halted_session_stays_halted_and_says_what_resumes_it(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    async with gateway(db, cfg) as client:
        asked = await client.call_tool("delete_project", {"name": "p"})
        rid = (asked.structuredContent or {})["approval_request_id"]
        done = cli(db, "approvals", "reject", rid, "--reason", "not this one")
        assert done.returncode == 0, done.stdout + done.stderr
        sid = only_session(db.open()).session_id
        for _ in range(2):  # asked again: still halted, never a new session behind a person's back
            refused = await client.call_tool("reserve_seat", {"seat": "1A"})
            assert refused.isError and (refused.meta or {})[META] == {"error": "session_halted", "session": sid}
            assert sid in text(refused) and f"undolog sessions resume {sid}" in text(refused)
        done = cli(db, "sessions", "resume", sid, "--reason", "looked at it")
        assert done.returncode == 0, done.stdout + done.stderr
        goes_on = await client.call_tool("reserve_seat", {"seat": "1A"})  # what the refusal said resumes it
        assert not goes_on.isError, text(goes_on)
    assert len([s for s in db.open().sessions.list() if (s.agent_id or "").startswith("mcp:")]) == 1


def _says_no(reason: str) -> Any:
    async def answer(ctx: RequestContext[ClientSession, Any], params: types.ElicitRequestParams) -> types.ElicitResult:
        return types.ElicitResult(action="decline", content={"reason": reason})
    return answer


async def test_an_elicitation_decline_is_a_respond_and_the_session_goes_on(db: Any, tmp_path: Path) -> None:
    """Before: a "no" in the client's form was a reject, which halts the session."""
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
        approval = "elicit"
    """)
    async with gateway(db, cfg, elicit=_says_no("use the archive instead")) as client:
        answered = await client.call_tool("close_ticket", {"id": 1})
        assert not answered.isError and "use the archive instead" in text(answered), text(answered)
        assert (answered.meta or {})[META] == {"responded": True}
        goes_on = await client.call_tool("reserve_seat", {"seat": "1A"})
        assert not goes_on.isError, text(goes_on)
    u = db.open()
    s = only_session(u)
    assert s.state == SessionState.ACTIVE
    (req,) = u.approvals.list(session_id=s.session_id)
    assert req.state.value == "responded"


async def test_a_tool_whose_decline_is_reject_halts_the_session(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
        approval = "elicit"
        decline = "reject"
    """)
    async with gateway(db, cfg, elicit=_says_no("never")) as client:
        answered = await client.call_tool("close_ticket", {"id": 1})
        assert answered.isError and (answered.meta or {})[META]["error"] == "approval_rejected", text(answered)
    assert only_session(db.open()).state == SessionState.HALTED


def test_decline_is_refused_on_a_tool_decided_at_the_desk(tmp_path: Path) -> None:
    from undolog_core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="decline is for approval"):
        load_config({"upstreams": {"t": {"url": "http://127.0.0.1:9/mcp"}},
                     "tools": {"t": {"x": {"tier": "irreversible", "decline": "reject"}}}})
