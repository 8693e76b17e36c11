"""The REST API under ``/v1``.

Every route declares its roles with :func:`require`, which runs before the handler,
so 401/403 never depend on whether the addressed object exists.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Body, Depends, Path, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_jsonable_python

from undolog_core import RollbackReport, errors, limits
from undolog_core.limits import MAX_ID_LENGTH

from .auth import AuthFirstRoute, require, server_state
from .identity import is_admin, owns
from .problems import Problem
from .state import ServerState
from .storage import KEY_NAME_MAX, ROLES, ApiKey, ApproverGroup, NotificationPolicy
from .views import groups_for, may_see
from .webhooks import TargetRefused, check_target

router = APIRouter(prefix="/v1", route_class=AuthFirstRoute)

AGENT = require("agent")
APPROVER = require("approver", "admin")
ADMIN = require("admin")
ANY = require(*ROLES)
AGENT_OR_ADMIN = require("agent", "admin")

ApprovalState = Literal["pending", "approved", "rejected", "timed_out", "auto_approved", "cancelled", "expired",
                        "responded"]
SessionState = Literal["active", "awaiting_approval", "halted", "rolled_back", "completed"]


def _id() -> Any:
    """A fresh path-parameter declaration (FastAPI binds one FieldInfo to one parameter)."""
    return Path(min_length=1, max_length=MAX_ID_LENGTH)


def _LIMIT() -> Any:  # noqa: N802 - reads like the Query(...) it stands for
    """A page size for a listing: every list endpoint is paged, never unbounded."""
    return Query(100, ge=1, le=1000)


def _OFFSET() -> Any:  # noqa: N802
    return Query(0, ge=0, le=1_000_000)


# ---------------------------------------------------------------------------------------- models


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class ApprovalOut(_Out):
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


class EffectOut(_Out):
    effect_id: str
    call_id: str
    tool_name: str
    tool_revision: int | None = None
    tier: str
    state: str
    args_snapshot: Any = None
    result_snapshot: Any = None
    error: str | None = None
    created_at: datetime
    updated_at: datetime | None = None
    compensation_name: str | None = None
    undo_state: str | None = None
    redacted: bool = Field(
        False,
        description="The call's tool is routed to approver groups the caller is not in: its arguments, result "
        "and error are withheld (null)",
    )


class UndoStepPlan(_Out):
    undo_id: int
    effect_id: str
    tool_name: str
    compensation_name: str
    compensation_version: int | None = None
    state: str
    compensation_registered: bool = Field(description="Whether this server can run the compensation now")


class ToolBrief(_Out):
    name: str
    tier: str
    revision: int | None = None
    fingerprint: str | None = None
    reason: str | None = None
    risk_tags: list[str] = []
    args_schema: dict[str, Any] | None = None


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


class ApprovalEventOut(_Out):
    event_id: int | None = None
    approval_request_id: str | None = None
    action: str
    actor: str
    payload: Any = None
    created_at: datetime | None = None
    hash: str | None = None


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    agent_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    label: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._~-]+$",
        description="Your own label, the readable start of the minted id (`<label>.<random>`). The server always "
        "mints the id: a caller cannot pick the id an embedded app will use later.",
    )
    on_failure: Literal["rollback", "continue"] = "rollback"


class SessionOut(_Out):
    session_id: str
    agent_id: str | None = None
    state: str
    halted_reason: str | None = None
    halted_reason_redacted: bool = Field(
        False,
        description="The session has calls routed to approver groups the caller is not in, and why it halted may "
        "quote them (a compensation's error, a rejection's reason): halted_reason is withheld (null)",
    )
    created_by: str | None = None
    tool_calls_total: int = 0
    on_failure: str | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None


class RevalidateOut(SessionOut):
    changes: Any = Field(None, description="What revalidation changed (tool -> old and new revision)")


class SessionDetail(SessionOut):
    effects: list[EffectOut]
    undo_plan: list[UndoStepPlan]
    approvals: list[ApprovalOut]


class RollbackStepOut(_Out):
    undo_id: int | None = None
    effect_id: str | None = None
    tool_name: str | None = None
    compensation_name: str | None = None
    outcome: str
    attempts: int = 0
    error: str | None = None


class RollbackOut(_Out):
    session_id: str
    steps: list[RollbackStepOut]
    already_rolled_back: bool = False
    complete: bool = True
    halted_reason: str | None = None
    kept_irreversible: list[str] = Field([], description="Effects of IRREVERSIBLE calls that no rollback can undo")
    ran_by: str | None = Field(
        None, description="The live process that ran the rollback (the MCP gateway serving the session, over its "
                          "live upstream connections), when it was not this server")
    ran_without_live_upstream: bool = Field(
        False, description="The session's owning process was gone, so this server ran the rollback against "
                           "upstreams started for it: state an upstream kept in its own memory was not restored")


class ActorIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: str | None = Field(None, max_length=2000)


class ResolveIn(BaseModel):
    """A person's settlement of an effect whose outcome is unknown."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    resolved_as: Literal["committed", "compensated", "not_happened"] = Field(
        alias="as", description="What the external system shows: the call happened and stands (committed), it is "
        "undone (compensated), or it never happened (not_happened)")
    reason: str = Field(min_length=1, max_length=2000, description="What the person checked (audited)")


