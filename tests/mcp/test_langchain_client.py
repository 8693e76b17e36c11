"""``langchain-mcp-adapters`` (a client nobody here wrote) with its default ``get_tools()``, which opens a new MCP
session for every tool call, driving a LangChain ``create_agent`` agent (a scripted model) through the gateway:
over HTTP with ``session = "key"``, and over stdio through ``undolog mcp connect`` to a ``--socket`` gateway with
``session = "process"``. An IRREVERSIBLE call approved by a person runs exactly once on the agent's re-issue, and
``undolog sessions rollback`` undoes the agent's COMPENSABLE calls newest first. On SQLite and PostgreSQL.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from langchain.agents import create_agent
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_mcp_adapters.client import MultiServerMCPClient

from undolog_core import SessionState

from .test_gateway import cli, world
from .test_sessions import agent_key, grouped_config, http_gateway, mcp_sessions, socket_gateway

pytestmark = pytest.mark.reads_store


class ScriptedChatModel(BaseChatModel):
    """A model that plays a fixed script: turn k (the number of AI messages so far) asks for ``turns[k]``'s tool
    calls; after the script, a final answer quoting the tool messages. ``bind_tools`` returns itself, which is
    all ``create_agent`` asks of it."""

    turns: list[list[tuple[str, dict[str, Any]]]]

    def _generate(self, messages: list[BaseMessage], stop: Any = None, run_manager: Any = None,
                  **kwargs: Any) -> ChatResult:
        k = sum(isinstance(m, AIMessage) for m in messages)
        if k < len(self.turns):
            calls = [{"name": n, "args": a, "id": f"call-{k}-{i}", "type": "tool_call"}
                     for i, (n, a) in enumerate(self.turns[k])]
            msg = AIMessage(content="", tool_calls=calls)
        else:
            said = [str(m.content) for m in messages if isinstance(m, ToolMessage)]
            msg = AIMessage(content="done: " + " || ".join(said))
        return ChatResult(generations=[ChatGeneration(message=msg)])

    def bind_tools(self, tools: Sequence[Any], **kwargs: Any) -> ScriptedChatModel:
        return self

    @property
    def _llm_type(self) -> str:
        return "scripted"


async def run_agent(client: MultiServerMCPClient, turns: list[list[tuple[str, dict[str, Any]]]]) -> list[str]:
    """One agent run; returns what each tool answered the model."""
    tools = await client.get_tools()  # the default: every call opens (and closes) an MCP session of its own
    agent = create_agent(ScriptedChatModel(turns=turns), tools)
    out = await agent.ainvoke({"messages": [{"role": "user", "content": "tidy up the acme project"}]})
    return [str(m.content) for m in out["messages"] if isinstance(m, ToolMessage)]


async def drive(db: Any, tmp_path: Path, client: MultiServerMCPClient) -> None:
    """The same story over either transport: ask, a person approves, the agent asks again, then works; then a
    person rolls the session back from the CLI."""
    said = await run_agent(client, [[("delete_project", {"name": "acme"})]])
    assert "needs a person's approval" in said[0]
    u = db.open()
    (s,) = mcp_sessions(u)
    (request,) = u.approvals.list(state="pending")
    done = cli(db, "approvals", "approve", request.approval_request_id)
    assert done.returncode == 0, done.stderr
    said = await run_agent(client, [
        [("delete_project", {"name": "acme"})],  # the re-issue: a new MCP session, the same UndoLog session
        [("create_ticket", {"title": "one"})],
        [("reserve_seat", {"seat": "4A"})],
        [("create_ticket", {"title": "two"})],
        [("delete_project", {"name": "acme"})],  # asked again after it ran: its result replayed, not run again
    ])
    assert "deleted acme" in said[0] and "deleted acme" in said[4], said
    state = world(tmp_path)
    assert [c["tool"] for c in state["calls"]] == ["delete_project", "create_ticket", "reserve_seat", "create_ticket"]
    assert len({c["pid"] for c in state["calls"]}) == 1, "one upstream process served every client connection"
    (again,) = mcp_sessions(u)
    assert again.session_id == s.session_id, "every MCP session of the agent was logged in one UndoLog session"
    out = cli(db, "--app", str(tmp_path / "gateway.toml"), "sessions", "rollback", s.session_id)
    assert out.returncode == 0, out.stdout + out.stderr
    state = world(tmp_path)
    undo = [(c["tool"], c["args"]) for c in state["calls"] if c["tool"] in ("close_ticket", "release_seat")]
    assert undo == [("close_ticket", {"id": 2}), ("release_seat", {"seat": "4A"}), ("close_ticket", {"id": 1})]
    assert {t["status"] for t in state["tickets"].values()} == {"closed"} and state["seats"] == []
    assert u.sessions.get(s.session_id).state == SessionState.ROLLED_BACK


async def test_langchain_agent_over_http_with_one_session_per_key(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "key")
    db.open()
    token = agent_key(db, "lc-agent")
    with http_gateway(db, cfg) as url:
        client = MultiServerMCPClient({"gateway": {"transport": "streamable_http", "url": url,
                                                   "headers": {"Authorization": f"Bearer {token}"}}})
        await drive(db, tmp_path, client)


async def test_langchain_agent_over_stdio_through_a_socket_gateway(db: Any, tmp_path: Path) -> None:
    cfg = grouped_config(tmp_path, "process")
    sock = tmp_path / "gw.sock"
    db.open()
    with socket_gateway(db, cfg, sock):
        client = MultiServerMCPClient({"gateway": {
            "transport": "stdio", "command": sys.executable,
            "args": ["-m", "undolog_core.cli", "mcp", "connect", "--socket", str(sock)],
            "env": {**os.environ, **db.env},
        }})
        await drive(db, tmp_path, client)
