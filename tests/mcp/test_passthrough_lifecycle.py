"""What the gateway's clients asked of an upstream outlives the upstream's process, and ends with the clients.

With the real ``@modelcontextprotocol/server-everything`` upstream under ``wire_tap.py`` (its wire log is what
reached the upstream process itself) and real ``undolog mcp serve`` processes:

- a client's ``logging/setLevel`` is sent again to the upstream started again after it was killed (SIGKILL), before
  anything else reaches it, and the upstream then keeps to it (its own log messages below the level are not sent);
  the subscriptions the clients hold are made again on it;
- ``resources/subscribe`` is counted per URI across the gateway's clients: two clients on one URI make one upstream
  subscription, which ends upstream (``resources/unsubscribe``) when the last of them goes away: an HTTP session
  closed or idled out, a socket connection closed or its process killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamablehttp_client

from undolog_mcp.relay import LEVELS

from .test_gateway_everything import Client, everything_config, wire

pytestmark = pytest.mark.reads_store

# server-everything's resource whose subscription the tests hold (one of its static documents).
DOC = "demo://resource/static/document/architecture.md"
# What the gateway logs when an upstream's connection ended between calls (the next call starts it again).
NOTICED = "closed its connection; the next call to it starts it again"


async def until(check: Any, what: str, timeout: float = 60) -> Any:
    """Poll ``check()`` until it answers something true (an event with no notice of its own: a wire log line)."""
    with anyio.fail_after(timeout):
        while not (found := check()):
            await asyncio.sleep(0.05)
    assert found, what
    return found


def requests_in(log: Path, method: str) -> list[dict[str, Any]]:
    return [m for d, m in wire(log) if d == "in" and m.get("method") == method]


def agent_key(env: dict[str, str]) -> str:
    made = subprocess.run([sys.executable, "-m", "undolog_core.cli", "keys", "create", "--name", "lifecycle",
                           "--role", "agent"], env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().split()[-1]


@contextlib.contextmanager
def serving(args: list[str], env: dict[str, str], errors: Path, marker: str) -> Iterator[str]:
    """``undolog mcp serve ARGS`` as a process of its own, its log in ``errors``; yields the rest of the line that
    says it serves (after ``marker``)."""
    with errors.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", *args], env=env,
                                stderr=err, text=True)
    try:
        for _ in range(1200):
            lines = [line for line in errors.read_text().splitlines() if marker in line]
            if lines:
                break
            assert proc.poll() is None, f"the gateway did not start: {errors.read_text()}"
            time.sleep(0.05)
        else:
            raise AssertionError(f"the gateway did not start: {errors.read_text()}")
        yield lines[0].split(marker, 1)[1].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.asynccontextmanager
async def http_client(url: str, key: str, client: Client, *, close: bool = True) -> AsyncIterator[ClientSession]:
    """A client of the gateway over streamable HTTP; ``close=False``: it leaves without ending its session (no
    DELETE), which the gateway then ends when it idles out."""
    async with streamablehttp_client(url, headers={"Authorization": f"Bearer {key}"}, terminate_on_close=close) as (
            read, write, _), client.session(read, write) as session:
        await session.initialize()
        yield session


@contextlib.asynccontextmanager
async def socket_client(env: dict[str, str], path: Path, client: Client) -> AsyncIterator[ClientSession]:
    """A client whose config launches ``undolog mcp connect --socket PATH`` as its stdio server."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "undolog_core.cli", "mcp", "connect",
                                                                  "--socket", str(path)], env=env)
    async with stdio_client(params) as (read, write), client.session(read, write) as session:
        await session.initialize()
        yield session