class ResolutionOut(_Out):
    effect_id: str
    session_id: str
    tool_name: str
    resolved_as: str
    state: str = Field(description="The effect's state now")
    undo_state: str | None = None
    session_state: str = Field(description="The session's state: resolving does not resume it")
    actor: str
    reason: str
    event_id: int = Field(description="The audit event recording the decision (effect.resolved)")


class ToolRevision(_Out):
    revision: int
    tier: str
    fingerprint: str
    previous_fingerprint: str | None = None
    compensation_name: str | None = None
    compensation_version: int | None = None
    registered_at: datetime
    registered_by: str
    contract: Any = None


class ToolOut(_Out):
    name: str
    tier: str
    revision: int
    fingerprint: str
    registered_here: bool
    proxied: bool = False
    revisions: list[ToolRevision]


class AuditOut(_Out):
    ok: bool
    events_checked: int | None = None
    detail: Any = None


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=KEY_NAME_MAX)
    roles: list[Literal["agent", "approver", "admin"]] = Field(min_length=1)
    groups: list[str] = []


class KeyOut(_Out):
    key_id: str
    name: str
    roles: list[str]
    groups: list[str]
    created_at: datetime
    created_by: str | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None


class KeyCreated(KeyOut):
    key: str = Field(description="The bearer token. It is shown once and never stored.")


class MeOut(_Out):
    key_id: str
    name: str
    roles: list[str]
    groups: list[str]
    identity: str


class GroupIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tools: list[str] = []
    risk_tags: list[str] = []
    description: str | None = None


class GroupOut(GroupIn):
    name: str


class WebhookIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100)
    url: str = Field(pattern=r"^https?://", max_length=2000)
    secret: str | None = Field(None, min_length=16, max_length=MAX_ID_LENGTH)
    event_types: list[str] = ["*"]


class WebhookOut(_Out):
    target_id: str
    name: str
    url: str
    event_types: list[str]
    active: bool


class WebhookCreated(WebhookOut):
    secret: str = Field(description="HMAC secret for UndoLog-Signature; shown at creation")


class DeliveryOut(_Out):
    delivery_id: str
    event_id: str
    target_id: str
    event_type: str
    status: str
    attempts: int
    last_status_code: int | None = None
    last_error: str | None = None
    created_at: datetime
    delivered_at: datetime | None = None


class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    notify: list[str] = Field([], description="Webhook target names told of a new request")
    escalate_after_seconds: int | None = Field(None, ge=1, le=30 * 86400)
    escalate_to: list[str] = Field([], description="Webhook target names told when it escalates")


class PolicyOut(PolicyIn):
    risk_tag: str


class HealthOut(BaseModel):
    status: str
    database: str


# ---------------------------------------------------------------------------------------- helpers


def _st(request: Request) -> ServerState:
    return server_state(request)


def _approval_out(st: ServerState, d: Any, groups: list[str] | None = None, *, brief: bool = True) -> ApprovalOut:
    """A request as listed: its arguments as previews (``brief``), so a listing never carries unbounded blobs."""
    from .views import approval_dict

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


def _session_for(st: ServerState, key: ApiKey, session_id: str, *, write: bool = False) -> dict[str, Any]:
    """Load a session the key may see; agents see only their own (others are 404 to them)."""
    row = st.views.session_row(session_id)
    visible = row is not None and (
        "admin" in key.roles or ("approver" in key.roles and not write) or owns(key, row.get("created_by"))
    )
    if row is None or not visible:
        raise Problem(404, "session_not_found", f"session {session_id!r} does not exist")
    return row


