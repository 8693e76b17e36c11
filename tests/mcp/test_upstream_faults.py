"""SIGKILL of the upstream (not the gateway) at every fault point a COMPENSABLE call and an approved IRREVERSIBLE
call pass through, and while the upstream runs the call.

The points are the core's own (``FaultPoint``): the gateway runs in this process with a fault hook that, at the
armed point, SIGKILLs the upstream process (a real SDK server over stdio, ``counter_server.py``) and waits until
it is gone; the call then goes on as it would. The upstream records every call it gets with its key, forward
(``do-``) and undo (``undo-``), so the test counts them. Then the gateway stops and starts again (its recovery
settles what was left), and:

- no forward call ran twice (each ``do-`` key reached the upstream at most once);
- an interrupted compensation may run again, always with its effect's same ``undo-`` key;
- nothing is lost: every call asked has one effect, none left in flight, and the counter equals what the record
  says ran and was not undone;
- exactly one upstream process runs after the restart.

The points: a COMPENSABLE call's ``before_prewrite``, ``after_prewrite`` (before the forward call lands),
``after_tool`` (answered, before the commit mark) and ``after_failure_recorded``; killed while the upstream runs it,
then ``during_recovery`` (its unknown outcome settled); an approved IRREVERSIBLE call's ``before_gate``,
``after_approved_claim`` and ``after_tool``; a rollback's ``rollback_requested``, ``during_rollback`` (before a
compensation is sent), ``after_compensation`` (answered, before its success is recorded) and
``between_compensations``. (``after_mark_queued`` is on the path of an UndoLog opened with ``fast_commit_mark``
only, which the gateway never is.)

On SQLite and PostgreSQL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from mcp import ClientSession, types
from mcp.shared.memory import create_connected_server_and_client_session

from undolog_core import EffectState, UndoLog
from undolog_core._faults import FaultPoint, set_hook
from undolog_mcp.config import load_config
from undolog_mcp.gateway import Gateway

from ..support.mcp_upstreams import copy_upstream
from .test_live_rollback import upstream_processes

# SQLite run only (reads_store), but one case in the PostgreSQL smoke subset: what the gateway records when its
# upstream dies sits above storage, whose recovery paths tests/faults and tests/core pin on both databases.
pytestmark = pytest.mark.reads_store

HERE = Path(__file__).parent
IN_FLIGHT = {EffectState.PENDING, EffectState.RUNNING, EffectState.APPROVED}


def counter_config(tmp: Path) -> Path:
    copy_upstream(HERE / "counter_server.py", tmp)
    cfg = tmp / "gateway.toml"
    cfg.write_text(textwrap.dedent(f"""
        session = "process"

        [upstreams.counter]
        command = [{json.dumps(sys.executable)}, "counter_server.py"]
        env = {{ COUNTER_STATE = {json.dumps(str(tmp / "counter.json"))} }}
        timeout = 30

        [tools.counter.read_counter]
        tier = "safe"

        [tools.counter.add]
        tier = "compensable"
        compensation = {{ tool = "subtract", args = {{ n = "{{args.n}}", of = "{{forward_key}}" }} }}

        [tools.counter.add_final]
        tier = "irreversible"
    """))
    return cfg


def world(tmp: Path) -> dict[str, Any]:
    path = tmp / "counter.json"
    return dict(json.loads(path.read_text())) if path.exists() else {"value": 0, "calls": []}


class UpstreamKiller:
    """A fault hook that SIGKILLs the upstream the first time the armed point is reached."""

    def __init__(self, script: Path) -> None:
        self.script = script
        self.point: FaultPoint | None = None
        self.fired: list[str] = []

    def arm(self, point: FaultPoint) -> None:
        self.point = point

    def __call__(self, point: FaultPoint, session_id: str | None, tool: str | None, effect_id: str | None) -> None:
        if point != self.point or self.fired:
            return
        self.fired.append(f"{point.value} ({tool or '-'})")
        self.kill()

    def kill(self) -> None:
        for pid in upstream_processes(self.script):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while upstream_processes(self.script):  # gone (a zombie waiting to be reaped counts as gone)
            assert time.monotonic() < deadline, "the upstream did not die"
            time.sleep(0.01)


@contextlib.asynccontextmanager
async def gateway(db: Any, cfg: Path) -> AsyncIterator[tuple[Gateway, ClientSession, UndoLog]]:
    """The gateway in this process (so the fault hook runs in it), its upstream a real process, and the SDK's
    client over the in-memory transport."""
    u = db.open()
    gw = Gateway(load_config(cfg), u)
    try:
        async with gw.running(), create_connected_server_and_client_session(gw.server) as client:
            yield gw, client, u
    finally:
        u.close()


def session_of(result: types.CallToolResult) -> str:
    sid = (result.meta or {}).get("dev.undolog/session")
    assert isinstance(sid, str), result
    return sid


async def approved_call(client: ClientSession, u: UndoLog, n: int) -> types.CallToolResult:
    asked = await client.call_tool("add_final", {"n": n})
    rid = (asked.structuredContent or {}).get("approval_request_id")
    assert rid, asked
    u.approvals.approve(rid, approver="ana@desk")
    return await client.call_tool("add_final", {"n": n})


def check_invariants(db: Any, tmp: Path) -> dict[str, Any]:
    """What every point must leave: see the module's docstring."""
    calls = world(tmp)["calls"]
    forward = [c["key"] for c in calls if str(c["key"]).startswith("do-")]
    assert len(forward) == len(set(forward)), f"a forward call ran twice: {calls}"
    u = db.open()
    try:
        effects = [e for s in u.sessions.list() for e in u.sessions.effects(s.session_id)]
    finally:
        u.close()
    # An approved IRREVERSIBLE call settled as not run may wait, approved, for its re-issue; nothing else waits.
    assert not [e for e in effects if e["state"] in IN_FLIGHT - {EffectState.APPROVED}], effects
    # An undo key names one undo entry: every retry of a compensation carries the same one (here each undo of
    # a call of n subtracts n, and the tests' calls have distinct n).
    undo_keys: dict[int, set[str]] = {}
    for c in calls:
        if str(c["key"]).startswith("undo-"):
            undo_keys.setdefault(-int(c["n"]), set()).add(str(c["key"]))
    assert all(len(keys) == 1 for keys in undo_keys.values()), undo_keys
    # Nothing lost: what the world shows is what the log says ran and stayed (a committed call applied once; a
    # compensated one undone if it ran; a failed one never applied). An unknown one is a person's to check.
    if not [e for e in effects if e["state"] == EffectState.UNKNOWN]:
        kept = sum(int(e["args_snapshot"]["n"]) for e in effects if e["state"] == EffectState.COMMITTED)
        assert world(tmp)["value"] == kept, (world(tmp), effects)
    for e in effects:
        if e["state"] == EffectState.COMMITTED:
            assert forward.count(f"do-{e['effect_id']}") == 1, (e, calls)  # committed: it ran, once
    return {"calls": calls, "effects": effects}