def my_children(marker: str) -> set[int]:
    """This test process's own child processes whose command line holds ``marker`` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            command = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == os.getpid() and marker.encode() in command:
            found.add(int(entry.name))
    return found


# -- a restarted upstream ---------------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def gateway_session(transport: str, db: Any, cfg: Path, errors: Path,
                          client: Client) -> AsyncIterator[ClientSession]:
    env = {**os.environ, **db.env}
    if transport == "stdio":
        params = StdioServerParameters(command=sys.executable, args=["-m", "undolog_core.cli", "mcp", "serve",
                                                                      "--config", str(cfg)], env=env)
        with errors.open("w") as err:
            async with stdio_client(params, errlog=err) as (read, write), client.session(read, write) as session:
                await session.initialize()
                yield session
        return
    key = agent_key(env)
    with serving(["--config", str(cfg), "--http", "--port", "0"], env, errors, "serving ") as url:
        async with http_client(url, key, client) as session:
            yield session


@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_restarted_upstream_gets_the_log_level_again(db: Any, tmp_path: Path, transport: str) -> None:
    log = tmp_path / "wire.log"
    cfg = everything_config(tmp_path, log)
    errors = tmp_path / "gateway.log"
    db.open()
    client = Client()
    async with gateway_session(transport, db, cfg, errors, client) as session:
        # At its own default level, the upstream logs each subscription it takes at "info".
        await session.subscribe_resource(DOC)
        assert [m for d, m in wire(log) if d == "out" and m.get("method") == "notifications/message"
                and "Received Subscribe" in str(m["params"]["data"])]
        await session.set_logging_level("warning")
        assert not (await session.call_tool("echo", {"message": "before"})).isError

        os.kill(int((log.parent / (log.name + ".pid")).read_text()), signal.SIGKILL)  # the crash
        await until(lambda: NOTICED in errors.read_text(), "the gateway noticed the upstream's end")
        after = await session.call_tool("echo", {"message": "after the crash"})
        assert not after.isError, after
        assert len(requests_in(log, "initialize")) == 2  # started again for that call

        # The subscription the client holds is made again on the new process (in the background: wait for it).
        await until(lambda: len(requests_in(log, "resources/subscribe")) == 2, "subscribed again")
        again = requests_in(log, "resources/subscribe")[1]
        await until(lambda: [m for d, m in wire(log) if d == "out" and m.get("id") == again["id"]
                             and "method" not in m], "the new subscription answered")

    messages = wire(log)
    second = [i for i, (d, m) in enumerate(messages) if d == "in" and m.get("method") == "initialize"][1]
    restarted = messages[second:]
    sent = [m for d, m in restarted if d == "in" and "method" in m and "id" in m]
    methods = [m["method"] for m in sent]
    # The level went to the new process before any request of a client's: the call, the subscription.
    assert "logging/setLevel" in methods, methods
    level = sent[methods.index("logging/setLevel")]
    assert level["params"]["level"] == "warning"
    assert methods.index("logging/setLevel") < methods.index("tools/call")
    assert methods.index("logging/setLevel") < methods.index("resources/subscribe")
    # And the upstream kept to it: once the level was answered, nothing below "warning" left it, not even the
    # "info" message its subscribe handler sends before answering (it did, above, at its default level).
    answered = next(i for i, (d, m) in enumerate(restarted) if d == "out" and m.get("id") == level["id"]
                    and "method" not in m)
    below = [m["params"] for d, m in restarted[answered:] if d == "out" and m.get("method") == "notifications/message"
             and LEVELS.index(m["params"]["level"]) < LEVELS.index("warning")]
    assert below == [], below


# -- subscriptions held by several clients ----------------------------------------------------------------------

class Watcher(Client):
    """A client that counts the resource updates it is told of."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: list[str] = []

    async def on_message(self, message: Any) -> None:
        await super().on_message(message)
        if isinstance(message, types.ServerNotification) and isinstance(message.root,
                                                                        types.ResourceUpdatedNotification):
            self.updates.append(str(message.root.params.uri))


TOGGLE = '\n[tools.everything.toggle-subscriber-updates]\ntier = "safe"\n'


async def still_told(session: ClientSession, watcher: Watcher) -> None:
    """The upstream still holds the subscription: its simulated updates (one at once, then one every 5 s) reach
    ``watcher``. Two are awaited, the second sent well after the other client left."""
    toggled = await session.call_tool("toggle-subscriber-updates", {})
    assert not toggled.isError, toggled
    await until(lambda: watcher.updates.count(DOC) >= 2, "two updates of the resource still subscribed")


