"""Thin calls into the core's public API for operations several routes share."""

from __future__ import annotations

import dataclasses
from typing import Any

from undolog_core import UndoLog
from undolog_core.integration import persist_session


def create_session(
    undolog: UndoLog, *, agent_id: str, session_id: str | None, created_by: str, on_failure: str
) -> str:
    """Create (persist) a session for an HTTP agent and return its id.

    Written at once: the agent's next request may reach another server process, which knows the session only from
    the store (``undolog.session`` leaves a minted id's row to its first logged call on PostgreSQL)."""
    s = undolog.session(agent_id=agent_id, session_id=session_id, created_by=created_by, on_failure=on_failure)
    persist_session(undolog, s.id)
    return str(s.id)


def resume(undolog: UndoLog, session_id: str, *, actor: str, reason: str | None = None) -> None:
    """Un-halt a session after a person looked at it."""
    undolog.sessions.resume(session_id, actor=actor, reason=reason)


def revalidate(undolog: UndoLog, session_id: str, *, actor: str) -> Any:
    """Pin the session to the current tool revisions after a contract change; returns what changed."""
    return undolog.sessions.revalidate(session_id, actor=actor)


def verify_audit(undolog: UndoLog) -> dict[str, Any]:
    """Verify the approval events hash chain."""
    d = dataclasses.asdict(undolog.verify_audit())
    ok = bool(d.pop("ok"))
    checked = d.pop("events_checked", None)
    return {"ok": ok, "events_checked": checked, "detail": d or None}
