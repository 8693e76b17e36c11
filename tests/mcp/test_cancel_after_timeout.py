"""A call past its upstream's timeout: the gateway sends ``notifications/cancelled`` (naming the request) upstream
and settles the call only on what the upstream answers to it, or once its process is gone; meanwhile the effect
stays in flight and the client is told "outcome unknown, settling".

Real processes: ``undolog mcp serve`` over stdio with the SDK's client, in front of an SDK upstream whose slow
``add`` honours a cancel (it stops; the SDK answers "Request cancelled") or, in another test, ignores it (it applies
and answers late). The upstream records every call it gets with its key, and every cancel it receives, in its state
file (``counter_server.py``). Then the real ``server-everything`` (Node), whose wire log shows the cancel. Before:
no cancel was sent; a COMPENSABLE call was compensated at once while its original still ran upstream (it landed
after its undo). On SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from undolog_core import EffectState, SessionState

from .test_gateway import gateway, text
from .test_gateway_everything import EVERYTHING, NODE, TAP
from .test_probes import counter, effects, write_config

pytestmark = pytest.mark.reads_store

META = "dev.undolog/call"
IN_FLIGHT = {EffectState.PENDING.value, EffectState.RUNNING.value}


async def until(what: str, cond: Callable[[], bool], bound: float = 60.0) -> None:
    """Wait for ``cond`` (a bound on a hung test, not a timing assertion: the condition is what is checked)."""
    deadline = time.monotonic() + bound
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.05)


def settled(db: Any) -> Callable[[], bool]:
    def check() -> bool:
        rows = effects(db)[0]
        return bool(rows) and all(r.state not in IN_FLIGHT for r in rows)
    return check


def cancel_config(tmp: Path, *, probe: str | None, cancel: str = "") -> Path:
    cfg = write_config(tmp, probe=probe, timeout=1.0)
    if cancel:
        body = cfg.read_text().replace("env = { ", f'env = {{ COUNTER_CANCEL = "{cancel}", ', 1)
        cfg.write_text(body)
    return cfg


def told_settling(out: Any) -> str:
    """The client's answer at the timeout: an error saying "outcome unknown, settling", naming the effect."""
    said = text(out)
    assert out.isError and "outcome unknown, settling" in said, said
    meta = (out.meta or {})[META]
    assert meta["error"] == "outcome_unknown" and meta["status"] == "settling", meta
    assert meta["effect_id"] in said and "undolog sessions show" in said, said
    return str(meta["effect_id"])


@pytest.mark.parametrize("probe", ["was_applied", "was_applied_text"])
async def test_a_cancel_the_upstream_honours_settles_the_call_as_not_run_by_its_probe(
        db: Any, tmp_path: Path, probe: str) -> None:
    cfg = cancel_config(tmp_path, probe=probe)
    async with gateway(db, cfg) as client:
        out = await client.call_tool("add", {"n": 5, "delay": 60})
        effect_id = told_settling(out)
        await until("the upstream's cancel answer settles the call", settled(db))
        # The session goes on: the call did not happen, nothing was undone.
        ok = await client.call_tool("add", {"n": 2})
        assert not ok.isError, text(ok)
    world = counter(tmp_path)
    key = f"do-{effect_id}"
    assert world["cancels"] and world["cancels"][0]["ignored"] is False, world
    assert world["cancelled"] == [key], world  # the slow add stopped there
    assert [c["key"] for c in world["calls"]] == [key, world["calls"][1]["key"]]  # no undo call, never sent twice
    assert world["history"] == [0, 2], world
    rows, undos, events = effects(db)
    assert [r.state for r in rows] == ["failed", "committed"]
    assert [u.effect_id for u in undos] == [rows[1].effect_id]  # the not-run call's undo entry is gone
    payloads = [json.loads(e.payload) if isinstance(e.payload, str) else e.payload for e in events]
    # Probed once, after the upstream confirmed the cancel: "did not happen" then settles it.
    assert [(p["answer"], p["settled"]) for p in payloads] == [("not_happened", "not_run")]


async def test_a_cancel_the_upstream_ignores_leaves_the_call_in_flight_until_its_late_result(
        db: Any, tmp_path: Path) -> None:
    """The upstream goes on and answers with its result after the timeout: the call is committed with that
    result, never compensated. Before: compensated at once (0 -> -5), then the original landed (-5 -> 0)."""
    cfg = cancel_config(tmp_path, probe="was_applied", cancel="ignore")
    async with gateway(db, cfg) as client:
        out = await client.call_tool("add", {"n": 5, "delay": 4})
        effect_id = told_settling(out)
        rows, undos, _ = effects(db)
        assert rows[0].state in IN_FLIGHT and len(undos) == 1  # in flight, its undo entry kept
        await until("the cancel reaches the upstream", lambda: bool(counter(tmp_path).get("cancels")))
        assert rows[0].state in IN_FLIGHT
        await until("the late result settles the call", settled(db))
        again = await client.call_tool("add", {"n": 1})
        assert not again.isError, text(again)
    world = counter(tmp_path)
    assert world["cancels"][0]["ignored"] is True
    assert world["history"] == [0, 5, 6], world  # applied once, never undone
    assert [c["key"] for c in world["calls"]].count(f"do-{effect_id}") == 1
    assert not [c for c in world["calls"] if str(c["key"]).startswith("undo-")]
    rows, undos, events = effects(db)
    assert [r.state for r in rows] == ["committed", "committed"]
    assert "counter is 5" in json.dumps(rows[0].result_snapshot)  # the upstream's own late answer
    assert len(undos) == 2 and events == []  # settled by its answer: no probe was needed


