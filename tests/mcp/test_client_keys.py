"""A client's own idempotency key (``_meta`` ``dev.undolog/idempotency-key``) on COMPENSABLE and IRREVERSIBLE
calls: replayed, refused with other arguments, and scoped by (API key, tool, key) over HTTP and by (UndoLog
session, tool, key) over stdio; a SAFE call's key is forwarded, not recorded. Real gateway processes, the SDK's
clients, the SDK-written upstream. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from undolog_core import EffectState

from .test_gateway import cli, gateway, text, world, write_config
from .test_sessions import agent_key, grouped_config, http_gateway, over_http, session_of

# SQLite run only (reads_store) but for the HTTP case, in the PostgreSQL smoke subset: the keys' joining rules sit
# above storage (tests/core pins the sessions' and effects' queries on both databases).
pytestmark = pytest.mark.reads_store

KEY = "dev.undolog/idempotency-key"


async def test_over_stdio_a_key_replays_refuses_other_arguments_and_stays_in_its_session(
        db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    u = db.open()
    async with gateway(db, cfg, name="first") as client:
        made = await client.call_tool("create_ticket", {"title": "printer"}, meta={KEY: "k1"})
        assert not made.isError and made.structuredContent == {"id": 1, "title": "printer", "status": "open"}
        again = await client.call_tool("create_ticket", {"title": "printer"}, meta={KEY: "k1"})
        assert again.structuredContent == made.structuredContent
        assert (again.meta or {})["dev.undolog/call"]["replayed"] is True
        other = await client.call_tool("create_ticket", {"title": "scanner"}, meta={KEY: "k1"})
        assert other.isError and "other arguments" in text(other) and "k1" in text(other)
        # The same key on another tool is another call.
        seat = await client.call_tool("reserve_seat", {"seat": "1A"}, meta={KEY: "k1"})
        assert not seat.isError
        # A SAFE call's key goes to the upstream as it came; nothing is recorded.
        found = await client.call_tool("search_tickets", {"q": "p"}, meta={KEY: "s1"})
        assert not found.isError
        first_session = session_of(made)
    # A second stdio client (its own gateway process and session) using the same key gets its own call.
    async with gateway(db, cfg, name="second") as client:
        theirs = await client.call_tool("create_ticket", {"title": "printer"}, meta={KEY: "k1"})
        assert not theirs.isError and theirs.structuredContent["id"] == 2
        assert not (theirs.meta or {}).get("dev.undolog/call", {}).get("replayed")
    calls = world(tmp_path)["calls"]
    assert [c["tool"] for c in calls] == ["create_ticket", "reserve_seat", "search_tickets", "create_ticket"]
    assert calls[2]["key"] == "s1"  # forwarded
    assert all(c["key"].startswith("do-") for c in calls if c["tool"] != "search_tickets")
    effects = u.sessions.effects(first_session)
    assert [e["tool_name"] for e in effects] == ["create_ticket", "reserve_seat"]  # the SAFE call left nothing


@pytest.mark.pg_smoke
async def test_over_http_a_key_is_scoped_by_api_key_across_sessions(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "mcp")  # each MCP session its own UndoLog session
    u = db.open()
    bot, other = agent_key(db, "bot"), agent_key(db, "other")
    with http_gateway(db, cfg) as url:
        async with over_http(url, bot) as client:
            made = await client.call_tool("create_ticket", {"title": "a"}, meta={KEY: "k1"})
            assert not made.isError
        async with over_http(url, bot) as client:  # a later session of the same key: the recorded result
            again = await client.call_tool("create_ticket", {"title": "a"}, meta={KEY: "k1"})
            assert again.structuredContent == made.structuredContent
            assert (again.meta or {})["dev.undolog/call"]["replayed"] is True
            clash = await client.call_tool("create_ticket", {"title": "b"}, meta={KEY: "k1"})
            assert clash.isError and "other arguments" in text(clash)
        async with over_http(url, other) as client:  # another API key: its own call
            theirs = await client.call_tool("create_ticket", {"title": "a"}, meta={KEY: "k1"})
            assert not theirs.isError and theirs.structuredContent["id"] == 2
        # IRREVERSIBLE: the key names the one request, whichever session of the key asks.
        async with over_http(url, bot) as client:
            asked = await client.call_tool("delete_project", {"name": "acme"}, meta={KEY: "d1"})
            request_id = (asked.structuredContent or {})["approval_request_id"]
        assert cli(db, "approvals", "approve", request_id).returncode == 0
        async with over_http(url, bot) as client:
            ran = await client.call_tool("delete_project", {"name": "acme"}, meta={KEY: "d1"})
            assert not ran.isError and "deleted acme" in text(ran)
        async with over_http(url, bot) as client:
            replay = await client.call_tool("delete_project", {"name": "acme"}, meta={KEY: "d1"})
            assert "deleted acme" in text(replay) and (replay.meta or {})["dev.undolog/call"]["replayed"]
    calls = world(tmp_path)["calls"]
    assert [c["tool"] for c in calls] == ["create_ticket", "create_ticket", "delete_project"]
    committed = [e for s in u.sessions.list() for e in u.sessions.effects(s.session_id)
                 if e["state"] == EffectState.COMMITTED]
    assert len(committed) == 3


async def test_the_same_key_while_its_call_runs_joins_it(db: Any, tmp_path: Path) -> None:
    """Two sessions of one API key send the same key at once; the upstream's call takes a while (``slowish``):
    one runs it, the other waits for it and answers its result, whichever pre-write the unique index refused."""
    import anyio

    cfg = grouped_config(tmp_path, "mcp")
    db.open()
    bot = agent_key(db, "bot")
    answers: list[Any] = []
    with http_gateway(db, cfg) as url:

        async def one() -> None:
            async with over_http(url, bot) as client:
                answers.append(await client.call_tool("create_ticket", {"title": "slowish"}, meta={KEY: "k-slow"}))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            tg.start_soon(one)
    assert [a.isError for a in answers] == [False, False], [text(a) for a in answers]
    assert answers[0].structuredContent == answers[1].structuredContent
    assert [c["tool"] for c in world(tmp_path)["calls"]] == ["create_ticket"]  # ran once
