"""Issue #29, part 4: hostile input on the gateway's stdio, written raw to the real ``undolog mcp serve`` (the
protocol's own framing: one JSON-RPC message per line), fronting a real upstream.

Each hostile line gets an answer naming the limit; nothing is logged (no session, no effect) and nothing reaches
the upstream; the gateway's memory comes back to its level after a 30 MB line. Before the fix a 30 MB argument was
logged whole and forwarded (RSS 98 -> 537 MB, staying ~466 MB) and a batch got no answer at all.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from .test_gateway import write_config

pytestmark = pytest.mark.reads_store


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


class Raw:
    def __init__(self, db: Any, cfg: Path) -> None:
        env = {**os.environ, **db.env}
        self.proc = subprocess.Popen([sys.executable, "-m", "undolog_core.cli", "mcp", "serve", "--config", str(cfg)],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.buf = b""

    def send(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float = 60) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            ready, _, _ = select.select([fd], [], [], timeout)
            assert ready, "no answer: the sender would wait for ever"
            chunk = os.read(fd, 1 << 16)
            assert chunk, "the gateway exited"
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return dict(json.loads(line))

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _call(i: int, args: Any) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": i, "method": "tools/call",
                       "params": {"name": "create_ticket", "arguments": args}}).encode()


def test_hostile_lines_are_each_answered_and_nothing_is_logged_or_forwarded(db: Any, tmp_path: Path) -> None:
    cfg = write_config(tmp_path)
    u = db.open()
    g = Raw(db, cfg)
    try:
        g.send(json.dumps({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-06-18", "capabilities": {},
            "clientInfo": {"name": "hostile", "version": "1"}}}).encode())
        assert g.answer()["result"]["protocolVersion"] == "2025-06-18"
        g.send(b'{"jsonrpc": "2.0", "method": "notifications/initialized"}')
        g.send(b'{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}')
        assert g.answer()["id"] == 1
        base = _rss_kb(g.proc.pid)

        g.send(_call(2, {"title": "x" * (30 << 20)}))  # a 30 MB argument: past the line limit too
        a = g.answer()
        assert a["id"] == 2 and "line limit" in a["error"]["message"], a
        after_line = _rss_kb(g.proc.pid)

        g.send(_call(3, {"title": "y" * (300 << 10)}))  # under the line limit, over the argument limit
        a = g.answer()
        assert a["id"] == 3 and a["result"]["isError"] and "argument limit" in a["result"]["content"][0]["text"], a

        g.send(b'{"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {"name": "create_ticket", '
               b'"arguments": {"title": ' + b"[" * 200 + b"]" * 200 + b"}}}")
        a = g.answer()
        assert a["id"] == 4 and "nested deeper than" in a["error"]["message"], a

        g.send(b'[' + _call(5, {"title": "a"}) + b', ' + _call(6, {"title": "b"}) + b']')
        answers = [g.answer(), g.answer()]
        assert {x["id"] for x in answers} == {5, 6}
        assert all("batches are not supported" in x["error"]["message"] for x in answers)

        g.send(b'{"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": {"name": "create_ticket", '
               b'"arguments": {"title": "\xff\xfe"}}}')
        a = g.answer()
        assert a["id"] == 7 and "not valid UTF-8" in a["error"]["message"], a

        g.send(_call(8, {"title": "fine"}))  # the gateway still serves
        a = g.answer()
        assert a["id"] == 8 and not a["result"].get("isError"), a
        final = _rss_kb(g.proc.pid)
        print(f"\ngateway RSS KB: base={base} after 30 MB line={after_line} end={final}")
        assert after_line < base + 8_000 and final < base + 8_000, (base, after_line, final)
    finally:
        g.close()
    state = json.loads((tmp_path / "tickets.json").read_text())
    assert [c["args"] for c in state["calls"]] == [{"title": "fine"}]  # nothing hostile reached the upstream
    sessions = [s for s in u.sessions.list() if (s.agent_id or "").startswith("mcp:")]
    assert len(sessions) == 1
    effects = u.store.sessions.session_effects(sessions[0].session_id)
    assert len(effects) == 1, effects  # the one fine call: no refused line was logged
