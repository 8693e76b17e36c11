"""The whole protocol through the gateway, with the official SDK's client and the real
``@modelcontextprotocol/server-everything`` (pinned in ``package.json``, run by the pinned Node 22) as upstream,
the gateway served over stdio and over ``--http`` (a real ``undolog mcp serve`` subprocess).

The upstream runs under ``wire_tap.py``, which keeps its wire log: what reached the upstream process itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.shared.context import RequestContext

from .test_conformance import started

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
NODE = ROOT / "node_modules" / ".bin" / "node"
EVERYTHING = ROOT / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"
TAP = HERE / "wire_tap.py"
GATED = {"trigger-sampling-request", "trigger-elicitation-request", "get-roots-list"}
ROOT_URI = "file:///work/project-x"


def everything_config(tmp: Path, wire: Path, extra: str = "", url: str | None = None) -> Path:
    assert NODE.exists() and EVERYTHING.exists(), f"run `npm ci` in {ROOT}: server-everything and Node 22 are missing"
    cfg = tmp / "gateway.toml"
    command = [sys.executable, str(TAP), str(wire), "--", str(NODE), str(EVERYTHING), "stdio"]
    where = f"url = {json.dumps(url)}" if url else f"command = {json.dumps(command)}"
    tools = "".join(f'\n[tools.everything.{name}]\ntier = "safe"\n'
                    for name in [*sorted(GATED), "trigger-long-running-operation", "echo",
                                 "toggle-simulated-logging"])
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.everything]
        {where}
        """) + tools + extra)
    return cfg