def _undo_plan(st: ServerState, session_id: str) -> list[UndoStepPlan]:
    out = []
    for r in st.views.undo_plan(session_id):
        out.append(
            UndoStepPlan(
                undo_id=r["undo_id"],
                effect_id=r["effect_id"],
                tool_name=r["tool_name"],
                compensation_name=r["compensation_name"],
                compensation_version=r.get("compensation_version"),
                state=r["state"],
                compensation_registered=_compensation_registered(
                    st, r["compensation_name"], r.get("compensation_version")
                ),
            )
        )
    return out


def _compensation_registered(st: ServerState, name: str, version: int | None = None) -> bool:
    """Whether a rollback on this server could run the compensation now (present, same version)."""
    comp = st.undolog.registry.compensations.get(name)
    return comp is not None and (version is None or comp[1] == version)


def _tool_brief(st: ServerState, name: str) -> ToolBrief | None:
    try:
        spec = st.undolog.tool_spec(name)
    except errors.UndoLogError:
        return None
    return ToolBrief(
        name=name,
        tier=spec.tier.value,
        revision=spec.revision,
        fingerprint=spec.fingerprint,
        reason=spec.reason,
        risk_tags=list(spec.risk_tags),
        args_schema=spec.json_schema,
    )


class Visibility:
    """What of a session one key may read: every call's arguments, or only those of tools routed to its groups.

    An approver outside the groups a tool is routed to must not read that tool's calls anywhere: not in the
    request (403), not in the session's timeline, not in another request's ``recent_calls`` or ``agent_context``.
    Admins and the key that created the session see everything. A tool's groups are decided from its name and
    the risk tags of the revision the call ran under (any revision's tags when the revision is not known).

    Example:
        >>> vis = Visibility(st, key, session_row)
        >>> vis.sees("wire_money", 2)
        False
    """

    def __init__(self, st: ServerState, key: ApiKey, session: dict[str, Any]) -> None:
        self.key = key
        self.groups = st.store.groups()
        self.everything = is_admin(key) or owns(key, session.get("created_by")) or not self.groups
        self._tags: dict[tuple[str, int | None], list[str]] = {}
        if not self.everything:
            for r in st.views.tools():
                tags = list((r.get("contract") or {}).get("risk_tags") or [])
                self._tags[(r["tool_name"], int(r["revision"]))] = tags
                self._tags.setdefault((r["tool_name"], None), [])
                self._tags[(r["tool_name"], None)] = sorted(set(self._tags[(r["tool_name"], None)]) | set(tags))

    def sees(self, tool_name: str, revision: int | None = None) -> bool:
        """Whether the key may read the arguments of a call of ``tool_name`` (at ``revision``)."""
        if self.everything:
            return True
        tags = self._tags.get((tool_name, revision), self._tags.get((tool_name, None), []))
        return may_see(self.key, groups_for(self.groups, tool_name, tags))

    def effect(self, e: dict[str, Any]) -> dict[str, Any]:
        if self.sees(e["tool_name"], e.get("tool_revision")):
            return e
        return {**e, "args_snapshot": None, "result_snapshot": None, "error": None, "redacted": True}

    def context(self, context: Any) -> Any:
        """An approval's ``agent_context``, each call's arguments withheld unless the key may read them."""
        if self.everything or not isinstance(context, list):
            return context
        out = []
        for c in context:
            if isinstance(c, dict) and not self.sees(str(c.get("tool_name")), None):
                c = {**c, "args": None, "redacted": True}
            out.append(c)
        return out


def _halt_as_seen(st: ServerState, row: dict[str, Any], vis: Visibility) -> dict[str, Any]:
    """A session row with ``halted_reason`` withheld from a key that may not read all of the session's calls.

    The reason quotes what stopped the session: a failed compensation's error, a rejection's reason. Both belong to
    one call, whose error (or request) is withheld from keys outside its approver groups; so is the quote.
    """
    if not row.get("halted_reason") or vis.everything or owns(vis.key, row.get("created_by")):
        return row
    if all(vis.sees(e["tool_name"], e.get("tool_revision")) for e in st.views.effects(row["session_id"])):
        return row
    return {**row, "halted_reason": None, "halted_reason_redacted": True}


