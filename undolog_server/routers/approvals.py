"""``/v1/approvals``: listing, showing and deciding approval requests, and their event history."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request
from fastapi.types import DecoratedCallable
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_jsonable_python

from undolog_core import errors, limits
from undolog_core.limits import MAX_ID_LENGTH

from ..auth import AuthFirstRoute, server_state
from ..identity import is_admin, owns
from ..problems import Problem
from ..state import ServerState
from ..storage import ApiKey
from ..views import groups_for, may_see
from .common import APPROVER, OutModel, id_path
from .effects import EffectOut, UndoStepPlan, Visibility, effects_seen, undo_plan
from .tools import ToolBrief, tool_brief

router = APIRouter(route_class=AuthFirstRoute)


ApprovalState = Literal["pending", "approved", "rejected", "timed_out", "auto_approved", "cancelled", "expired",
                        "responded"]


class ApprovalOut(OutModel):
    approval_request_id: str
    effect_id: str
    session_id: str
    call_id: str
    tool_name: str
    proposed_args: dict[str, Any]
    approved_args: dict[str, Any] | None = None
    reason: str | None = None
    risk_tags: list[str] = []
    state: ApprovalState
    timeout_at: datetime
    seconds_left: float | None = Field(None, description="Seconds before timeout_at, for pending requests")
    created_at: datetime
    decided_at: datetime | None = None
    decided_by: str | None = None
    decision_reason: str | None = None
    action_digest: str | None = None
    groups: list[str] = Field([], description="Approver groups the request is routed to (empty: any approver)")


class ApprovalDetail(ApprovalOut):
    agent_context: Any = None
    recent_calls: list[EffectOut]
    undo_plan: list[UndoStepPlan]
    tool: ToolBrief | None = None


class ApproveIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(None, max_length=2000)


class RejectIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str = Field(min_length=1, max_length=2000)


class ModifyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    args: dict[str, Any]
    reason: str | None = Field(None, max_length=2000)


class ApprovalEventOut(OutModel):
    event_id: int | None = None
    approval_request_id: str | None = None
    action: str
    actor: str
    payload: Any = None
    created_at: datetime | None = None
    hash: str | None = None


def approval_out(st: ServerState, d: Any, groups: list[str] | None = None, *, brief: bool = True) -> ApprovalOut:
    """A request as listed: its arguments as previews (``brief``), so a listing never carries unbounded blobs."""
    from ..views import approval_dict

    d = approval_dict(d)
    if brief:
        _brief_args(d)
    d["groups"] = groups if groups is not None else groups_for(st.store.groups(), d["tool_name"], d["risk_tags"])
    return ApprovalOut.model_validate(d)


def _brief_args(d: dict[str, Any]) -> dict[str, Any]:
    for k in ("proposed_args", "approved_args"):
        if d.get(k) is not None:
            d[k] = limits.preview(d[k])
    return d


def _visible_approval(st: ServerState, key: ApiKey, approval_request_id: str) -> dict[str, Any]:
    row = st.views.approval_row(approval_request_id)
    if row is None:
        raise Problem(404, "approval_not_found", f"approval request {approval_request_id!r} does not exist")
    groups = groups_for(st.store.groups(), row["tool_name"], row["risk_tags"])
    if not may_see(key, groups):
        raise Problem(
            403,
            "not_in_approver_group",
            f"this request is routed to the approver group(s) {', '.join(groups)}; the key belongs to none",
            groups=groups,
        )
    row["groups"] = groups
    return row


def _decidable(st: ServerState, key: ApiKey, approval_request_id: str, action: str) -> dict[str, Any]:
    row = _visible_approval(st, key, approval_request_id)
    if owns(key, row.get("session_created_by")):
        try:  # the core's check, which audits the refusal before it raises
            st.undolog.approvals.refuse_own(approval_request_id, key.identity, action, key.principal_ref)
        except errors.SelfDecisionForbidden:
            pass
        raise Problem(
            403,
            "self_approval_forbidden",
            "this key created the session that raised the request; another person must decide it",
        )
    return row


def approval_detail(st: ServerState, row: dict[str, Any], key: ApiKey) -> ApprovalDetail:
    """Everything a person needs to decide one request (the session's other calls as ``key`` may see them)."""
    base = approval_out(st, row, brief=False).model_dump()  # the arguments in full: a person decides on them
    vis = Visibility(st, key, {"created_by": row.get("session_created_by")})
    context = vis.context(to_jsonable_python(row.get("agent_context")))
    if isinstance(context, list):
        context = [{**c, "args": limits.preview(c.get("args"))} if isinstance(c, dict) else c for c in context]
    return ApprovalDetail(
        **base,
        agent_context=context,
        recent_calls=effects_seen(st, row["session_id"], vis, limit=st.settings.context_calls, newest_first=True),
        undo_plan=undo_plan(st, row["session_id"]),
        tool=tool_brief(st, row["tool_name"]),
    )


@router.get("/approvals", response_model=list[ApprovalOut], tags=["approvals"], summary="List approval requests")
def list_approvals(
    request: Request,
    state: ApprovalState | None = None,
    session_id: str | None = Query(None, max_length=MAX_ID_LENGTH),
    tool: str | None = Query(None, max_length=MAX_ID_LENGTH),
    risk_tag: str | None = Query(None, max_length=100),
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=1_000_000),
    key: ApiKey = Depends(APPROVER),
) -> list[ApprovalOut]:
    st = server_state(request)
    groups = st.store.groups()
    # With approver groups, a non-admin sees only part of the table, so the page is filled by
    # filtering batches here; offset then counts visible requests, not rows.
    filtering = not is_admin(key) and bool(groups)
    db_offset, to_skip = (0, offset) if filtering else (offset, 0)
    out: list[ApprovalOut] = []
    while True:
        rows = st.views.approvals(
            state=state, session_id=session_id, tool_name=tool, risk_tag=risk_tag, limit=limit, offset=db_offset
        )
        for r in rows:
            g = groups_for(groups, r["tool_name"], r["risk_tags"])
            if filtering and not may_see(key, g):
                continue
            if to_skip:
                to_skip -= 1
                continue
            r["groups"] = g
            out.append(ApprovalOut.model_validate(_brief_args(r)))
            if len(out) >= limit:
                return out
        if len(rows) < limit:
            return out
        db_offset += limit


