"""The MCP gateway, driven the way the world drives it: the SDK's own client over stdio, talking to
``undolog mcp serve`` (a real subprocess), which talks to a real upstream MCP server written with the SDK
(``tickets_server.py``), on SQLite and PostgreSQL. Decisions go through the real ``undolog`` CLI.
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

import pytest
from mcp import ClientSession, StdioServerParameters, types
from mcp.client.stdio import stdio_client

from undolog_core import EffectState, SessionState, UndoLog

from ..support.mcp_upstreams import TICKETS, copy_upstream

HERE = Path(__file__).parent
UPSTREAM = TICKETS
KEY = "dev.undolog/idempotency-key"


def write_config(tmp: Path, *, timeout: float = 30.0, extra: str = "") -> Path:
    state = tmp / "tickets.json"
    cfg = tmp / "gateway.toml"
    # The upstream's command is relative to the config file's folder: copied there, resolved from there.
    copy_upstream(UPSTREAM, tmp)
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.tickets]
        command = [{json.dumps(sys.executable)}, "tickets_server.py"]
        env = {{ TICKETS_STATE = {json.dumps(str(state))} }}
        timeout = {timeout}

        [tools.tickets.search_tickets]
        tier = "safe"

        [tools.tickets.create_ticket]
        tier = "compensable"
        compensation = {{ tool = "close_ticket", args = {{ id = "{{result.id}}" }} }}

        [tools.tickets.reserve_seat]
        tier = "compensable"
        compensation = {{ tool = "release_seat", args = {{ seat = "{{args.seat}}" }} }}

        [tools.tickets.delete_project]
        tier = "irreversible"
        reason = "Deletes the project and every ticket in it"
        risk_tags = ["data-loss"]
        {extra}
    """))
    return cfg


def world(tmp: Path) -> dict[str, Any]:
    return dict(json.loads((tmp / "tickets.json").read_text()))


@contextlib.asynccontextmanager
async def gateway(db: Any, cfg: Path, *, elicit: Any = None, name: str = "test-client",
                  message_handler: Any = None) -> AsyncIterator[ClientSession]:
    env = {**os.environ, **db.env}
    params = StdioServerParameters(command=sys.executable, args=["-m", "undolog_core.cli", "mcp", "serve",
                                                                  "--config", str(cfg)], env=env)
    async with stdio_client(params) as (read, write):
        async with ClientSession(read, write, elicitation_callback=elicit, message_handler=message_handler,
                                 client_info=types.Implementation(name=name, version="1.0")) as session:
            await session.initialize()
            yield session


