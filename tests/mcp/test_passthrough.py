"""The pass-through beside tool calls, with the gateway in this process (its real ``Gateway`` over the SDK's
in-memory transport, so its counters can be read) in front of real upstream subprocesses written with the SDK:
two copies of the conformance fixture (names that clash), and a server whose tools and prompts grow.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, McpError, types
from mcp.shared.memory import create_connected_server_and_client_session

from undolog_core import UndoLog
from undolog_core.errors import ConfigurationError
from undolog_mcp.config import load_config
from undolog_mcp.gateway import Gateway

HERE = Path(__file__).parent
FIXTURE = HERE / "conformance_fixture.py"
GROWING = HERE / "growing_server.py"


def two_fixtures(tmp: Path, *, expose_b: str | None = None) -> Path:
    cfg = tmp / "gateway.toml"
    exposed = f"expose = {expose_b}" if expose_b is not None else ""
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.a]
        command = [{json.dumps(sys.executable)}, {json.dumps(str(FIXTURE))}]

        [upstreams.b]
        command = [{json.dumps(sys.executable)}, {json.dumps(str(FIXTURE))}]
        {exposed}

        [tools.a.test_simple_text]
        tier = "safe"

        [tools.a.test_sampling]
        tier = "safe"
        """))
    return cfg


@contextlib.asynccontextmanager
async def in_process(undolog: UndoLog, cfg: Path, **client: Any) -> AsyncIterator[tuple[Gateway, ClientSession]]:
    gw = Gateway(load_config(cfg), undolog)
    async with gw.running(), create_connected_server_and_client_session(gw.server, **client) as session:
        yield gw, session


async def test_resources_and_prompts_of_two_upstreams_prefixed_on_a_clash(undolog: UndoLog, tmp_path: Path) -> None:
    audit_before = undolog.verify_audit().events_checked
    async with in_process(undolog, two_fixtures(tmp_path)) as (gw, client):
        uris = {str(r.uri) for r in (await client.list_resources()).resources}
        # Both list test://static-text: each is exposed under its upstream's prefix, neither shadows the other.
        assert {"a+test://static-text", "b+test://static-text"} <= uris and "test://static-text" not in uris
        read = await client.read_resource("b+test://static-text")  # type: ignore[arg-type]
        assert read.contents[0].text == "This is the content of the static text resource."  # type: ignore[union-attr]
        assert str(read.contents[0].uri) == "b+test://static-text"  # named as the client knows it
        templates = {t.uriTemplate for t in (await client.list_resource_templates()).resourceTemplates}
        assert templates == {"a+test://template/{id}/data", "b+test://template/{id}/data"}
        by_template = await client.read_resource("a+test://template/42/data")  # type: ignore[arg-type]
        assert "42" in by_template.contents[0].text  # type: ignore[union-attr]

        prompts = {p.name for p in (await client.list_prompts()).prompts}
        assert {"a_test_simple_prompt", "b_test_prompt_with_arguments"} <= prompts
        got = await client.get_prompt("b_test_prompt_with_arguments", {"arg1": "x1", "arg2": "y2"})
        assert "x1" in got.messages[0].content.text  # type: ignore[union-attr]
        done = await client.complete(types.PromptReference(type="ref/prompt", name="a_test_prompt_with_arguments"),
                                     {"name": "arg1", "value": "pa"})
        assert done.completion.values == ["paris", "park", "party"]

        with pytest.raises(McpError, match="no upstream of the gateway lists resource"):
            await client.read_resource("test://nowhere")  # type: ignore[arg-type]
        # Reads and prompt gets are SAFE by nature: counted, not audited, no UndoLog session made for them.
        assert gw.passthrough.counts["resources/read"] == 2 and gw.passthrough.counts["prompts/get"] == 1
    assert undolog.verify_audit().events_checked == audit_before
    assert undolog.sessions.list() == []


async def test_what_is_exposed_is_what_is_advertised(undolog: UndoLog, tmp_path: Path) -> None:
    async with in_process(undolog, two_fixtures(tmp_path, expose_b="[]")) as (gw, client):
        # b passes nothing through: a's resources and prompts keep their own names (no clash left).
        uris = {str(r.uri) for r in (await client.list_resources()).resources}
        assert "test://static-text" in uris and not any("+" in u for u in uris)
        assert "a" in gw.passthrough.describe()[0] and "nothing" in gw.passthrough.describe()[1]
        init = client.get_server_capabilities()
        assert init is not None and init.resources is not None and init.resources.subscribe
        assert init.prompts is not None and init.completions is not None and init.logging is not None

    cfg = tmp_path / "none.toml"
    cfg.write_text(two_fixtures(tmp_path).read_text().replace("[upstreams.b]", "[upstreams.b]\nexpose = []")
                   .replace("[upstreams.a]\n", "[upstreams.a]\nexpose = []\n"))
    async with in_process(undolog, cfg) as (gw, client):
        caps = client.get_server_capabilities()
        assert caps is not None and caps.resources is None and caps.prompts is None and caps.completions is None
        assert caps.tools is not None and caps.tools.listChanged
        with pytest.raises(McpError, match="Method not found"):
            await client.list_resources()
        # The two upstreams' instructions, each under its name.
        assert gw.passthrough.instructions() == ("[a]\nThe conformance suite's fixture server.\n\n"
                                                 "[b]\nThe conformance suite's fixture server.")