async def restart_and_check(db: Any, tmp: Path, cfg: Path) -> dict[str, Any]:
    """Stop, start again (recovery settles what the kill left), and check what must hold."""
    async with gateway(db, cfg) as (_, client, _u):
        read = await client.call_tool("read_counter", {})
        assert not read.isError, read
        assert upstream_processes(tmp / "counter_server.py") == [read.structuredContent["pid"]]  # exactly one
    return check_invariants(db, tmp)


COMPENSABLE_POINTS = [FaultPoint.BEFORE_PREWRITE, FaultPoint.AFTER_PREWRITE, FaultPoint.AFTER_TOOL]
IRREVERSIBLE_POINTS = [FaultPoint.BEFORE_GATE, FaultPoint.AFTER_APPROVED_CLAIM, FaultPoint.AFTER_TOOL]
ROLLBACK_POINTS = [FaultPoint.ROLLBACK_REQUESTED, FaultPoint.DURING_ROLLBACK, FaultPoint.AFTER_COMPENSATION,
                   FaultPoint.BETWEEN_COMPENSATIONS]


@pytest.fixture
def killer(tmp_path: Path) -> Any:
    k = UpstreamKiller(tmp_path / "counter_server.py")
    set_hook(k)
    try:
        yield k
    finally:
        set_hook(None)


@pytest.mark.parametrize("point", COMPENSABLE_POINTS, ids=lambda p: p.value)
async def test_upstream_killed_mid_compensable_call(db: Any, tmp_path: Path, killer: UpstreamKiller,
                                                    point: FaultPoint) -> None:
    cfg = counter_config(tmp_path)
    async with gateway(db, cfg) as (_, client, _u):
        killer.arm(point)
        out = await client.call_tool("add", {"n": 5})
        assert killer.fired, f"{point} was never reached"
        assert not [p for p in upstream_processes(tmp_path / "counter_server.py")][1:]  # never two
        await client.call_tool("add", {"n": 1})  # refused when the kill halted the session: nothing to check
    seen = await restart_and_check(db, tmp_path, cfg)
    first = [e for e in seen["effects"] if e["args_snapshot"] == {"n": 5}]
    assert len(first) == 1, seen  # asked once, one effect
    state = first[0]["state"]
    forwarded = [c for c in seen["calls"] if c["key"] == f"do-{first[0]['effect_id']}"]
    if point is FaultPoint.AFTER_TOOL:
        # It ran and answered before the kill: committed, its answer recorded.
        assert state == EffectState.COMMITTED and not out.isError and len(forwarded) == 1, (out, seen)
    else:
        # Killed before it was sent: sent once to the upstream started again, or settled as not run / undone.
        assert state in (EffectState.COMMITTED, EffectState.COMPENSATED, EffectState.FAILED), seen


