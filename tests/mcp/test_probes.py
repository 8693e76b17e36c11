"""Probes with three answers, through the real gateway (``undolog mcp serve`` over stdio, the SDK's client) in
front of a real SDK upstream whose world is a counter (``counter_server.py``).

A probe answers in structured content or as JSON text; only an explicit ``{"happened": false}`` says the call did
not happen, and that settles a COMPENSABLE call as not run (no compensation) only once its request can no longer
land. Before: a JSON-text answer read as "did not happen", and "did not happen" compensated what never ran (the
counter went 0 -> -5).
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from mcp import types

from undolog_core import UndoLog
from undolog_core.storage import schema as t

from ..support.mcp_upstreams import copy_upstream
from .test_gateway import gateway

HERE = Path(__file__).parent

pytestmark = pytest.mark.reads_store


def write_config(tmp: Path, *, probe: str | None, timeout: float = 30.0, probe_mode: str = "") -> Path:
    copy_upstream(HERE / "counter_server.py", tmp)
    env = f'COUNTER_STATE = {json.dumps(str(tmp / "counter.json"))}'
    if probe_mode:
        env += f', COUNTER_PROBE = "{probe_mode}"'
    cfg = tmp / "gateway.toml"
    cfg.write_text(textwrap.dedent(f"""
        [upstreams.counter]
        command = [{json.dumps(sys.executable)}, "counter_server.py"]
        env = {{ {env} }}
        timeout = {timeout}

        [tools.counter.add]
        tier = "compensable"
        compensation = {{ tool = "subtract", args = {{ n = "{{args.n}}" }} }}
        {f'probe = "{probe}"' if probe else ""}
    """))
    return cfg


def counter(tmp: Path) -> dict[str, Any]:
    return dict(json.loads((tmp / "counter.json").read_text()))


def effects(db: Any) -> list[Any]:
    u = UndoLog.open(db.url, schema=db.schema)
    try:
        with u.store.read() as c:
            rows = c.execute(sa.select(t.effect_log).order_by(t.effect_log.c.seq)).all()
            undos = c.execute(sa.select(t.undo_stack)).all()
            events = c.execute(sa.select(t.approval_events).where(t.approval_events.c.action == "effect.probe")
                               .order_by(t.approval_events.c.event_id)).all()
        return [rows, undos, events]
    finally:
        u.close()


def text(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


@pytest.mark.parametrize("probe", ["was_applied", "was_applied_text"])
async def test_a_call_that_died_before_it_ran_is_settled_not_run_and_never_compensated(
        db: Any, tmp_path: Path, probe: str) -> None:
    cfg = write_config(tmp_path, probe=probe)
    async with gateway(db, cfg) as client:
        out = await client.call_tool("add", {"n": 5, "crash": "before"})
        assert out.isError and "did not happen" in text(out), text(out)
        # The session goes on: nothing happened, nothing was undone.
        ok = await client.call_tool("add", {"n": 2})
        assert not ok.isError, text(ok)
    world = counter(tmp_path)
    assert world["history"] == [0, 2], world  # never 0 -> -5
    rows, undos, events = effects(db)
    assert [r.state for r in rows] == ["failed", "committed"]
    assert [u.effect_id for u in undos] == [rows[1].effect_id]  # the not-run call's undo entry is gone
    payloads = [json.loads(e.payload) if isinstance(e.payload, str) else e.payload for e in events]
    assert [(p["answer"], p["settled"]) for p in payloads] == [("not_happened", "not_run")]
    assert events[0].subject == f"effect:{rows[0].effect_id}"


@pytest.mark.parametrize("probe", ["was_applied", "was_applied_text"])
async def test_a_call_that_died_after_it_ran_is_committed_with_the_probes_result(
        db: Any, tmp_path: Path, probe: str) -> None:
    """Before (JSON text): the answer was read as "did not happen" and the call compensated although it ran."""
    cfg = write_config(tmp_path, probe=probe)
    async with gateway(db, cfg) as client:
        out = await client.call_tool("add", {"n": 5, "crash": "after"})
        assert "confirms it happened" in text(out), text(out)
    assert counter(tmp_path)["history"] == [0, 5]
    rows, _, events = effects(db)
    assert rows[0].state == "committed" and rows[0].result_snapshot == {"counter": 5}
    payload = events[0].payload if not isinstance(events[0].payload, str) else json.loads(events[0].payload)
    assert (payload["answer"], payload["settled"]) == ("happened", "committed")


@pytest.mark.parametrize("probe", ["was_applied", "was_applied_text"])
async def test_a_probe_that_cannot_tell_takes_the_path_of_no_probe(db: Any, tmp_path: Path, probe: str) -> None:
    cfg = write_config(tmp_path, probe=probe, probe_mode="cant_tell")
    async with gateway(db, cfg) as client:
        out = await client.call_tool("add", {"n": 5, "crash": "after"})
        assert "undone" in text(out), text(out)
    assert counter(tmp_path)["history"] == [0, 5, 0]  # compensated: what ran was undone
    rows, _, events = effects(db)
    assert rows[0].state == "compensated"
    payload = events[0].payload if not isinstance(events[0].payload, str) else json.loads(events[0].payload)
    assert (payload["answer"], payload["settled"]) == ("cant_tell", "compensated")


# A probe asked while the original request may still land (a timeout): see test_cancel_after_timeout.py, where the
# gateway cancels it upstream and asks the probe only once the upstream confirmed the cancel.