def _effects(st: ServerState, session_id: str, vis: Visibility, limit: int | None = None,
             newest_first: bool = False, offset: int = 0) -> list[EffectOut]:
    """A session's effects as ``vis`` lets the key read them, arguments and results as previews (a timeline never
    carries unbounded blobs)."""
    rows = st.views.effects(session_id, newest_first=newest_first)
    rows = rows[offset: offset + limit] if limit is not None else rows[offset:]
    out = []
    for e in rows:
        e = dict(vis.effect(e))
        e["args_snapshot"] = limits.preview(e.get("args_snapshot"))
        e["result_snapshot"] = limits.preview(e.get("result_snapshot"))
        out.append(EffectOut.model_validate(e))
    return out


def approval_detail(st: ServerState, row: dict[str, Any], key: ApiKey) -> ApprovalDetail:
    """Everything a person needs to decide one request (the session's other calls as ``key`` may see them)."""
    base = _approval_out(st, row, brief=False).model_dump()  # the arguments in full: a person decides on them
    vis = Visibility(st, key, {"created_by": row.get("session_created_by")})
    context = vis.context(to_jsonable_python(row.get("agent_context")))
    if isinstance(context, list):
        context = [{**c, "args": limits.preview(c.get("args"))} if isinstance(c, dict) else c for c in context]
    return ApprovalDetail(
        **base,
        agent_context=context,
        recent_calls=_effects(st, row["session_id"], vis, limit=st.settings.context_calls, newest_first=True),
        undo_plan=_undo_plan(st, row["session_id"]),
        tool=_tool_brief(st, row["tool_name"]),
    )


def rollback_out(session_id: str, report: RollbackReport) -> RollbackOut:
    """Shape a core RollbackReport for the API."""
    steps = []
    for step in report.steps:
        d = dataclasses.asdict(step)
        d["outcome"] = str(getattr(step.outcome, "value", step.outcome))
        steps.append(RollbackStepOut.model_validate(d))
    return RollbackOut(
        session_id=session_id,
        steps=steps,
        already_rolled_back=report.already_rolled_back,
        complete=report.complete,
        halted_reason=report.halted_reason,
        kept_irreversible=[str(x) for x in report.kept_irreversible],
        ran_by=report.ran_by,
        ran_without_live_upstream=report.ran_without_live_upstream,
    )


def _key_out(k: ApiKey) -> dict[str, Any]:
    return {
        "key_id": k.key_id,
        "name": k.name,
        "roles": sorted(k.roles),
        "groups": sorted(k.groups),
        "created_at": k.created_at,
        "created_by": k.created_by,
        "revoked_at": k.revoked_at,
        "last_used_at": k.last_used_at,
    }


# ---------------------------------------------------------------------------------------- health / me


@router.get("/health", response_model=HealthOut, tags=["meta"], summary="Liveness and database reachability")
def health(request: Request) -> HealthOut:
    st = _st(request)
    try:
        st.store.ping()
    except Exception:
        raise Problem(503, "database_unavailable", "the database does not answer",
                      headers={"Retry-After": "1"}) from None
    return HealthOut(status="ok", database="postgresql" if st.store.core.is_postgres else "sqlite")


@router.get("/me", response_model=MeOut, tags=["meta"], summary="The calling key")
def me(key: ApiKey = Depends(ANY)) -> MeOut:
    return MeOut(key_id=key.key_id, name=key.name, roles=sorted(key.roles), groups=sorted(key.groups), identity=key.identity)


# ---------------------------------------------------------------------------------------- approvals


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
    st = _st(request)
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
def show_approval(request: Request, approval_request_id: str = _id(), key: ApiKey = Depends(APPROVER)) -> ApprovalDetail:
    st = _st(request)
    return approval_detail(st, _visible_approval(st, key, approval_request_id), key)


@router.post(
    "/approvals/{approval_request_id}:approve",
    response_model=ApprovalOut,
    tags=["approvals"],
    summary="Approve a pending request",
    responses={409: {"description": "Already decided"}},
)
def approve(
    request: Request,
    approval_request_id: str = _id(),
    body: ApproveIn | None = Body(None),
    key: ApiKey = Depends(APPROVER),
) -> ApprovalOut:
    st = _st(request)
    row = _decidable(st, key, approval_request_id, "approve")
    record = st.undolog.approvals.approve(approval_request_id, approver=key.identity, principal=key.principal_ref,
                                          reason=body.reason if body else None)
    return _approval_out(st, record, row["groups"])