def cli(db: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **db.env, "UNDOLOG_ACTOR": "ana@desk"}
    return subprocess.run([sys.executable, "-m", "undolog_core.cli", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def text(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


def only_session(u: UndoLog) -> Any:
    sessions = [s for s in u.sessions.list() if (s.agent_id or "").startswith("mcp:")]
    assert len(sessions) == 1, sessions
    return sessions[0]


async def test_each_tier_and_what_is_not_exposed(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    async with gateway(db, cfg) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        # Unclassified tools are not exposed: nothing unclassified can run.
        assert set(listed) == {"search_tickets", "create_ticket", "reserve_seat", "delete_project"}
        assert listed["delete_project"].outputSchema is None
        assert listed["create_ticket"].outputSchema is not None  # passed through for the tiers that run at once
        unknown = await client.call_tool("export_everything", {})
        assert unknown.isError and "unknown tool" in text(unknown)

        safe = await client.call_tool("search_tickets", {"q": "x"})
        assert not safe.isError

        made = await client.call_tool("create_ticket", {"title": "printer"})
        assert not made.isError and made.structuredContent == {"id": 1, "title": "printer", "status": "open"}

        gated = await client.call_tool("delete_project", {"name": "acme"})
        assert not gated.isError  # a normal tool result, not a protocol error
        info = gated.structuredContent or {}
        assert info["status"] == "awaiting_approval" and info["reason"].startswith("Deletes the project")
        assert "approval" in text(gated)
    state = world(tmp_path)
    assert [c["tool"] for c in state["calls"]] == ["search_tickets", "create_ticket"]  # delete_project not forwarded
    assert state["calls"][0]["key"] is None  # SAFE: no key, nothing logged
    u = db.open()
    s = only_session(u)
    assert s.agent_id == "mcp:test-client/1.0"
    effects = u.sessions.effects(s.session_id)
    by_tool = {e["tool_name"]: e for e in effects}
    assert "search_tickets" not in by_tool  # SAFE calls touch no database
    assert by_tool["create_ticket"]["state"] == EffectState.COMMITTED
    assert state["calls"][1]["key"] == f"do-{by_tool['create_ticket']['effect_id']}"
    assert state["calls"][0]["epoch"] is None and state["calls"][1]["epoch"] == 1  # the fencing token beside it
    assert by_tool["delete_project"]["state"] == EffectState.AWAITING_APPROVAL


async def test_approve_and_reject_through_the_cli(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
    """)
    async with gateway(db, cfg) as client:
        first = await client.call_tool("delete_project", {"name": "acme"})
        request_id = (first.structuredContent or {})["approval_request_id"]
        again = await client.call_tool("delete_project", {"name": "acme"})  # still pending: the same request
        assert (again.structuredContent or {})["approval_request_id"] == request_id
        done = cli(db, "approvals", "approve", request_id)
        assert done.returncode == 0, done.stderr
        ran = await client.call_tool("delete_project", {"name": "acme"})
        assert not ran.isError and "deleted acme" in text(ran)
        replay = await client.call_tool("delete_project", {"name": "acme"})
        assert "deleted acme" in text(replay) and (replay.meta or {}).get("dev.undolog/call", {}).get("replayed")
        other = await client.call_tool("delete_project", {"name": "globex"})  # other arguments: a new call
        assert (other.structuredContent or {})["status"] == "awaiting_approval"
        # A reject is told truthfully, and (as everywhere in UndoLog) halts the session.
        close = await client.call_tool("close_ticket", {"id": 9})
        close_id = (close.structuredContent or {})["approval_request_id"]
        done = cli(db, "approvals", "reject", close_id, "--reason", "not today")
        assert done.returncode == 0, done.stderr
        answer = await client.call_tool("close_ticket", {"id": 9})
        assert answer.isError and "not today" in text(answer)
    assert [c["tool"] for c in world(tmp_path)["calls"]] == ["delete_project"]  # ran exactly once


async def test_an_approval_timeout_is_told_truthfully(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    db.open().policy.set(actor="admin:test", approval_timeout_seconds=1)
    async with gateway(db, cfg) as client:
        first = await client.call_tool("delete_project", {"name": "acme"})
        assert (first.structuredContent or {})["status"] == "awaiting_approval"
        await asyncio.sleep(1.5)
        late = await client.call_tool("delete_project", {"name": "acme"})
        assert late.isError and "timed out" in text(late).lower()
    assert not (tmp_path / "tickets.json").exists()  # never forwarded


async def test_rollback_through_the_cli_calls_the_templated_compensations(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    async with gateway(db, cfg) as client:
        await client.call_tool("create_ticket", {"title": "a"})
        await client.call_tool("reserve_seat", {"seat": "12A"})
        # An upstream isError is a definite failure: nothing happened, nothing to compensate; the session goes on
        # (the model saw an error, as with any MCP tool).
        refused = await client.call_tool("reserve_seat", {"seat": "bad-seat"})
        assert refused.isError and "no such seat" in text(refused)
        await client.call_tool("create_ticket", {"title": "b"})
        # A bad argument is refused before anything is logged, naming the field; the upstream never sees it.
        bad = await client.call_tool("create_ticket", {"title": 5})
        assert bad.isError and "title" in text(bad)
        missing = await client.call_tool("reserve_seat", {})
        assert missing.isError and "seat" in text(missing)
    u = db.open()
    s = only_session(u)
    effects = u.sessions.effects(s.session_id)
    assert len(effects) == 4  # the two refused arguments left nothing
    failed = [e for e in effects if e["state"] == EffectState.FAILED]
    assert len(failed) == 1 and failed[0]["undo_id"] is None  # its undo entry went: nothing happened
    # The CLI reaches the upstreams through the gateway's config (--app), from another process.
    out = cli(db, "--app", str(cfg), "sessions", "rollback", s.session_id)
    assert out.returncode == 0, out.stdout + out.stderr
    state = world(tmp_path)
    assert all(c["args"] != {"title": 5} for c in state["calls"])
    undo = [c for c in state["calls"] if c["tool"] in ("close_ticket", "release_seat")]
    assert [(c["tool"], c["args"]) for c in undo] == [
        ("close_ticket", {"id": 2}), ("release_seat", {"seat": "12A"}), ("close_ticket", {"id": 1}),
    ]  # newest first, arguments from {result.id} and {args.seat}; nothing for the refused seat
    assert all(c["key"].startswith("undo-") for c in undo)
    assert {t["status"] for t in state["tickets"].values()} == {"closed"} and state["seats"] == []
    assert u.sessions.get(s.session_id).state == SessionState.ROLLED_BACK


@pytest.mark.pg_smoke
async def test_an_upstream_that_crashes_mid_call_is_settled_not_lost(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    async with gateway(db, cfg) as client:
        await client.call_tool("reserve_seat", {"seat": "1A"})
        lost = await client.call_tool("reserve_seat", {"seat": "crash"})
        assert lost.isError and "did not answer" in text(lost)
        assert (lost.meta or {}).get("dev.undolog/call", {}).get("error") == "outcome_unknown"
        # The crashed upstream is started again by the next call to it.
        again = await client.call_tool("search_tickets", {"q": "x"})
        assert not again.isError, text(again)
    u = db.open()
    s = only_session(u)
    crashed = [e for e in u.sessions.effects(s.session_id) if e["args_snapshot"] == {"seat": "crash"}]
    # Its compensation needs no result, so it was undone in case it happened, and a person looks at the session.
    assert crashed[0]["state"] == EffectState.COMPENSATED
    assert "crash" not in world(tmp_path)["seats"]
    assert u.sessions.get(s.session_id).state == SessionState.HALTED


async def test_a_crash_whose_undo_needs_the_result_becomes_unknown(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    async with gateway(db, cfg) as client:
        lost = await client.call_tool("create_ticket", {"title": "crash"})
        assert lost.isError and "outcome is unknown" in text(lost)
    u = db.open()
    s = only_session(u)
    (effect,) = u.sessions.effects(s.session_id)
    assert effect["state"] == EffectState.UNKNOWN
    assert u.sessions.get(s.session_id).state == SessionState.HALTED


async def test_an_upstream_timeout_is_an_unknown_outcome_settled_on_the_upstreams_answer(
        db: Any, tmp_path: Path) -> None:
    """The upstream is told to cancel (its sync tool runs on regardless, on the event loop, as FastMCP runs one);
    the call stays in flight, "settling", until the upstream answers: its late result (committed), or its cancel
    confirmed (unknown: the undo needs the result nobody saw; the session halts for a person)."""
    cfg = write_config(tmp_path, timeout=0.5)
    u = db.open()
    async with gateway(db, cfg) as client:
        slow = await client.call_tool("create_ticket", {"title": "slow"})
        assert slow.isError and "outcome unknown, settling" in text(slow), text(slow)
        (effect,) = u.sessions.effects(only_session(u).session_id)
        assert effect["state"] == EffectState.PENDING  # in flight, never undone before the upstream answers
        for _ in range(600):
            (effect,) = u.sessions.effects(only_session(u).session_id)
            if effect["state"] != EffectState.PENDING:
                break
            await asyncio.sleep(0.05)
    assert effect["state"] in (EffectState.COMMITTED, EffectState.UNKNOWN), effect
    if effect["state"] == EffectState.COMMITTED:
        assert effect["result_snapshot"]["structuredContent"]["title"] == "slow"
    else:
        assert u.sessions.get(only_session(u).session_id).state == SessionState.HALTED


async def test_an_upstream_contract_change_cancels_pending_approvals(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
        [tools.tickets.export_everything]
        tier = "irreversible"
    """)
    async with gateway(db, cfg) as client:
        close = await client.call_tool("close_ticket", {"id": 1})
        export = await client.call_tool("export_everything", {})
    close_id = (close.structuredContent or {})["approval_request_id"]
    export_id = (export.structuredContent or {})["approval_request_id"]
    # Loading the same config again (the CLI, the desk) registers the same contracts: no new revision.
    out = cli(db, "--app", str(cfg), "sessions", "list")
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(db.open().registry.history("close_ticket")) == 1
    # The upstream changes close_ticket's input schema: loading the config again registers a new revision,
    # which cancels the request bound to the old one.
    (tmp_path / "tickets_server.py").write_text(UPSTREAM.read_text().replace(
        "def close_ticket(id: int)", "def close_ticket(id: int, reason: str = '')"))
    out = cli(db, "--app", str(cfg), "approvals", "list", "--state", "all")
    assert out.returncode == 0, out.stdout + out.stderr
    u = db.open()
    history = u.registry.history("close_ticket")
    assert len(history) == 2 and "reason" in json.dumps(history[-1], default=str)
    assert u.approvals.get(close_id).state.value == "cancelled"
    assert u.approvals.get(export_id).state.value == "pending"  # its tool did not change


async def test_decided_at_the_client_through_elicitation(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
        approval = "elicit"
        [tools.tickets.export_everything]
        tier = "irreversible"
        approval = "elicit"
        [tools.tickets.release_seat]
        tier = "irreversible"
        approval = "elicit"
        risk_tags = ["billing"]
    """)
    # An approver group covers the billing risk tag: those calls are decided by verified approvers only.
    from undolog_server.storage import ApproverGroup, ServerStore

    store = ServerStore(db.open().store)
    store.migrate()
    store.put_group(ApproverGroup("finance", (), ("billing",), "billing approvers"))
    asked: list[types.ElicitRequestParams] = []

    async def person(context: Any, params: types.ElicitRequestParams) -> types.ElicitResult:
        asked.append(params)
        if "export_everything" in params.message:
            return types.ElicitResult(action="decline", content={"approve": False, "reason": "no exports"})
        return types.ElicitResult(action="accept", content={"approve": True, "id": 7})  # edited: 7, not 1

    async with gateway(db, cfg, elicit=person, name="editor") as client:
        closed = await client.call_tool("close_ticket", {"id": 1})
        assert not closed.isError and "closed" in text(closed)
        grouped = await client.call_tool("release_seat", {"seat": "1A"})
        assert (grouped.structuredContent or {}).get("status") == "awaiting_approval", text(grouped)
        assert "finance" in text(grouped)
        # A decline is a respond: the tool did not run, the person's reason is its result, the session goes on
        # (a reject, which halts it, only where the tool's config says decline = "reject").
        declined = await client.call_tool("export_everything", {})
        assert not declined.isError and "no exports" in text(declined), text(declined)
    assert len(asked) == 2  # never asked for the grouped tool
    schema = asked[0].requestedSchema
    assert set(schema["properties"]) >= {"approve", "reason", "id"}  # a flat schema: its field is editable
    calls = world(tmp_path)["calls"]
    assert [(c["tool"], c["args"]) for c in calls] == [("close_ticket", {"id": 7})]  # the edit ran, once
    u = db.open()
    s = only_session(u)
    decided = u.approvals.list(session_id=s.session_id)
    approvers = {a.tool_name: a.decided_by for a in decided}
    assert approvers["close_ticket"] == "mcp-client:editor/1.0 (unverified)"
    assert {a.tool_name: a.state.value for a in decided}["export_everything"] == "responded"
    assert s.state == SessionState.AWAITING_APPROVAL  # release_seat waits at the desk; nothing halted it


async def test_served_over_http_behind_agent_keys(db: Any, tmp_path: Path) -> None:
    from mcp.client.streamable_http import streamablehttp_client

    cfg = write_config(tmp_path)
    db.open()
    agent = cli(db, "keys", "create", "--name", "bot", "--role", "agent")
    approver = cli(db, "keys", "create", "--name", "ana", "--role", "approver")
    assert agent.returncode == 0 and approver.returncode == 0, agent.stderr + approver.stderr
    agent_token, approver_token = agent.stdout.strip().split()[-1], approver.stdout.strip().split()[-1]
    env = {**os.environ, **db.env}
    proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg),
                             "--http", "--port", "0"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url = None
        assert proc.stderr is not None
        for line in proc.stderr:
            if "serving http://" in line:
                url = line.split("serving ", 1)[1].strip()
                break
        assert url and url.startswith("http://127.0.0.1:"), "the gateway listens on loopback by default"
        import httpx

        async with httpx.AsyncClient(timeout=30) as raw:
            assert (await raw.post(url, json={})).status_code == 401
            refused = await raw.post(url, json={}, headers={"Authorization": f"Bearer {approver_token}"})
            assert refused.status_code == 401  # an approver key is not an agent
        async with streamablehttp_client(url, headers={"Authorization": f"Bearer {agent_token}"}) as (r, w, _):
            async with ClientSession(r, w, client_info=types.Implementation(name="remote", version="2")) as client:
                await client.initialize()
                names = {t.name for t in (await client.list_tools()).tools}
                assert "export_everything" not in names and "create_ticket" in names
                made = await client.call_tool("create_ticket", {"title": "over http"})
                assert not made.isError
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    u = db.open()
    s = only_session(u)
    # The owner is the desk's principal reference, the one form its self-approval checks compare (issue #29).
    assert s.agent_id == "mcp:remote/2" and s.created_by == "key:" + agent.stdout.strip().split()[-1].split("_")[1]


def test_init_proposes_a_config_to_review(db: Any, tmp_path: Path) -> None:
    (tmp_path / "tickets.json").write_text(json.dumps({"tickets": {}, "seats": [], "calls": [], "next": 1}))
    out = cli(db, "mcp", "init", "--upstream", "tickets", "--env", f"TICKETS_STATE={tmp_path / 'tickets.json'}",
              "--", sys.executable, str(UPSTREAM))
    assert out.returncode == 0, out.stderr
    proposal = out.stdout
    assert proposal.startswith("# PROPOSAL")
    assert '[tools.tickets.search_tickets]  # proposed: Search tickets by title.\n' in proposal
    assert '#   arguments: q  ' in proposal and '\ntier = "safe"  # proposed: the upstream hints readOnlyHint' in proposal
    assert '[tools.tickets.delete_project]' in proposal and 'tier = "irreversible"' in proposal  # destructiveHint
    assert "# [tools.tickets.create_ticket]" in proposal  # no hint: left unclassified, commented out
    import tomllib

    parsed = tomllib.loads(proposal)
    assert set(parsed["tools"]["tickets"]) == {"search_tickets", "delete_project"}


def test_the_gateway_installs_beside_the_crewai_and_semantic_kernel_extras() -> None:
    # `pip install 'undolog[all,mcp]'` resolved in this environment (the dev extra includes both): the SDK is on
    # its 1.x line, which the frameworks pin, next to both frameworks.
    from importlib.metadata import version

    assert int(version("mcp").split(".")[0]) == 1
    assert version("crewai") and version("semantic-kernel")


async def test_upstream_results_are_checked_against_a_schema_compiled_once(tmp_path: Path,
                                                                          monkeypatch: Any) -> None:
    # The SDK client's call_tool checks the output schema against the JSON Schema metaschema on every call (more
    # CPU than the rest of the gateway's hop); the gateway's connection checks each listed schema once, and still
    # refuses a result that does not match it, with the SDK's own error.
    from jsonschema.validators import Draft202012Validator

    from undolog_mcp.config import load_config
    from undolog_mcp.upstream import connect

    checked: list[Any] = []
    real = Draft202012Validator.check_schema.__func__  # type: ignore[attr-defined]

    def counting(cls: Any, schema: Any, *a: Any, **k: Any) -> None:
        checked.append(schema.get("title"))
        real(cls, schema, *a, **k)

    monkeypatch.setattr(Draft202012Validator, "check_schema", classmethod(counting))
    cfg = load_config(write_config(tmp_path))
    async with connect(cfg.upstreams["tickets"]) as up:
        for i in range(5):
            made = await up.call("create_ticket", {"title": f"t{i}"}, f"key-{i}")
            assert not made.isError and made.structuredContent == {"id": i + 1, "title": f"t{i}", "status": "open"}
        assert checked == ["Ticket"]  # once for five calls (the SDK's call_tool: five times)
        await up.session.list_tools()  # listed again: the schema held now is compiled again, once
        await up.call("create_ticket", {"title": "t5"}, None)
        await up.call("create_ticket", {"title": "t6"}, None)
        assert len(checked) == 2
        for i in range(2):  # import_ticket answers its id as a string: refused, with the SDK's own error
            try:
                await up.call("import_ticket", {"title": f"s{i}"}, None)
            except RuntimeError as exc:
                assert str(exc).startswith(f"Invalid structured content returned by tool import_ticket: '{8 + i}' "
                                           "is not of type 'integer'"), exc
            else:
                raise AssertionError("a result that does not match the output schema was let through")
        assert len(checked) == 3  # import_ticket's schema: once for both calls


async def test_a_result_that_does_not_match_its_output_schema_is_refused(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, extra="""
        [tools.tickets.import_ticket]
        tier = "compensable"
        compensation = { tool = "close_ticket", args = { id = "{result.id}" } }
    """)
    async with gateway(db, cfg) as client:
        sloppy = await client.call_tool("import_ticket", {"title": "printer"})
        assert sloppy.isError
        assert "Invalid structured content returned by tool import_ticket" in text(sloppy)
        made = await client.call_tool("create_ticket", {"title": "fax"})
        assert not made.isError and made.structuredContent == {"id": 2, "title": "fax", "status": "open"}
    u = db.open()
    by_tool = {e["tool_name"]: e for e in u.sessions.effects(only_session(u).session_id)}
    assert by_tool["create_ticket"]["state"] == EffectState.COMMITTED
    assert by_tool["import_ticket"]["state"] != EffectState.COMMITTED  # never recorded as the result it is not
