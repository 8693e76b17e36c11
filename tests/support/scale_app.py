"""An app the many-process tests run in subprocesses: its compensations append to a log file (O_APPEND, one
line per write), which survives the processes and shows how often each ran.

    python -m tests.support.scale_app seed N        # pre-write N COMPENSABLE calls, then die by SIGKILL
    python -m tests.support.scale_app sweep         # wait for $SCALE_GO, then recover(), expire_due() and lapse_due() once
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from undolog_core import ToolTier, UndoLog, compensation, undolog_tool
from undolog_core._driver import Execute


def _log(entry: dict[str, Any]) -> None:
    fd = os.open(Path(os.environ["SCALE_STATE"]) / "runs.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(entry) + "\n").encode())
    finally:
        os.close(fd)


def runs() -> list[dict[str, Any]]:
    p = Path(os.environ["SCALE_STATE"]) / "runs.log"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="scale_undo")
def scale_charge(n: int) -> dict[str, Any]:
    return {"charged": n}


@compensation("scale_undo")
def scale_undo(ctx: Any) -> None:
    _log({"pid": os.getpid(), "key": ctx.idempotency_key})


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="closes an account")
def scale_close(n: int) -> dict[str, Any]:
    return {"closed": n}


def open_app() -> UndoLog:
    u = UndoLog.open(os.environ["UNDOLOG_DATABASE_URL"], schema=os.environ.get("UNDOLOG_SCHEMA") or None)
    u.register(scale_charge, scale_undo, scale_close)
    return u


def seed(n: int, per_session: int = 3) -> None:
    u = open_app()
    sid = ""
    for i in range(n):
        if i % per_session == 0:
            sid = u.session(agent_id=f"crashed-{i}").id
        d = u.driver.decide(sid, "scale_charge", {"n": i}, call_id=f"c{i}")
        assert isinstance(d, Execute), d
    os.kill(os.getpid(), signal.SIGKILL)


def sweep() -> None:
    u = open_app()
    go = Path(os.environ["SCALE_GO"])
    while not go.exists():
        time.sleep(0.005)
    report = u.recover()
    expired = u.approvals.expire_due()
    lapsed = u.approvals.lapse_due()
    print(json.dumps({"reconciled": [r["effect_id"] for r in report.reconciled], "errors": report.errors,
                      "expired": expired, "lapsed": lapsed}))
    u.close()


if __name__ == "__main__":
    if sys.argv[1] == "seed":
        seed(int(sys.argv[2]))
    else:
        sweep()
