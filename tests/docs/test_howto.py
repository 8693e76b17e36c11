"""The how-to and reference blocks that need something around them, run here as written.

A block marked ``<!-- runs-in: tests/docs/test_howto.py -->`` needs what its page says is yours: an app module
(``myagent.app:undolog``), a crashed process to recover, a paused graph, an upstream MCP server, a database with
a pending request. Each test below builds that, the way production has it (a real database, the real ``undolog``
command in a subprocess, real frameworks, a process killed with SIGKILL), then runs the block's text from the
page. The only edits are the ones a reader makes: a placeholder id replaced by a real one, a port by a free one,
a path under ``/etc`` by one in the test's folder; each is spelled out where it is made.

``CLAIMS`` lists every block run here (page, first line); a block marked for this file that no test claims, or a
claimed block that lost its marker, fails ``test_every_block_marked_for_this_file_is_run_here``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.docs.test_docs import ROOT, _free_port, _page_env, blocks

HERE = "tests/docs/test_howto.py"

#: Every block this file runs: (page, the block's first line).
CLAIMS = [
    ("how-to/recovery.md", "undolog --app myagent.app:undolog recover"),
    ("how-to/recovery.md", "report = undolog.recover()"),
    ("how-to/recovery.md", "from undolog_core import ProbeContext"),
    ("how-to/recovery.md", "undolog sessions list --state halted"),
    ("how-to/desk.md", "pip install 'undolog[server]'"),
    ("how-to/desk.md", "[defaults]"),
    ("how-to/desk.md", "from undolog_core.webhooks import verify_signature"),
    ("how-to/desk.md", "POST <target url>"),
    ("how-to/audit-checkpoints.md", "pip install 'undolog[audit]'"),
    ("how-to/compensations.md", "undolog check-undo --app"),
    ("how-to/mcp-gateway.md", "pip install 'undolog[mcp]'"),
    ("how-to/mcp-gateway.md", "{"),
    ("how-to/postgresql.md", "export UNDOLOG_DATABASE_URL"),
    ("reference/cli.md", "undolog --db sqlite:///undolog.db sessions list"),
    ("reference/cli.md", "undolog approvals list\n"),
    ("reference/errors.md", '{"type": "https://undolog.dev/problems/approval_already_decided"'),
    ("reference/gateway-toml.md", "# database ="),
    ("reference/gateway-toml.md", "[tools.memory.create_entities]"),
    ("README.md", "pip install -e '.[docs]' && mkdocs serve"),
    ("how-to/crewai.md", "python -m examples.crewai_support_crew"),
]


def block(page: str, first_line: str) -> str:
    """The text of the one block of ``page`` that starts with ``first_line``, which must be marked as run here."""
    assert (page, first_line) in CLAIMS, f"add ({page!r}, {first_line!r}) to CLAIMS"
    found = [b for b in blocks(page) if b.code.startswith(first_line)]
    assert len(found) == 1, f"{page}: {len(found)} blocks start with {first_line!r}"
    [b] = found
    assert b.marker == ("runs-in", HERE), f"{page}:{b.line}: mark the block <!-- runs-in: {HERE} -->"
    return b.code


def test_every_block_marked_for_this_file_is_run_here() -> None:
    pages = {p for p, _ in CLAIMS}
    from tests.docs.test_docs import PAGES

    marked = [(p, b) for p in [*PAGES, "README.md"] for b in blocks(p) if b.marker == ("runs-in", HERE)]
    for page, b in marked:
        assert any(p == page and b.code.startswith(first) for p, first in CLAIMS), (
            f"{page}:{b.line} is marked runs-in {HERE}, but no test here runs it")
    assert pages <= {p for p, _ in marked}


def sh(script: str, cwd: Path, env: dict[str, str] | None = None, *, ok: bool = True,
       timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run a block as a reader would paste it into bash (``set -e``): anything left in the background is stopped."""
    wrapped = "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n" + script
    out = subprocess.run(["bash", "-c", wrapped], cwd=cwd, env=env or _page_env(cwd), capture_output=True,
                         text=True, timeout=timeout, start_new_session=True)
    if ok:
        assert out.returncode == 0, f"exit {out.returncode}:\n{script}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    return out


def without_install(code: str) -> str:
    """A block's lines but its first, a ``pip install`` line (``.ci/run`` installs the same extras)."""
    first, _, rest = code.partition("\n")
    assert first.startswith("pip install "), first
    return rest


