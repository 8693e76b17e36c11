"""Regression tests for the core's known holes (the issue "Holes in the core"), one section per hole.

Every test drives real objects: a real store (SQLite file or PostgreSQL schema), real subprocesses SIGKILLed at
named fault points (``undolog_core._faults``) for the crash cases. Hole 1's end-to-end LangGraph version is in
``tests/adapters/test_langgraph_halt_blocks_released_call.py``; holes 2 and 3 (connections) are in ``test_connections.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from undolog_core import AwaitingApproval, Execute, errors
from undolog_core.storage import schema as t
from undolog_core.testing import internals

from ..support import crash_app
from ..support.toolkit import setup

ROOT = Path(__file__).resolve().parents[2]

# What a session that is being rolled back (or was) may answer a new call with; the exact class is the fix's.
REFUSED_CODES = {"session_closed", "session_halted", "invalid_session_state"}


# ------------------------------------------------------------------------------------------ hole 1
# A released call (handed back with engine.release(), as the LangGraph adapter does on GraphInterrupt) must not run
# again once its session was rolled back or halted: its re-issue is refused and the tool never runs.


def _approved_and_released(undolog: Any, sid: str, call_id: str, user_id: str) -> str:
    """An IRREVERSIBLE call approved, claimed to run, then handed back by the framework's control flow."""
    w = undolog.engine.intercept(sid, "delete_user_account", {"user_id": user_id}, call_id=call_id)
    assert isinstance(w, AwaitingApproval)
    undolog.approvals.approve(w.approval_request_id, approver="ana")
    d = undolog.engine.intercept(sid, "delete_user_account", {"user_id": user_id}, call_id=call_id)
    assert isinstance(d, Execute)
    undolog.engine.release(d.effect_id)
    return str(d.effect_id)


def _effect_state(undolog: Any, effect_id: str) -> str:
    with internals(undolog).read() as c:
        return str(c.execute(sa.select(t.effect_log.c.state).where(t.effect_log.c.effect_id == effect_id)).scalar_one())


def test_released_irreversible_call_does_not_run_after_rollback(undolog: Any) -> None:
    world, tools = setup(undolog)
    s = undolog.session(agent_id="hole1")
    _approved_and_released(undolog, s.id, "d1", "u1")
    undolog.rollback(s.id)
    assert undolog.sessions.get(s.id).state == "rolled_back"
    with pytest.raises(errors.UndoLogError) as ei:
        s.call_sync(tools["delete_user_account"], user_id="u1", call_id="d1")
    assert ei.value.code in {"session_closed", "approval_cancelled"}, ei.value
    assert world.count("delete") == 0 and "u1" in world.accounts


def test_released_irreversible_call_does_not_run_after_another_request_is_rejected(undolog: Any) -> None:
    world, tools = setup(undolog)
    s = undolog.session(agent_id="hole1")
    _approved_and_released(undolog, s.id, "d1", "u1")
    other = undolog.engine.intercept(s.id, "wire_transfer", {"to": "x", "cents": 5}, call_id="w1")
    undolog.approvals.reject(other.approval_request_id, approver="ana", reason="no")
    assert undolog.sessions.get(s.id).state == "halted"
    with pytest.raises(errors.SessionHalted):
        s.call_sync(tools["delete_user_account"], user_id="u1", call_id="d1")
    assert world.count("delete") == 0 and "u1" in world.accounts


def _compensable_released(undolog: Any, sid: str) -> str:
    d = undolog.engine.intercept(sid, "send_refund_email", {"user_id": "u1", "amount": 5}, call_id="c1")
    assert isinstance(d, Execute)
    undolog.engine.release(d.effect_id)
    return str(d.effect_id)


def test_released_compensable_call_does_not_run_in_a_halted_session(undolog: Any) -> None:
    world, tools = setup(undolog)
    s = undolog.session(agent_id="hole1")
    _compensable_released(undolog, s.id)
    other = undolog.engine.intercept(s.id, "wire_transfer", {"to": "x", "cents": 5}, call_id="w1")
    undolog.approvals.reject(other.approval_request_id, approver="ana", reason="no")
    with pytest.raises(errors.SessionHalted):
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5, call_id="c1")
    assert world.count("send") == 0


def test_released_compensable_call_does_not_run_after_rollback(undolog: Any) -> None:
    world, tools = setup(undolog)
    s = undolog.session(agent_id="hole1")
    effect_id = _compensable_released(undolog, s.id)
    undolog.rollback(s.id)
    # It may have half-happened before it was released: the rollback undid it, once.
    assert world.count("cancel") == 1 and _effect_state(undolog, effect_id) == "compensated"
    with pytest.raises(errors.UndoLogError):
        s.call_sync(tools["send_refund_email"], user_id="u1", amount=5, call_id="c1")
    assert world.count("send") == 0 and world.count("cancel") == 1


# ------------------------------------------------------------------------------------------ crash fixture


