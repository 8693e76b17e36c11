"""``/v1/sessions``: creating, listing and showing sessions; rollback, resume, revalidate."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Body, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import to_jsonable_python

from undolog_core import RollbackReport
from undolog_core.limits import MAX_ID_LENGTH

from ..auth import AuthFirstRoute, server_state
from ..identity import owns
from ..problems import Problem
from ..state import ServerState
from ..storage import ApiKey
from ..views import groups_for, may_see
from .approvals import ApprovalOut, approval_out
from .common import ADMIN, AGENT, AGENT_OR_ADMIN, ANY, OutModel, id_path
from .effects import EffectOut, UndoStepPlan, Visibility, effects_seen, undo_plan

router = APIRouter(route_class=AuthFirstRoute)


SessionState = Literal["active", "awaiting_approval", "halted", "rolled_back", "completed"]


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    agent_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    label: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._~-]+$",
        description="Your own label, the readable start of the minted id (`<label>.<random>`). The server always "
        "mints the id: a caller cannot pick the id an embedded app will use later.",
    )
    on_failure: Literal["rollback", "continue"] = "rollback"


class SessionOut(OutModel):
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


class RollbackStepOut(OutModel):
    undo_id: int | None = None
    effect_id: str | None = None
    tool_name: str | None = None
    compensation_name: str | None = None
    outcome: str
    attempts: int = 0
    error: str | None = None


class RollbackOut(OutModel):
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


def _session_for(st: ServerState, key: ApiKey, session_id: str, *, write: bool = False) -> dict[str, Any]:
    """Load a session the key may see; agents see only their own (others are 404 to them)."""
    row = st.views.session_row(session_id)
    visible = row is not None and (
        "admin" in key.roles or ("approver" in key.roles and not write) or owns(key, row.get("created_by"))
    )
    if row is None or not visible:
        raise Problem(404, "session_not_found", f"session {session_id!r} does not exist")
    return row


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


@router.post("/sessions", response_model=SessionOut, status_code=201, tags=["sessions"], summary="Create a session")
def create_session(request: Request, body: SessionCreate, response: Response, key: ApiKey = Depends(AGENT)) -> SessionOut:
    """Create a session owned by the calling key, under an id the server mints.

    The id is never the caller's choice: an agent key that could name a session could create, ahead of time,
    the id an embedded app will resume later (a thread id like ``ticket-1042``), and so read and roll back that
    app's calls. A ``label`` only prefixes the minted id (``ticket.3f9c…``) so people can read it.
    """
    st = server_state(request)
    from ..coreops import create_session as _create

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
    st = server_state(request)
    only_own = not (key.roles & {"approver", "admin"})
    rows = st.views.sessions(
        state=state, agent_id=agent_id, created_by=key.principal_ref if only_own else None, limit=limit, offset=offset
    )
    vis = Visibility(st, key, {})  # per row below: the session's own key sees all of it
    return [SessionOut.model_validate(_halt_as_seen(st, r, vis)) for r in rows]


@router.get("/sessions/{session_id}", response_model=SessionDetail, tags=["sessions"], summary="Session timeline")
def show_session(
    request: Request,
    session_id: str = id_path(),
    effects_limit: int = Query(500, ge=1, le=1000, description="Effects shown (oldest first), a page of the timeline"),
    effects_offset: int = Query(0, ge=0, le=1_000_000),
    key: ApiKey = Depends(ANY),
) -> SessionDetail:
    st = server_state(request)
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
            approvals.append(approval_out(st, a, g))
    vis = Visibility(st, key, row)
    return SessionDetail(
        **SessionOut.model_validate(_halt_as_seen(st, row, vis)).model_dump(),
        effects=effects_seen(st, sid, vis, limit=effects_limit, offset=effects_offset),
        undo_plan=undo_plan(st, sid),
        approvals=approvals,
    )


@router.post(
    "/sessions/{session_id}:rollback",
    response_model=RollbackOut,
    tags=["sessions"],
    summary="Roll the session back (LIFO compensations), returning each step's outcome",
)
def rollback_session(request: Request, session_id: str = id_path(), key: ApiKey = Depends(AGENT_OR_ADMIN)) -> RollbackOut:
    st = server_state(request)
    _session_for(st, key, session_id, write=True)
    report = st.undolog.rollback(session_id, actor=key.identity)
    return rollback_out(session_id, report)


@router.post(
    "/sessions/{session_id}:resume", response_model=SessionOut, tags=["sessions"], summary="Resume a halted session"
)
def resume_session(
    request: Request, session_id: str = id_path(), body: ActorIn | None = Body(None), key: ApiKey = Depends(ADMIN)
) -> SessionOut:
    st = server_state(request)
    _session_for(st, key, session_id, write=True)
    from ..coreops import resume

    resume(st.undolog, session_id, actor=key.identity, reason=body.reason if body else None)
    return SessionOut.model_validate(st.views.session_row(session_id))


@router.post(
    "/sessions/{session_id}:revalidate",
    response_model=RevalidateOut,
    tags=["sessions"],
    summary="Accept the current tool contracts for this session after a contract change",
)
def revalidate_session(
    request: Request, session_id: str = id_path(), body: ActorIn | None = Body(None), key: ApiKey = Depends(ADMIN)
) -> RevalidateOut:
    st = server_state(request)
    _session_for(st, key, session_id, write=True)
    from ..coreops import revalidate

    changes = revalidate(st.undolog, session_id, actor=key.identity)
    row = st.views.session_row(session_id) or {}
    return RevalidateOut.model_validate({**row, "changes": to_jsonable_python(changes, fallback=str)})
