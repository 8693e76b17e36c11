"""Session grouping and the long-lived gateway, driven as clients drive it: the SDK's own client over
``undolog mcp connect`` (a real subprocess) to ``undolog mcp serve --socket`` (another), and the SDK's
streamable-HTTP client to ``undolog mcp serve --http`` behind real desk API keys; the upstream is the SDK-written
``tickets_server.py``. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client

from undolog_core import EffectState, SessionState, UndoLog
from undolog_mcp.config import SessionGrouping
from undolog_mcp.sessions import SESSION_META, SessionRefused, SessionRouter

from .test_gateway import cli, text, world, write_config

pytestmark = pytest.mark.reads_store


def grouped_config(tmp: Path, grouping: str, *, extra: str = "") -> Path:
    """The tests' gateway config with ``session = ...`` at its top, where the key belongs."""
    cfg = write_config(tmp, extra=extra)
    cfg.write_text(f'session = "{grouping}"\n' + cfg.read_text())
    return cfg


@contextlib.contextmanager
def socket_gateway(db: Any, cfg: Path, path: Path, *, env: dict[str, str] | None = None
                   ) -> Iterator[subprocess.Popen[str]]:
    """``undolog mcp serve --socket`` as a process of its own, until the block ends."""
    env = {**os.environ, **db.env, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg),
                             "--socket", str(path)], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "serving on socket" in line:
                break
        else:
            raise AssertionError(f"the socket gateway did not start (exit {proc.wait()})")
        yield proc
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.asynccontextmanager
async def connected(db: Any, path: Path, *, name: str = "short-lived") -> AsyncIterator[ClientSession]:
    """A client whose config launches ``undolog mcp connect --socket PATH`` as its stdio server."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "undolog_core.cli", "mcp", "connect",
                                                                  "--socket", str(path)],
                                   env={**os.environ, **db.env})
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write, client_info=types.Implementation(name=name, version="1")) as client:
            await client.initialize()
            yield client


@contextlib.contextmanager
def http_gateway(db: Any, cfg: Path) -> Iterator[str]:
    env = {**os.environ, **db.env}
    proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg),
                             "--http", "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = None
        for line in proc.stderr:
            if "serving http://" in line:
                url = line.split("serving ", 1)[1].strip()
                break
        assert url, f"the HTTP gateway did not start (exit {proc.poll()})"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.asynccontextmanager
async def over_http(url: str, token: str, *, headers: dict[str, str] | None = None) -> AsyncIterator[ClientSession]:
    from mcp.client.streamable_http import streamablehttp_client

    async with streamablehttp_client(url, headers={"Authorization": f"Bearer {token}", **(headers or {})}) as (
            r, w, _):
        async with ClientSession(r, w, client_info=types.Implementation(name="remote", version="1")) as client:
            await client.initialize()
            yield client


def agent_key(db: Any, name: str) -> str:
    made = cli(db, "keys", "create", "--name", name, "--role", "agent")
    assert made.returncode == 0, made.stderr
    return made.stdout.strip().split()[-1]


def session_of(result: types.CallToolResult) -> str:
    sid = (result.meta or {}).get(SESSION_META)
    assert isinstance(sid, str), result
    return sid


def mcp_sessions(u: UndoLog) -> list[Any]:
    return [s for s in u.sessions.list() if (s.agent_id or "").startswith("mcp:")]


async def test_socket_gateway_serves_short_connections_in_one_process_session(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    db.open()
    with socket_gateway(db, cfg, sock):
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600  # only its owner may connect
        ids = []
        for title in ("first", "second", "third"):
            async with connected(db, sock) as client:  # a client that opens one MCP session per call
                made = await client.call_tool("create_ticket", {"title": title})
                assert not made.isError, text(made)
                ids.append(session_of(made))
        assert len(set(ids)) == 1, "with session = process every connection's calls share one session"
        # A second long-lived gateway on the same socket is refused while the first serves.
        env = {**os.environ, **db.env}
        clash = subprocess.run([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg),
                                "--socket", str(sock)], env=env, capture_output=True, text=True, timeout=120)
        assert clash.returncode != 0 and "already serving" in clash.stderr
    calls = world(tmp_path)["calls"]
    assert [c["tool"] for c in calls] == ["create_ticket"] * 3
    assert len({c["pid"] for c in calls}) == 1, "the upstream is not restarted per client connection"
    u = db.open()
    (s,) = mcp_sessions(u)
    assert s.session_id == ids[0]
    assert [e["state"] for e in u.sessions.effects(s.session_id)] == [EffectState.COMMITTED] * 3
    # The gateway removed its socket on the way out; a client then is told how to start one.
    assert not sock.exists()
    env = {**os.environ, **db.env}
    lonely = subprocess.run([sys.executable, "-m", "undolog_core.cli", "mcp", "connect", "--socket", str(sock)],
                            env=env, capture_output=True, text=True, timeout=60, input="")
    assert lonely.returncode == 2 and "no gateway is listening" in lonely.stderr
    assert "undolog mcp serve" in lonely.stderr


async def test_an_approval_in_a_process_session_meets_the_reissue_of_another_connection(
        db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    db.open()
    with socket_gateway(db, cfg, sock):
        async with connected(db, sock) as client:
            asked = await client.call_tool("delete_project", {"name": "acme"})
            request_id = (asked.structuredContent or {})["approval_request_id"]
        done = cli(db, "approvals", "approve", request_id)
        assert done.returncode == 0, done.stderr
        async with connected(db, sock) as client:
            ran = await client.call_tool("delete_project", {"name": "acme"})
            assert not ran.isError and "deleted acme" in text(ran)
        async with connected(db, sock) as client:
            again = await client.call_tool("delete_project", {"name": "acme"})
            assert "deleted acme" in text(again) and (again.meta or {})["dev.undolog/call"]["replayed"]
    assert [c["tool"] for c in world(tmp_path)["calls"]] == ["delete_project"]  # ran exactly once


async def test_a_stdio_client_names_only_sessions_this_gateway_process_made(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "mcp")
    sock = tmp_path / "gw.sock"
    db.open()
    with socket_gateway(db, cfg, sock):
        async with connected(db, sock) as first:
            made = await first.call_tool("create_ticket", {"title": "one"})
            mine = session_of(made)
        async with connected(db, sock) as second:
            fresh = await second.call_tool("create_ticket", {"title": "two"})
            assert session_of(fresh) != mine  # session = mcp: a new MCP session is a new UndoLog session
            named = await second.call_tool("create_ticket", {"title": "three"}, meta={SESSION_META: mine})
            assert not named.isError and session_of(named) == mine
            # Calls after naming stay in the named session for this MCP session.
            after = await second.call_tool("reserve_seat", {"seat": "4A"})
            assert session_of(after) == mine
            # An id the gateway never gave out is refused; it is never started under the client's chosen id.
            invented = await second.call_tool("create_ticket", {"title": "four"}, meta={SESSION_META: "my-own-id"})
            assert invented.isError and "no session 'my-own-id' for this client" in text(invented)
    u = db.open()
    assert len(mcp_sessions(u)) == 2
    assert [e["tool_name"] for e in u.sessions.effects(mine)] == ["create_ticket", "create_ticket", "reserve_seat"]
    # Another gateway process (stdio, started by a client) cannot take over a session it did not make.
    from .test_gateway import gateway

    async with gateway(db, cfg) as other:
        refused = await other.call_tool("create_ticket", {"title": "five"}, meta={SESSION_META: mine})
        assert refused.isError and (refused.meta or {})["dev.undolog/call"]["error"] == "session_not_yours"
    assert "four" not in str(world(tmp_path)) and "five" not in str(world(tmp_path))


async def test_key_grouping_over_http_and_naming_by_the_same_key_only(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "key")
    db.open()
    bot, other = agent_key(db, "bot"), agent_key(db, "other-bot")
    with http_gateway(db, cfg) as url:
        seen = []
        for title in ("a", "b"):
            async with over_http(url, bot) as client:  # a new MCP session per call, as langchain's default
                made = await client.call_tool("create_ticket", {"title": title})
                assert not made.isError, text(made)
                seen.append(session_of(made))
        assert seen[0] == seen[1], "session = key: one UndoLog session per API key"
        async with over_http(url, other) as client:
            theirs = await client.call_tool("create_ticket", {"title": "c"})
            assert session_of(theirs) != seen[0]
            stolen = await client.call_tool("create_ticket", {"title": "d"}, meta={SESSION_META: seen[0]})
            assert stolen.isError and "no session" in text(stolen)
        async with over_http(url, other, headers={"X-UndoLog-Session": seen[0]}) as client:
            stolen = await client.call_tool("create_ticket", {"title": "e"})
            assert stolen.isError and "no session" in text(stolen)
        async with over_http(url, bot, headers={"X-UndoLog-Session": seen[0]}) as client:
            again = await client.call_tool("create_ticket", {"title": "f"})
            assert not again.isError and session_of(again) == seen[0]
    # After a restart, the key still names its own session (read from the database: created by this key).
    with http_gateway(db, cfg) as url:
        async with over_http(url, bot) as client:
            named = await client.call_tool("create_ticket", {"title": "g"}, meta={SESSION_META: seen[0]})
            assert not named.isError and session_of(named) == seen[0]
    u = db.open()
    titles = [e["args_snapshot"]["title"] for e in u.sessions.effects(seen[0])]
    assert titles == ["a", "b", "f", "g"]
    assert u.sessions.get(seen[0]).created_by.startswith("key:")
    assert not {"d", "e"} & {c["args"].get("title") for c in world(tmp_path)["calls"]}


def test_key_grouping_refused_without_http(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "key")
    env = {**os.environ, **db.env}
    out = subprocess.run([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg),
                          "--socket", str(tmp_path / "s.sock")], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and 'session = "key"' in out.stderr and "--http" in out.stderr


class McpSession:
    """Stands for the SDK's server session object in the router's own tests (only its identity is used)."""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_an_idle_key_session_ends_but_a_halted_one_stays(undolog: UndoLog) -> None:
    clock = Clock()
    router = SessionRouter(undolog, SessionGrouping.KEY, idle=60, clock=clock)
    first = await router.session_for(mcp_session=McpSession(), principal="key:a", named=None, label="mcp:t/1")
    clock.now += 59
    assert await router.session_for(mcp_session=McpSession(), principal="key:a", named=None, label="mcp:t/1") == first
    clock.now += 61
    second = await router.session_for(mcp_session=McpSession(), principal="key:a", named=None, label="mcp:t/1")
    assert second != first and undolog.sessions.get(first).state == SessionState.COMPLETED
    # A halted session is not ended by waiting: the key's calls keep meeting it until a person resumes it.
    undolog.sessions.get(second)
    undolog.sessions.set_state(second, SessionState.HALTED, allowed=(SessionState.ACTIVE,))
    clock.now += 600
    assert await router.sweep() == []
    assert await router.session_for(mcp_session=McpSession(), principal="key:a", named=None, label="mcp:t/1") == second
    assert undolog.sessions.get(second).state == SessionState.HALTED
    # The sweep ends an idle active session without waiting for the key's next call.
    other = await router.session_for(mcp_session=McpSession(), principal="key:b", named=None, label="mcp:t/1")
    clock.now += 61
    assert await router.sweep() == [other]
    assert undolog.sessions.get(other).state == SessionState.COMPLETED


async def test_a_named_session_must_be_the_keys_own(undolog: UndoLog) -> None:
    router = SessionRouter(undolog, SessionGrouping.MCP, idle=60)
    theirs = undolog.session(agent_id="x", created_by="key:b")
    undolog.sessions.get(theirs.id)  # written, as a session with calls is
    mine = await router.session_for(mcp_session=McpSession(), principal="key:a", named=None, label="mcp:t/1")
    assert await router.session_for(mcp_session=McpSession(), principal="key:a", named=mine, label="l") == mine
    for named, principal in ((theirs.id, "key:a"), (mine, "key:b"), (mine, None), ("nope", "key:a"), (7, "key:a"),
                             ("x" * 500, "key:a")):
        with pytest.raises(SessionRefused):
            await router.session_for(mcp_session=McpSession(), principal=principal, named=named, label="l")
    # Another router (another gateway process) knows a key's session from the database; over stdio it does not.
    later = SessionRouter(undolog, SessionGrouping.MCP, idle=60)
    assert await later.session_for(mcp_session=McpSession(), principal="key:b", named=theirs.id, label="l") == theirs.id
    with pytest.raises(SessionRefused):
        await later.session_for(mcp_session=McpSession(), principal=None, named=theirs.id, label="l")
