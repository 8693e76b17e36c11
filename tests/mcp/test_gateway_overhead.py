"""What the gateway sends to its database per call, counted statement by statement (the timing side is
benchmarks/mcp_gateway.py), and what it hands to worker threads.

A COMPENSABLE call through the gateway must cost the database exactly what the core's own ``Session.call`` of a
COMPENSABLE tool costs: one pre-write statement, one commit mark, each its own durable transaction (on PostgreSQL
one round trip each, no BEGIN, no read), and nothing else (no session lookup, lease renewal, audit read or revision
check per call). A SAFE call touches no database. Neither leaves the event loop for a worker thread.

The gateway runs in this process, with the SDK's own client over the SDK's in-memory transport and a real upstream
(``tickets_server.py``) over stdio; the counter is tests/test_overhead_statements.py's (SQLAlchemy events plus the
driver's own trace: sqlite3's trace callback, libpq's protocol trace).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
from mcp import types
from mcp.shared.memory import create_connected_server_and_client_session

from tests.test_overhead_statements import StatementCounter, describe, wire_transactions
from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool
from undolog_mcp.config import load_config
from undolog_mcp.gateway import Gateway
from undolog_mcp.stdio import stdio_transport

from .test_gateway import write_config

# Counts what reaches each database (its own step in CI, on both databases).
pytestmark = [pytest.mark.perf, pytest.mark.storage]

CALLS = 5


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("gw_oh_close"))
async def gw_oh_create(title: str) -> dict[str, Any]:
    return {"id": 1, "title": title}


@compensation("gw_oh_close")
def gw_oh_close(ctx: Any) -> None:
    return None


def shape(evs: list[Any]) -> list[list[str]]:
    """The committed transactions on the wire, each as its statements' first three words (the values differ).

    On PostgreSQL libpq's trace shows a prepared statement as an Execute message only (no text): every one is then a
    transaction of its own unless a BEGIN was sent, which the assertions on ``begin`` events catch."""
    mine = [e for e in evs if e.main]
    if any(e.text == "(extended-protocol Execute)" for e in mine):
        return [[e.text.lower()] for e in mine if e.level == "wire" and e.kind == "stmt"]
    done, left_open = wire_transactions(mine)
    assert not left_open, describe(evs)
    return [[" ".join(st.split()[:3]).lower() for st in tx] for tx in done]


class Hops:
    """Counts every hand-off to a worker thread (asyncio's to_thread, anyio's run_sync) while installed."""

    def __init__(self, monkeypatch: Any) -> None:
        self.seen: Counter[str] = Counter()
        real_to_thread, real_run_sync = asyncio.to_thread, anyio.to_thread.run_sync

        async def to_thread(fn: Any, *a: Any, **k: Any) -> Any:
            self.seen[f"to_thread {getattr(fn, '__qualname__', fn)}"] += 1
            return await real_to_thread(fn, *a, **k)

        async def run_sync(fn: Any, *a: Any, **k: Any) -> Any:
            self.seen[f"run_sync {getattr(fn, '__qualname__', fn)}"] += 1
            return await real_run_sync(fn, *a, **k)

        monkeypatch.setattr(asyncio, "to_thread", to_thread)
        monkeypatch.setattr(anyio.to_thread, "run_sync", run_sync)


async def test_a_compensable_call_costs_the_database_what_the_cores_call_costs(db: Any, tmp_path: Path,
                                                                               monkeypatch: Any) -> None:
    u = db.open()
    u.register(gw_oh_create, gw_oh_close)
    counter = StatementCounter(u)  # before the hot path takes its connections: they are traced from the first
    try:
        gw = Gateway(load_config(write_config(tmp_path)), u)
        async with gw.running(), create_connected_server_and_client_session(
                gw.server, client_info=types.Implementation(name="overhead", version="1")) as client:
            # The session's first calls (the UndoLog session is created, its first pre-write read in a thread).
            # The last is COMPENSABLE: SAFE calls are counted in memory and flushed to the session row by the next
            # pre-write (one UPDATE more, once), as the core's own calls do.
            for i in range(2):
                assert not (await client.call_tool("search_tickets", {"q": "x"})).isError
                assert not (await client.call_tool("create_ticket", {"title": f"warm{i}"})).isError
            core = u.session(agent_id="overhead-core")
            for i in range(2):
                await core.call(gw_oh_create, title=f"warm{i}")
            hops = Hops(monkeypatch)

            counter.mark("gateway")
            for i in range(CALLS):
                made = await client.call_tool("create_ticket", {"title": f"t{i}"})
                assert not made.isError and made.structuredContent == {"id": i + 3, "title": f"t{i}",
                                                                       "status": "open"}
            counter.mark("gateway_safe")
            for _ in range(CALLS):
                assert not (await client.call_tool("search_tickets", {"q": "x"})).isError
            counter.mark("core")
            for i in range(CALLS):
                assert await core.call(gw_oh_create, title=f"t{i}") == {"id": 1, "title": f"t{i}"}
            counter.mark("end")
            gateway_hops = dict(hops.seen)

        gateway, safe, ours = (counter.window(a, b) for a, b in (("gateway", "gateway_safe"),
                                                                  ("gateway_safe", "core"), ("core", "end")))
        # The core's own call: one pre-write, one commit mark, each one statement in a transaction of its own.
        per_call = shape(ours)
        assert len(per_call) == 2 * CALLS, describe(ours)
        prewrite, mark = per_call[0], per_call[1]
        assert len(prewrite) == 1 and len(mark) == 1, describe(ours)
        # The gateway's COMPENSABLE call: exactly the same, statement for statement, and nothing else (no read,
        # no BEGIN or COMMIT of its own, no lease, audit or revision statement).
        assert shape(gateway) == [prewrite, mark] * CALLS, "the gateway's COMPENSABLE calls:\n" + describe(gateway)
        for evs in (gateway, ours):
            assert [e for e in evs if e.kind in ("begin", "commit", "rollback")] == [], describe(evs)
            assert {e.engine for e in evs} == {"durable"}, describe(evs)
        # No statement went through SQLAlchemy on either side (the hot path is the raw driver's).
        assert [e for e in gateway + ours if e.level == "sa" and e.main] == [], describe(gateway + ours)
        # A SAFE call: nothing at all, from any thread.
        assert safe == [], "the gateway's SAFE calls touched the database:\n" + describe(safe)
        # And neither tier left the event loop: the pre-write and the commit mark ran inline.
        assert gateway_hops == {}, gateway_hops
    finally:
        counter.close()


async def test_the_stdio_transport_serves_on_the_loop(monkeypatch: Any) -> None:
    # Pipes, as an MCP client starts the gateway: every line read and written on the loop, no worker thread (the
    # SDK's transport makes three hops per request: readline, write, flush).
    from mcp.server.lowlevel import Server

    server: Server[Any, Any] = Server("echo")

    @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
    async def _list() -> list[types.Tool]:
        return [types.Tool(name="echo", inputSchema={"type": "object"})]

    @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
    async def _call(name: str, arguments: dict[str, Any]) -> types.CallToolResult:
        return types.CallToolResult(content=[types.TextContent(type="text", text=arguments["s"])])

    to_server_r, to_server_w = os.pipe()
    to_client_r, to_client_w = os.pipe()
    hops = Hops(monkeypatch)
    # More than the reader's buffer limit in one line (and multi-byte), within the gateway's input limits (a line
    # of 1 MiB, arguments of 256 KiB): 80 kB of UTF-8, 240 kB as the JSON text sent.
    big = "é" * 40_000

    async def serve() -> None:
        async with stdio_transport(to_server_r, to_client_w) as (read, write):
            await server.run(read, write, server.create_initialization_options())

    def client_side() -> list[dict[str, Any]]:
        import json

        out: list[dict[str, Any]] = []
        with os.fdopen(to_server_w, "w", encoding="utf-8") as w, os.fdopen(to_client_r, encoding="utf-8") as r:
            def ask(msg: dict[str, Any]) -> None:
                w.write(json.dumps(msg) + "\n")
                w.flush()

            ask({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": types.LATEST_PROTOCOL_VERSION, "capabilities": {},
                "clientInfo": {"name": "t", "version": "1"}}})
            out.append(json.loads(r.readline()))
            ask({"jsonrpc": "2.0", "method": "notifications/initialized"})
            for i, s in enumerate(["a", big, "b"]):
                ask({"jsonrpc": "2.0", "id": i + 1, "method": "tools/call",
                     "params": {"name": "echo", "arguments": {"s": s}}})
                out.append(json.loads(r.readline()))
        return out

    result: dict[str, Any] = {}
    th = threading.Thread(target=lambda: result.update(out=client_side()))
    th.start()
    with anyio.fail_after(60):
        await serve()  # ends when the client closes its end (EOF)
    th.join(10)
    answers = result["out"]
    assert answers[0]["result"]["serverInfo"]["name"] == "echo"
    assert [a["result"]["content"][0]["text"] for a in answers[1:]] == ["a", big, "b"]
    assert hops.seen == Counter(), hops.seen
    for fd in (to_server_r, to_client_w):
        assert os.get_blocking(fd)  # the process's own descriptors are left as they were found
        os.close(fd)


class GatewayFrames:
    """Counts, while installed, the Python frames entered in ``undolog_mcp`` (by function) and the anyio cancel
    scopes the gateway module opens shielded, on every thread."""

    def __init__(self, monkeypatch: Any) -> None:
        import sys

        import undolog_mcp.gateway as gateway_module

        self.frames: Counter[str] = Counter()
        self.shields = 0
        real_scope = anyio.CancelScope

        def scope(*a: Any, **k: Any) -> Any:
            if k.get("shield") and sys._getframe(1).f_globals.get("__name__") == gateway_module.__name__:
                self.shields += 1
            return real_scope(*a, **k)

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and "undolog_mcp" in frame.f_code.co_filename:
                self.frames[f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"] += 1

        self._profile = profile
        monkeypatch.setattr(gateway_module.anyio, "CancelScope", scope)

    def __enter__(self) -> GatewayFrames:
        import sys

        self.frames.clear()
        self.shields = 0
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        return self

    def __exit__(self, *exc: Any) -> None:
        import sys

        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


async def test_a_compensable_call_opens_one_shield_and_runs_few_gateway_frames(db: Any, tmp_path: Path,
                                                                             monkeypatch: Any) -> None:
    # What the gateway itself adds to a COMPENSABLE call over a SAFE one is its shield against the client's cancel
    # (one anyio cancel scope, 11 frames, 4-5 us of CPU warm: it used to open two, nested). Otherwise undolog_mcp
    # runs the same frames for both tiers; the rest (the pre-write, the mark) is the core's. Counted, not timed.
    u = db.open()
    try:
        gw = Gateway(load_config(write_config(tmp_path)), u)
        async with gw.running(), create_connected_server_and_client_session(
                gw.server, client_info=types.Implementation(name="frames", version="1")) as client:
            for i in range(2):  # the session's first calls: created, its first pre-write read in a thread
                assert not (await client.call_tool("search_tickets", {"q": "x"})).isError
                assert not (await client.call_tool("create_ticket", {"title": f"warm{i}"})).isError
            counted = GatewayFrames(monkeypatch)
            with counted:
                for i in range(CALLS):
                    assert not (await client.call_tool("create_ticket", {"title": f"t{i}"})).isError
            compensable, compensable_shields = Counter(counted.frames), counted.shields
            with counted:
                for _ in range(CALLS):
                    assert not (await client.call_tool("search_tickets", {"q": "x"})).isError
            safe, safe_shields = Counter(counted.frames), counted.shields
    finally:
        u.close()
    assert compensable_shields == CALLS, compensable_shields  # one per call: call()'s, around decision and run
    assert safe_shields == 0, safe_shields  # a SAFE call logs nothing: nothing to shield
    # The upstream call function is made once per upstream, not once per call.
    assert compensable["gateway.py:_make_upstream_call"] == 0, compensable
    assert compensable["gateway.py:_guarded"] == CALLS, compensable
    # The gateway's own frames: a COMPENSABLE call runs exactly the SAFE call's undolog_mcp frames (its extra work is
    # the core's and the shield's), 49 a call when this was written (the SDK's in-memory transport, as here).
    extra = {k: compensable[k] - safe[k] for k in compensable | safe if compensable[k] != safe[k]}
    assert extra == {}, extra
    assert sum(compensable.values()) <= 49 * CALLS, compensable
