"""The gateway under attack: clients that cancel, upstreams that cannot be started or hang, configs that clash.

The same real processes as ``test_gateway.py``: the SDK's client over stdio, ``undolog mcp serve`` as a
subprocess, the SDK-written upstream (``tickets_server.py``), on SQLite and PostgreSQL.
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
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, McpError, StdioServerParameters, types
from mcp.client.stdio import stdio_client

from undolog_core import EffectState, SessionState

from .test_gateway import UPSTREAM, cli, gateway, only_session, text, world, write_config


async def until(what: str, cond: Callable[[], bool], bound: float = 30.0) -> None:
    """Wait for ``cond`` (a bound, not a timing assertion: the condition is what is checked)."""
    deadline = time.monotonic() + bound
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.05)


def upstream_got(tmp: Path, title: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return any(c["args"].get("title") == title for c in world(tmp)["calls"])
        except (FileNotFoundError, ValueError):
            return False
    return check


def calls_of(tmp: Path) -> list[dict[str, Any]]:
    """Every call the upstream got (none when it never wrote its world)."""
    return list(world(tmp)["calls"]) if (tmp / "tickets.json").exists() else []


def effects_of(db: Any) -> list[dict[str, Any]]:
    u = db.open()
    return list(u.sessions.effects(only_session(u).session_id))


async def test_a_client_that_cancels_mid_call_leaves_nothing_in_flight(db: Any, tmp_path: Path) -> None:
    # MCP lets a client cancel a request (notifications/cancelled); the SDK then cancels the handler. Once the call
    # is forwarded the upstream does it anyway: the gateway must still record what the upstream answered, not leave
    # the call in flight (pending, its result lost) while the session goes on.
    cfg = write_config(tmp_path)
    async with gateway(db, cfg) as client:
        call = asyncio.ensure_future(client.call_tool("create_ticket", {"title": "slowish"}))
        await until("the upstream got the call", upstream_got(tmp_path, "slowish"))
        request_id = client._request_id - 1  # the SDK numbers requests itself: the one just sent
        await client.send_notification(types.ClientNotification(types.CancelledNotification(
            params=types.CancelledNotificationParams(requestId=request_id, reason="the user pressed stop"))))
        with pytest.raises(McpError, match="cancelled"):
            await call
        await until("the cancelled call is recorded",
                    lambda: [e["state"] for e in effects_of(db)] == [EffectState.COMMITTED])
        after = await client.call_tool("create_ticket", {"title": "next"})
        assert not after.isError, text(after)
    (cancelled, _) = effects_of(db)
    assert cancelled["result_snapshot"]["structuredContent"] == {"id": 1, "title": "slowish", "status": "open"}
    # ... so a rollback undoes it with the id the upstream answered.
    u = db.open()
    out = cli(db, "--app", str(tmp_path / "gateway.toml"), "sessions", "rollback", only_session(u).session_id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert {t["status"] for t in world(tmp_path)["tickets"].values()} == {"closed"}


async def test_a_client_that_disconnects_mid_call_leaves_nothing_in_flight(db: Any, tmp_path: Path) -> None:
    # The client goes away (the gateway's stdin closes) while a COMPENSABLE call is at the upstream: the gateway
    # finishes recording it before it exits, so nothing is left for recovery to guess at. (A raw client: the SDK's
    # own stdio client would SIGTERM the gateway 2 s after closing the pipe.)
    cfg = write_config(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg)],
                            env={**os.environ, **db.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        for message in (
            {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                "protocolVersion": types.LATEST_PROTOCOL_VERSION, "capabilities": {},
                "clientInfo": {"name": "leaver", "version": "1"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"},
            {"jsonrpc": "2.0", "id": 1, "method": "tools/call",
             "params": {"name": "create_ticket", "arguments": {"title": "slowish"}}},
        ):
            proc.stdin.write(json.dumps(message).encode() + b"\n")
            proc.stdin.flush()
            if message.get("id") == 0:
                assert b'"id":0' in proc.stdout.readline()
        await until("the upstream got the call", upstream_got(tmp_path, "slowish"))
        proc.stdin.close()  # the client is gone
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert [e["state"] for e in effects_of(db)] == [EffectState.COMMITTED]


@contextlib.asynccontextmanager
async def logged_gateway(db: Any, cfg: Path, log: Path) -> AsyncIterator[ClientSession]:
    """The gateway as ``test_gateway.gateway`` starts it, its stderr kept in ``log``."""
    params = StdioServerParameters(command=sys.executable, args=["-m", "undolog_core.cli", "mcp", "serve",
                                                                  "--config", str(cfg)], env={**os.environ, **db.env})
    with open(log, "w") as errlog:
        async with stdio_client(params, errlog=errlog) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            yield session


def said(log: Path, words: str) -> Callable[[], bool]:
    return lambda: words in log.read_text()


def kill_upstream(tmp: Path) -> None:
    """SIGKILL the tickets upstream the gateway started for ``tmp`` (its command names the copy in ``tmp``)."""
    script = str(tmp / "tickets_server.py")
    killed = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if script.encode() in cmdline:
            os.kill(int(pid), signal.SIGKILL)
            killed += 1
    assert killed == 1, killed


async def test_an_upstream_that_died_while_idle_is_started_again_for_the_next_call(db: Any, tmp_path: Path) -> None:
    # The upstream died between calls (OOM-killed, restarted by an operator): the next call finds its connection
    # already closed, so it never left the gateway. It must run on a fresh upstream, not be taken for a call
    # whose outcome is unknown (compensated "in case", the session halted for a person, for nothing).
    cfg, log = write_config(tmp_path), tmp_path / "gateway.log"
    async with logged_gateway(db, cfg, log) as client:
        await client.call_tool("reserve_seat", {"seat": "1A"})
        kill_upstream(tmp_path)
        await until("the gateway noticed", said(log, "upstream tickets closed its connection"))
        again = await client.call_tool("reserve_seat", {"seat": "2A"})
        assert not again.isError, text(again)
    u = db.open()
    s = only_session(u)
    assert [e["state"] for e in u.sessions.effects(s.session_id)] == [EffectState.COMMITTED] * 2
    assert u.sessions.get(s.session_id).state == SessionState.ACTIVE
    assert world(tmp_path)["seats"] == ["1A", "2A"]


async def test_an_upstream_that_cannot_be_started_again_refuses_the_call_as_not_run(db: Any, tmp_path: Path) -> None:
    # The upstream died and its command now fails at start (a broken deploy): the next call never reaches an
    # upstream, so it definitely did not run: recorded as failed with nothing to undo, not as a call that may
    # have happened (whose compensation, needing a result it never had, would halt every rollback).
    cfg, log = write_config(tmp_path), tmp_path / "gateway.log"
    async with logged_gateway(db, cfg, log) as client:
        await client.call_tool("reserve_seat", {"seat": "1A"})
        kill_upstream(tmp_path)
        await until("the gateway noticed", said(log, "upstream tickets closed its connection"))
        (tmp_path / "tickets_server.py").write_text("import sys\nsys.exit('broken deploy')\n")
        refused = await client.call_tool("create_ticket", {"title": "never"})
        assert refused.isError and "upstream tickets could not be started" in text(refused), text(refused)
    u = db.open()
    s = only_session(u)
    by_tool = {e["tool_name"]: e for e in u.sessions.effects(s.session_id)}
    assert by_tool["create_ticket"]["state"] == EffectState.FAILED and by_tool["create_ticket"]["undo_id"] is None
    assert u.sessions.get(s.session_id).state == SessionState.ACTIVE
    assert not upstream_got(tmp_path, "never")()


def serve_fails(db: Any, cfg: Path) -> str:
    env = {**os.environ, **db.env}
    out = subprocess.run([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg)], env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    return out.stderr


def test_an_upstream_that_cannot_start_stops_the_gateway_naming_it(db: Any, tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text('[upstreams.tickets]\ncommand = ["no-such-upstream-binary", "serve"]\n'
                   '[tools.tickets.search_tickets]\ntier = "safe"\n')
    err = serve_fails(db, cfg)
    assert "upstream 'tickets'" in err and "no-such-upstream-binary" in err, err
    cfg.write_text(f'[upstreams.tickets]\ncommand = [{json.dumps(sys.executable)}, "-c", "raise SystemExit(4)"]\n'
                   '[tools.tickets.search_tickets]\ntier = "safe"\n')
    err = serve_fails(db, cfg)
    assert "upstream 'tickets'" in err, err


def test_an_upstream_that_never_answers_at_start_stops_the_gateway(db: Any, tmp_path: Path) -> None:
    # An upstream that starts and then says nothing would hold the gateway (and the client that started it) at
    # start for ever: its timeout bounds the handshake too.
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(f'[upstreams.mute]\ncommand = [{json.dumps(sys.executable)}, "-c", "import time; time.sleep(600)"]\n'
                   'start_timeout = 1\n[tools.mute.anything]\ntier = "safe"\n')
    err = serve_fails(db, cfg)
    assert "upstream 'mute'" in err and "start_timeout" in err, err


def test_prefixed_names_that_clash_stop_the_gateway() -> None:
    # Two upstreams both list x, so each is exposed prefixed (a_x, b_x); a's own tool named b_x then takes the
    # same name. One of them silently shadowed the other (a client calling b_x ran whichever was planned last, and
    # each start registered the two contracts over each other as new revisions, cancelling pending approvals).
    from undolog_core.errors import ConfigurationError
    from undolog_mcp.config import load_config
    from undolog_mcp.gateway import plan_exposure

    cfg = load_config({
        "upstreams": {"a": {"command": ["a"]}, "b": {"command": ["b"]}},
        "tools": {"a": {"x": {"tier": "safe"}, "b_x": {"tier": "safe"}}, "b": {"x": {"tier": "safe"}}},
    })

    def tool(name: str) -> types.Tool:
        return types.Tool(name=name, inputSchema={"type": "object"})

    with pytest.raises(ConfigurationError, match=r"b_x.*a/b_x.*b/x|b_x.*b/x.*a/b_x"):
        plan_exposure(cfg, {"a": [tool("x"), tool("b_x")], "b": [tool("x")]})
    # No clash: prefixed where two share a name, as before.
    exposure = plan_exposure(cfg, {"a": [tool("x"), tool("y")], "b": [tool("x")]})
    assert set(exposure.tools) == {"a_x", "b_x"}


async def test_an_elicited_answer_that_is_not_a_yes_runs_nothing(db: Any, tmp_path: Path) -> None:
    # The form asks a boolean; a client (or its form library) that answers the string "false", or a number, must
    # not have approved an irreversible call: only a true yes runs it. Not a yes or a no: no decision, the request
    # stays pending at the desk.
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
        approval = "elicit"
    """)
    answers = iter([{"approve": "false", "reason": "no!"}, {"approve": 1}, {"approve": True}])

    async def sloppy(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        return types.ElicitResult(action="accept", content=next(answers))

    async with gateway(db, cfg, elicit=sloppy, name="sloppy") as client:
        for _ in range(2):
            asked = await client.call_tool("close_ticket", {"id": 1})
            assert (asked.structuredContent or {}).get("status") == "awaiting_approval", text(asked)
        assert not (tmp_path / "tickets.json").exists()  # never forwarded
        ran = await client.call_tool("close_ticket", {"id": 1})  # a real yes
        assert not ran.isError and "closed" in text(ran)
    assert [c["tool"] for c in world(tmp_path)["calls"]] == ["close_ticket"]


async def test_an_upstream_started_again_with_a_changed_tool_does_not_run_what_was_approved(db: Any,
                                                                                          tmp_path: Path) -> None:
    # The upstream dies and comes back as another version (an upgrade; `npx pkg@latest` on every start) whose
    # close_ticket takes another argument. The approval was given for the old contract: the call must not be sent
    # to the new one, and the new listing is registered at once (a new revision, as at start), which cancels
    # what is still pending against the old one.
    cfg, log = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
        [tools.tickets.export_everything]
        tier = "irreversible"
    """), tmp_path / "gateway.log"
    async with logged_gateway(db, cfg, log) as client:
        asked = await client.call_tool("close_ticket", {"id": 1})
        close_id = (asked.structuredContent or {})["approval_request_id"]
        pending = await client.call_tool("export_everything", {})
        export_id = (pending.structuredContent or {})["approval_request_id"]
        done = cli(db, "approvals", "approve", close_id)
        assert done.returncode == 0, done.stderr
        (tmp_path / "tickets_server.py").write_text(UPSTREAM.read_text().replace(
            "def close_ticket(id: int)", "def close_ticket(id: int, reason: str = '')"))
        kill_upstream(tmp_path)
        await until("the gateway noticed", said(log, "upstream tickets closed its connection"))
        refused = await client.call_tool("close_ticket", {"id": 1})
        assert refused.isError and "changed close_ticket" in text(refused), text(refused)
        again = await client.call_tool("close_ticket", {"id": 1})  # asked again: never under the old approval
        assert again.isError or (again.structuredContent or {}).get("status") == "awaiting_approval", text(again)
    assert "close_ticket" not in {c["tool"] for c in calls_of(tmp_path)}
    u = db.open()
    history = u.registry.history("close_ticket")
    assert len(history) == 2 and "reason" in json.dumps(history[-1], default=str)
    assert u.approvals.get(export_id).state.value == "pending"  # its tool did not change
    assert "changed tools (close_ticket)" in log.read_text()


def test_a_compensation_template_naming_what_the_tool_does_not_have_stops_the_gateway(db: Any, tmp_path: Path) -> None:
    # A typo in a template ({args.seta}) used to pass every check at start and fail only when it mattered: at
    # rollback, where the compensation could not be built and the session halted. The upstream's listing says
    # what the tool takes and answers: checked against it at start.
    cfg = write_config(tmp_path)
    good = cfg.read_text()
    cfg.write_text(good.replace('args = {{ seat = "{{args.seat}}" }}'.replace("{{", "{").replace("}}", "}"),
                                'args = { seat = "{args.seta}" }'))
    assert "{args.seta}" in cfg.read_text()
    err = serve_fails(db, cfg)
    assert "{args.seta}" in err and "reserve_seat" in err and "seat" in err, err
    cfg.write_text(good.replace("{result.id}", "{result.ident}"))  # create_ticket answers a Ticket: no "ident"
    err = serve_fails(db, cfg)
    assert "{result.ident}" in err and "create_ticket" in err, err


@pytest.mark.parametrize("bad", ['timeout = nan', 'timeout = inf', 'timeout = true', 'start_timeout = -1'])
def test_a_timeout_that_is_no_number_of_seconds_is_refused(tmp_path: Path, bad: str) -> None:
    from undolog_core.errors import ConfigurationError
    from undolog_mcp.config import load_config

    cfg = tmp_path / "gateway.toml"
    cfg.write_text(f'[upstreams.tickets]\ncommand = ["x"]\n{bad}\n')
    with pytest.raises(ConfigurationError, match=r"\[upstreams.tickets\] \w*timeout must be a positive number"):
        load_config(cfg)


def test_an_empty_placeholder_path_is_refused_at_load(tmp_path: Path) -> None:
    from undolog_core.errors import ConfigurationError
    from undolog_mcp.config import load_config

    cfg = tmp_path / "gateway.toml"
    cfg.write_text('[upstreams.t]\ncommand = ["x"]\n[tools.t.a]\ntier = "compensable"\n'
                   'compensation = { tool = "b", args = { id = "{result.}" } }\n')
    with pytest.raises(ConfigurationError, match=r"\{result\.\}"):
        load_config(cfg)


async def test_a_live_upstream_that_says_its_tools_changed_does_not_run_what_was_approved(db: Any,
                                                                                        tmp_path: Path) -> None:
    # MCP lets a server change its tools while it runs and say so (notifications/tools/list_changed). The gateway
    # listed once, at start: an approval given for the old close_ticket ran against the new one. It is listed
    # anew on the notice, before the next call is sent, with the same outcome as an upstream started again.
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
        [tools.tickets.upgrade_tools]
        tier = "safe"
    """)
    told = asyncio.Event()

    async def notices(message: Any) -> None:
        if isinstance(message, types.ServerNotification) and isinstance(message.root,
                                                                        types.ToolListChangedNotification):
            told.set()

    async with gateway(db, cfg, message_handler=notices) as client:
        asked = await client.call_tool("close_ticket", {"id": 1})
        done = cli(db, "approvals", "approve", (asked.structuredContent or {})["approval_request_id"])
        assert done.returncode == 0, done.stderr
        upgraded = await client.call_tool("upgrade_tools", {})
        assert not upgraded.isError, text(upgraded)
        refused = await client.call_tool("close_ticket", {"id": 1})
        # Refused whichever way the race goes: decided under the old contract and not sent ("changed close_ticket"),
        # refused at the decision (the gateway listed the new one first, on the upstream's notice), or the approval
        # cancelled because the contract it was given for changed.
        answer = text(refused)
        assert refused.isError and ("changed close_ticket" in answer or "'close_ticket' changed since" in answer
                                    or "contract of 'close_ticket' changed" in answer), answer
        # The gateway relays the upstream's notice to this client too. Left before it came, the SDK's stdio client
        # fails its own exit (its reader sends the late notice into the closed session: BrokenResourceError), as
        # CI saw once on a loaded machine; so the test waits for the notice it expects.
        await asyncio.wait_for(told.wait(), 60)
    assert "close_ticket" not in {c["tool"] for c in calls_of(tmp_path)}
    history = db.open().registry.history("close_ticket")
    assert len(history) == 2 and "reason" in json.dumps(history[-1], default=str)