@pytest.mark.pg_smoke
async def test_upstream_killed_while_it_runs_the_call(db: Any, tmp_path: Path, killer: UpstreamKiller) -> None:
    """Killed mid-run (the request landed, no answer will come): the outcome is unknown, settled at once against
    the upstream started again; recovery's claim (``during_recovery``) meets no live upstream either."""
    cfg = counter_config(tmp_path)
    async with gateway(db, cfg) as (_, client, _u):
        killer.arm(FaultPoint.DURING_RECOVERY)
        script = tmp_path / "counter_server.py"
        async def kill_once_running() -> None:
            deadline = time.monotonic() + 60
            while not any(c["n"] == 5 for c in world(tmp_path)["calls"]):
                assert time.monotonic() < deadline, "the call never reached the upstream"
                await anyio.sleep(0.02)
            killer.kill()

        async with anyio.create_task_group() as tg:
            tg.start_soon(kill_once_running)
            out = await client.call_tool("add", {"n": 5, "delay": 30})
        assert out.isError and "did not answer" in "".join(getattr(c, "text", "") for c in out.content), out
        assert len(upstream_processes(script)) <= 1
    seen = await restart_and_check(db, tmp_path, cfg)
    (first,) = [e for e in seen["effects"] if e["args_snapshot"].get("n") == 5]
    assert first["state"] == EffectState.COMPENSATED  # not proven not to have run: undone, with its undo- key
    undo = [c for c in seen["calls"] if str(c["key"]).startswith("undo-")]
    assert len(undo) >= 1 and len({c["key"] for c in undo}) == 1


async def test_upstream_killed_after_a_failure_was_recorded(db: Any, tmp_path: Path, killer: UpstreamKiller) -> None:
    cfg = counter_config(tmp_path)
    async with gateway(db, cfg) as (_, client, _u):
        killer.arm(FaultPoint.AFTER_FAILURE_RECORDED)
        out = await client.call_tool("add", {"n": -1})
        assert out.isError and killer.fired
    seen = await restart_and_check(db, tmp_path, cfg)
    (failed,) = seen["effects"]
    assert failed["state"] == EffectState.FAILED
    assert len([c for c in seen["calls"] if c["n"] == -1]) == 1  # tried once, never again


@pytest.mark.parametrize("point", IRREVERSIBLE_POINTS, ids=lambda p: p.value)
async def test_upstream_killed_mid_approved_irreversible_call(db: Any, tmp_path: Path, killer: UpstreamKiller,
                                                              point: FaultPoint) -> None:
    cfg = counter_config(tmp_path)
    async with gateway(db, cfg) as (_, client, u):
        killer.arm(point)
        out = await approved_call(client, u, 7)
        assert killer.fired, f"{point} was never reached"
        again = await client.call_tool("add_final", {"n": 7})  # the client asks again: never a second run
    seen = await restart_and_check(db, tmp_path, cfg)
    finals = [c for c in seen["calls"] if c.get("final")]
    assert len(finals) <= 1, finals  # at most once
    (effect,) = [e for e in seen["effects"] if e["tool_name"] == "add_final"]
    if point is FaultPoint.AFTER_TOOL:
        assert effect["state"] == EffectState.COMMITTED and len(finals) == 1 and not out.isError, (out, seen)
        assert not again.isError  # its recorded result, replayed
    else:
        # Killed before it was sent: it ran once on the upstream started again, or it is unknown (the session
        # halted for a person) and was never run again on its own.
        assert effect["state"] in (EffectState.COMMITTED, EffectState.UNKNOWN), seen
        assert len(finals) == (1 if effect["state"] == EffectState.COMMITTED else len(finals))


@pytest.mark.parametrize("point", ROLLBACK_POINTS, ids=lambda p: p.value)
async def test_upstream_killed_during_a_rollback(db: Any, tmp_path: Path, killer: UpstreamKiller,
                                                 point: FaultPoint) -> None:
    cfg = counter_config(tmp_path)
    async with gateway(db, cfg) as (_, client, u):
        made = await client.call_tool("add", {"n": 5})
        await client.call_tool("add", {"n": 2})
        sid = session_of(made)
        killer.arm(point)
        report = await u.arollback(sid, actor="ana@desk")
        assert killer.fired, f"{point} was never reached"
        if not report.complete:
            # An interrupted compensation leaves its entry to be run again (a person asks again): same undo key.
            report = await u.arollback(sid, actor="ana@desk")
        assert report.complete, report
    seen = await restart_and_check(db, tmp_path, cfg)
    assert world(tmp_path)["value"] == 0, seen  # both undone
    assert {e["state"] for e in seen["effects"]} == {EffectState.COMPENSATED}
    undo = {}
    for c in seen["calls"]:
        if str(c["key"]).startswith("undo-"):
            undo.setdefault(c["key"], []).append(c["n"])
    assert sorted(sorted(set(v)) for v in undo.values()) == [[-5], [-2]], undo  # one key per effect's undo
