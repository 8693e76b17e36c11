"""SIGKILL of the long-lived socket gateway at the fault points a COMPENSABLE call and an approved IRREVERSIBLE
call pass through (the core's ``UNDOLOG_FAULT``: the gateway kills itself there), then a gateway started again on
the same socket: no forward call runs twice, nothing is left in flight, and clients go on. Real processes: the
gateway, its upstream, ``undolog mcp connect`` for each client, the CLI for the approval. On SQLite and PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import McpError

from undolog_core import EffectState

from .test_gateway import cli, world
from .test_sessions import connected, grouped_config, mcp_sessions, socket_gateway

pytestmark = pytest.mark.storage

IN_FLIGHT = {EffectState.PENDING, EffectState.RUNNING}


def effects(u: Any) -> list[dict[str, Any]]:
    return [e for s in mcp_sessions(u) for e in u.sessions.effects(s.session_id)]


async def killed_mid_call(db: Any, sock: Path, tool: str, args: dict[str, Any]) -> None:
    """The call whose fault point kills the gateway: the client's connection ends without an answer."""
    with anyio.fail_after(120):
        async with connected(db, sock) as client:
            with pytest.raises(McpError):
                await client.call_tool(tool, args)


@pytest.mark.parametrize("point", ["after_prewrite", "after_tool"])
async def test_sigkill_mid_compensable_call(db: Any, tmp_path: Path, point: str) -> None:
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    u = db.open()
    with socket_gateway(db, cfg, sock, env={"UNDOLOG_FAULT": point}) as proc:
        await killed_mid_call(db, sock, "reserve_seat", {"seat": "1A"})
        assert proc.wait(timeout=60) == -9
    with socket_gateway(db, cfg, sock):  # started again: recovery at start settles what the kill left
        async with connected(db, sock) as client:
            after = await client.call_tool("reserve_seat", {"seat": "2B"})
            assert not after.isError
    calls = [(c["tool"], c["args"]) for c in world(tmp_path)["calls"]]
    ran = calls.count(("reserve_seat", {"seat": "1A"}))
    assert ran == (1 if point == "after_tool" else 0), calls  # never forwarded twice
    assert world(tmp_path)["seats"] == ["2B"]  # what may have happened was undone (its key: undo-<id>)
    settled = effects(u)
    assert not [e for e in settled if e["state"] in IN_FLIGHT], settled
    first = [e for e in settled if e["args_snapshot"] == {"seat": "1A"}]
    assert len(first) == 1 and first[0]["state"] == EffectState.COMPENSATED  # nothing lost


@pytest.mark.parametrize("point", ["after_approved_claim", "after_tool"])
async def test_sigkill_mid_approved_irreversible_call(db: Any, tmp_path: Path, point: str) -> None:
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    u = db.open()
    with socket_gateway(db, cfg, sock, env={"UNDOLOG_FAULT": point}) as proc:
        async with connected(db, sock) as client:
            asked = await client.call_tool("delete_project", {"name": "acme"})
        request_id = (asked.structuredContent or {})["approval_request_id"]
        assert cli(db, "approvals", "approve", request_id).returncode == 0
        await killed_mid_call(db, sock, "delete_project", {"name": "acme"})
        assert proc.wait(timeout=60) == -9
    with socket_gateway(db, cfg, sock):
        async with connected(db, sock) as client:
            again = await client.call_tool("delete_project", {"name": "acme"})
            # A new gateway process is a new session: the call asks a person again; it never runs on its own.
            assert (again.structuredContent or {}).get("status") == "awaiting_approval"
    ran = [c for c in (world(tmp_path)["calls"] if (tmp_path / "tickets.json").exists() else [])
           if c["tool"] == "delete_project"]
    assert len(ran) == (1 if point == "after_tool" else 0)  # at most once, never re-run by recovery
    original = [e for e in effects(u) if e["tool_name"] == "delete_project" and e["state"] != "awaiting_approval"]
    assert len(original) == 1 and original[0]["state"] not in IN_FLIGHT, original  # settled, not lost