async def test_without_a_probe_a_confirmed_cancel_is_compensated_with_its_undo_key(db: Any, tmp_path: Path) -> None:
    cfg = cancel_config(tmp_path, probe=None)
    async with gateway(db, cfg) as client:
        out = await client.call_tool("add", {"n": 5, "delay": 60})
        effect_id = told_settling(out)
        await until("the upstream's cancel answer settles the call", settled(db))
    world = counter(tmp_path)
    assert world["cancelled"] == [f"do-{effect_id}"]
    undo = [c for c in world["calls"] if str(c["key"]).startswith("undo-")]
    # No proof it did not happen: compensated (a compensation tolerates "never happened"), once its request could
    # no longer land; the session halts for a person to look.
    assert len(undo) == 1 and undo[0]["n"] == -5, world
    u = db.open()
    (row,) = [e for s in u.sessions.list() for e in u.sessions.effects(s.session_id)]
    assert row["state"] == EffectState.COMPENSATED
    assert u.sessions.get(row["session_id"]).state == SessionState.HALTED


def everything_compensable(tmp: Path, wire: Path) -> Path:
    assert NODE.exists() and EVERYTHING.exists(), "run `npm ci`: server-everything and Node 22 are missing"
    cfg = tmp / "gateway.toml"
    command = [sys.executable, str(TAP), str(wire), "--", str(NODE), str(EVERYTHING), "stdio"]
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.everything]
        command = {json.dumps(command)}
        timeout = 1

        [tools.everything.echo]
        tier = "safe"

        [tools.everything.trigger-long-running-operation]
        tier = "compensable"
        compensation = {{ tool = "echo", args = {{ message = "undo {{undo_key}}" }} }}
    """))
    return cfg


def wire_lines(wire: Path) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for line in wire.read_bytes().splitlines():
        mark, _, body = line.partition(b" ")
        try:
            out.append((mark.decode(), json.loads(body)))
        except ValueError:
            continue
    return out


async def test_server_everything_is_told_to_cancel_and_the_call_stays_in_flight_until_its_process_is_gone(
        db: Any, tmp_path: Path) -> None:
    """The reference server (TypeScript SDK) honours a cancel by never answering the request: the call stays in
    flight while that process lives, and is settled once it is gone (the next start's recovery)."""
    wire = tmp_path / "wire.log"
    cfg = everything_compensable(tmp_path, wire)
    async with gateway(db, cfg) as client:
        out = await client.call_tool("trigger-long-running-operation", {"duration": 30, "steps": 30})
        effect_id = told_settling(out)

        def cancelled() -> bool:
            return any(m == ">" and msg.get("method") == "notifications/cancelled" for m, msg in wire_lines(wire))

        await until("the cancel reaches server-everything", cancelled)
        echo = await client.call_tool("echo", {"message": "still here"})  # the same upstream serves on
        assert not echo.isError, text(echo)
        rows = effects(db)[0]
        assert [r.state for r in rows] == ["pending"]  # no answer: still in flight, never compensated meanwhile
    lines = wire_lines(wire)
    (call,) = [msg for m, msg in lines if m == ">" and msg.get("method") == "tools/call"
               and msg["params"]["name"] == "trigger-long-running-operation"]
    (cancel,) = [msg for m, msg in lines if m == ">" and msg.get("method") == "notifications/cancelled"]
    assert cancel["params"]["requestId"] == call["id"]
    assert call["params"]["_meta"]["dev.undolog/idempotency-key"] == f"do-{effect_id}"
    assert not [msg for m, msg in lines if m == "<" and msg.get("id") == call["id"] and "result" in msg]
    async with gateway(db, cfg) as client:  # its process gone, the next start's recovery settles it
        await client.list_tools()
    rows = effects(db)[0]
    assert [r.state for r in rows] == ["compensated"]
    undo = [msg for m, msg in wire_lines(wire) if m == ">" and msg.get("method") == "tools/call"
            and msg["params"]["name"] == "echo" and re.match(r"undo undo-", msg["params"]["arguments"]["message"])]
    assert len(undo) == 1