@pytest.fixture
def crash(db: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Run tests/support/crash_app.py in a subprocess (optionally armed at a fault point); its world is a log file."""
    state = tmp_path / "world"
    state.mkdir()
    monkeypatch.setenv("CRASH_STATE", str(state))

    def run(*args: str, fault: str | None = None, skip: int = 0) -> tuple[int, str, str]:
        env = {**os.environ, **db.env, "CRASH_STATE": str(state), "PYTHONPATH": str(ROOT)}
        env.pop("UNDOLOG_FAULT", None)
        env.pop("UNDOLOG_FAULT_SKIP", None)
        if fault:
            env["UNDOLOG_FAULT"] = fault
            env["UNDOLOG_FAULT_SKIP"] = str(skip)
        p = subprocess.run([sys.executable, "-m", "tests.support.crash_app", *args], env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
        return p.returncode, p.stdout, p.stderr

    def app() -> Any:
        u = crash_app.build(url=db.url, schema=db.schema)
        db.opened.append(u)
        return u

    run.app = app  # type: ignore[attr-defined]
    return run


def _log(kind: str) -> list[list[Any]]:
    return [c for c in crash_app.calls() if c[0] == kind]


def _effects(u: Any, session_id: str) -> dict[str, str]:
    """call_id -> effect state."""
    with internals(u).read() as c:
        rows = c.execute(sa.select(t.effect_log.c.call_id, t.effect_log.c.state)
                         .where(t.effect_log.c.session_id == session_id)).all()
    return {r.call_id: r.state for r in rows}


# ------------------------------------------------------------------------------------------ hole 4
# A rollback killed between (or inside) its compensation steps is resumed by recover(), and until then the session
# refuses new COMPENSABLE calls: a requested rollback is durable before its first step.


@pytest.mark.parametrize(
    "fault,skip,in_progress",
    [
        ("between_compensations", 0, None),  # u2 compensated and recorded, u1 not claimed yet
        ("during_rollback", 1, None),  # u2 done, u1 claimed, its compensation not called
        ("after_compensation", 0, "u2"),  # u2's compensation returned, its success not recorded
    ],
)
def test_rollback_killed_mid_walk_is_resumed_and_blocks_new_calls(crash: Any, fault: str, skip: int,
                                                                  in_progress: str | None) -> None:
    code, _, err = crash("calls", "s1", "3")  # c0..c2 committed: sends to u0, u1, u2
    assert code == 0, err
    code, _, err = crash("rollback", "s1", fault=fault, skip=skip)
    assert code == -signal.SIGKILL, err
    assert [c[1] for c in _log("cancel")] == ["u2"]  # newest first; killed before u1's compensation was called
    u = crash.app()
    # Half undone: the agent must not keep calling tools in it before recovery finishes the rollback (refusing to
    # resume the session at all is a refusal too).
    with pytest.raises(errors.UndoLogError) as ei:
        u.session(session_id="s1").call_sync("send", user_id="late", call_id="late")
    assert ei.value.code in REFUSED_CODES, ei.value
    assert [c for c in _log("send") if c[1] == "late"] == []
    u.recover()
    assert u.sessions.get("s1").state == "rolled_back"
    cancels = [c[1] for c in _log("cancel")]
    for user in ("u0", "u1", "u2"):
        n = cancels.count(user)
        if user == in_progress:
            assert n in (1, 2), cancels  # the step in flight may be retried, with the same undo key
        else:
            assert n == 1, cancels
    keys = {}
    for c in _log("cancel"):
        keys.setdefault(c[1], set()).add(c[2])
    assert all(len(k) == 1 for k in keys.values()), keys  # a retried step reuses its undo-{id} key
    assert set(_effects(u, "s1").values()) == {"compensated"}
    assert u.recover().reconciled == [] and [c[1] for c in _log("cancel")] == cancels  # nothing runs again


# ------------------------------------------------------------------------------------------ hole 5
# Recovery killed while it settles one in-doubt effect must, on its next run, settle only that effect: it must not
# turn into a rollback of the whole session that nobody asked for.


@pytest.mark.parametrize("fault", ["during_rollback", "during_recovery"])
def test_recovery_killed_mid_settlement_does_not_roll_back_the_session(crash: Any, fault: str) -> None:
    u = crash.app()
    s = u.session(session_id="s1")
    s.call_sync("send", user_id="a0", call_id="a0")
    s.call_sync("send", user_id="a1", call_id="a1")
    code, _, err = crash("call", "s1", "send", fault="after_prewrite")  # c1 for u1: pre-written, never ran
    assert code == -signal.SIGKILL, err
    assert _effects(u, "s1") == {"a0": "committed", "a1": "committed", "c1": "pending"}
    code, _, err = crash("recover", "x", fault=fault)
    assert code == -signal.SIGKILL, err
    u.recover()
    assert _effects(u, "s1") == {"a0": "committed", "a1": "committed", "c1": "compensated"}
    assert [c[1] for c in _log("cancel")] == ["u1"]  # only the in-doubt effect; a0 and a1 never undone
    assert u.sessions.get("s1").state == "halted"  # for a person to review, not rolled back


# ------------------------------------------------------------------------------------------ imports


def test_import_loads_no_web_or_agent_framework() -> None:
    heavy = ["fastapi", "starlette", "uvicorn", "jinja2", "httpx", "langgraph", "langchain", "langchain_core",
             "crewai", "semantic_kernel"]
    code = (
        "import json, sys; import undolog_core; "
        f"heavy = {heavy!r}; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & set(heavy))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    assert json.loads(out.stdout) == []
