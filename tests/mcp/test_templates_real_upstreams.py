"""Compensation templates against upstreams nobody here wrote: the reference ``@modelcontextprotocol/server-filesystem``
and ``server-memory`` (Node, pinned by the project's ``package.json``, installed by ``npm ci``), behind the real
gateway (``undolog mcp serve`` over stdio, the SDK's client), rolled back from the real CLI.

Before: undoing ``create_entities`` of two entities removed one and reported complete; a create that created
nothing broke its template; ``edit_file`` with ``dryRun`` was logged as an effect whose undo failed; an overwrite
could not be undone (nothing captured what was there).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from undolog_core import EffectState, SessionState

from .test_gateway import cli, gateway, only_session, text

ROOT = Path(__file__).resolve().parents[2]
NODE = ROOT / "node_modules" / ".bin" / "node"
FS = ROOT / "node_modules" / "@modelcontextprotocol" / "server-filesystem" / "dist" / "index.js"
MEMORY = ROOT / "node_modules" / "@modelcontextprotocol" / "server-memory" / "dist" / "index.js"

pytestmark = pytest.mark.reads_store


@pytest.fixture(autouse=True)
def _reference_servers_installed() -> None:
    # Fails, never skips: CI installs them with `npm ci`, and a missing install must not pass unnoticed.
    assert NODE.exists() and FS.exists() and MEMORY.exists(), \
        "the Node MCP reference servers are not installed: run `npm ci` in the repository"


def write_config(tmp: Path, files: Path, memory: Path) -> Path:
    cfg = tmp / "gateway.toml"
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.fs]
        command = [{json.dumps(str(NODE))}, {json.dumps(str(FS))}, {json.dumps(str(files))}]

        [upstreams.memory]
        command = [{json.dumps(str(NODE))}, {json.dumps(str(MEMORY))}]
        env = {{ MEMORY_FILE_PATH = {json.dumps(str(memory))} }}

        [tools.fs.read_text_file]
        tier = "safe"

        [tools.fs.write_file]
        tier = "compensable"
        capture = {{ tool = "read_text_file", args = {{ path = "{{args.path}}" }} }}
        compensation = {{ tool = "write_file", args = {{ path = "{{args.path}}", content = "{{before.content}}" }} }}

        [tools.fs.edit_file]
        tier = "compensable"
        capture = {{ tool = "read_text_file", args = {{ path = "{{args.path}}" }} }}
        compensation = {{ tool = "write_file", args = {{ path = "{{args.path}}", content = "{{before.content}}" }} }}

        [tools.fs.edit_file_preview]
        of = "edit_file"
        pin = {{ dryRun = true }}
        tier = "safe"

        [tools.memory.read_graph]
        tier = "safe"

        [tools.memory.create_entities]
        tier = "compensable"
        compensation = {{ tool = "delete_entities", args = {{ entityNames = ["{{item.name}}"] }}, for_each = "{{result.entities}}", skip_if_empty = true }}
    """))
    return cfg


def entity(name: str) -> dict[str, Any]:
    return {"name": name, "entityType": "person", "observations": [f"{name} was here"]}