@router.post(
    "/approvals/{approval_request_id}:reject",
    response_model=ApprovalOut,
    tags=["approvals"],
    summary="Reject a pending request (halts its session)",
    responses={409: {"description": "Already decided"}},
)
def reject(
    request: Request, body: RejectIn, approval_request_id: str = _id(), key: ApiKey = Depends(APPROVER)
) -> ApprovalOut:
    st = _st(request)
    row = _decidable(st, key, approval_request_id, "reject")
    record = st.undolog.approvals.reject(approval_request_id, approver=key.identity, principal=key.principal_ref,
                                         reason=body.reason)
    return _approval_out(st, record, row["groups"])


@router.post(
    "/approvals/{approval_request_id}:modify",
    response_model=ApprovalOut,
    tags=["approvals"],
    summary="Approve with edited arguments (validated against the tool's schema)",
    responses={409: {"description": "Already decided"}, 422: {"description": "Edited arguments invalid"}},
)
def modify(
    request: Request, body: ModifyIn, approval_request_id: str = _id(), key: ApiKey = Depends(APPROVER)
) -> ApprovalOut:
    st = _st(request)
    row = _decidable(st, key, approval_request_id, "modify")
    record = st.undolog.approvals.modify(approval_request_id, approver=key.identity, principal=key.principal_ref,
                                         args=body.args, reason=body.reason)
    return _approval_out(st, record, row["groups"])


@router.get(
    "/approvals/{approval_request_id}/events",
    response_model=list[ApprovalEventOut],
    tags=["approvals"],
    summary="Event history of a request",
)
def approval_events(
    request: Request,
    approval_request_id: str = _id(),
    limit: int = Query(100, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=1_000_000),
    key: ApiKey = Depends(APPROVER),
) -> list[ApprovalEventOut]:
    st = _st(request)
    _visible_approval(st, key, approval_request_id)
    events = st.undolog.approvals.events(approval_request_id)[offset: offset + limit]
    out = []
    for e in events:
        d = _event_dict(e)
        d["payload"] = limits.preview(d.get("payload"))  # a modify event holds both argument sets
        out.append(ApprovalEventOut.model_validate(d))
    return out


def _event_dict(e: Any) -> dict[str, Any]:
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


# ---------------------------------------------------------------------------------------- sessions


@router.post("/sessions", response_model=SessionOut, status_code=201, tags=["sessions"], summary="Create a session")
def create_session(request: Request, body: SessionCreate, response: Response, key: ApiKey = Depends(AGENT)) -> SessionOut:
    """Create a session owned by the calling key, under an id the server mints.

    The id is never the caller's choice: an agent key that could name a session could create, ahead of time,
    the id an embedded app will resume later (a thread id like ``ticket-1042``), and so read and roll back that
    app's calls. A ``label`` only prefixes the minted id (``ticket.3f9c…``) so people can read it.
    """
    st = _st(request)
    from .coreops import create_session as _create

    minted = new_session_id(body.label)
    session_id = _create(st.undolog, agent_id=body.agent_id, session_id=minted,
                         created_by=key.principal_ref, on_failure=body.on_failure)
    response.headers["Location"] = f"/v1/sessions/{session_id}"
    return SessionOut.model_validate(st.views.session_row(session_id))


def new_session_id(label: str | None = None) -> str:
    """A session id for the API: 96 random bits, after the caller's label if any (``ticket.9f2c…``)."""
    import secrets

    token = secrets.token_hex(12)
    return f"{label}.{token}" if label else f"api.{token}"


@router.get("/sessions", response_model=list[SessionOut], tags=["sessions"], summary="List sessions")
def list_sessions(
    request: Request,
    state: SessionState | None = None,
    agent_id: str | None = Query(None, max_length=MAX_ID_LENGTH),
    limit: int = Query(50, ge=1, le=500),
    offset: int = Query(0, ge=0, le=1_000_000),
    key: ApiKey = Depends(ANY),
) -> list[SessionOut]:
    st = _st(request)
    only_own = not (key.roles & {"approver", "admin"})
    rows = st.views.sessions(
        state=state, agent_id=agent_id, created_by=key.principal_ref if only_own else None, limit=limit, offset=offset
    )
    vis = Visibility(st, key, {})  # per row below: the session's own key sees all of it
    return [SessionOut.model_validate(_halt_as_seen(st, r, vis)) for r in rows]