async def test_http_clients_subscriptions_end_upstream_when_the_last_one_goes(db: Any, tmp_path: Path) -> None:
    log = tmp_path / "wire.log"
    cfg = everything_config(tmp_path, log, extra=TOGGLE)
    env = {**os.environ, **db.env}
    db.open()
    key = agent_key(env)
    staying = Watcher()
    # The idle timeout ends a session that left without saying so; one whose client listens (the SDK's client
    # holds a GET stream open) never idles.
    with serving(["--config", str(cfg), "--http", "--port", "0", "--idle-timeout", "3"], env,
                 tmp_path / "gateway.log", "serving ") as url:
        async with contextlib.AsyncExitStack() as stack:
            second = await stack.enter_async_context(http_client(url, key, staying, close=False))
            async with http_client(url, key, Client()) as first:
                await first.subscribe_resource(DOC)
                await second.subscribe_resource(DOC)
                assert len(requests_in(log, "resources/subscribe")) == 1  # one upstream subscription for both
            # The first client closed its session (DELETE): the second still holds the URI, so it stays.
            await still_told(second, staying)
            assert requests_in(log, "resources/unsubscribe") == []
        # The second left without closing its session: it idles out, and the upstream is told.
        gone = await until(lambda: requests_in(log, "resources/unsubscribe"), "unsubscribed upstream")
        assert [m["params"]["uri"] for m in gone] == [DOC]


async def test_socket_clients_subscriptions_end_upstream_when_the_last_one_goes(db: Any, tmp_path: Path) -> None:
    log = tmp_path / "wire.log"
    cfg = everything_config(tmp_path, log, extra=TOGGLE)
    env = {**os.environ, **db.env}
    sock = tmp_path / "gw.sock"
    db.open()
    staying = Watcher()
    with serving(["--config", str(cfg), "--socket", str(sock)], env, tmp_path / "gateway.log", "serving on socket"):
        async with socket_client(env, sock, staying) as second:
            before = my_children(str(sock))
            killed = contextlib.AsyncExitStack()
            first = await killed.enter_async_context(socket_client(env, sock, Client()))
            (connect_pid,) = my_children(str(sock)) - before
            await first.subscribe_resource(DOC)
            await second.subscribe_resource(DOC)
            assert len(requests_in(log, "resources/subscribe")) == 1

            os.kill(connect_pid, signal.SIGKILL)  # the first client's connection dies with its process
            with contextlib.suppress(Exception):
                await killed.aclose()
            await still_told(second, staying)
            assert requests_in(log, "resources/unsubscribe") == []
        # The second client's connection closed (its client ended): the last holder is gone.
        gone = await until(lambda: requests_in(log, "resources/unsubscribe"), "unsubscribed upstream")
        assert [m["params"]["uri"] for m in gone] == [DOC]


# -- the counting itself, with the gateway in this process ------------------------------------------------------

async def test_subscriptions_are_counted_per_uri_and_released_with_the_clients(undolog: Any, tmp_path: Path) -> None:
    """Two clients of one in-process gateway (the SDK's in-memory transport) on one URI of the conformance fixture,
    whose wire is tapped: one upstream subscription, kept while any client holds the URI, ended by the last."""
    from mcp.shared.memory import create_connected_server_and_client_session

    from undolog_mcp.config import load_config
    from undolog_mcp.gateway import Gateway

    from .test_gateway_everything import TAP

    log = tmp_path / "wire.log"
    cfg = tmp_path / "gateway.toml"
    fixture = Path(__file__).parent / "conformance_fixture.py"
    command = [sys.executable, str(TAP), str(log), "--", sys.executable, str(fixture)]
    cfg.write_text(f"[upstreams.fixture]\ncommand = {json.dumps(command)}\n")
    uri: Any = "test://watched-resource"
    gw = Gateway(load_config(cfg), undolog)
    async with gw.running():
        async with create_connected_server_and_client_session(gw.server) as one, \
                create_connected_server_and_client_session(gw.server) as two:
            await one.subscribe_resource(uri)
            await two.subscribe_resource(uri)
            await two.subscribe_resource(uri)  # again: it holds it once
            assert len(requests_in(log, "resources/subscribe")) == 1
            await one.unsubscribe_resource(uri)  # the other still holds it: nothing upstream
            await one.unsubscribe_resource(uri)  # (not held: nothing to do)
            assert requests_in(log, "resources/unsubscribe") == []
            await two.unsubscribe_resource(uri)  # the last holder: the upstream is told before the answer
            assert len(requests_in(log, "resources/unsubscribe")) == 1
            await one.subscribe_resource(uri)
            await two.subscribe_resource(uri)
            assert len(requests_in(log, "resources/subscribe")) == 2
        # Both went away holding it: released, and the upstream told once.
        await until(lambda: len(requests_in(log, "resources/unsubscribe")) == 2, "unsubscribed upstream")
