"""`undolog demo` (examples.support_agent.demo) runs offline and prints the promised timeline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rich.console import Console

from examples.support_agent.demo import run_demo

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, **kw: object) -> tuple[str, object]:
    console = Console(record=True, width=140, force_terminal=False, color_system=None)
    result = run_demo(console=console, db_path=str(tmp_path / "demo.db"), **kw)
    return console.export_text(), result


def test_demo_approve(tmp_path: Path) -> None:
    out, r = _run(tmp_path)
    assert "search_knowledge_base ran freely" in out
    assert "logged effect" in out and "with undo entry #1 (cancel_refund_email)" in out
    assert "delete_user_account stopped before running" in out and "approval request" in out
    assert "ana approved" in out and "delete_user_account ran once, after approval" in out
    assert "rollback, newest first (LIFO)" in out
    lines = [ln for ln in out.splitlines() if "cancel_refund_email undid send_refund_email" in ln]
    assert ["B-8" in lines[0], "B-7" in lines[1]] == [True, True]  # newest first
    assert r.world.account_status("u-1042") == "deleted"
    assert [(e.order_id, e.status) for e in r.world.emails()] == [
        ("A-1042", "queued"), ("B-7", "recalled"), ("B-8", "recalled")]
    assert r.undolog.sessions.get(r.threads["ticket-2002"]).state == "rolled_back"
    r.undolog.close()


def test_demo_reject_and_interactive(tmp_path: Path) -> None:
    out, r = _run(tmp_path / "a", reject=True)
    assert "ana rejected" in out and "delete_user_account was NOT run" in out
    assert "this conversation is on hold" in out
    assert r.world.account_status("u-1042") == "active"
    assert r.undolog.sessions.get(r.threads["ticket-1042"]).state == "halted"
    r.undolog.close()
    asked: list[str] = []
    out, r = _run(tmp_path / "b", interactive=True, ask=lambda q, choices: asked.append(q) or "reject")
    assert asked and "ana rejected" in out
    r.undolog.close()


def test_python_m_entry_point(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "examples.support_agent", "--db", str(tmp_path / "x.db")],
                          cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "rollback, newest first" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "examples.support_agent", "--model", "nonexistent"],
                         cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "provider:name" in bad.stdout
