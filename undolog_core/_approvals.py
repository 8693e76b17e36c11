"""Human approvals: decisions are recorded here; the tool runs when the caller re-issues the call."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import _schema as t
from ._audit import append_event
from ._store import utcnow
from ._tools import build_args_model, canonical_json, sha256_hex
from .errors import ApprovalAlreadyDecided, ApprovalNotFound, ArgumentsInvalid, UndoLogError

if TYPE_CHECKING:
    from ._undolog import UndoLog


@dataclass(frozen=True)
class ApprovalRecord:
    """One approval request, as a person sees it."""

    approval_request_id: str
    effect_id: str
    session_id: str
    call_id: str
    tool_name: str
    tool_revision: int
    proposed_args: dict[str, Any]
    approved_args: dict[str, Any] | None
    reason: str | None
    risk_tags: list[str]
    agent_context: list[dict[str, Any]]
    state: str
    timeout_at: dt.datetime
    created_at: dt.datetime
    decided_at: dt.datetime | None
    decided_by: str | None
    decision_reason: str | None
    action_digest: str

    @property
    def seconds_left(self) -> float:
        return max(0.0, (self.timeout_at - utcnow()).total_seconds())

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        for k in ("timeout_at", "created_at", "decided_at"):
            d[k] = d[k].isoformat() if d[k] else None
        d["seconds_left"] = self.seconds_left if self.state == "pending" else 0.0
        return d


@dataclass(frozen=True)
class ApprovalEvent:
    event_id: int
    approval_request_id: str | None
    action: str
    actor: str
    payload: dict[str, Any]
    created_at: dt.datetime
    prev_hash: str
    hash: str


def _record(row: Any) -> ApprovalRecord:
    return ApprovalRecord(
        approval_request_id=row.approval_request_id,
        effect_id=row.effect_id,
        session_id=row.session_id,
        call_id=row.call_id,
        tool_name=row.tool_name,
        tool_revision=row.tool_revision,
        proposed_args=row.proposed_args,
        approved_args=row.approved_args,
        reason=row.reason,
        risk_tags=list(row.risk_tags or []),
        agent_context=list(row.agent_context or []),
        state=row.state,
        timeout_at=row.timeout_at,
        created_at=row.created_at,
        decided_at=row.decided_at,
        decided_by=row.decided_by,
        decision_reason=row.decision_reason,
        action_digest=row.action_digest,
    )


class ApprovalService:
    """Decide approval requests from code, the CLI or the server.

    Example:
        >>> for req in undolog.approvals.pending():
        ...     undolog.approvals.approve(req.approval_request_id, approver="ana")
    """

    def __init__(self, undolog: UndoLog) -> None:
        self._u = undolog

    @property
    def _store(self) -> Any:
        return self._u.store

    # -- reading -------------------------------------------------------------------------------------

    def pending(
        self,
        session_id: str | None = None,
        *,
        tool_name: str | None = None,
        risk_tag: str | None = None,
    ) -> builtins.list[ApprovalRecord]:
        """Pending requests, newest first. Requests past their timeout are expired first."""
        self.expire_due()
        return self.list(state="pending", session_id=session_id, tool_name=tool_name, risk_tag=risk_tag)

    def list(
        self,
        *,
        state: str | None = None,
        session_id: str | None = None,
        tool_name: str | None = None,
        risk_tag: str | None = None,
        limit: int = 500,
        offset: int = 0,
    ) -> builtins.list[ApprovalRecord]:
        """Requests newest first, without expiring any (a read only; :meth:`pending` expires first).

        ``offset`` skips that many of the matching requests (paging). The risk tag filter runs in Python
        (the tags are a JSON list, queried differently by the two databases), after the page is read.

        Example:
            >>> undolog.approvals.list(state="pending", tool_name="delete_user_account", limit=50, offset=50)
        """
        r = t.approval_requests
        q = sa.select(r).order_by(r.c.created_at.desc(), r.c.approval_request_id.desc()).limit(limit).offset(offset)
        if state:
            if state not in t.REQUEST_STATES:
                raise UndoLogError(f"unknown approval state {state!r}; known: {', '.join(t.REQUEST_STATES)}")
            q = q.where(r.c.state == state)
        if session_id:
            q = q.where(r.c.session_id == session_id)
        if tool_name:
            q = q.where(r.c.tool_name == tool_name)
        with self._store.read() as conn:
            rows = [_record(x) for x in conn.execute(q)]
        if risk_tag:
            rows = [x for x in rows if risk_tag in x.risk_tags]
        return rows

    def get(self, approval_request_id: str) -> ApprovalRecord:
        """One request; a pending request past its timeout is expired on read."""
        rec = self._get(approval_request_id)
        if rec.state == "pending" and rec.timeout_at <= utcnow():
            self.expire([approval_request_id])
            rec = self._get(approval_request_id)
        return rec

    def _get(self, approval_request_id: str) -> ApprovalRecord:
        with self._store.read() as conn:
            row = conn.execute(
                sa.select(t.approval_requests).where(t.approval_requests.c.approval_request_id == approval_request_id)
            ).first()
        if row is None:
            raise ApprovalNotFound(approval_request_id)
        return _record(row)

    def find_for_call(self, session_id: str, tool_name: str, args: Mapping[str, Any]) -> ApprovalRecord | None:
        """The newest request of this session for the same (tool, canonical arguments), in any state.

        Matches the proposed arguments or the approved (modified) ones; a rejected or timed-out request is
        returned too, so an adapter can tell the agent the truth again.
        """
        spec = self._u.registry.tools.get(tool_name)
        values = spec.snapshot(spec.validate(args)) if spec else dict(args)
        digest = sha256_hex(canonical_json(values))
        for rec in self.list(session_id=session_id, tool_name=tool_name, limit=200):
            if sha256_hex(canonical_json(rec.proposed_args)) == digest:
                return self.get(rec.approval_request_id)
            if rec.approved_args is not None and sha256_hex(canonical_json(rec.approved_args)) == digest:
                return self.get(rec.approval_request_id)
        return None

    def events(self, approval_request_id: str) -> builtins.list[ApprovalEvent]:
        import json

        self._get(approval_request_id)
        e = t.approval_events
        with self._store.read() as conn:
            rows = conn.execute(
                sa.select(e).where(e.c.approval_request_id == approval_request_id).order_by(e.c.event_id)
            ).all()
        return [
            ApprovalEvent(r.event_id, r.approval_request_id, r.action, r.actor, json.loads(r.payload), r.created_at,
                          r.prev_hash, r.hash)
            for r in rows
        ]

    # -- deciding ------------------------------------------------------------------------------------

    def approve(self, approval_request_id: str, *, approver: str, reason: str | None = None) -> ApprovalRecord:
        """Approve as proposed. The tool runs when the agent re-issues the same call."""
        return self._decide(approval_request_id, approver, "approve", reason=reason)

    def modify(
        self, approval_request_id: str, *, approver: str, args: Mapping[str, Any], reason: str | None = None
    ) -> ApprovalRecord:
        """Approve with edited arguments, validated against the tool's schema (a bad edit names the field)."""
        if not isinstance(args, Mapping):
            raise ArgumentsInvalid("<unknown>", [{"loc": [], "msg": "edited arguments must be a JSON object"}])
        return self._decide(approval_request_id, approver, "modify", reason=reason, args=dict(args))

    def reject(self, approval_request_id: str, *, approver: str, reason: str) -> ApprovalRecord:
        """Reject: the call never runs, the session halts and its other pending requests are cancelled."""
        return self._decide(approval_request_id, approver, "reject", reason=reason)

    def _validate_edit(self, conn: Connection, req: Any, args: dict[str, Any]) -> dict[str, Any]:
        spec = self._u.registry.tools.get(req.tool_name)
        if spec is not None and spec.revision == req.tool_revision:
            validated: dict[str, Any] = spec.snapshot(spec.validate(args))
            return validated
        # This process (a CLI, a server) does not have the tool loaded: validate against the stored contract.
        contract = conn.execute(
            sa.select(t.tool_registry.c.contract).where(
                t.tool_registry.c.tool_name == req.tool_name, t.tool_registry.c.revision == req.tool_revision
            )
        ).scalar()
        if contract is None:
            raise UndoLogError(f"the contract of {req.tool_name!r} revision {req.tool_revision} is not in the registry")
        model = build_args_model(req.tool_name, None, contract["args_schema"])
        try:
            return dict(model.model_validate(args).model_dump(mode="json", exclude_unset=True))
        except Exception as exc:
            import pydantic

            if isinstance(exc, pydantic.ValidationError):
                raise ArgumentsInvalid(
                    req.tool_name, [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
                ) from None
            raise

    def _decide(
        self,
        approval_request_id: str,
        approver: str,
        action: str,
        *,
        reason: str | None = None,
        args: dict[str, Any] | None = None,
    ) -> ApprovalRecord:
        if not approver or not str(approver).strip():
            raise UndoLogError("a decision needs the approver's identity (approver=...)")
        if action == "reject" and not (reason and reason.strip()):
            raise UndoLogError("a rejection needs a reason")
        # Expire first, so a decision that arrives after the deadline is refused, not silently applied.
        self.get(approval_request_id)
        r = t.approval_requests
        now = utcnow()
        with self._store.tx() as conn:
            req = conn.execute(
                self._store.for_update(sa.select(r).where(r.c.approval_request_id == approval_request_id))
            ).first()
            if req is None:
                raise ApprovalNotFound(approval_request_id)
            if req.state != "pending":
                raise ApprovalAlreadyDecided(approval_request_id, req.state)
            payload: dict[str, Any] = {"reason": reason}
            if action in ("approve", "modify"):
                approved = req.proposed_args if action == "approve" else self._validate_edit(conn, req, args or {})
                approved_digest = sha256_hex(canonical_json(approved))
                if action == "modify":
                    payload["args"] = approved
                    payload["proposed_args"] = req.proposed_args
                conn.execute(
                    r.update()
                    .where(r.c.approval_request_id == approval_request_id, r.c.state == "pending")
                    .values(state="approved", approved_args=approved, approved_digest=approved_digest,
                            decided_at=now, decided_by=approver, decision_reason=reason)
                )
                conn.execute(
                    t.effect_log.update()
                    .where(t.effect_log.c.effect_id == req.effect_id, t.effect_log.c.state == "awaiting_approval")
                    .values(state="approved", updated_at=now)
                )
                decided = "approved"
            else:
                conn.execute(
                    r.update()
                    .where(r.c.approval_request_id == approval_request_id, r.c.state == "pending")
                    .values(state="rejected", decided_at=now, decided_by=approver, decision_reason=reason)
                )
                conn.execute(
                    t.effect_log.update()
                    .where(t.effect_log.c.effect_id == req.effect_id)
                    .values(state="rejected", error=f"rejected by {approver}: {reason}", updated_at=now)
                )
                decided = "rejected"
            out = {
                "approval_request_id": approval_request_id,
                "session_id": req.session_id,
                "tool_name": req.tool_name,
                "decision": action,
                "state": decided,
                "approver": approver,
                "reason": reason,
            }
            append_event(
                conn, self._store, subject=f"approval:{approval_request_id}", approval_request_id=approval_request_id,
                action=action, actor=approver, payload=payload, outbox=[("approval.decided", out)], now=now,
            )
            if action == "reject":
                why = f"approval {approval_request_id} ({req.tool_name}) rejected by {approver}: {reason}"
                self._cancel_others(conn, req.session_id, approval_request_id, why, now)
                self._u.engine.halt(conn, req.session_id, why, now=now)
            else:
                self._u.engine.refresh_awaiting(conn, req.session_id, now=now)
        return self._get(approval_request_id)

    def _cancel_others(self, conn: Connection, session_id: str, except_id: str | None, why: str, now: dt.datetime) -> None:
        r = t.approval_requests
        q = sa.select(r.c.approval_request_id, r.c.effect_id).where(r.c.session_id == session_id, r.c.state == "pending")
        if except_id:
            q = q.where(r.c.approval_request_id != except_id)
        for other in conn.execute(self._store.for_update(q)).all():
            self.cancel(conn, other.approval_request_id, other.effect_id, why, now)

    def cancel(self, conn: Connection, request_id: str, effect_id: str, why: str, now: dt.datetime) -> None:
        r = t.approval_requests
        res = conn.execute(
            r.update()
            .where(r.c.approval_request_id == request_id, r.c.state.in_(("pending", "approved", "auto_approved")))
            .values(state="cancelled", decided_at=now, decided_by="undolog", decision_reason=why)
        )
        if res.rowcount == 0:
            return
        # A released call (handed back by a framework mid-run, not re-issued yet) is cancelled with its request:
        # its re-issue must not run it in a session that has stopped.
        conn.execute(
            t.effect_log.update()
            .where(t.effect_log.c.effect_id == effect_id,
                   t.effect_log.c.state.in_(("awaiting_approval", "approved", "released")))
            .values(state="cancelled", error=why, updated_at=now)
        )
        append_event(
            conn, self._store, subject=f"approval:{request_id}", approval_request_id=request_id, action="cancel",
            actor="undolog", payload={"reason": why}, now=now,
        )

    # -- timeouts ------------------------------------------------------------------------------------

    def expire_due(self, now: dt.datetime | None = None) -> builtins.list[str]:
        """Apply the timeout to every pending request past ``timeout_at``; returns their ids.

        Several processes may call it at once: on PostgreSQL rows are claimed with SKIP LOCKED, and each
        request's state change is conditional, so each timeout is applied exactly once.
        """
        now = now or utcnow()
        r = t.approval_requests
        with self._store.read() as conn:
            due: builtins.list[str] = list(conn.execute(
                sa.select(r.c.approval_request_id).where(r.c.state == "pending", r.c.timeout_at <= now)
            ).scalars().all())
        return self.expire(due, now=now) if due else []

    def expire(self, ids: Iterable[str], *, now: dt.datetime | None = None) -> builtins.list[str]:
        now = now or utcnow()
        done: builtins.list[str] = []
        r = t.approval_requests
        for rid in ids:
            with self._store.tx() as conn:
                req = conn.execute(
                    self._store.for_update(
                        sa.select(r).where(r.c.approval_request_id == rid, r.c.state == "pending", r.c.timeout_at <= now),
                        skip_locked=True,
                    )
                ).first()
                if req is None:
                    continue
                policy = self._u.policy.read(conn)
                base = {"approval_request_id": rid, "session_id": req.session_id, "tool_name": req.tool_name,
                        "timeout_at": req.timeout_at.isoformat()}
                if policy.auto_approve_on_timeout:
                    conn.execute(
                        r.update().where(r.c.approval_request_id == rid, r.c.state == "pending").values(
                            state="auto_approved", approved_args=req.proposed_args,
                            approved_digest=sha256_hex(canonical_json(req.proposed_args)),
                            decided_at=now, decided_by="undolog:timeout-policy",
                            decision_reason="auto-approved on timeout by org policy",
                        )
                    )
                    conn.execute(
                        t.effect_log.update()
                        .where(t.effect_log.c.effect_id == req.effect_id, t.effect_log.c.state == "awaiting_approval")
                        .values(state="approved", updated_at=now)
                    )
                    append_event(
                        conn, self._store, subject=f"approval:{rid}", approval_request_id=rid, action="auto_approve",
                        actor="undolog:timeout-policy", payload={"policy": "auto_approve_on_timeout"},
                        outbox=[("approval.timed_out", {**base, "outcome": "auto_approved"}),
                                ("approval.decided", {**base, "state": "auto_approved", "decision": "auto_approve"})],
                        now=now,
                    )
                    self._u.engine.refresh_awaiting(conn, req.session_id, now=now)
                else:
                    conn.execute(
                        r.update().where(r.c.approval_request_id == rid, r.c.state == "pending").values(
                            state="timed_out", decided_at=now, decided_by="undolog:timeout",
                            decision_reason="no decision before timeout_at",
                        )
                    )
                    conn.execute(
                        t.effect_log.update()
                        .where(t.effect_log.c.effect_id == req.effect_id)
                        .values(state="timed_out", error="approval timed out", updated_at=now)
                    )
                    append_event(
                        conn, self._store, subject=f"approval:{rid}", approval_request_id=rid, action="timeout",
                        actor="undolog:timeout", payload={"timeout_at": req.timeout_at.isoformat()},
                        outbox=[("approval.timed_out", {**base, "outcome": "timed_out"})], now=now,
                    )
                    why = f"approval {rid} ({req.tool_name}) timed out without a decision"
                    self._cancel_others(conn, req.session_id, rid, why, now)
                    self._u.engine.halt(conn, req.session_id, why, now=now)
                done.append(rid)
        return done
