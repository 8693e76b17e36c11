"""The processes of the history checker (``tests/faults/histories.py``): client workers that run short histories
(one session each) against a shared database, and one helper per run (recoveries on demand, and the scripted
approver). Each appends what happened, from outside the product, to the history file.

    python -m tests.faults.history_worker WORKER SEED [SEED ...]
    python -m tests.faults.history_worker recover OFFSET | approver | zygote

Every line is written with one ``write(2)`` on an O_APPEND file, so a line written before a SIGKILL survives it and
lines of concurrent processes never interleave; the file's order is the run's one global order. Lines:

* ``ask``: a client is about to ask for a call (a first ask or a re-ask); ``answer``: what it got (ok, or the
  error's code); ``rollback`` / ``rolled_back``: the client asked for its session's rollback / it returned.
* ``run_start`` / ``run_end``: a tool ran (COMPENSABLE ``h_send`` or IRREVERSIBLE ``h_wire``), with its effect,
  call and epoch; ``comp``: a compensation ran, with its undo key.
* ``waiting``: a client asked for approvals and waits for the approver; ``decided`` / ``decided_all``: the
  scripted approver's decisions, written after each returned (a ``reject`` halts the session: from that line on
  the session's halt is committed).
* ``recovered``: a recovery returned, with the sessions that were halted or rolled back by then.
* ``clock``: the process moved UndoLog's clock (``undolog_core._clock``), never the system's.

Faults come from the environment: ``UNDOLOG_FAULT`` (SIGKILL at that fault point, after ``UNDOLOG_FAULT_SKIP``
passes), ``UNDOLOG_HOST_ID`` (the owner looks foreign), ``HISTORY_CLOCK`` (``SECONDS@K``: jump the clock before the
K-th history); the driver stops the process (SIGSTOP/SIGCONT) and kills its connections from outside.
"""

from __future__ import annotations

import json
import os
import random
import select
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from undolog_core import ToolTier, UndoLog, UndoLogError, _clock, compensation, current_call, undolog_tool

LEASE = 1.0
PAUSE = 0.6  # a slow tool's or compensation's run: the window the driver stops a process in
#: Answers that say the session stopped taking calls: from that line on its halt (or end) is committed.
STOPPED = ("session_halted", "session_closed", "outcome_conflict", "approval_rejected")


