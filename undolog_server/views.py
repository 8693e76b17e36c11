"""Read-only queries over the core's tables for listings the core API does not offer.

Writes always go through the core API; these reads only shape what the API and the
dashboard show (timelines, undo plans, filtered listings).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from undolog_core import _schema as s

from .store import ApiKey, ApproverGroup, utcnow

PENDING_UNDO_STATES = ("armed", "compensating", "compensation_failed")


def approval_dict(row: Any) -> dict[str, Any]:
    """Turn an approval row (or ApprovalRecord) into a plain dict with ``seconds_left``."""
    if hasattr(row, "_mapping"):
        d = dict(row._mapping)
    elif isinstance(row, dict):
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
    """Queries over the core tables.

    Args:
        engine: The UndoLog's SQLAlchemy engine.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

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
        """List approval requests, newest first.

        The risk tag filter runs in Python because the tags are a JSON list and the two
        databases query JSON differently; the scan is bounded by ``limit``.
        """
        t = s.approval_requests
        q = sa.select(t).order_by(t.c.created_at.desc(), t.c.approval_request_id.desc())
        if state:
            q = q.where(t.c.state == state)
        if session_id:
            q = q.where(t.c.session_id == session_id)
        if tool_name:
            q = q.where(t.c.tool_name == tool_name)
        out: list[dict[str, Any]] = []
        with self.engine.connect() as conn:
            if risk_tag is None:
                rows = conn.execute(q.limit(limit).offset(offset)).all()
                return [approval_dict(r) for r in rows]
            skipped = 0
            for r in conn.execute(q).yield_per(500):
                if risk_tag not in (r.risk_tags or ()):
                    continue
                if skipped < offset:
                    skipped += 1
                    continue
                out.append(approval_dict(r))
                if len(out) >= limit:
                    break
        return out

    def effects(self, session_id: str, *, limit: int | None = None, newest_first: bool = False) -> list[dict[str, Any]]:
        """The session's effect timeline."""
        t = s.effect_log
        order = (t.c.created_at.desc(), t.c.effect_id.desc()) if newest_first else (t.c.created_at, t.c.effect_id)
        q = sa.select(t).where(t.c.session_id == session_id).order_by(*order)
        if limit is not None:
            q = q.limit(limit)
        u = s.undo_stack
        with self.engine.connect() as conn:
            rows = [dict(r._mapping) for r in conn.execute(q)]
            seqs = [r["seq"] for r in rows]
            undo: dict[str, dict[str, Any]] = {}
            if seqs:
                for row in conn.execute(sa.select(u).where(u.c.undo_id.in_(seqs))):
                    undo[row.effect_id] = dict(row._mapping)
        for r in rows:
            entry = undo.get(r["effect_id"])
            r["compensation_name"] = entry["compensation_name"] if entry else None
            r["undo_state"] = entry["state"] if entry else None
            r["undo_id"] = entry["undo_id"] if entry else None
        return rows

    def undo_plan(self, session_id: str) -> list[dict[str, Any]]:
        """The compensations a rollback would run now, in the order it would run them (LIFO)."""
        u = s.undo_stack
        e = s.effect_log
        q = (
            sa.select(u, e.c.tool_name)
            .join(e, e.c.seq == u.c.undo_id)
            .where(e.c.session_id == session_id, u.c.state.in_(PENDING_UNDO_STATES))
            .order_by(u.c.undo_id.desc())
        )
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def sessions(
        self,
        *,
        state: str | None = None,
        agent_id: str | None = None,
        created_by: str | None = None,
        limit: int = 50,
        offset: int = 0,
    ) -> list[dict[str, Any]]:
        t = s.sessions
        q = sa.select(t).order_by(t.c.created_at.desc(), t.c.session_id).limit(limit).offset(offset)
        if state:
            q = q.where(t.c.state == state)
        if agent_id:
            q = q.where(t.c.agent_id == agent_id)
        if created_by:
            q = q.where(t.c.created_by == created_by)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def session_row(self, session_id: str) -> dict[str, Any] | None:
        t = s.sessions
        with self.engine.connect() as conn:
            r = conn.execute(sa.select(t).where(t.c.session_id == session_id)).first()
        return dict(r._mapping) if r else None

    def approval_row(self, approval_request_id: str) -> dict[str, Any] | None:
        """One request, with ``session_created_by`` (who created its session) joined in."""
        t = s.approval_requests
        q = (
            sa.select(t, s.sessions.c.created_by.label("session_created_by"))
            .select_from(t.outerjoin(s.sessions, s.sessions.c.session_id == t.c.session_id))
            .where(t.c.approval_request_id == approval_request_id)
        )
        with self.engine.connect() as conn:
            r = conn.execute(q).first()
        return approval_dict(r) if r else None

    def tools(self, name: str | None = None) -> list[dict[str, Any]]:
        """Registry rows, newest revision first within each tool."""
        t = s.tool_registry
        q = sa.select(t).order_by(t.c.tool_name, t.c.revision.desc())
        if name is not None:
            q = q.where(t.c.tool_name == name)
        with self.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    def pending_approvals(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Pending requests, newest first."""
        t = s.approval_requests
        q = sa.select(t).where(t.c.state == "pending").order_by(t.c.created_at.desc(), t.c.approval_request_id.desc())
        if limit is not None:
            q = q.limit(limit)
        with self.engine.connect() as conn:
            return [approval_dict(r) for r in conn.execute(q)]