async def test_the_world_is_restored_after_rollback(db: Any, tmp_path: Path) -> None:
    files = tmp_path / "files"
    files.mkdir()
    (files / "notes.txt").write_text("the original notes\n")
    (files / "plan.txt").write_text("step one\nstep two\n")
    memory = tmp_path / "memory.jsonl"
    cfg = write_config(tmp_path, files, memory)
    edit = {"path": str(files / "plan.txt"), "edits": [{"oldText": "step two", "newText": "step 2"}]}
    async with gateway(db, cfg) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        # The pinned property is not in either exposed schema: the tier never depends on a call's arguments.
        assert "dryRun" not in listed["edit_file_preview"].inputSchema["properties"]
        assert "dryRun" not in listed["edit_file"].inputSchema["properties"]

        preview = await client.call_tool("edit_file_preview", edit)
        assert not preview.isError and "step 2" in text(preview), text(preview)
        assert (files / "plan.txt").read_text() == "step one\nstep two\n"  # a preview changes nothing
        sneaky = await client.call_tool("edit_file", {**edit, "dryRun": True})
        assert sneaky.isError and "dryRun" in text(sneaky)
        assert (await client.call_tool("edit_file_preview", {**edit, "dryRun": False})).isError

        wrote = await client.call_tool("write_file", {"path": str(files / "notes.txt"), "content": "overwritten"})
        assert not wrote.isError, text(wrote)
        edited = await client.call_tool("edit_file", edit)
        assert not edited.isError, text(edited)
        assert (files / "plan.txt").read_text() == "step one\nstep 2\n"

        made = await client.call_tool("create_entities", {"entities": [entity("ada"), entity("grace")]})
        assert not made.isError, text(made)
        # Nothing new: the result lists no entity, so there is nothing to undo (skip_if_empty).
        again = await client.call_tool("create_entities", {"entities": [entity("ada")]})
        assert not again.isError and (again.structuredContent or {}).get("entities") == [], text(again)
        graph = await client.call_tool("read_graph", {})
        assert sorted(e["name"] for e in (graph.structuredContent or {})["entities"]) == ["ada", "grace"]

    u = db.open()
    s = only_session(u)
    effects = u.sessions.effects(s.session_id)
    # The preview is SAFE: no effect. The refused calls logged nothing.
    assert [e["tool_name"] for e in effects] == ["write_file", "edit_file", "create_entities", "create_entities"]
    assert all(e["state"] == EffectState.COMMITTED for e in effects)

    out = cli(db, "--app", str(cfg), "sessions", "rollback", s.session_id)
    assert out.returncode == 0, out.stdout + out.stderr
    assert u.sessions.get(s.session_id).state == SessionState.ROLLED_BACK
    assert (files / "notes.txt").read_text() == "the original notes\n"  # restored from what capture read
    assert (files / "plan.txt").read_text() == "step one\nstep two\n"
    remaining = [json.loads(line) for line in memory.read_text().splitlines() if line.strip()]
    assert [r for r in remaining if r.get("type") == "entity"] == []  # both entities gone, not one


@pytest.fixture
def _portal_closed_after() -> Iterator[None]:
    """Closes the process-wide portal's upstream connections at teardown: otherwise the Node server this test
    opens through it stays alive for the rest of the pytest process (seen in a no-xdist random-order run)."""
    yield
    import asyncio

    from undolog_mcp.upstream import PORTAL

    if PORTAL._loop is not None and PORTAL._connections is not None:
        asyncio.run_coroutine_threadsafe(PORTAL._connections.close(), PORTAL._loop).result(timeout=60)


@pytest.mark.usefixtures("_portal_closed_after")
async def test_recovery_after_a_crash_restores_from_the_capture(db: Any, tmp_path: Path) -> None:
    """A gateway that died after capturing and sending an overwrite: recovery (the batch path, from another
    process's view) compensates it with what the capture stored. Before: the batch path gave the compensation the
    call's arguments, not the undo entry's, so {before.content} was missing and the undo failed until it was
    dead-lettered."""
    from undolog_core import Execute
    from undolog_mcp import Gateway, load_config
    from undolog_mcp.capture import capture_before
    from undolog_mcp.upstream import PORTAL, list_tools

    files = tmp_path / "files"
    files.mkdir()
    target = files / "notes.txt"
    target.write_text("the original notes\n")
    cfg = load_config(write_config(tmp_path, files, tmp_path / "memory.jsonl"))
    u = db.open()
    gw = Gateway(cfg, u)
    gw.register({name: await list_tools(up) for name, up in cfg.upstreams.items()})
    s = u.session(agent_id="crashed-gateway")
    args = {"path": str(target), "content": "overwritten"}
    d = await u.driver.adecide(s.id, "write_file", args)
    assert isinstance(d, Execute) and d.effect_id is not None

    async def call(name: str, call_args: Any, key: Any, check: Any = None) -> Any:
        return await PORTAL.call(cfg.upstreams["fs"], name, call_args, key)

    capture = cfg.tools[("fs", "write_file")].compensation.capture
    assert await capture_before(u, call, capture, "write_file", args, d.args, d.effect_id) is None
    assert not (await call("write_file", args, d.idempotency_key)).isError  # sent; then the gateway "dies"
    assert target.read_text() == "overwritten"
    u.leases.abandon(d.effect_id)
    report = u.recover()
    assert report.reconciled == [{"effect_id": d.effect_id, "tool_name": "write_file", "outcome": "compensated"}]
    assert target.read_text() == "the original notes\n"