def py(code: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run Python source in a fresh process in ``cwd`` (which is on its path, as ``python script.py`` has it)."""
    (cwd / "_block.py").write_text(code)
    out = subprocess.run([sys.executable, "_block.py"], cwd=cwd, env=env or _page_env(cwd), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"{code}\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    return out.stdout


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --- recovering after a crash ------------------------------------------------------------------------------

#: The billing API the recovery page's probe asks: refunds kept in a JSON file, so two processes share them. A
#: refund whose ``CRASH`` says so kills its process with SIGKILL, before or after the refund is written.
BILLING = '''
import json, os, signal
from pathlib import Path


class Billing:
    path = Path("billing.json")

    def _load(self):
        return json.loads(self.path.read_text()) if self.path.exists() else {}

    def refund(self, order_id, amount, idempotency_key):
        if os.environ.get("CRASH") == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        refunds = self._load()
        refunds[idempotency_key] = {"order_id": order_id, "amount": amount, "cancelled": False}
        self.path.write_text(json.dumps(refunds))
        if os.environ.get("CRASH") == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return {"order_id": order_id, "refunded": amount}

    def find_refund(self, idempotency_key):
        if os.environ.get("BILLING_DOWN"):
            return None  # cannot tell
        return self._load().get(idempotency_key, False)

    def cancel(self, idempotency_key):
        refunds = self._load()
        if idempotency_key in refunds:
            refunds[idempotency_key]["cancelled"] = True
            self.path.write_text(json.dumps(refunds))


billing = Billing()
'''


def _recovery_app(tmp_path: Path) -> None:
    """``myagent/app.py``: the app the recovery page names, holding the page's probe block as written."""
    write(tmp_path / "myagent" / "__init__.py", "")
    write(tmp_path / "myagent" / "billing.py", BILLING)
    probe_block = block("how-to/recovery.md", "from undolog_core import ProbeContext")
    (tmp_path / "myagent" / "app.py").write_text(
        "from undolog_core import UndoLog, compensation\n"
        "from myagent.billing import billing\n\n"
        + probe_block
        + "\n\n@compensation('cancel_refund')\n"
        "def cancel_refund(ctx):  # keyed by the call: a refund that never happened has nothing to cancel\n"
        "    billing.cancel(f'do-{ctx.effect_id}')\n\n\n"
        "undolog = UndoLog.open('sqlite:///undolog.db')\n"
        "undolog.register(refund, cancel_refund)\n")


def _crash(tmp_path: Path, session_id: str, when: str) -> None:
    """A process of the app that refunds an order and is SIGKILLed in the middle of the call."""
    script = (
        "from myagent.app import refund, undolog\n"
        f"with undolog.session(session_id={session_id!r}) as s:\n"
        "    s.call_sync(refund, order_id='A-7', amount=12.5)\n")
    (tmp_path / "crash.py").write_text(script)
    env = {**_page_env(tmp_path), "CRASH": when}
    out = subprocess.run([sys.executable, "crash.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == -signal.SIGKILL, out.stdout + out.stderr


def test_recovery_page_recovers_killed_processes_and_a_person_resolves_one(tmp_path: Path) -> None:
    _recovery_app(tmp_path)
    billing = tmp_path / "billing.json"

    def refunds() -> dict[str, Any]:
        return json.loads(billing.read_text()) if billing.exists() else {}

    # The refund was written, then the process died: the probe says it happened, so it is committed.
    _crash(tmp_path, "order-7", when="after")
    out = sh(block("how-to/recovery.md", "undolog --app myagent.app:undolog recover"), tmp_path)
    report = json.loads(out.stdout[out.stdout.index("{"):])  # the second command's JSON: nothing left to do
    assert not report["errors"] and not report["left_alive"], report
    assert [r["cancelled"] for r in refunds().values()] == [False]

    # Killed before the refund was written; in code, at start: the probe says it did not happen, nothing to undo.
    _crash(tmp_path, "order-8", when="before")
    code = block("how-to/recovery.md", "report = undolog.recover()")
    out = py("import json\nfrom myagent.app import undolog\n\n" + code
             + "\nprint(json.dumps(report.to_dict(), default=str))\n", tmp_path)
    report = json.loads(out)
    assert len(report["reconciled"]) == 1 and not report["errors"], report
    assert len(refunds()) == 1, "nothing was refunded, nothing compensated"

    # Billing cannot tell: the refund is compensated and the session halted for a person, who looks and decides.
    _crash(tmp_path, "order-9", when="after")
    sh("undolog --app myagent.app:undolog recover", tmp_path, {**_page_env(tmp_path), "BILLING_DOWN": "1"})
    assert sorted(r["cancelled"] for r in refunds().values()) == [False, True]
    halted = block("how-to/recovery.md", "undolog sessions list --state halted")
    out = sh(halted.replace("SESSION_ID", "order-9"), tmp_path)
    assert "order-9" in out.stdout and "checked the ledger" not in out.stderr, out.stdout


# --- running the approval desk ---------------------------------------------------------------------------

MYAPP = '''
from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("unsend"))
def send_email(to: str) -> str:
    return to


@compensation("unsend")
def unsend(ctx) -> None:
    pass


def register(undolog):
    undolog.register(send_email, unsend)
'''


def _serve_and_check(script: str, port: int, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """Run a block whose last line starts the desk, in the background, and check that it answers."""
    script = script.rstrip("\n")
    last = script.rsplit("\n", 1)[-1]
    assert last.startswith("undolog serve"), last
    probe = (f" &\nfor _ in $(seq 1 240); do curl -sf http://127.0.0.1:{port}/v1/health >/dev/null && break; "
             "sleep 0.5; done\n"
             f"curl -sf http://127.0.0.1:{port}/v1/health\necho\n"
             f"curl -sf -o /dev/null -w 'ui %{{http_code}}\\n' http://127.0.0.1:{port}/ui/login\n"
             f"curl -sf -o openapi.json http://127.0.0.1:{port}/openapi.json\nhead -c 200 openapi.json\necho\n")
    return sh(script + probe, tmp_path, env).stdout


def test_desk_page_starts_the_desk_with_an_app_and_the_proxy_config(tmp_path: Path) -> None:
    write(tmp_path / "myapp" / "__init__.py", "")
    write(tmp_path / "myapp" / "tools.py", MYAPP)
    # The proxy's TOML, as the page shows it, is the tools.toml the start line names.
    (tmp_path / "tools.toml").write_text(block("how-to/desk.md", "[defaults]"))
    port = _free_port()
    script = without_install(block("how-to/desk.md", "pip install 'undolog[server]'")).replace(
        "--port 8000", f"--port {port}")
    out = _serve_and_check(script, port, tmp_path)
    assert '"status":"ok"' in out.replace(" ", "") and "ui 200" in out, out
    listed = sh("undolog --db sqlite:///undolog.db tools --json", tmp_path).stdout
    names = {row["tool_name"] for row in json.loads(listed)}
    assert {"send_email", "refund"} <= names, names  # the app's tool and the proxied one


def test_desk_page_webhook_receiver_verifies_what_the_desk_signs() -> None:
    from undolog_core.webhooks import sign

    secret, raw_body, delivery = "whsec_test", b'{"id": "evt_42", "type": "approval.requested"}', "dl_1"
    header = sign(secret, int(time.time()), raw_body, delivery_id=delivery)
    request = SimpleNamespace(headers={"UndoLog-Signature": header, "UndoLog-Delivery": delivery})
    code = block("how-to/desk.md", "from undolog_core.webhooks import verify_signature")
    ns: dict[str, Any] = {"secret": secret, "request": request, "raw_body": raw_body}
    exec(compile(code, "desk.md", "exec"), ns)  # noqa: S102 - the page's own block
    assert ns["ok"] is True
    ns["raw_body"] = raw_body.replace(b"42", b"43")
    exec(compile(code, "desk.md", "exec"), ns)  # noqa: S102
    assert ns["ok"] is False, "an edited body must not verify"


def test_desk_page_webhook_request_is_what_the_desk_sends(db: Any) -> None:
    import re

    from tests.server.conftest import make_desk
    from tests.support.receiver import Receiver
    from undolog_server.state import ServerSettings

    shown = block("how-to/desk.md", "POST <target url>")
    head, _, body = shown.partition("\n\n")
    shown_headers = dict(line.split(": ", 1) for line in head.splitlines()[1:])
    receiver = Receiver().start()
    # Loopback receivers are refused unless the admin allows private targets (the desk's SSRF rule).
    desk = make_desk(db, settings=ServerSettings(background=True, sweep_interval=0.05, webhook_interval=0.02,
                                                 webhook_timeout=10.0, webhook_allow_private=True))
    try:
        made = desk.client("admin").post("/v1/webhooks", json={"name": "hook", "url": f"{receiver.url}/hook",
                                                                "event_types": ["approval.requested"]})
        assert made.status_code == 201, made.text
        receiver.secrets["/hook"] = made.json()["secret"]
        desk.pending()
        for _ in range(600):
            if receiver.events("/hook"):
                break
            time.sleep(0.1)
        [got] = receiver.events("/hook")
    finally:
        desk.close()
        desk.undolog.close()
        receiver.stop()
    assert got.signature_ok, "the signature the page describes verifies"
    assert shown_headers["UndoLog-Event"] == got.event_type == "approval.requested"
    assert got.delivery_id.startswith(shown_headers["UndoLog-Delivery"].rstrip("…"))
    assert re.fullmatch(r"t=\d+,v2=[0-9a-f]+…", shown_headers["UndoLog-Signature"])
    shown_keys = set(re.findall(r'"(\w+)":', body))
    real_keys = set(got.body) | set(got.body["data"])
    assert shown_keys <= real_keys, f"the page shows {sorted(shown_keys - real_keys)}, which the desk does not send"
    assert got.body["id"].startswith("evt_") and got.body["type"] == "approval.requested"


# --- signed audit checkpoints -----------------------------------------------------------------------------


def test_audit_checkpoint_commands_sign_and_verify(tmp_path: Path) -> None:
    # The page keeps the key under /etc and the checkpoints under /srv; here both live in the test's folder.
    code = without_install(block("how-to/audit-checkpoints.md", "pip install 'undolog[audit]'"))
    code = code.replace("/etc/undolog", str(tmp_path / "etc" / "undolog")).replace("/srv/", str(tmp_path / "srv") + "/")
    (tmp_path / "etc" / "undolog").mkdir(parents=True)
    env = {**_page_env(tmp_path), "DB": "sqlite:///undolog.db"}
    sh('undolog --db "$DB" db upgrade', tmp_path, env)
    out = sh(code, tmp_path, env)
    assert len(list((tmp_path / "srv" / "undolog-checkpoints").glob("checkpoint-*.json"))) == 1, out.stdout


# --- checking a compensation ------------------------------------------------------------------------------


def test_compensations_page_check_undo_command_on_a_fresh_clone(tmp_path: Path) -> None:
    import shutil

    # A fresh clone's examples/ and nothing else: the command is run from the clone's root, as the page says.
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**_page_env(tmp_path), "SUPPORT_WORLD": str(tmp_path / "world.sqlite")}
    out = sh(block("how-to/compensations.md", "undolog check-undo --app"), tmp_path, env)
    assert "OK:" in out.stdout, out.stdout


# --- the MCP gateway --------------------------------------------------------------------------------------

#: An upstream MCP server of tickets, on the official SDK: the ``tickets_server.py`` the gateway pages name.
TICKETS = '''
from pydantic import BaseModel
from mcp.server.fastmcp import FastMCP
from mcp.types import ToolAnnotations

mcp = FastMCP("tickets")
TICKETS: dict[int, str] = {}


class Ticket(BaseModel):
    id: int
    title: str


@mcp.tool(annotations=ToolAnnotations(readOnlyHint=True))
def search_tickets(query: str) -> list[str]:
    """Search tickets by title."""
    return [t for t in TICKETS.values() if query in t]


@mcp.tool()
def create_ticket(title: str) -> Ticket:
    """Create a ticket."""
    ticket = Ticket(id=len(TICKETS) + 1, title=title)
    TICKETS[ticket.id] = title
    return ticket


@mcp.tool()
def close_ticket(id: int) -> str:
    """Close a ticket."""
    TICKETS.pop(id, None)
    return "closed"


@mcp.tool(annotations=ToolAnnotations(destructiveHint=True))
def delete_project(name: str) -> str:
    """Delete a project and every ticket in it."""
    TICKETS.clear()
    return "deleted"


if __name__ == "__main__":
    mcp.run()
'''


async def _list_tools(command: str, args: list[str], env: dict[str, str], cwd: Path) -> list[str]:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    params = StdioServerParameters(command=command, args=args, env=env, cwd=str(cwd))
    async with stdio_client(params) as (read, write_), ClientSession(read, write_) as session:
        await session.initialize()
        return sorted(t.name for t in (await session.list_tools()).tools)


def test_mcp_gateway_page_proposes_a_config_and_serves_it_over_stdio(tmp_path: Path) -> None:
    (tmp_path / "tickets_server.py").write_text(TICKETS)
    env = _page_env(tmp_path)
    code = without_install(block("how-to/mcp-gateway.md", "pip install 'undolog[mcp]'"))
    init, serve = [line.split("  #")[0].strip() for line in code.strip().splitlines()]
    sh(init, tmp_path, env)
    proposal = (tmp_path / "gateway.toml").read_text()
    assert "[tools.tickets.search_tickets]" in proposal, proposal
    # The gateway is a stdio server the client starts: started here by the SDK's client, as the page's line.
    argv = shlex.split(serve)
    tools = asyncio.run(_list_tools(argv[0], argv[1:], env, tmp_path))
    assert "search_tickets" in tools, tools

    # The client's configuration, with /abs/path replaced by where the files are.
    config = json.loads(block("how-to/mcp-gateway.md", "{").replace("/abs/path", str(tmp_path)))
    [server] = config["mcpServers"].values()
    tools = asyncio.run(_list_tools(server["command"], server["args"], {**env, **server["env"]}, tmp_path))
    assert "search_tickets" in tools, tools
    assert (tmp_path / "undolog.db").exists(), "the client's env names the database the gateway writes"


def test_gateway_toml_reference_is_a_config_the_gateway_serves(tmp_path: Path) -> None:
    (tmp_path / "tickets_server.py").write_text(TICKETS)
    (tmp_path / "gateway.toml").write_text(block("reference/gateway-toml.md", "# database ="))
    env = _page_env(tmp_path)
    tools = asyncio.run(_list_tools("undolog", ["--db", "sqlite:///undolog.db", "mcp", "serve", "--config",
                                                "gateway.toml"], env, tmp_path))
    assert tools == ["create_ticket", "delete_project", "search_tickets"], tools  # close_ticket has no tier


def test_gateway_toml_reference_templates_load() -> None:
    from undolog_mcp.config import load_config

    fragment = block("reference/gateway-toml.md", "[tools.memory.create_entities]")
    # The fragment's tools belong to two upstreams, declared as the gateway's own tests declare them.
    upstreams = ('[upstreams.memory]\ncommand = ["node", "server-memory"]\n'
                 '[upstreams.fs]\ncommand = ["node", "server-filesystem", "."]\n')
    import tomllib

    config = load_config(tomllib.loads(upstreams + fragment))
    assert config is not None


# --- PostgreSQL -------------------------------------------------------------------------------------------


@pytest.mark.postgres_only
def test_postgresql_page_sets_up_and_starts_the_desk(tmp_path: Path, db: Any) -> None:
    write(tmp_path / "myapp" / "__init__.py", "")
    write(tmp_path / "myapp" / "tools.py", MYAPP)
    code = block("how-to/postgresql.md", "export UNDOLOG_DATABASE_URL")
    first, _, rest = code.partition("\n")
    assert first == "export UNDOLOG_DATABASE_URL=postgresql+psycopg://undolog@db.internal/undolog"
    # The test's own server and a fresh schema (the page's optional UNDOLOG_SCHEMA) stand for db.internal.
    port = _free_port()
    script = (f"export UNDOLOG_DATABASE_URL={db.url}\nexport UNDOLOG_SCHEMA={db.schema}\n"
              + rest.replace("--port 8000", f"--port {port}"))
    out = _serve_and_check(script, port, tmp_path)
    assert "ui 200" in out, out
    assert "upgraded" in out, out


# --- reference: the command line --------------------------------------------------------------------------

SUPPORT_APP = '''
from undolog_core import CompensationDescriptor, ToolTier, UndoLog, compensation, undolog_tool

SENT = []


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("unsend"))
def send_email(to: str) -> str:
    SENT.append(to)
    return to


@compensation("unsend")
def unsend(ctx) -> None:
    pass


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="Pays the refund")
def refund(order_id: str, amount: float) -> dict:
    return {"order_id": order_id, "amount": amount}


undolog = UndoLog.open("sqlite:///undolog.db")
undolog.register(send_email, unsend, refund)
'''

RAISE = '''
from undolog_core import ApprovalPending
from {module} import undolog, send_email, refund

with undolog.session(session_id="s-1") as s:
    s.call_sync(send_email, to="ana@example.com")
    try:
        s.call_sync(refund, order_id="A-1", amount=42.5)
    except ApprovalPending as p:
        print(p.approval_request_id)
'''


def _app_with_a_request(tmp_path: Path, package: str) -> str:
    write(tmp_path / package / "__init__.py", "")
    write(tmp_path / package / "app.py", SUPPORT_APP)
    return py(RAISE.format(module=f"{package}.app"), tmp_path).strip()


def test_cli_reference_commands_run_against_a_real_database(tmp_path: Path) -> None:
    request_id = _app_with_a_request(tmp_path, "support")
    code = block("reference/cli.md", "undolog approvals list\n")
    code = code.replace("3f2c9d...", request_id).replace("9a1b77...", "s-1")
    out = sh(code, tmp_path)
    assert request_id in out.stdout and "audit trail tampered with" not in out.stdout, out.stdout


def test_cli_reference_where_it_points(tmp_path: Path) -> None:
    _app_with_a_request(tmp_path, "myagent")
    lines = block("reference/cli.md", "undolog --db sqlite:///undolog.db sessions list").strip().splitlines()
    assert len(lines) == 3
    # The second line names a PostgreSQL server of yours: run with the test's own on the PostgreSQL run (below).
    out = sh("\n".join([lines[0], lines[2].replace(" ID ", " s-1 ")]), tmp_path)
    assert "s-1" in out.stdout, out.stdout


@pytest.mark.postgres_only
def test_cli_reference_where_it_points_on_postgresql(tmp_path: Path, db: Any) -> None:
    line = block("reference/cli.md", "undolog --db sqlite:///undolog.db sessions list").strip().splitlines()[1]
    line = line.replace("postgresql+psycopg://u@host/db", db.url).replace("--schema agents", f"--schema {db.schema}")
    db.open().close()
    sh(line, tmp_path)


# --- reference: error codes -------------------------------------------------------------------------------


def _keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items()}
    return None


def test_errors_page_problem_answer_is_what_the_desk_answers(db: Any) -> None:
    from tests.server.conftest import make_desk

    desk = make_desk(db)
    try:
        request_id, _ = desk.pending()
        approve = f"/v1/approvals/{request_id}:approve"
        assert desk.client("approver").post(approve, json={"reason": "ok"}).status_code == 200
        answer = desk.client("approver").post(approve, json={"reason": "again"})
    finally:
        desk.close()
        desk.undolog.close()
    shown = json.loads(block("reference/errors.md", '{"type": "https://undolog.dev/problems/approval_already_decided"'))
    real = answer.json()
    assert answer.status_code == shown["status"] and answer.headers["content-type"].startswith("application/problem+json")
    assert set(real) == set(shown), f"the desk answers {sorted(real)}; the page shows {sorted(shown)}"
    for key in ("type", "title", "status", "code", "state"):
        assert real[key] == shown[key], (key, real[key], shown[key])


# --- README: serving the docs ------------------------------------------------------------------------------


def test_readme_serves_the_docs_site(tmp_path: Path) -> None:
    code = block("README.md", "pip install -e '.[docs]' && mkdocs serve")
    install, serve = (part.split("#")[0].strip() for part in code.split("&&"))
    assert install == "pip install -e '.[docs]'"  # the dev extra `.ci/run` installs includes docs
    # A long-running server: started on a free port (the page's 8000 may be taken), asked for the home page, stopped.
    port = _free_port()
    env = {**_page_env(tmp_path), "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.Popen([*shlex.split(serve), "--dev-addr", f"127.0.0.1:{port}"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        import httpx

        home = None
        for _ in range(600):
            if proc.poll() is not None:
                pytest.fail(f"mkdocs serve exited {proc.returncode}: {proc.stderr.read() if proc.stderr else ''}")
            try:
                home = httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.5)
        assert home is not None and home.status_code == 200 and "UndoLog" in home.text
        assert httpx.get(f"http://127.0.0.1:{port}/how-to/postgresql/", timeout=5).status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


# --- CrewAI and Semantic Kernel: the example demos ----------------------------------------------------------


def test_framework_page_demos_run_offline(tmp_path: Path) -> None:
    import shutil

    # From a clone's root, as the page runs them: its examples/ and nothing else.
    shutil.copytree(ROOT / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    out = sh(block("how-to/crewai.md", "python -m examples.crewai_support_crew"), tmp_path, timeout=600)
    assert out.stdout.count("UndoLog") >= 4 or "delete_user_account" in out.stdout, out.stdout[-2000:]
