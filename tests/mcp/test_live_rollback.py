"""Undo in the process that did the work: a rollback asked from the CLI while the gateway runs is run by that
gateway, over its live connection to an upstream whose state lives in its own memory (the official SDK), and
only when the gateway is gone does the CLI run it itself, saying so. Real processes throughout (the gateway, the
upstream, the CLI). On SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from mcp import types

from undolog_core import SessionState

from ..support.mcp_upstreams import copy_upstream
from .test_gateway import cli, gateway
from .test_sessions import session_of

pytestmark = pytest.mark.reads_store

HERE = Path(__file__).parent


def memory_config(tmp: Path) -> Path:
    copy_upstream(HERE / "memory_server.py", tmp)
    cfg = tmp / "gateway.toml"
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.memory]
        command = [{json.dumps(sys.executable)}, "memory_server.py"]

        [tools.memory.list_items]
        tier = "safe"

        [tools.memory.add_item]
        tier = "compensable"
        compensation = {{ tool = "remove_item", args = {{ id = "{{result.id}}" }} }}
    """))
    return cfg


def held(u: Any, sid: str) -> Any:
    """The session's owner row, once the gateway's owner loop has written it (it does so as the session starts)."""
    for _ in range(200):
        row = u.store.owners.session_owner(sid)
        if row is not None:
            return row
        time.sleep(0.05)
    raise AssertionError(f"the gateway never held session {sid}")


def listed(result: types.CallToolResult) -> dict[str, Any]:
    assert not result.isError, result
    return dict(result.structuredContent or {})


async def test_a_cli_rollback_runs_in_the_gateway_over_its_live_upstream(db: Any, tmp_path: Path) -> None:
    cfg = memory_config(tmp_path)
    u = db.open()
    async with gateway(db, cfg) as client:
        first = await client.call_tool("add_item", {"name": "a"})
        await client.call_tool("add_item", {"name": "b"})
        before = listed(await client.call_tool("list_items", {}))
        assert before["items"] == ["a", "b"]
        sid = session_of(first)
        held(u, sid)
        out = cli(db, "--app", str(cfg), "sessions", "rollback", sid, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout)
        assert report["complete"] and report.get("ran_by"), report
        assert "ran_without_live_upstream" not in report
        assert [s["outcome"] for s in report["steps"]] == ["compensated", "compensated"]
        after = listed(await client.call_tool("list_items", {}))
        # The live state is restored, in the one upstream process that did the work.
        assert after == {"items": [], "pid": before["pid"]}
        # The session rolled back, the client's next call starts a new one (it is told its id).
        again = await client.call_tool("add_item", {"name": "c"})
        assert not again.isError and session_of(again) != sid
    assert u.sessions.get(sid).state == SessionState.ROLLED_BACK


async def test_with_the_gateway_gone_the_cli_runs_it_and_says_so(db: Any, tmp_path: Path) -> None:
    cfg = memory_config(tmp_path)
    u = db.open()
    async with gateway(db, cfg) as client:
        made = await client.call_tool("add_item", {"name": "a"})
        sid = session_of(made)
        row = held(u, sid)
        pid = int(row.owner.split("|")[1])
        os.kill(pid, signal.SIGKILL)  # the gateway dies; its upstream (and its memory) with it
        out = cli(db, "--app", str(cfg), "sessions", "rollback", sid, "--json")
        assert out.returncode == 0, out.stdout + out.stderr
        report = json.loads(out.stdout)
        assert report["complete"] and report["ran_without_live_upstream"] is True and "ran_by" not in report


def upstream_processes(script: Path) -> list[int]:
    """The live processes running this test's copy of an upstream script (read from /proc: Linux)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = next(line for line in (entry / "status").read_text().splitlines() if line.startswith("State:"))
        except (OSError, StopIteration):
            continue
        if str(script).encode() in cmdline or (script.name.encode() in cmdline and str(script.parent).encode()
                                                in (entry / "cwd").resolve().as_posix().encode()):
            if "Z" not in state.split()[1]:  # a zombie is gone, waiting to be reaped
                pids.append(int(entry.name))
    return pids


async def test_after_an_upstream_crash_the_undo_reaches_the_one_upstream_started_again(
        db: Any, tmp_path: Path) -> None:
    """The settle-at-once of a call the crash left unknown compensates over the gateway's own connection (the
    upstream started again in its place), not a second upstream started for the compensation."""
    from .test_gateway import only_session, text, world, write_config

    cfg = write_config(tmp_path)
    async with gateway(db, cfg) as client:
        await client.call_tool("reserve_seat", {"seat": "1A"})
        lost = await client.call_tool("reserve_seat", {"seat": "crash"})
        assert lost.isError and "undone" in text(lost)
        found = await client.call_tool("search_tickets", {"q": "x"})
        assert not found.isError
        assert len(upstream_processes(tmp_path / "tickets_server.py")) == 1, "exactly one upstream process remains"
    calls = world(tmp_path)["calls"]
    undo = [c for c in calls if c["tool"] == "release_seat"]
    assert [c["args"] for c in undo] == [{"seat": "crash"}]
    assert undo[0]["pid"] == calls[-1]["pid"], "compensated in the upstream the gateway went on with"
    u = db.open()
    assert only_session(u).state == SessionState.HALTED