@router.get("/sessions/{session_id}", response_model=SessionDetail, tags=["sessions"], summary="Session timeline")
def show_session(
    request: Request,
    session_id: str = _id(),
    effects_limit: int = Query(500, ge=1, le=1000, description="Effects shown (oldest first), a page of the timeline"),
    effects_offset: int = Query(0, ge=0, le=1_000_000),
    key: ApiKey = Depends(ANY),
) -> SessionDetail:
    st = _st(request)
    row = _session_for(st, key, session_id)
    return session_detail(st, row, key, effects_limit=effects_limit, effects_offset=effects_offset)


def session_detail(st: ServerState, row: dict[str, Any], key: ApiKey, *, effects_limit: int = 500,
                   effects_offset: int = 0) -> SessionDetail:
    """A session with its effects, undo plan and the approval requests ``key`` may see.

    The key that created the session sees all of its requests; an approver sees only those
    routed to one of its groups (or to no group), as in the approvals listing.
    """
    sid = row["session_id"]
    groups = st.store.groups()
    owner = owns(key, row.get("created_by"))
    approvals = []
    for a in st.views.approvals(session_id=sid, limit=500):
        g = groups_for(groups, a["tool_name"], a["risk_tags"])
        if owner or may_see(key, g):
            approvals.append(_approval_out(st, a, g))
    vis = Visibility(st, key, row)
    return SessionDetail(
        **SessionOut.model_validate(_halt_as_seen(st, row, vis)).model_dump(),
        effects=_effects(st, sid, vis, limit=effects_limit, offset=effects_offset),
        undo_plan=_undo_plan(st, sid),
        approvals=approvals,
    )


@router.post(
    "/sessions/{session_id}:rollback",
    response_model=RollbackOut,
    tags=["sessions"],
    summary="Roll the session back (LIFO compensations), returning each step's outcome",
)
def rollback_session(request: Request, session_id: str = _id(), key: ApiKey = Depends(AGENT_OR_ADMIN)) -> RollbackOut:
    st = _st(request)
    _session_for(st, key, session_id, write=True)
    report = st.undolog.rollback(session_id, actor=key.identity)
    return rollback_out(session_id, report)


@router.post(
    "/sessions/{session_id}:resume", response_model=SessionOut, tags=["sessions"], summary="Resume a halted session"
)
def resume_session(
    request: Request, session_id: str = _id(), body: ActorIn | None = Body(None), key: ApiKey = Depends(ADMIN)
) -> SessionOut:
    st = _st(request)
    _session_for(st, key, session_id, write=True)
    from .coreops import resume

    resume(st.undolog, session_id, actor=key.identity, reason=body.reason if body else None)
    return SessionOut.model_validate(st.views.session_row(session_id))


@router.post(
    "/sessions/{session_id}:revalidate",
    response_model=RevalidateOut,
    tags=["sessions"],
    summary="Accept the current tool contracts for this session after a contract change",
)
def revalidate_session(
    request: Request, session_id: str = _id(), body: ActorIn | None = Body(None), key: ApiKey = Depends(ADMIN)
) -> RevalidateOut:
    st = _st(request)
    _session_for(st, key, session_id, write=True)
    from .coreops import revalidate

    changes = revalidate(st.undolog, session_id, actor=key.identity)
    row = st.views.session_row(session_id) or {}
    return RevalidateOut.model_validate({**row, "changes": to_jsonable_python(changes, fallback=str)})


@router.post(
    "/effects/{effect_id}:resolve",
    response_model=ResolutionOut,
    tags=["sessions"],
    summary="Settle an effect whose outcome is unknown (audited; the session stays halted)",
    responses={404: {"description": "No such effect"}, 409: {"description": "The effect is not unknown"},
               403: {"description": "The key created the session, or is outside the tool's approver groups"}},
)
def resolve_effect(
    request: Request, body: ResolveIn, effect_id: str = _id(), key: ApiKey = Depends(APPROVER)
) -> ResolutionOut:
    """A person who checked the external system settles a call whose outcome is unknown (it finished after it was
    taken over, or nothing could tell whether it happened): ``committed``, ``compensated`` or ``not_happened``.
    Recorded as the audit event ``effect.resolved`` with who and why. The session is not resumed: resume it or
    roll it back next. The key that created the session may not resolve its calls."""
    st = _st(request)
    session_id = st.undolog.store.session_of_effect(effect_id)
    row = st.views.session_row(session_id) if session_id is not None else None
    if row is None:
        raise Problem(404, "effect_not_found", f"effect {effect_id!r} does not exist")
    found = st.undolog.store.effect(effect_id)
    if not Visibility(st, key, row).sees(found.tool_name, found.tool_revision):
        raise Problem(403, "not_in_approver_group",
                      f"tool {found.tool_name!r} is routed to approver groups this key is not in")
    done = st.undolog.resolve_effect(effect_id, outcome=body.resolved_as, reason=body.reason, actor=key.identity,
                                     principal=key.principal_ref)
    return ResolutionOut.model_validate(done.to_dict())


