"""Thin calls into the core for operations whose exact core spelling the routes should not repeat."""

from __future__ import annotations

import dataclasses
from typing import Any


def create_session(
    undolog: Any, *, agent_id: str, session_id: str | None, created_by: str, on_failure: str
) -> str:
    """Create (persist) a session for an HTTP agent and return its id."""
    s = undolog.session(agent_id=agent_id, session_id=session_id, created_by=created_by, on_failure=on_failure)
    ensure = getattr(s, "ensure", None) or getattr(s, "open", None) or getattr(s, "start", None)
    if callable(ensure):
        ensure()
    return str(s.id)


def resume(undolog: Any, session_id: str, *, actor: str, reason: str | None = None) -> None:
    """Un-halt a session after a person looked at it."""
    try:
        undolog.sessions.resume(session_id, actor=actor, reason=reason)
    except TypeError:
        undolog.sessions.resume(session_id, actor=actor)


def revalidate(undolog: Any, session_id: str, *, actor: str) -> Any:
    """Pin the session to the current tool revisions after a contract change; returns what changed."""
    return undolog.sessions.revalidate(session_id, actor=actor)


def verify_audit(undolog: Any) -> dict[str, Any]:
    """Verify the approval events hash chain."""
    fn = getattr(undolog, "verify_audit", None)
    if fn is None:
        audit = getattr(undolog, "audit", None)
        fn = getattr(audit, "verify", None)
    if fn is None:
        from undolog_core import _audit

        report = _audit.verify(undolog.store)
    else:
        report = fn()
    d = dataclasses.asdict(report) if dataclasses.is_dataclass(report) else dict(vars(report))
    ok = bool(d.pop("ok"))
    checked = d.pop("events_checked", None)
    return {"ok": ok, "events_checked": checked, "detail": d or None}
