"""Approvals released across sessions, narrowly: over HTTP, to a later session of the same API key asking the
same call, while the request's own session is active; joined while pending; a reject halts every joiner. Over
stdio (the local socket) approvals stay bound to their session. A real HTTP gateway process behind real desk keys,
the SDK's client, the SDK-written upstream; decisions through the real CLI. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from undolog_core import EffectState, SessionState

from .test_gateway import cli, text, world
from .test_sessions import (
    agent_key,
    connected,
    grouped_config,
    http_gateway,
    over_http,
    session_of,
    socket_gateway,
)

pytestmark = pytest.mark.reads_store


async def ask(url: str, token: str, name: str) -> Any:
    """One call in an MCP session of its own (as a client that opens a session per call does)."""
    async with over_http(url, token) as client:
        return await client.call_tool("delete_project", {"name": name})


async def test_an_approval_is_released_once_to_a_later_session_of_the_same_key(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "mcp")
    u = db.open()
    bot, other = agent_key(db, "bot"), agent_key(db, "other")
    with http_gateway(db, cfg) as url:
        first = await ask(url, bot, "acme")
        request_id = (first.structuredContent or {})["approval_request_id"]
        origin = session_of(first)
        joined = await ask(url, bot, "acme")  # pending: the same ask from a later session joins the request
        assert (joined.structuredContent or {})["approval_request_id"] == request_id
        assert session_of(joined) != origin and "waits on that request" in text(joined)
        foreign = await ask(url, other, "acme")  # another key's ask is its own request
        assert (foreign.structuredContent or {})["approval_request_id"] != request_id
        assert len(u.approvals.list(state="pending")) == 2
        done = cli(db, "approvals", "approve", request_id)
        assert done.returncode == 0, done.stderr
        ran = await ask(url, bot, "acme")
        assert not ran.isError and "deleted acme" in text(ran)
        assert session_of(ran) == origin  # run and recorded in the request's own session
        # Released once: a later identical call (the approved one has run) asks a person anew.
        later = await ask(url, bot, "acme")
        assert (later.structuredContent or {}).get("status") == "awaiting_approval"
        assert later.structuredContent["approval_request_id"] not in (request_id,)
    assert [c["tool"] for c in world(tmp_path)["calls"]] == ["delete_project"]  # exactly once
    effect = next(e for e in u.sessions.effects(origin) if e["tool_name"] == "delete_project")
    assert effect["state"] == EffectState.COMMITTED
    events = u.approvals.events(request_id)
    actions = [(ev.action, ev.payload.get("session_id")) for ev in events]
    assert ("joined", session_of(joined)) in actions
    released = [sid for action, sid in actions if action == "released"]
    assert len(released) == 1 and released[0] not in (origin, session_of(joined))
    assert all(ev.actor.startswith("key:") for ev in events if ev.action in ("joined", "released"))


async def test_a_reject_halts_the_request_session_and_every_joiner(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "mcp")
    u = db.open()
    bot = agent_key(db, "bot")
    with http_gateway(db, cfg) as url:
        first = await ask(url, bot, "globex")
        request_id = (first.structuredContent or {})["approval_request_id"]
        joiners = [session_of(await ask(url, bot, "globex")) for _ in range(2)]
        assert len(u.approvals.list(state="pending")) == 1  # no new request
        done = cli(db, "approvals", "reject", request_id, "--reason", "not that project")
        assert done.returncode == 0, done.stderr
        for sid in [session_of(first), *joiners]:
            assert u.sessions.get(sid).state == SessionState.HALTED
        # A joiner's MCP session now gets the halt, not a run.
        async with over_http(url, bot, headers={"X-UndoLog-Session": joiners[0]}) as client:
            made = await client.call_tool("create_ticket", {"title": "after the reject"})
            assert made.isError and "halted" in text(made)
    assert world(tmp_path)["calls"] == [] if (tmp_path / "tickets.json").exists() else True


async def test_no_release_when_the_request_session_is_not_active(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "mcp")
    u = db.open()
    bot = agent_key(db, "bot")
    with http_gateway(db, cfg) as url:
        first = await ask(url, bot, "initech")
        request_id = (first.structuredContent or {})["approval_request_id"]
        assert cli(db, "approvals", "approve", request_id).returncode == 0
        # The request's session halts (a person stopped it) before the re-issue arrives from another session.
        u.sessions.set_state(session_of(first), SessionState.HALTED, allowed=(SessionState.ACTIVE,))
        again = await ask(url, bot, "initech")
        assert (again.structuredContent or {}).get("status") == "awaiting_approval"
        assert again.structuredContent["approval_request_id"] != request_id
    assert not (tmp_path / "tickets.json").exists() or world(tmp_path)["calls"] == []


async def test_over_the_socket_approvals_stay_bound_to_their_session(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "mcp")
    sock = tmp_path / "gw.sock"
    u = db.open()
    with socket_gateway(db, cfg, sock):
        async with connected(db, sock) as client:
            first = await client.call_tool("delete_project", {"name": "acme"})
        request_id = (first.structuredContent or {})["approval_request_id"]
        assert cli(db, "approvals", "approve", request_id).returncode == 0
        async with connected(db, sock) as client:
            again = await client.call_tool("delete_project", {"name": "acme"})
        assert (again.structuredContent or {}).get("status") == "awaiting_approval"
        assert again.structuredContent["approval_request_id"] != request_id
    assert not (tmp_path / "tickets.json").exists() or world(tmp_path)["calls"] == []
    assert u.approvals.get(request_id).state == "approved"
