"""The docs' CrewAI, Semantic Kernel and "Logs and traces" snippets, run as written.

Each ```python block of those pages (docs/how-to/crewai.md, semantic-kernel.md, logs-and-traces.md) is executed
in order, in a namespace holding what the page says the
snippets are run against: ``undolog`` (a fresh store), the support tools of ``examples/``, and a scripted model
(``llm`` for CrewAI, ``chat_service`` and ``settings`` for Semantic Kernel). A snippet that no longer runs, or no
longer does what its text says, fails here.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from crewai.hooks import clear_all_global_hooks

from examples.crewai_support_crew import support as crew_support
from examples.crewai_support_crew.demo import build_crew
from examples.crewai_support_crew.llm import ScriptedLLM
from examples.semantic_kernel_support import support as sk_support
from examples.semantic_kernel_support.llm import ScriptedChat, auto_settings, call

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _page(name: str) -> str:
    """A docs page's text (the snippets moved there from the README; tests/docs runs every other block)."""
    return (DOCS / name).read_text()


def _blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


async def _run(src: str, ns: dict[str, Any]) -> None:
    code = compile(src, "docs", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    out = eval(code, ns)  # noqa: S307 - the docs' own snippet, run as a user would
    if inspect.iscoroutine(out):
        await out


@pytest.fixture(autouse=True)
def _clean() -> Any:
    crew_support.BACKEND.reset()
    sk_support.BACKEND.reset()
    clear_all_global_hooks()
    yield
    clear_all_global_hooks()


def test_crewai_snippets(undolog: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # Sync, as a crew is run: CrewAI refuses a synchronous kickoff inside a running event loop.
    blocks = _blocks(_page("how-to/crewai.md"))
    assert len(blocks) == 2
    llm = ScriptedLLM(model="scripted", native=True, steps=[
        {"tool": "send_refund_email", "args": {"user_id": "u1", "amount": 25.0}},
        {"tool": "delete_user_account", "args": {"user_id": "u1"}}])
    ns: dict[str, Any] = {"undolog": undolog, "llm": llm, "search_knowledge_base": crew_support.search_knowledge_base,
                          "send_refund_email": crew_support.send_refund_email,
                          "delete_user_account": crew_support.delete_user_account,
                          "cancel_refund_email": crew_support.cancel_refund_email}
    exec(compile(blocks[0], "docs", "exec"), ns)  # noqa: S102 - the docs' own snippet
    run, done = ns["run"], ns["done"]
    [request] = undolog.approvals.list(session_id=run.session_id)
    assert request.tool_name == "delete_user_account" and request.state == "approved"
    # The continuation repeated the whole task (the scripted model starts over, as a real one does): the refund was
    # replayed, not sent twice; the approved deletion ran once.
    assert [m["status"] for m in crew_support.BACKEND.outbox] == ["sent"]
    assert "u1" not in crew_support.BACKEND.accounts and not done.awaiting_approval
    assert "replayed" in llm.observations[0]

    exec(compile(blocks[1], "docs", "exec"), ns)  # noqa: S102
    more = ns["more"]
    later = more.kickoff(build_crew(more, [{"tool": "book_callback", "args": {"day": "mon"}}]), inputs={"ticket": "x"})
    undolog.rollback(later.session_id)
    assert "released mon" in capsys.readouterr().out


async def test_semantic_kernel_snippets(undolog: Any) -> None:
    blocks = _blocks(_page("how-to/semantic-kernel.md"))
    assert len(blocks) == 2
    chat = ScriptedChat(ai_model_id="scripted", turns=[[call("k1", "support-send_refund_email", user_id="u1",
                                                             amount=25.0)],
                                                       [call("k2", "support-delete_user_account", user_id="u1")]])
    ns: dict[str, Any] = {"undolog": undolog, "SupportPlugin": sk_support.SupportPlugin,
                          "cancel_refund_email": sk_support.cancel_refund_email, "chat_service": chat,
                          "settings": auto_settings()}
    await _run(blocks[0], ns)
    assert [m["status"] for m in sk_support.BACKEND.outbox] == ["sent"] and "u1" in sk_support.BACKEND.accounts
    assert "awaiting approval" in str(ns["history"].messages[-1].items[-1].result)

    await _run(blocks[1], ns)
    assert "u1" not in sk_support.BACKEND.accounts
    assert "'deleted': 'u1'" in ns["reply"].content
    # The compensation given to the filter is the one a rollback runs.
    undolog.rollback("chat-42")
    assert [m["status"] for m in sk_support.BACKEND.outbox] == ["cancelled"]


async def test_logs_snippet(undolog: Any, capsys: pytest.CaptureFixture[str]) -> None:
    logs, _otel = _blocks(_page("how-to/logs-and-traces.md"))
    root, ul_logger = logging.getLogger(), logging.getLogger("undolog")
    handlers, level = list(root.handlers), ul_logger.level
    try:
        root.handlers = []  # basicConfig configures only a root logger without handlers
        await _run(logs, {})
        from tests.support.toolkit import setup

        _, tools = setup(undolog)
        with undolog.session(session_id="readme-log") as s:
            s.call_sync(tools["send_refund_email"], user_id="u1", amount=1)
        undolog.rollback("readme-log")
    finally:
        for h in root.handlers:
            root.removeHandler(h)
        root.handlers = handlers
        ul_logger.setLevel(level)
    err = capsys.readouterr().err
    assert "undolog.saga INFO compensated: cancel_refund_email undid send_refund_email (session readme-log" in err


def test_traces_snippet(db: Any, tmp_path: Path) -> None:
    _logs, otel = _blocks(_page("how-to/logs-and-traces.md"))
    # A process of its own: the snippet sets the process-wide tracer provider.
    program = otel + (
        "\nfrom undolog_core import UndoLog, undolog_tool, compensation, ToolTier, CompensationDescriptor\n"
        f"u = UndoLog.open({'sqlite:///' + str(tmp_path / 'o.db')!r})\n"
        "@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new('undo_x'))\n"
        "def x(n: int) -> int:\n    return n\n"
        "@compensation('undo_x')\ndef undo_x(ctx):\n    pass\n"
        "u.register(x, undo_x)\n"
        "with u.session(session_id='s') as s:\n    s.call_sync(x, n=1, call_id='c-1')\n"
        "provider.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OTEL_SDK_DISABLED"}
    out = subprocess.run([sys.executable, "-c", program], cwd=ROOT, env={**env, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"name": "execute_tool x"' in out.stdout and '"gen_ai.tool.call.id": "c-1"' in out.stdout