class Client:
    """What the client saw beside its answers: every notification, and the server-to-client requests."""

    def __init__(self) -> None:
        self.notifications: list[Any] = []
        self.logs: list[types.LoggingMessageNotificationParams] = []
        self.sampled: list[types.CreateMessageRequestParams] = []
        self.elicited: list[Any] = []
        self.tools_changed = asyncio.Event()
        self.roots_asked = 0

    async def on_message(self, message: Any) -> None:
        if isinstance(message, types.ServerNotification):
            self.notifications.append(message.root)
            if isinstance(message.root, types.ToolListChangedNotification):
                self.tools_changed.set()

    async def on_log(self, params: types.LoggingMessageNotificationParams) -> None:
        self.logs.append(params)

    async def sampling(self, ctx: RequestContext[Any, Any],
                       params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        self.sampled.append(params)
        return types.CreateMessageResult(role="assistant", model="scripted-model", stopReason="endTurn",
                                         content=types.TextContent(type="text", text="a scripted completion"))

    async def elicitation(self, ctx: RequestContext[Any, Any], params: Any) -> types.ElicitResult:
        self.elicited.append(params)
        return types.ElicitResult(action="accept", content={"color": "blue", "number": 7, "pets": "cats"})

    async def roots(self, ctx: RequestContext[Any, Any]) -> types.ListRootsResult:
        self.roots_asked += 1
        return types.ListRootsResult(roots=[types.Root(uri=ROOT_URI, name="project-x")])  # type: ignore[arg-type]

    def session(self, read: Any, write: Any, *, roots: bool = True) -> ClientSession:
        return ClientSession(read, write, sampling_callback=self.sampling, elicitation_callback=self.elicitation,
                             list_roots_callback=self.roots if roots else None, logging_callback=self.on_log,
                             message_handler=self.on_message,
                             client_info=types.Implementation(name="everything-test", version="1"))


@contextlib.asynccontextmanager
async def over_stdio(db: Any, cfg: Path, client: Client) -> AsyncIterator[ClientSession]:
    params = StdioServerParameters(command=sys.executable, args=["-m", "undolog_core.cli", "mcp", "serve",
                                                                  "--config", str(cfg)], env={**os.environ, **db.env})
    async with stdio_client(params) as (read, write), client.session(read, write) as session:
        await session.initialize()
        yield session


@contextlib.asynccontextmanager
async def over_http(db: Any, cfg: Path, client: Client) -> AsyncIterator[ClientSession]:
    from mcp.client.streamable_http import streamablehttp_client

    env = {**os.environ, **db.env}
    made = subprocess.run([sys.executable, "-m", "undolog_core.cli", "keys", "create", "--name", "everything",
                           "--role", "agent"], env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip().split()[-1]
    with started([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg), "--http",
                  "--port", "0"], "undolog mcp: serving ", env) as url:
        async with streamablehttp_client(url, headers={"Authorization": f"Bearer {key}"}) as (read, write, _), \
                client.session(read, write) as session:
            await session.initialize()
            yield session


TRANSPORTS = {"stdio": over_stdio, "http": over_http}


def wire(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The upstream's wire log: ("in" | "out", message) in order."""
    out = []
    for line in path.read_bytes().splitlines():
        mark, _, body = line.partition(b" ")
        with contextlib.suppress(ValueError):
            out.append(("in" if mark == b">" else "out", json.loads(body)))
    return out


@pytest.mark.reads_store
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_capability_gated_tools_progress_and_logs(db: Any, tmp_path: Path, transport: str) -> None:
    cfg = everything_config(tmp_path, tmp_path / "wire.log")
    db.open()
    client = Client()
    async with TRANSPORTS[transport](db, cfg, client) as session:
        init_caps = session.get_server_capabilities()
        assert init_caps is not None and init_caps.resources is not None and init_caps.prompts is not None
        listed = {t.name for t in (await session.list_tools()).tools}
        # roots are one client's: relayed only where the upstream's connection serves one (the gateway over stdio)
        expected = GATED if transport == "stdio" else GATED - {"get-roots-list"}
        assert expected <= listed, listed
        if transport == "http":
            assert "get-roots-list" not in listed

        sampled = await session.call_tool("trigger-sampling-request", {"prompt": "say hello", "maxTokens": 20})
        assert not sampled.isError, sampled
        assert "a scripted completion" in sampled.content[0].text  # type: ignore[union-attr]
        assert "say hello" in client.sampled[0].messages[0].content.text  # type: ignore[union-attr]

        elicited = await session.call_tool("trigger-elicitation-request", {})
        assert not elicited.isError, elicited
        assert client.elicited and "blue" in json.dumps([c.model_dump() for c in elicited.content])

        if transport == "stdio":
            roots = await session.call_tool("get-roots-list", {})
            assert not roots.isError and ROOT_URI in roots.content[0].text  # type: ignore[union-attr]
            # The upstream logged the roots it received, during the call: relayed to this client.
            assert any("Roots updated" in str(log.data) for log in client.logs), client.logs
            # The client's roots changed: the upstream is told, and asks this client again (no call in flight).
            asked = client.roots_asked
            await session.send_roots_list_changed()
            with anyio.fail_after(30):
                while client.roots_asked == asked:
                    await asyncio.sleep(0.02)

        await session.set_logging_level("debug")
        before = len(client.logs)
        toggled = await session.call_tool("toggle-simulated-logging", {})
        assert not toggled.isError, toggled
        with anyio.fail_after(30):  # it sends one message at once, then one every 5 s
            while not any("message" in str(log.data) for log in client.logs[before:]):
                await asyncio.sleep(0.05)

        progress: list[float] = []

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            progress.append(value)

        done = await session.call_tool("trigger-long-running-operation", {"duration": 0.3, "steps": 3},
                                       progress_callback=on_progress)
        assert not done.isError, done
        assert progress == [1, 2, 3]


@pytest.mark.reads_store
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_cancel_reaches_the_upstream(db: Any, tmp_path: Path, transport: str) -> None:
    log = tmp_path / "wire.log"
    cfg = everything_config(tmp_path, log)
    db.open()
    client = Client()
    async with TRANSPORTS[transport](db, cfg, client) as session:
        started_op = asyncio.Event()

        async def on_progress(value: float, total: float | None, message: str | None) -> None:
            started_op.set()

        request_id = session._request_id  # the id the SDK gives the next request (no await before it is taken)
        call = asyncio.ensure_future(session.call_tool("trigger-long-running-operation",
                                                       {"duration": 60, "steps": 60},
                                                       progress_callback=on_progress))
        with anyio.fail_after(60):
            await started_op.wait()  # running upstream: its first progress came through the gateway
        await session.send_notification(types.ClientNotification(types.CancelledNotification(
            params=types.CancelledNotificationParams(requestId=request_id, reason="the user changed their mind"))))
        with anyio.fail_after(60):
            while True:
                sent = [m for d, m in wire(log) if d == "in" and m.get("method") == "tools/call"
                        and m["params"]["name"] == "trigger-long-running-operation"]
                cancels = [m for d, m in wire(log) if d == "in" and m.get("method") == "notifications/cancelled"]
                if sent and cancels:
                    break
                await asyncio.sleep(0.05)
        # The upstream was told to cancel its own request (the id it was sent with), and answers it no more.
        assert cancels[0]["params"]["requestId"] == sent[0]["id"]
        echoed = await session.call_tool("echo", {"message": "still here"})  # the session goes on
        assert not echoed.isError
        answered = [m for d, m in wire(log) if d == "out" and m.get("id") == sent[0]["id"]]
        assert not answered, answered
        call.cancel()


@pytest.mark.reads_store
async def test_an_upstream_over_streamable_http(db: Any, tmp_path: Path) -> None:
    """server-everything serving streamable HTTP itself (``node index.js streamableHttp``), the gateway over stdio
    in front of it: the same gated tools, relayed the same way."""
    from .test_conformance import free_port

    port = free_port()
    node = subprocess.Popen([str(NODE), str(EVERYTHING), "streamableHttp"], env={**os.environ, "PORT": str(port)},
                            stderr=subprocess.PIPE, text=True)
    try:
        assert node.stderr is not None
        for line in node.stderr:
            if "listening on port" in line:
                break
        cfg = everything_config(tmp_path, tmp_path / "unused.log", url=f"http://127.0.0.1:{port}/mcp")
        db.open()
        client = Client()
        async with over_stdio(db, cfg, client) as session:
            listed = {t.name for t in (await session.list_tools()).tools}
            assert GATED <= listed, listed
            sampled = await session.call_tool("trigger-sampling-request", {"prompt": "over http", "maxTokens": 5})
            assert not sampled.isError and "a scripted completion" in sampled.content[0].text  # type: ignore[union-attr]
            roots = await session.call_tool("get-roots-list", {})
            assert not roots.isError and ROOT_URI in roots.content[0].text  # type: ignore[union-attr]
            progress: list[float] = []

            async def on_progress(value: float, total: float | None, message: str | None) -> None:
                progress.append(value)

            done = await session.call_tool("trigger-long-running-operation", {"duration": 0.2, "steps": 2},
                                           progress_callback=on_progress)
            assert not done.isError and progress == [1, 2]
            resources = (await session.list_resources()).resources
            assert resources
            read = await session.read_resource(resources[0].uri)
            assert read.contents
    finally:
        node.terminate()
        node.wait(timeout=30)
