"""One client process of the history checker (``tests/faults/histories.py``): runs short histories (one session
each) against a shared database, and appends what happened outside the product to the history file.

    python -m tests.faults.history_worker WORKER SEED [SEED ...]

Every line is written with one ``write(2)`` on an O_APPEND file, so a line written before a SIGKILL survives it and
lines of concurrent processes never interleave: ``run_start`` / ``run_end`` (the tool, with its effect and epoch),
``comp`` (a compensation, with its undo key), ``answer`` (what the caller got: ok, or the error's code),
``rollback`` (the client asked for its session's rollback). The worker's faults come from the environment:
``UNDOLOG_FAULT`` (SIGKILL at that fault point, after ``UNDOLOG_FAULT_SKIP`` passes) and ``UNDOLOG_HOST_ID`` (the
owner looks foreign); the driver stops it (SIGSTOP/SIGCONT) from outside.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

from undolog_core import ToolTier, UndoLog, UndoLogError, compensation, current_call, undolog_tool

LEASE = 1.0


def note(kind: str, **fields: Any) -> None:
    line = (json.dumps({"kind": kind, "pid": os.getpid(), "t": time.time(), **fields}) + "\n").encode()
    fd = os.open(os.environ["HISTORY_FILE"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="h_unsend")
def h_send(n: int, pause: float) -> dict[str, Any]:
    call = current_call()
    assert call is not None
    note("run_start", effect=call.effect_id, session=call.session_id, epoch=call.epoch, pause=pause)
    if pause:
        time.sleep(pause)  # the window the driver stops the process in
    note("run_end", effect=call.effect_id, session=call.session_id, epoch=call.epoch)
    return {"n": n}


@compensation("h_unsend")
def h_unsend(ctx: Any) -> None:
    note("comp", effect=ctx.effect_id, session=ctx.session_id, key=ctx.idempotency_key)


def build(**kw: Any) -> UndoLog:
    u = UndoLog.open(**kw)
    u.register(h_send, h_unsend)
    return u


def history(u: UndoLog, seed: int) -> None:
    """One short history: a session of 1-4 calls, some slow, sometimes rolled back by its client."""
    rng = random.Random(seed)
    sid = f"h{seed}"
    s = u.session(session_id=sid)
    for i in range(rng.randint(1, 4)):
        pause = 0.6 if os.environ.get("HISTORY_ALL_SLOW") or rng.random() < 0.3 else 0.0
        try:
            s.call_sync("h_send", n=i, pause=pause, call_id=f"c{i}")
            note("answer", session=sid, call=f"c{i}", ok=True)
        except UndoLogError as exc:
            note("answer", session=sid, call=f"c{i}", ok=False, code=exc.code)
            return
    if rng.random() < 0.3:
        note("rollback", session=sid)
        try:
            s.rollback_sync(actor="client")
        except UndoLogError as exc:
            note("rollback_refused", session=sid, code=exc.code)
        return
    try:
        s.complete()
    except UndoLogError:
        pass  # halted meanwhile (a take-over, a late finish): the history says so


def main(argv: list[str]) -> None:
    worker, seeds = argv[0], [int(x) for x in argv[1:]]
    u = build(url=os.environ["UNDOLOG_DATABASE_URL"], schema=os.environ.get("UNDOLOG_SCHEMA") or None,
              lease_seconds=LEASE)
    if worker == "recover":  # another process's recover(), as the driver asks for it
        seen = [(r.effect_id, r.owner, str(r.lease_until)) for r in u.store.in_flight().effects]
        report = u.recover()
        note("recovered", reconciled=report.reconciled, left_alive=report.left_alive, in_flight=seen)
        u.close()
        return
    note("worker", worker=worker, host=os.environ.get("UNDOLOG_HOST_ID"))
    for seed in seeds:
        note("history", seed=seed)
        history(u, seed)
        note("done", seed=seed)
    u.close()


if __name__ == "__main__":
    main(sys.argv[1:])
