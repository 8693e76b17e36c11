"""An app run in subprocesses by the crash tests. Its outside world is a log file, so it survives SIGKILL.

    python -m tests.support.crash_app MODE SESSION_ID [ARG]
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from undolog_core import ToolTier, UndoLog, UndoLogError, compensation, current_call, undolog_tool


def _log_path() -> Path:
    return Path(os.environ["CRASH_STATE"]) / "calls.log"


def log(*entry: Any) -> None:
    with open(_log_path(), "a") as fh:
        fh.write(json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def calls() -> list[list[Any]]:
    p = _log_path()
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _happened(key: str) -> Any:
    for c in calls():
        if c[0] in ("send", "delete") and c[-1] == key:
            return {"replayed_from_probe": key}
    return False


def probe(ctx: Any) -> Any:
    return _happened(ctx.idempotency_key)


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="cancel_send")
def send(user_id: str) -> dict[str, Any]:
    log("send", user_id, current_call().idempotency_key)  # type: ignore[union-attr]
    return {"sent": user_id}


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="cancel_send", probe=probe)
def send_probed(user_id: str) -> dict[str, Any]:
    log("send", user_id, current_call().idempotency_key)  # type: ignore[union-attr]
    return {"sent": user_id}


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="cancel_send")
def slow_send(user_id: str, seconds: float) -> dict[str, Any]:
    log("slow_start", user_id)
    time.sleep(seconds)
    log("send", user_id, current_call().idempotency_key)  # type: ignore[union-attr]
    return {"sent": user_id}


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation="cancel_send")
def send_fails(user_id: str) -> dict[str, Any]:
    """Half-sends (its world changed), then fails: the session's policy rolls it back, this call included."""
    log("send", user_id, current_call().idempotency_key)  # type: ignore[union-attr]
    raise RuntimeError("smtp exploded mid-send")


@compensation("cancel_send")
def cancel_send(ctx: Any) -> None:
    if os.environ.get("CRASH_CANCEL_FAILS"):
        raise RuntimeError("cancel keeps failing")
    log("cancel", ctx.args["user_id"], ctx.idempotency_key)


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="gone for good")
def delete(user_id: str) -> dict[str, Any]:
    log("delete", user_id, current_call().idempotency_key)  # type: ignore[union-attr]
    return {"deleted": user_id}


@undolog_tool(tier=ToolTier.IRREVERSIBLE, reason="gone for good", probe=probe)
def delete_probed(user_id: str) -> dict[str, Any]:
    log("delete", user_id, current_call().idempotency_key)  # type: ignore[union-attr]
    return {"deleted": user_id}


def build(**kw: Any) -> UndoLog:
    u = UndoLog.open(**kw)
    u.register(send, send_probed, slow_send, send_fails, cancel_send, delete, delete_probed)
    return u


def build_default() -> UndoLog:
    """The app on ``UNDOLOG_DATABASE_URL`` / ``UNDOLOG_SCHEMA`` with ``CRASH_LEASE`` (for ``--app``)."""
    return build(url=os.environ["UNDOLOG_DATABASE_URL"], schema=os.environ.get("UNDOLOG_SCHEMA") or None,
                 lease_seconds=float(os.environ.get("CRASH_LEASE", "30")))


def main(argv: list[str]) -> None:
    mode, session_id = argv[0], argv[1]
    u = build(lease_seconds=float(os.environ.get("CRASH_LEASE", "30")),
              fast_commit_mark=bool(os.environ.get("CRASH_FAST_MARK")))
    s = u.session(session_id=session_id)
    if mode == "call":
        s.call_sync(argv[2], user_id="u1", call_id="c1")
    elif mode == "calls":
        for i in range(int(argv[2])):
            s.call_sync("send", user_id=f"u{i}", call_id=f"c{i}")
        print("ready", flush=True)
    elif mode == "send_then_fail":
        s.call_sync("send", user_id="u0", call_id="c0")
        try:
            s.call_sync("send_fails", user_id="u1", call_id="c1")
        except RuntimeError:
            pass
    elif mode == "send_then_report_failure":  # a caller that runs the tool itself reports its failure
        s.call_sync("send", user_id="u0", call_id="c0")
        d = u.driver.decide(session_id, "send", {"user_id": "u1"}, call_id="c1")
        log("send", "u1", d.idempotency_key)
        u.driver.fail(d.effect_id, "the upstream said 500")
    elif mode == "slow":
        s.call_sync("slow_send", user_id="u1", seconds=float(argv[2]), call_id="slow")
    elif mode == "slow_answer":  # a slow call whose answer (ok, or the error's code) the caller prints
        try:
            s.call_sync("slow_send", user_id="u1", seconds=float(argv[2]), call_id="slow")
            print(json.dumps({"ok": True}), flush=True)
        except UndoLogError as exc:
            print(json.dumps({"ok": False, "code": exc.code, "message": exc.message}), flush=True)
    elif mode == "run_approved":
        s.call_sync(argv[2], user_id="u1", call_id="d1")
    elif mode == "rollback":
        u.rollback(session_id)
    elif mode == "recover":
        print(json.dumps(u.recover().to_dict()), flush=True)
    elif mode == "expire":
        print(json.dumps(u.approvals.expire_due()), flush=True)
    u.close()


if __name__ == "__main__":
    main(sys.argv[1:])
