"""Terminal escapes and Rich markup in agent- or model-supplied fields are shown inert by the CLI (issue 34).

Arguments, an agent id, a tool's exception (the session's halt reason and the effect's error), a person's decision
reason and the agent context carry a corpus of hostile strings: ANSI colour and screen-clearing sequences, an OSC
window-title sequence, a carriage return that overwrites a line, BEL, backspace, an 8-bit CSI, bidirectional
overrides, and Rich markup (styles, links). Through the real CLI (``sessions show``, ``approvals list/show``) no
byte of a terminal control reaches the output (each is shown as ``\\x1b``...) and the markup is printed as text.
Before the fix the ESC sequences went through to the terminal (Rich strips BEL/CR/BS, not ESC).
"""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from undolog_core import ApprovalPending, ToolTier, UndoLog, compensation, undolog_tool
from undolog_core.cli import app

from .support.toolkit import setup

runner = CliRunner()
CLEAN_ENV = {"UNDOLOG_APP": None, "UNDOLOG_ACTOR": None, "UNDOLOG_DATABASE_URL": None, "UNDOLOG_SCHEMA": None,
             "COLUMNS": "400"}

CORPUS = [
    "\x1b[31mred\x1b[0m",
    "\x1b[2J\x1b[H",
    "\x1b]0;pwned-title\x07",
    "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\",
    "approved\rREJECTED",
    "bell\x07back\x08space",
    "csi\x9b31m8bit",
    "\u202etxt.exe\u202c",
    "[bold red]markup[/bold red]",
    "[link=https://evil.example]link[/link]",
]
HOSTILE = " | ".join(CORPUS)
# What must never reach a terminal, whatever the field.
CONTROLS = ["\x1b", "\x07", "\x08", "\x9b", "\r", "\u202e"]


def run(db: Any, *args: str) -> Any:
    base = ["--db", db.url] + (["--schema", db.schema] if db.schema else [])
    return runner.invoke(app, [*base, *args], env=CLEAN_ENV, catch_exceptions=False)


def assert_inert(out: str, *, full: bool = True) -> None:
    for c in CONTROLS:
        assert c not in out, f"{c!r} reached the terminal"
    # Shown, not acted on: as an escape (a text field), or JSON's own escape (arguments shown as JSON).
    assert "\\x1b[31mred" in out or "\\u001b[31mred" in out
    if full:  # the outputs that show the hostile arguments whole
        assert "[bold red]markup[/bold red]" in out and "[link=https://evil.example]link[/link]" in out


@pytest.mark.reads_store
def test_hostile_fields_are_shown_inert_in_the_cli(db: Any) -> None:
    u: UndoLog = db.open()
    _, tools = setup(u)
    s = u.session(session_id="s-hostile", agent_id="agent \x1b[31mred\x1b[0m\x1b]0;t\x07 [bold]x[/bold]")
    s.call_sync(tools["send_refund_email"], user_id=HOSTILE, amount=1)
    with pytest.raises(ApprovalPending) as p:
        s.call_sync("delete_user_account", user_id=HOSTILE, call_id="d1")
    u.approvals.reject(p.value.approval_request_id, approver="ana", reason=f"no: {HOSTILE}")

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="hostile_undo")
    def hostile_tool(x: str) -> None:
        raise RuntimeError(f"model said: {HOSTILE}")

    @compensation("hostile_undo")
    def hostile_undo(ctx: Any) -> None:
        raise RuntimeError(f"undo said: {HOSTILE}")

    u.register(hostile_tool, hostile_undo)
    u.saga.backoff_seconds = 0
    s2 = u.session(session_id="s-failing")
    with pytest.raises(RuntimeError):
        s2.call_sync(hostile_tool, x=HOSTILE)
    assert "undo said" in (u.sessions.get("s-failing").halted_reason or "")

    for args in (["sessions", "show", "s-hostile"], ["sessions", "list"], ["sessions", "show", "s-failing"],
                 ["approvals", "list", "--state", "rejected"],
                 ["approvals", "show", p.value.approval_request_id]):
        r = run(db, *args)
        assert r.exit_code == 0, (args, r.output)
        assert_inert(r.stdout, full=args[1] == "show")
    shown = run(db, "approvals", "show", p.value.approval_request_id).stdout
    assert "no: " in shown and "pwned-title" in shown  # the reason is there, made visible