@router.get(
    "/approvals/{approval_request_id}", response_model=ApprovalDetail, tags=["approvals"], summary="Show one request"
)
def show_approval(request: Request, approval_request_id: str = id_path(), key: ApiKey = Depends(APPROVER)) -> ApprovalDetail:
    st = server_state(request)
    return approval_detail(st, _visible_approval(st, key, approval_request_id), key)


def _decision_route(action: str, summary: str, *, edit: bool = False) -> Callable[[DecoratedCallable], DecoratedCallable]:
    """The route of one decision on a request (``:approve``, ``:reject``, ``:modify``): 409 once it is decided, and
    422 for an edit its tool's schema refuses."""
    responses: dict[int | str, dict[str, Any]] = {409: {"description": "Already decided"}}
    if edit:
        responses[422] = {"description": "Edited arguments invalid"}
    return router.post(f"/approvals/{{approval_request_id}}:{action}", response_model=ApprovalOut, tags=["approvals"],
                       summary=summary, responses=responses)


def _decide(request: Request, key: ApiKey, approval_request_id: str, action: Literal["approve", "reject", "modify"],
            **decision: Any) -> ApprovalOut:
    """One decision by ``key`` through the core's approvals service (which records it, or refuses a decided one)."""
    st = server_state(request)
    row = _decidable(st, key, approval_request_id, action)
    record = getattr(st.undolog.approvals, action)(approval_request_id, approver=key.identity,
                                                   principal=key.principal_ref, **decision)
    return approval_out(st, record, row["groups"])


@_decision_route("approve", "Approve a pending request")
def approve(
    request: Request,
    approval_request_id: str = id_path(),
    body: ApproveIn | None = Body(None),
    key: ApiKey = Depends(APPROVER),
) -> ApprovalOut:
    return _decide(request, key, approval_request_id, "approve", reason=body.reason if body else None)


@_decision_route("reject", "Reject a pending request (halts its session)")
def reject(
    request: Request, body: RejectIn, approval_request_id: str = id_path(), key: ApiKey = Depends(APPROVER)
) -> ApprovalOut:
    return _decide(request, key, approval_request_id, "reject", reason=body.reason)


@_decision_route("modify", "Approve with edited arguments (validated against the tool's schema)", edit=True)
def modify(
    request: Request, body: ModifyIn, approval_request_id: str = id_path(), key: ApiKey = Depends(APPROVER)
) -> ApprovalOut:
    return _decide(request, key, approval_request_id, "modify", args=body.args, reason=body.reason)


@router.get(
    "/approvals/{approval_request_id}/events",
    response_model=list[ApprovalEventOut],
    tags=["approvals"],
    summary="Event history of a request",
)
def approval_events(
    request: Request,
    approval_request_id: str = id_path(),
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=1_000_000),
    key: ApiKey = Depends(APPROVER),
) -> list[ApprovalEventOut]:
    st = server_state(request)
    _visible_approval(st, key, approval_request_id)
    events = st.undolog.approvals.events(approval_request_id)[offset: offset + limit]
    out = []
    for e in events:
        d = event_dict(e)
        d["payload"] = limits.preview(d.get("payload"))  # a modify event holds both argument sets
        out.append(ApprovalEventOut.model_validate(d))
    return out


def event_dict(e: Any) -> dict[str, Any]:
    import json

    if dataclasses.is_dataclass(e) and not isinstance(e, type):
        d = dataclasses.asdict(e)
    elif isinstance(e, dict):
        d = dict(e)
    else:
        d = dict(vars(e))
    payload = d.get("payload")
    if isinstance(payload, str):
        try:
            d["payload"] = json.loads(payload)
        except ValueError:
            pass
    d["payload"] = to_jsonable_python(d.get("payload"), fallback=str)
    return d