# ---------------------------------------------------------------------------------------- tools / audit


def _tools(st: ServerState, name: str | None = None) -> list[ToolOut]:
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in st.views.tools(name):
        by_name.setdefault(r["tool_name"], []).append(r)
    proxied = set(st.proxy.tools) if st.proxy else set()
    out = []
    for tool_name, revs in by_name.items():
        head = revs[0]
        out.append(
            ToolOut(
                name=tool_name,
                tier=head["tier"],
                revision=head["revision"],
                fingerprint=head["fingerprint"],
                registered_here=_tool_brief(st, tool_name) is not None,
                proxied=tool_name in proxied,
                revisions=[ToolRevision.model_validate(to_jsonable_python(r, fallback=str) | {
                    "registered_at": r["registered_at"]}) for r in revs],
            )
        )
    return out


@router.get("/tools", response_model=list[ToolOut], tags=["tools"], summary="Tool registry with revisions")
def list_tools(request: Request, limit: int = _LIMIT(), offset: int = _OFFSET(),
               key: ApiKey = Depends(ANY)) -> list[ToolOut]:
    return _tools(_st(request))[offset: offset + limit]


@router.get("/tools/{tool_name}", response_model=ToolOut, tags=["tools"], summary="One tool and its revisions")
def show_tool(request: Request, tool_name: str = _id(), key: ApiKey = Depends(ANY)) -> ToolOut:
    found = _tools(_st(request), tool_name)
    if not found:
        raise Problem(404, "tool_not_registered", f"tool {tool_name!r} is not in the registry")
    return found[0]


@router.get("/audit/verify", response_model=AuditOut, tags=["audit"], summary="Verify the approval events hash chain")
def audit_verify(request: Request, key: ApiKey = Depends(APPROVER)) -> AuditOut:
    from .coreops import verify_audit

    return AuditOut.model_validate(verify_audit(_st(request).undolog))


# ---------------------------------------------------------------------------------------- admin


@router.get("/keys", response_model=list[KeyOut], tags=["admin"], summary="List API keys (never their secrets)")
def list_keys(request: Request, limit: int = _LIMIT(), offset: int = _OFFSET(),
              key: ApiKey = Depends(ADMIN)) -> list[KeyOut]:
    return [KeyOut.model_validate(_key_out(k)) for k in _st(request).store.list_keys()[offset: offset + limit]]


@router.post("/keys", response_model=KeyCreated, status_code=201, tags=["admin"], summary="Create an API key")
def create_key(request: Request, body: KeyCreate, key: ApiKey = Depends(ADMIN)) -> KeyCreated:
    new, token = _st(request).store.create_key(body.name, body.roles, body.groups, created_by=key.identity)
    return KeyCreated.model_validate(_key_out(new) | {"key": token})


@router.delete("/keys/{key_id}", status_code=204, tags=["admin"], summary="Revoke an API key")
def revoke_key(request: Request, key_id: str = _id(), key: ApiKey = Depends(ADMIN)) -> Response:
    if not _st(request).store.revoke_key(key_id):
        raise Problem(404, "key_not_found", f"no active key {key_id!r}")
    return Response(status_code=204)


@router.get("/approver-groups", response_model=list[GroupOut], tags=["admin"], summary="List approver groups")
def list_groups(request: Request, limit: int = _LIMIT(), offset: int = _OFFSET(),
                key: ApiKey = Depends(ADMIN)) -> list[GroupOut]:
    return [GroupOut(name=g.name, tools=list(g.tools), risk_tags=list(g.risk_tags), description=g.description)
            for g in _st(request).store.groups()[offset: offset + limit]]


@router.put("/approver-groups/{name}", response_model=GroupOut, tags=["admin"], summary="Create or replace a group")
def put_group(
    request: Request, body: GroupIn, name: str = Path(min_length=1, max_length=100), key: ApiKey = Depends(ADMIN)
) -> GroupOut:
    _st(request).store.put_group(ApproverGroup(name, tuple(body.tools), tuple(body.risk_tags), body.description))
    return GroupOut(name=name, **body.model_dump())