def note(kind: str, **fields: Any) -> None:
    line = (json.dumps({"kind": kind, "pid": os.getpid(), "t": time.time(), **fields}) + "\n").encode()
    fd = os.open(os.environ["HISTORY_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


_stalled = False


def _pause(seconds: float, kind: str) -> None:
    """A slow tool's or compensation's run. A stall worker's first pause of the kind its driver stops it in lasts
    until the driver has stopped it, recovered behind it and let it go on (``HISTORY_STALL_GATE`` exists), not a
    fixed ``PAUSE``: on a loaded CI machine the driver saw the pause only after it had ended, the stop missed it,
    and a mutation test's forced stall never reached the guard it removed."""
    global _stalled
    gate = os.environ.get("HISTORY_STALL_GATE")
    stopped_in = "comp" if os.environ.get("HISTORY_FORCE") == "comp" else "run_start"
    if gate and not _stalled and kind == stopped_in:
        _stalled = True
        deadline = time.monotonic() + 60
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return
    time.sleep(seconds)


def _slow(key: str) -> bool:
    """Whether a run pauses: always in the driver's forced runs, else for about a third of them."""
    if os.environ.get("HISTORY_ALL_SLOW"):
        return True
    return random.Random(key).random() < 0.3


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="h_unsend")
def h_send(n: int, pause: float) -> dict[str, Any]:
    call = current_call()
    assert call is not None
    note("run_start", tool="h_send", effect=call.effect_id, session=call.session_id, call=call.call_id,
         epoch=call.epoch, pause=pause)
    if pause:
        _pause(pause, "run_start")
    note("run_end", effect=call.effect_id, session=call.session_id, epoch=call.epoch)
    return {"n": n}


@compensation("h_unsend")
def h_unsend(ctx: Any) -> None:
    # Only a client's own rollback pauses (a helper's recovery must not: the driver waits for it).
    pause = PAUSE if os.environ.get("HISTORY_COMP_PAUSE") and _slow(ctx.idempotency_key + "c") else 0.0
    note("comp", effect=ctx.effect_id, session=ctx.session_id, key=ctx.idempotency_key, pause=pause)
    if pause:
        _pause(pause, "comp")


@undolog_tool(tier=ToolTier.IRREVERSIBLE)
def h_wire(n: int, verdict: str) -> dict[str, Any]:
    """An IRREVERSIBLE call; ``verdict`` is the scripted approver's script (approve or reject)."""
    call = current_call()
    assert call is not None
    note("run_start", tool="h_wire", effect=call.effect_id, session=call.session_id, call=call.call_id,
         epoch=call.epoch, pause=0)
    note("run_end", effect=call.effect_id, session=call.session_id, epoch=call.epoch)
    return {"n": n}


def build(**kw: Any) -> UndoLog:
    u = UndoLog.open(**kw)
    u.register(h_send, h_unsend, h_wire)
    return u


def _ask(s: Any, sid: str, call: str, tool: str, **args: Any) -> str | None:
    """One ask; returns None when done, else the error's code (written to the history either way)."""
    note("ask", session=sid, call=call, tool=tool)
    try:
        s.call_sync(tool, call_id=call, **args)
    except UndoLogError as exc:
        note("answer", session=sid, call=call, ok=False, code=exc.code)
        return exc.code
    note("answer", session=sid, call=call, ok=True)
    return None


def _decided(history: Path, sid: str, deadline: float) -> bool:
    """Whether the approver has decided everything the session waits for (read from the history)."""
    needle = f'"session": "{sid}"'
    while time.monotonic() < deadline:
        for line in history.read_text().splitlines():
            if '"decided_all"' in line and needle in line:
                return True
        time.sleep(0.05)
    return False


def history(u: UndoLog, seed: int) -> None:
    """One short history: a session of 1-4 calls (COMPENSABLE, sometimes IRREVERSIBLE ones waiting for the scripted
    approver), some slow, sometimes rolled back by its client; after a refusal the client sometimes asks again (a
    call asked after its session stopped must never run)."""
    rng = random.Random(seed)
    sid = f"h{seed}"
    for attempt in range(5):
        try:
            s = u.session(session_id=sid)
            break
        except UndoLogError as exc:  # a connection cut under it (pg_terminate_backend): a client asks again
            note("session_refused", session=sid, code=exc.code)
            if exc.code != "database_unavailable" or attempt == 4:
                raise
    forced = os.environ.get("HISTORY_FORCE")
    wires = forced == "wires" or rng.random() < 0.25
    n = 2 if forced in ("wires", "comp") else rng.randint(1, 4)
    stopped = False
    for i in range(n):
        code = _ask(s, sid, f"c{i}", "h_send", n=i, pause=PAUSE if _slow(f"{seed}-{i}") and forced != "comp" else 0.0)
        if code is not None:
            stopped = True
            break
    if wires and not stopped:
        # One or two IRREVERSIBLE asks, then wait for the approver. Two, one approved and one rejected: the approved
        # one's re-ask comes after the reject halted the session, and must be refused.
        verdicts = ["approve", "reject"] if forced == "wires" else (
            [rng.choice(("approve", "approve", "reject"))] + (["reject"] if rng.random() < 0.4 else []))
        asked = []
        for j, verdict in enumerate(verdicts):
            code = _ask(s, sid, f"w{j}", "h_wire", n=j, verdict=verdict)
            if code != "approval_pending":
                stopped = code is not None
                break
            asked.append((f"w{j}", j, verdict))
        if asked:
            note("waiting", session=sid)
            if _decided(Path(os.environ["HISTORY_FILE"]), sid, time.monotonic() + 30):
                for call, j, verdict in asked:
                    code = _ask(s, sid, call, "h_wire", n=j, verdict=verdict)
                    stopped = stopped or code in STOPPED
    if stopped and rng.random() < 0.5:
        _ask(s, sid, "after", "h_send", n=99, pause=0.0)  # asked after the stop: refused, never run
        return
    if stopped:
        return
    if forced == "comp" or rng.random() < 0.3:
        note("rollback", session=sid)
        try:
            s.rollback_sync(actor="client")
        except UndoLogError as exc:
            note("rollback_refused", session=sid, code=exc.code)
            return
        note("rolled_back", session=sid)
        if rng.random() < 0.5:
            _ask(s, sid, "after", "h_send", n=99, pause=0.0)
        return
    try:
        s.complete()
    except UndoLogError:
        pass  # halted meanwhile (a take-over, a late finish): the history says so


def _clock_plan() -> tuple[float, int] | None:
    plan = os.environ.get("HISTORY_CLOCK")
    if not plan:
        return None
    seconds, at = plan.split("@")
    return float(seconds), int(at)


def _stopped_sessions(u: UndoLog) -> list[str]:
    s = sa.table("undolog_sessions", sa.column("session_id"), sa.column("state"))
    with u.store.read() as c:
        return [r.session_id for r in c.execute(
            sa.select(s.c.session_id).where(s.c.state.in_(("halted", "rolling_back", "rolled_back"))))]


def approve_waiting(u: UndoLog, history: Path, handled: set[str]) -> None:
    """The scripted approver, a person outside the product: decides the requests of every session that waits, as
    each call's ``verdict`` says, approvals first (an approved call's re-ask then comes after the reject halted its
    session), and writes each decision after it returned."""
    waiting = []
    for line in history.read_text().splitlines():
        if '"waiting"' in line:
            sid = json.loads(line)["session"]
            if sid not in handled:
                waiting.append(sid)
    for sid in waiting:
        handled.add(sid)
        pending = sorted(u.approvals.pending(session_id=sid), key=lambda r: r.proposed_args["verdict"] != "approve")
        for rec in pending:
            verdict = rec.proposed_args["verdict"]
            try:
                if verdict == "approve":
                    u.approvals.approve(rec.approval_request_id, approver="script")
                else:
                    u.approvals.reject(rec.approval_request_id, approver="script", reason="scripted")
            except UndoLogError as exc:
                note("decide_refused", session=sid, request=rec.approval_request_id, code=exc.code)
                continue
            note("decided", session=sid, request=rec.approval_request_id, effect=rec.effect_id, action=verdict)
        note("decided_all", session=sid)


def recover_once(u: UndoLog, offset: float) -> None:
    """Another process's recover(), with this process's UndoLog clock moved ``offset`` seconds from the system's."""
    _clock.jump(offset)
    seen = [(r.effect_id, r.owner, str(r.lease_until)) for r in u.store.effects.in_flight().effects]
    report = u.recover()
    _clock.reset()
    note("recovered", offset=offset, reconciled=report.reconciled, left_alive=report.left_alive, in_flight=seen,
         errors=report.errors, stopped=_stopped_sessions(u))


def approver(u: UndoLog) -> None:
    """The scripted approver, until the driver creates the stop file (then one last round)."""
    history = Path(os.environ["HISTORY_FILE"])
    stop = Path(os.environ["HISTORY_STOP"])
    handled: set[str] = set()
    while not stop.exists():
        approve_waiting(u, history, handled)
        time.sleep(0.05)
    approve_waiting(u, history, handled)


def main(argv: list[str]) -> None:
    worker, rest = argv[0], argv[1:]
    u = build(url=os.environ["UNDOLOG_DATABASE_URL"], schema=os.environ.get("UNDOLOG_SCHEMA") or None,
              lease_seconds=LEASE)
    if worker == "recover":
        recover_once(u, float(rest[0]))
        u.close()
        return
    if worker == "approver":
        approver(u)
        u.close()
        return
    seeds = [int(x) for x in rest]
    note("worker", worker=worker, host=os.environ.get("UNDOLOG_HOST_ID"))
    jump = _clock_plan()
    for k, seed in enumerate(seeds):
        if jump is not None and k == jump[1]:
            _clock.jump(jump[0])
            note("clock", offset=jump[0])
        note("history", seed=seed)
        history(u, seed)
        note("done", seed=seed)
    try:
        u.close()
    except UndoLogError as exc:  # its last count flush met a cut connection: the history is written already
        note("close_failed", code=exc.code)


def _child(args: list[str], env: dict[str, str], err: str) -> None:
    """A forked worker: its own environment, host id and fault, then :func:`main`. Never returns."""
    code = 1
    try:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.environ.clear()
        os.environ.update(env)
        # What the core reads from the environment at import (the zygote imported it with none of these).
        from undolog_core import _faults
        from undolog_core.storage import base

        base._HOST = env.get(base.HOST_ID_ENV) or socket.gethostname()
        _faults.arm(env.get("UNDOLOG_FAULT") or None, skip=int(env.get("UNDOLOG_FAULT_SKIP", "0") or 0))
        main(args)
        code = 0
    except BaseException:  # noqa: BLE001 - a forked child reports and exits, never returns into the zygote's loop
        traceback.print_exc()
    finally:
        sys.stderr.flush()
        os._exit(code)


def zygote() -> None:
    """Forks the run's processes (``spawn JSON`` on stdin, answered ``pid PID``) after the imports were paid once:
    a fresh interpreter on a loaded CI machine took 5-20 s to import the core, a fork takes milliseconds. Reports
    every child's end as ``exit PID STATUS`` (a negative status: killed by that signal)."""
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    pending = b""
    while True:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            out.write(f"exit {pid} {code}\n")
            out.flush()
        ready, _, _ = select.select([0], [], [], 0.02)
        if not ready:
            continue
        chunk = os.read(0, 1 << 16)  # (not sys.stdin: its buffer would hide a second line from select)
        if not chunk:
            return
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if line.strip() == b"quit":
                return
            cmd = json.loads(line.split(b" ", 1)[1])
            pid = os.fork()
            if pid == 0:
                _child(cmd["args"], cmd["env"], cmd["err"])
            out.write(f"pid {pid}\n")
            out.flush()

if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:
        main(sys.argv[1:])
