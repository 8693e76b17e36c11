"""A live process stalled past its lease (issue 34, hole 1): same host, left alone; elsewhere, taken over and its
late finish recorded, never lost.

A worker runs a slow COMPENSABLE call with a 1 s lease and is stopped (SIGSTOP) in the middle of the tool for
longer than its lease; ``recover()`` runs in the test process meanwhile, then the worker is continued (SIGCONT).
Before the fix the same-host worker's call was compensated by recovery, then the tool finished: its caller got
``InvalidEffectState`` (its result lost), the effect stayed ``compensated``, and nothing recorded that the side
effect happened after its undo. The owner is made to look foreign with ``UNDOLOG_HOST_ID`` (the host-id
override), which is how a stall on another machine looks from here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from undolog_core.cli import app as cli_app
from undolog_core.storage import schema as t

from ..support import crash_app

pytestmark = pytest.mark.storage

ROOT = Path(__file__).resolve().parents[2]
LEASE = 1.0


@pytest.fixture
def worker(db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    state = tmp_path / "world"
    state.mkdir()
    monkeypatch.setenv("CRASH_STATE", str(state))
    procs: list[subprocess.Popen[str]] = []

    def start(session_id: str, *, host: str | None = None, seconds: float = 1.0,
              fast: bool = False) -> subprocess.Popen[str]:
        env = {**os.environ, **db.env, "CRASH_STATE": str(state), "PYTHONPATH": str(ROOT),
               "CRASH_LEASE": str(LEASE)}
        env.pop("UNDOLOG_FAULT", None)
        env.pop("UNDOLOG_HOST_ID", None)
        env.pop("CRASH_FAST_MARK", None)
        if host:
            env["UNDOLOG_HOST_ID"] = host
        if fast:
            env["CRASH_FAST_MARK"] = "1"  # the commit mark deferred (fast_commit_mark=True)
        p = subprocess.Popen([sys.executable, "-m", "tests.support.crash_app", "slow_answer", session_id, str(seconds)],
                             env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        procs.append(p)
        return p

    def app() -> Any:
        u = crash_app.build(url=db.url, schema=db.schema, lease_seconds=LEASE)
        db.opened.append(u)
        return u

    start.app = app  # type: ignore[attr-defined]
    yield start
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def stop_in_the_tool(p: subprocess.Popen[str]) -> None:
    """SIGSTOP the worker once its tool has started, then wait out its lease (and some: the renewals stop too)."""
    deadline = time.monotonic() + 90
    while not any(c[0] == "slow_start" for c in crash_app.calls()):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline, "the worker's tool never started"
        time.sleep(0.02)
    os.kill(p.pid, signal.SIGSTOP)
    time.sleep(LEASE * 2.5)


def answer(p: subprocess.Popen[str]) -> dict[str, Any]:
    os.kill(p.pid, signal.SIGCONT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    return dict(json.loads(out.strip().splitlines()[-1]))


def effect(u: Any, session_id: str) -> Any:
    with u.store.read() as c:
        return c.execute(sa.select(t.effect_log).where(t.effect_log.c.session_id == session_id)).one()


def kinds() -> list[str]:
    return [c[0] for c in crash_app.calls()]


FAST = pytest.mark.parametrize("fast", [False, True], ids=["durable_mark", "deferred_mark"])


@FAST
def test_a_local_process_stopped_past_its_lease_is_left_alone(worker: Any, fast: bool) -> None:
    p = worker("s-local", fast=fast)
    stop_in_the_tool(p)
    u = worker.app()
    row = effect(u, "s-local")
    assert row.state == "pending" and row.lease_until is not None
    report = u.recover()
    assert report.reconciled == [] and report.left_alive == 1, report.to_dict()
    assert answer(p) == {"ok": True}
    row = effect(u, "s-local")
    assert row.state == "committed" and row.result_snapshot == {"sent": "u1"}
    assert kinds() == ["slow_start", "send"]  # no compensation
    assert u.sessions.get("s-local").state != "halted"


@FAST
def test_a_foreign_process_stopped_past_its_lease_is_taken_over_and_its_late_finish_recorded(worker: Any,
                                                                                            fast: bool) -> None:
    """With the mark deferred (``fast_commit_mark``) the caller had its answer when the mark was queued; the
    deferred mark is fenced by owner as the durable one is, so it does not land, and the late finish is recorded
    all the same (before: the deferred mark was dropped without a trace, the effect left ``compensated``)."""
    p = worker("s-far", host="another-host", fast=fast)
    stop_in_the_tool(p)
    u = worker.app()
    report = u.recover()
    assert [r["outcome"] for r in report.reconciled] == ["compensated"], report.to_dict()
    got = answer(p)
    # The order in the world: the tool started, its compensation ran, then the tool finished.
    assert kinds() == ["slow_start", "cancel", "send"]
    if fast:
        assert got == {"ok": True}  # answered at the queue, before the mark was written
    else:
        assert got["ok"] is False and got["code"] == "outcome_conflict", got
        assert "after its compensation" in got["message"] and "effects resolve" in got["message"]
    row = effect(u, "s-far")
    assert row.state == "unknown" and "finished after compensation" in (row.error or "")
    assert row.result_snapshot == {"sent": "u1"}
    sess = u.sessions.get("s-far")
    assert sess.state == "halted" and "finished after compensation" in (sess.halted_reason or "")
    with u.store.read() as c:
        ev = c.execute(sa.select(t.approval_events).where(t.approval_events.c.action == "effect.finished_late")).one()
    payload = json.loads(ev.payload)
    assert ev.subject == f"effect:{row.effect_id}" and payload["result"] == {"sent": "u1"}
    assert payload["state_before"] == "compensated"
    assert u.verify_audit().ok
    assert u.recover().reconciled == []  # no second compensation: a person decides


def test_an_operator_takes_over_a_local_stopped_process(worker: Any, db: Any) -> None:
    """``undolog recover --take-over EFFECT``: a person's decision for a process that will not come back."""
    p = worker("s-forced")
    stop_in_the_tool(p)
    u = worker.app()
    eid = effect(u, "s-forced").effect_id
    assert u.recover().left_alive == 1
    env = {"UNDOLOG_APP": None, "UNDOLOG_SCHEMA": None, "COLUMNS": "200", "CRASH_LEASE": str(LEASE), **db.env}
    app = ["--app", "tests.support.crash_app:build_default", "recover"]
    r = CliRunner().invoke(cli_app, [*app, "--take-over", eid, "--json"], env=env, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert [x["outcome"] for x in json.loads(r.stdout)["reconciled"]] == ["compensated"]
    got = answer(p)
    assert got["code"] == "outcome_conflict", got
    assert effect(u, "s-forced").state == "unknown"
    missing = CliRunner().invoke(cli_app, [*app, "--take-over", "nope"], env=env, catch_exceptions=False)
    assert missing.exit_code == 1 and "not in flight" in missing.stderr


def test_the_epoch_is_a_fencing_token_one_more_at_every_claim(db: Any) -> None:
    """``current_call().epoch`` beside the key (which stays ``do-{effect_id}``): 1 at a call's first run; a take-over
    claims it with the next one, which its probe carries, so an upstream keeping the highest epoch per key refuses
    the stalled owner's late write."""
    from undolog_core import ToolTier, compensation, current_call, undolog_tool

    seen: list[tuple[str, int, str]] = []

    def probe(ctx: Any) -> bool:
        seen.append(("probe", ctx.epoch, ctx.idempotency_key))
        return False

    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="unfence", probe=probe)
    def fenced(x: int) -> dict[str, int]:
        call = current_call()
        assert call is not None and call.idempotency_key is not None
        seen.append(("run", call.epoch, call.idempotency_key))
        return {"x": x}

    @compensation("unfence")
    def unfence(ctx: Any) -> None:
        seen.append(("undo", 0, ctx.idempotency_key))

    u = db.open()
    u.register(fenced, unfence)
    s = u.session(session_id="s-epoch")
    s.call_sync(fenced, x=1)
    assert seen[0][:2] == ("run", 1) and seen[0][2].startswith("do-")
    d = u.engine.intercept("s-epoch", "fenced", {"x": 2}, call_id="c2")
    assert d.epoch == 1
    u.leases.abandon(d.effect_id)  # as if its process had died (or stalled elsewhere past its lease)
    report = u.recover()
    # Its probe says "did not happen" and its process is gone: settled as not run, nothing compensated.
    assert [r["outcome"] for r in report.reconciled] == ["not_run"]
    assert ("probe", 2, f"do-{d.effect_id}") in seen
    with u.store.read() as c:
        # Never lower than the take-over's claim (settling it as not run may claim it once more).
        assert c.execute(sa.select(t.effect_log.c.epoch).where(t.effect_log.c.effect_id == d.effect_id)).scalar() >= 2
