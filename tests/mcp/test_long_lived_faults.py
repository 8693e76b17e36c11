"""SIGKILL of the long-lived socket gateway at the fault points a COMPENSABLE call and an approved IRREVERSIBLE
call pass through (the core's ``UNDOLOG_FAULT``: the gateway kills itself there), then a gateway started again on
the same socket: no forward call runs twice, nothing is left in flight, and clients go on. Real processes: the
gateway, its upstream, ``undolog mcp connect`` for each client, the CLI for the approval. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import McpError

from undolog_core import EffectState

from .test_gateway import cli, world
from .test_sessions import connected, grouped_config, mcp_sessions, socket_gateway

# SQLite run only (reads_store): the gateway's kills and restarts sit above storage; recovery after a kill at every
# fault point is pinned on both databases by tests/faults and tests/core, and the gateway's kills on PostgreSQL by
# the smoke cases of tests/mcp/test_upstream_faults.py and tests/mcp/test_gateway.py.
pytestmark = pytest.mark.reads_store

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


# The points the lines above do not reach: before anything is written, a tool error's failure record, the in-doubt
# settling of a call whose upstream died, and a rollback the gateway runs for the CLI (the live-owner path).


async def test_sigkill_before_the_prewrite_leaves_nothing_and_runs_nothing(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    u = db.open()
    with socket_gateway(db, cfg, sock, env={"UNDOLOG_FAULT": "before_prewrite"}) as proc:
        await killed_mid_call(db, sock, "reserve_seat", {"seat": "1A"})
        assert proc.wait(timeout=60) == -9
    with socket_gateway(db, cfg, sock):
        async with connected(db, sock) as client:
            again = await client.call_tool("reserve_seat", {"seat": "1A"})  # the client's retry runs it, once
            assert not again.isError
    calls = [(c["tool"], c["args"]) for c in world(tmp_path)["calls"]]
    assert calls.count(("reserve_seat", {"seat": "1A"})) == 1, calls
    settled = effects(u)
    assert [e["state"] for e in settled] == [EffectState.COMMITTED], settled  # nothing written by the killed one


async def test_sigkill_before_the_gate_raises_no_request_and_runs_nothing(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    u = db.open()
    with socket_gateway(db, cfg, sock, env={"UNDOLOG_FAULT": "before_gate"}) as proc:
        await killed_mid_call(db, sock, "delete_project", {"name": "acme"})
        assert proc.wait(timeout=60) == -9
    with socket_gateway(db, cfg, sock):
        async with connected(db, sock) as client:
            asked = await client.call_tool("delete_project", {"name": "acme"})
            assert (asked.structuredContent or {}).get("status") == "awaiting_approval"
    assert not [c for c in (world(tmp_path)["calls"] if (tmp_path / "tickets.json").exists() else [])
                if c["tool"] == "delete_project"]
    assert [e["state"] for e in effects(u)] == ["awaiting_approval"]  # one request, from the ask after the restart


async def test_sigkill_after_a_tool_errors_failure_was_recorded(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    u = db.open()
    with socket_gateway(db, cfg, sock, env={"UNDOLOG_FAULT": "after_failure_recorded"}) as proc:
        await killed_mid_call(db, sock, "reserve_seat", {"seat": "bad-9"})  # the upstream answers a tool error
        assert proc.wait(timeout=60) == -9
    with socket_gateway(db, cfg, sock):
        async with connected(db, sock) as client:
            assert not (await client.call_tool("reserve_seat", {"seat": "2B"})).isError
    calls = [(c["tool"], c["args"]) for c in world(tmp_path)["calls"]]
    assert calls.count(("reserve_seat", {"seat": "bad-9"})) == 1, calls  # never re-run
    states = {e["args_snapshot"]["seat"]: e["state"] for e in effects(u)}
    assert states == {"bad-9": EffectState.FAILED, "2B": EffectState.COMMITTED}, states


async def test_sigkill_while_settling_a_call_whose_upstream_died(db: Any, tmp_path: Path) -> None:
    """The upstream dies mid-call (after reserving): the gateway settles the unknown outcome at once, and dies as
    it claims it (``during_recovery``). Started again, its recovery undoes it, once, with its undo key."""
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    u = db.open()
    with socket_gateway(db, cfg, sock, env={"UNDOLOG_FAULT": "during_recovery"}) as proc:
        await killed_mid_call(db, sock, "reserve_seat", {"seat": "crash"})
        assert proc.wait(timeout=60) == -9
    with socket_gateway(db, cfg, sock):
        async with connected(db, sock) as client:
            await client.call_tool("search_tickets", {"q": "x"})
    calls = world(tmp_path)["calls"]
    assert [c["args"] for c in calls if c["tool"] == "reserve_seat"] == [{"seat": "crash"}]
    undo = [c for c in calls if c["tool"] == "release_seat"]
    assert len(undo) >= 1 and len({c["key"] for c in undo}) == 1 and undo[0]["key"].startswith("undo-"), undo
    assert world(tmp_path)["seats"] == []
    (effect,) = effects(u)
    assert effect["state"] == EffectState.COMPENSATED


@pytest.mark.parametrize("point", ["rollback_requested", "during_rollback", "after_compensation",
                                   "between_compensations"])
async def test_sigkill_mid_a_rollback_the_gateway_runs(db: Any, tmp_path: Path, point: str) -> None:
    """The CLI files the rollback for the gateway serving the session; the gateway dies running it. The CLI sees
    the owner gone and runs it itself (saying so): each undo runs with its own undo key, a step interrupted after
    its compensation ran may run again with that same key, and every seat is released."""
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    u = db.open()
    with socket_gateway(db, cfg, sock, env={"UNDOLOG_FAULT": point}) as proc:
        async with connected(db, sock) as client:
            first = await client.call_tool("reserve_seat", {"seat": "1A"})
            await client.call_tool("reserve_seat", {"seat": "2B"})
        sid = (first.meta or {})["dev.undolog/session"]
        out = cli(db, "--app", str(cfg), "sessions", "rollback", sid, "--json", "--wait", "120")
        assert proc.wait(timeout=60) == -9
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    if not report["complete"]:
        # A step left claimed by the dead gateway: asked again, it completes (its lease is the dead process's).
        out = cli(db, "--app", str(cfg), "sessions", "rollback", sid, "--json")
        report = json.loads(out.stdout)
    assert report["complete"], report
    calls = world(tmp_path)["calls"]
    assert [c["args"]["seat"] for c in calls if c["tool"] == "reserve_seat"] == ["1A", "2B"]  # never re-run
    undo: dict[str, set[str]] = {}
    for c in calls:
        if c["tool"] == "release_seat":
            undo.setdefault(c["args"]["seat"], set()).add(c["key"])
    assert {seat: len(keys) for seat, keys in undo.items()} == {"1A": 1, "2B": 1}, undo  # one key per undo
    assert world(tmp_path)["seats"] == []
    assert {e["state"] for e in effects(u)} == {EffectState.COMPENSATED}