async def test_over_http_an_mcp_session_answers_only_the_key_that_opened_it(db: Any, tmp_path: Path) -> None:
    # "An MCP session belongs to the key that opened it" held for tool calls only: another agent key that learned
    # the session id could end it (DELETE), read its stream (GET), or post into it, e.g. a JSON-RPC response to
    # the elicitation form the gateway sent that session's person. Every request naming a session must come
    # with the key that opened it.
    import httpx
    from mcp.client.streamable_http import streamablehttp_client

    cfg = write_config(tmp_path)
    db.open()
    tokens = []
    for name in ("bot", "other-bot"):
        made = cli(db, "keys", "create", "--name", name, "--role", "agent")
        assert made.returncode == 0, made.stderr
        tokens.append(made.stdout.strip().split()[-1])
    proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg),
                             "--http", "--port", "0"], env={**os.environ, **db.env}, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = next(line.split("serving ", 1)[1].strip() for line in proc.stderr if "serving http://" in line)
        async with streamablehttp_client(url, headers={"Authorization": f"Bearer {tokens[0]}"}) as (r, w, sid):
            async with ClientSession(r, w) as client:
                await client.initialize()
                session_id = sid()
                assert session_id
                other = {"Authorization": f"Bearer {tokens[1]}", "mcp-session-id": session_id,
                         "mcp-protocol-version": types.LATEST_PROTOCOL_VERSION,
                         "accept": "application/json, text/event-stream"}
                async with httpx.AsyncClient(timeout=10) as raw:
                    ended = await raw.delete(url, headers=other)
                    assert ended.status_code == 404, ended.text
                    posted = await raw.post(url, headers=other, json={
                        "jsonrpc": "2.0", "id": 99, "method": "tools/list"})
                    assert posted.status_code == 404, posted.text
                made = await client.call_tool("create_ticket", {"title": "still mine"})  # the session lives on
                assert not made.isError, text(made)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_message_the_sdk_cannot_parse_is_answered_not_left_hanging(db: Any, tmp_path: Path) -> None:
    # A model that cuts an emoji in half leaves a lone surrogate ("\ud83d") in a call's arguments; JSON allows the
    # escape, the SDK's parser refuses it, and the gateway used to answer nothing (a log notice without an id):
    # the client waited for ever. A request whose id can be read gets a JSON-RPC error naming the problem.
    import select

    cfg = write_config(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg)],
                            env={**os.environ, **db.env}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    assert proc.stdin is not None and proc.stdout is not None

    def send(line: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(line.encode() + b"\n")
        proc.stdin.flush()

    def answer_to(request_id: int) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1)
            if ready:
                message = json.loads(proc.stdout.readline())  # type: ignore[union-attr]
                if message.get("id") == request_id:
                    return dict(message)
        raise AssertionError(f"no answer to request {request_id}")

    try:
        send(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": types.LATEST_PROTOCOL_VERSION, "capabilities": {},
            "clientInfo": {"name": "raw", "version": "1"}}}))
        answer_to(0)
        send(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        send('{"jsonrpc":"2.0","id":5,"method":"tools/call","params":{"name":"create_ticket",'
             '"arguments":{"title":"broken \\ud83d emoji"}}}')
        refused = answer_to(5)
        assert refused["error"]["code"] == types.PARSE_ERROR, refused
        assert "surrogate" in refused["error"]["message"] or "escape" in refused["error"]["message"], refused
        send('{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"create_ticket","arguments":{"x":'
             + "[" * 100_000 + "]" * 100_000 + "}}}")  # deeper than either parser reads: refused, not fatal
        send(json.dumps({"jsonrpc": "2.0", "id": 6, "method": "tools/call",
                         "params": {"name": "create_ticket", "arguments": {"title": "fine"}}}))
        assert not answer_to(6)["result"]["isError"]  # the gateway serves on
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
    assert [c["args"] for c in world(tmp_path)["calls"]] == [{"title": "fine"}]
