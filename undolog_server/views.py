"""Read-only queries over the core's tables for listings the core API does not offer.

Writes always go through the core API; these reads only shape what the API and the
dashboard show (timelines, undo plans, filtered listings).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from undolog_core import UndoLog
from undolog_core.errors import ApprovalNotFound, SessionNotFound

from .storage import ApiKey, ApproverGroup, utcnow


def approval_dict(row: Any) -> dict[str, Any]:
    """Turn an ApprovalRecord (or a dict of one) into a plain dict with ``seconds_left``."""
    if isinstance(row, dict):
        d = dict(row)
    else:
        d = {k: getattr(row, k) for k in _APPROVAL_FIELDS if hasattr(row, k)}
    timeout_at = d.get("timeout_at")
    if d.get("state") == "pending" and isinstance(timeout_at, datetime):
        d["seconds_left"] = max(0.0, (timeout_at - utcnow()).total_seconds())
    else:
        d["seconds_left"] = None
    d["risk_tags"] = list(d.get("risk_tags") or [])
    return d


_APPROVAL_FIELDS = (
    "approval_request_id",
    "effect_id",
    "session_id",
    "call_id",
    "tool_name",
    "tool_revision",
    "proposed_args",
    "approved_args",
    "reason",
    "risk_tags",
    "agent_context",
    "state",
    "timeout_at",
    "created_at",
    "decided_at",
    "decided_by",
    "decision_reason",
    "action_digest",
)


def groups_for(groups: Sequence[ApproverGroup], tool_name: str, risk_tags: Sequence[str]) -> list[str]:
    """Names of the approver groups a request is routed to (empty: every approver)."""
    return [g.name for g in groups if g.matches(tool_name, risk_tags)]


def may_see(key: ApiKey, request_groups: Sequence[str]) -> bool:
    """Whether a key may see and decide a request routed to ``request_groups``."""
    if "admin" in key.roles:
        return True
    if "approver" not in key.roles:
        return False
    return not request_groups or bool(key.groups & set(request_groups))


class CoreViews:
    """Listings over the core's public read API, shaped as plain dicts for the routes and templates.

    Args:
        undolog: The served UndoLog.
    """

    def __init__(self, undolog: UndoLog) -> None:
        self.undolog = undolog

    def approvals(
        self,
        *,
        state: str | None = None,
        session_id: str | None = None,
        tool_name: str | None = None,
        risk_tag: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[dict[str, Any]]:
        """List approval requests, newest first (never expiring any: a read only), their arguments as previews."""
        a = self.undolog.approvals
        if risk_tag is None:
            recs = a.list(state=state, session_id=session_id, tool_name=tool_name, limit=limit, offset=offset,
                          brief=True)
            return [approval_dict(r) for r in recs]
        # The core filters tags after reading a page, so page over the matches here.
        out: list[dict[str, Any]] = []
        skipped, db_offset, batch = 0, 0, 500
        while len(out) < limit:
            recs = a.list(state=state, session_id=session_id, tool_name=tool_name, limit=batch, offset=db_offset,
                          brief=True)
            for r in recs:
                if risk_tag not in r.risk_tags:
                    continue
                if skipped < offset:
                    skipped += 1
                    continue
                out.append(approval_dict(r))
                if len(out) >= limit:
                    break
            if len(recs) < batch:
                break
            db_offset += batch
        return out

    def effects(self, session_id: str, *, limit: int | None = None, newest_first: bool = False) -> list[dict[str, Any]]:
        """The session's effect timeline, each effect with its undo entry (if any)."""
        try:
            rows = self.undolog.sessions.effects(session_id)
        except SessionNotFound:
            return []
        if newest_first:
            rows.reverse()
        return rows[:limit] if limit is not None else rows

    def undo_plan(self, session_id: str) -> list[dict[str, Any]]:
        """The compensations a rollback would run now, in the order it would run them (LIFO)."""
        return self.undolog.saga.undo_plan(session_id)

    def sessions(
        self,
        *,
        state: str | None = None,
        agent_id: str | None = None,
        created_by: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[dict[str, Any]]:
        recs = self.undolog.sessions.list(
            state=state, agent_id=agent_id, created_by=created_by, limit=limit, offset=offset
        )
        return [dict(r.__dict__) for r in recs]

    def session_row(self, session_id: str) -> dict[str, Any] | None:
        try:
            return dict(self.undolog.sessions.get(session_id).__dict__)
        except SessionNotFound:
            return None

    def approval_row(self, approval_request_id: str) -> dict[str, Any] | None:
        """One request, with ``session_created_by`` (who created its session).

        Read with ``approvals.get``, which applies a timeout that is due (as every read of a request does).
        """
        try:
            rec = self.undolog.approvals.get(approval_request_id)
        except ApprovalNotFound:
            return None
        d = approval_dict(rec)
        session = self.session_row(rec.session_id)
        d["session_created_by"] = session["created_by"] if session else None
        return d

    def tools(self, name: str | None = None) -> list[dict[str, Any]]:
        """Registry rows, newest revision first within each tool."""
        rows = self.undolog.registry.history(name)
        rows.sort(key=lambda r: (r["tool_name"], -int(r["revision"])))
        return rows

    def pending_approvals(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Pending requests, newest first."""
        recs = self.undolog.approvals.list(state="pending", limit=limit if limit is not None else 10_000, brief=True)
        return [approval_dict(r) for r in recs]