@router.delete("/approver-groups/{name}", status_code=204, tags=["admin"], summary="Delete a group")
def delete_group(request: Request, name: str = Path(min_length=1, max_length=100), key: ApiKey = Depends(ADMIN)) -> Response:
    if not _st(request).store.delete_group(name):
        raise Problem(404, "group_not_found", f"no approver group {name!r}")
    return Response(status_code=204)


@router.get("/webhooks", response_model=list[WebhookOut], tags=["admin"], summary="List webhook targets")
def list_webhooks(request: Request, limit: int = _LIMIT(), offset: int = _OFFSET(),
                  key: ApiKey = Depends(ADMIN)) -> list[WebhookOut]:
    return [WebhookOut.model_validate(dataclasses.asdict(t)) for t in _st(request).store.targets()[offset: offset + limit]]


@router.post("/webhooks", response_model=WebhookCreated, status_code=201, tags=["admin"], summary="Add a webhook target")
def create_webhook(request: Request, body: WebhookIn, key: ApiKey = Depends(ADMIN)) -> WebhookCreated:
    st = _st(request)
    try:
        # Checked again at every send, after resolution: this refusal is the early, readable one.
        check_target(body.url, allow_private=st.settings.webhook_allow_private)
    except TargetRefused as exc:
        raise Problem(422, exc.code, str(exc)) from None
    try:
        t = st.store.create_target(body.name, body.url, body.secret, body.event_types)
    except ValueError as exc:
        raise Problem(409, "webhook_exists", str(exc)) from None
    return WebhookCreated.model_validate(dataclasses.asdict(t))


@router.delete("/webhooks/{target_id}", status_code=204, tags=["admin"], summary="Remove a webhook target")
def delete_webhook(request: Request, target_id: str = _id(), key: ApiKey = Depends(ADMIN)) -> Response:
    if not _st(request).store.delete_target(target_id):
        raise Problem(404, "webhook_not_found", f"no webhook target {target_id!r}")
    return Response(status_code=204)


@router.get(
    "/webhooks/{target_id}/deliveries", response_model=list[DeliveryOut], tags=["admin"], summary="Delivery log"
)
def webhook_deliveries(
    request: Request, target_id: str = _id(), limit: int = Query(100, ge=1, le=1000), key: ApiKey = Depends(ADMIN)
) -> list[DeliveryOut]:
    st = _st(request)
    if st.store.get_target(target_id) is None:
        raise Problem(404, "webhook_not_found", f"no webhook target {target_id!r}")
    return [DeliveryOut.model_validate(d) for d in st.store.deliveries(target_id, limit)]


@router.get(
    "/notification-policies", response_model=list[PolicyOut], tags=["admin"], summary="List notification policies"
)
def list_policies(request: Request, limit: int = _LIMIT(), offset: int = _OFFSET(),
                  key: ApiKey = Depends(ADMIN)) -> list[PolicyOut]:
    return [PolicyOut.model_validate(dataclasses.asdict(p)) for p in _st(request).store.policies()[offset: offset + limit]]


@router.put(
    "/notification-policies/{risk_tag}",
    response_model=PolicyOut,
    tags=["admin"],
    summary="Set the policy for a risk tag ('*' for every request)",
)
def put_policy(
    request: Request, body: PolicyIn, risk_tag: str = Path(min_length=1, max_length=100), key: ApiKey = Depends(ADMIN)
) -> PolicyOut:
    st = _st(request)
    names = {t.name for t in st.store.targets()}
    unknown = sorted((set(body.notify) | set(body.escalate_to)) - names)
    if unknown:
        # 409: the body is valid; what it names is not there now (a client may create the target and retry).
        raise Problem(409, "unknown_webhook_target", f"no webhook target named {', '.join(unknown)}", targets=unknown)
    st.store.put_policy(NotificationPolicy(risk_tag, tuple(body.notify), body.escalate_after_seconds, tuple(body.escalate_to)))
    return PolicyOut(risk_tag=risk_tag, **body.model_dump())


@router.delete("/notification-policies/{risk_tag}", status_code=204, tags=["admin"], summary="Delete a policy")
def delete_policy(
    request: Request, risk_tag: str = Path(min_length=1, max_length=100), key: ApiKey = Depends(ADMIN)
) -> Response:
    if not _st(request).store.delete_policy(risk_tag):
        raise Problem(404, "policy_not_found", f"no notification policy for {risk_tag!r}")
    return Response(status_code=204)