def test_expose_names_only_what_can_pass(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[upstreams.a]\ncommand = ["x"]\nexpose = ["resources", "tools"]\n')
    with pytest.raises(ConfigurationError, match=r"expose must be a list of 'resources', 'prompts', 'completion'"):
        load_config(cfg)


async def test_sampling_refused_when_several_clients_calls_are_in_flight(undolog: UndoLog, tmp_path: Path) -> None:
    """Two clients call the same upstream at once: whose is the upstream's question? The gateway does not guess."""
    cfg = two_fixtures(tmp_path)
    gw = Gateway(load_config(cfg), undolog)
    first_asked = asyncio.Event()
    release = asyncio.Event()

    async def slow_sampling(ctx: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        first_asked.set()
        await release.wait()
        return types.CreateMessageResult(role="assistant", model="m", content=types.TextContent(type="text",
                                                                                                text="first"))

    async def quick_sampling(ctx: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        raise AssertionError("the second client must not be asked another call's question")

    async with gw.running(), \
            create_connected_server_and_client_session(gw.server, sampling_callback=slow_sampling) as one, \
            create_connected_server_and_client_session(gw.server, sampling_callback=quick_sampling) as two:
        first = asyncio.ensure_future(one.call_tool("test_sampling", {"prompt": "one"}))
        with anyio.fail_after(30):
            await first_asked.wait()
        second = await two.call_tool("test_sampling", {"prompt": "two"})
        release.set()
        answered = await first
    assert not answered.isError and "first" in answered.content[0].text  # type: ignore[union-attr]
    assert second.isError
    assert "requests of 2 clients" in json.dumps(second.model_dump(mode="json"))


async def test_list_changed_reaches_the_client_when_what_is_exposed_changes(undolog: UndoLog, tmp_path: Path) -> None:
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.growing]
        command = [{json.dumps(sys.executable)}, {json.dumps(str(GROWING))}]

        [tools.growing.grow]
        tier = "safe"

        [tools.growing.grown]
        tier = "safe"
        """))
    seen: list[Any] = []
    changed = {"tools": asyncio.Event(), "prompts": asyncio.Event()}

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ServerNotification):
            seen.append(message.root)
            if isinstance(message.root, types.ToolListChangedNotification):
                changed["tools"].set()
            if isinstance(message.root, types.PromptListChangedNotification):
                changed["prompts"].set()

    async with in_process(undolog, cfg, message_handler=on_message) as (_gw, client):
        assert {t.name for t in (await client.list_tools()).tools} == {"grow"}
        # An unclassified tool stays hidden: its coming changes nothing the client sees...
        await client.call_tool("grow", {"name": "stray", "kind": "tool"})
        # ...a classified one is exposed, and the client is told.
        await client.call_tool("grow", {"name": "grown", "kind": "tool"})
        with anyio.fail_after(30):
            await changed["tools"].wait()
        assert {t.name for t in (await client.list_tools()).tools} == {"grow", "grown"}
        assert not (await client.call_tool("grown", {})).isError
        assert sum(isinstance(n, types.ToolListChangedNotification) for n in seen) == 1

        await client.call_tool("grow", {"name": "new_prompt", "kind": "prompt"})
        with anyio.fail_after(30):
            await changed["prompts"].wait()
        assert [p.name for p in (await client.list_prompts()).prompts] == ["new_prompt"]


@pytest.mark.reads_store
async def test_an_approval_for_the_old_contract_does_not_run_after_the_client_is_told_of_the_new(
        db: Any, tmp_path: Path) -> None:
    """The gateway lists an upstream's tools anew as soon as it says they changed (to tell its clients). A client
    told, calling again the call approved under the old contract, must be refused, not run against the new one."""
    import os

    from mcp.client.stdio import StdioServerParameters, stdio_client

    from .test_gateway import cli, text, write_config
    from .test_gateway_faults import calls_of

    cfg = write_config(tmp_path, extra="""
        [tools.tickets.close_ticket]
        tier = "irreversible"
        [tools.tickets.upgrade_tools]
        tier = "safe"
    """)
    told = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ServerNotification) and isinstance(message.root,
                                                                        types.ToolListChangedNotification):
            told.set()

    params = StdioServerParameters(command=sys.executable, args=["-m", "undolog_core.cli", "mcp", "serve",
                                                                  "--config", str(cfg)], env={**os.environ, **db.env})
    async with stdio_client(params) as (read, write), ClientSession(read, write, message_handler=on_message) as client:
        await client.initialize()
        asked = await client.call_tool("close_ticket", {"id": 1})
        done = cli(db, "approvals", "approve", (asked.structuredContent or {})["approval_request_id"])
        assert done.returncode == 0, done.stderr
        assert not (await client.call_tool("upgrade_tools", {})).isError
        with anyio.fail_after(30):
            await told.wait()  # the gateway listed and registered the new contract
        refused = await client.call_tool("close_ticket", {"id": 1})
        assert refused.isError and "'close_ticket' changed since" in text(refused), text(refused)
    assert "close_ticket" not in {c["tool"] for c in calls_of(tmp_path)}


async def test_log_messages_go_to_the_client_that_called_filtered_by_its_level(undolog: UndoLog,
                                                                               tmp_path: Path) -> None:
    cfg = two_fixtures(tmp_path)
    cfg.write_text(cfg.read_text() + '\n[tools.a.test_tool_with_logging]\ntier = "safe"\n')
    logs: dict[str, list[Any]] = {"quiet": [], "verbose": []}

    def keep(name: str) -> Any:
        async def on_log(params: types.LoggingMessageNotificationParams) -> None:
            logs[name].append(params)
        return on_log

    gw = Gateway(load_config(cfg), undolog)
    async with gw.running(), \
            create_connected_server_and_client_session(gw.server, logging_callback=keep("quiet")) as quiet, \
            create_connected_server_and_client_session(gw.server, logging_callback=keep("verbose")) as verbose:
        await verbose.set_logging_level("debug")  # the most verbose level asked goes upstream
        await quiet.set_logging_level("error")
        await quiet.call_tool("test_tool_with_logging", {})
        await verbose.call_tool("test_tool_with_logging", {})
        await verbose.send_ping()  # (the notifications sent before the answer are read by now)
    # Each call's three info messages reached only the client that called; the quiet one's level kept them out.
    assert [m.data for m in logs["verbose"]] == ["Tool execution started", "Tool processing data",
                                                 "Tool execution completed"]
    assert logs["quiet"] == []


async def test_a_resource_update_reaches_the_clients_subscribed(undolog: UndoLog, tmp_path: Path) -> None:
    updated: list[str] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ServerNotification) and isinstance(message.root,
                                                                        types.ResourceUpdatedNotification):
            updated.append(str(message.root.params.uri))

    async with in_process(undolog, two_fixtures(tmp_path), message_handler=on_message) as (_gw, client):
        await client.subscribe_resource("a+test://watched-resource")  # type: ignore[arg-type]
        with anyio.fail_after(30):  # the fixture says the resource was updated as soon as it is subscribed to
            while not updated:
                await asyncio.sleep(0.02)
        await client.unsubscribe_resource("a+test://watched-resource")  # type: ignore[arg-type]
    assert updated == ["a+test://watched-resource"]  # named as this client knows it


async def test_a_log_message_is_not_relayed_when_it_could_be_another_clients(undolog: UndoLog,
                                                                             tmp_path: Path) -> None:
    cfg = two_fixtures(tmp_path)
    cfg.write_text(cfg.read_text() + '\n[tools.a.test_tool_with_logging]\ntier = "safe"\n')
    logs: list[Any] = []
    asked, release = asyncio.Event(), asyncio.Event()

    async def on_log(params: types.LoggingMessageNotificationParams) -> None:
        logs.append(params)

    async def slow_sampling(ctx: Any, params: types.CreateMessageRequestParams) -> types.CreateMessageResult:
        asked.set()
        await release.wait()
        return types.CreateMessageResult(role="assistant", model="m", content=types.TextContent(type="text", text="x"))

    gw = Gateway(load_config(cfg), undolog)
    async with gw.running(), \
            create_connected_server_and_client_session(gw.server, sampling_callback=slow_sampling,
                                                       logging_callback=on_log) as one, \
            create_connected_server_and_client_session(gw.server, logging_callback=on_log) as two:
        await two.set_logging_level("debug")
        first = asyncio.ensure_future(one.call_tool("test_sampling", {"prompt": "hold"}))
        with anyio.fail_after(30):
            await asked.wait()
        # Two clients' requests to upstream a in flight: its log messages name neither, so neither gets them.
        assert not (await two.call_tool("test_tool_with_logging", {})).isError
        release.set()
        assert not (await first).isError
        assert logs == []
        # One client in flight: its messages are its own.
        await two.call_tool("test_tool_with_logging", {})
        await two.send_ping()
        assert len(logs) == 3
