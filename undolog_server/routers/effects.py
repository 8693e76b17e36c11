"""Effects: what a key may read of a session's calls (:class:`Visibility`), the timeline's models and
``POST /v1/effects/{effect_id}:resolve``."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from undolog_core import limits
from undolog_core.integration import find_effect

from ..auth import AuthFirstRoute, server_state
from ..identity import is_admin, owns
from ..problems import Problem
from ..state import ServerState
from ..storage import ApiKey
from ..views import groups_for, may_see
from .common import APPROVER, OutModel, id_path

router = APIRouter(route_class=AuthFirstRoute)


class EffectOut(OutModel):
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


class UndoStepPlan(OutModel):
    undo_id: int
    effect_id: str
    tool_name: str
    compensation_name: str
    compensation_version: int | None = None
    state: str
    compensation_registered: bool = Field(description="Whether this server can run the compensation now")


class ResolveIn(BaseModel):
    """A person's settlement of an effect whose outcome is unknown."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    resolved_as: Literal["committed", "compensated", "not_happened"] = Field(
        alias="as", description="What the external system shows: the call happened and stands (committed), it is "
        "undone (compensated), or it never happened (not_happened)")
    reason: str = Field(min_length=1, max_length=2000, description="What the person checked (audited)")


class ResolutionOut(OutModel):
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


def effects_seen(st: ServerState, session_id: str, vis: Visibility, limit: int | None = None,
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


def undo_plan(st: ServerState, session_id: str) -> list[UndoStepPlan]:
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


@router.post(
    "/effects/{effect_id}:resolve",
    response_model=ResolutionOut,
    tags=["sessions"],
    summary="Settle an effect whose outcome is unknown (audited; the session stays halted)",
    responses={404: {"description": "No such effect"}, 409: {"description": "The effect is not unknown"},
               403: {"description": "The key created the session, or is outside the tool's approver groups"}},
)
def resolve_effect(
    request: Request, body: ResolveIn, effect_id: str = id_path(), key: ApiKey = Depends(APPROVER)
) -> ResolutionOut:
    """A person who checked the external system settles a call whose outcome is unknown (it finished after it was
    taken over, or nothing could tell whether it happened): ``committed``, ``compensated`` or ``not_happened``.
    Recorded as the audit event ``effect.resolved`` with who and why. The session is not resumed: resume it or
    roll it back next. The key that created the session may not resolve its calls."""
    st = server_state(request)
    found = find_effect(st.undolog, effect_id)
    row = st.views.session_row(found.session_id) if found is not None else None
    if found is None or row is None:
        raise Problem(404, "effect_not_found", f"effect {effect_id!r} does not exist")
    if not Visibility(st, key, row).sees(found.tool_name, found.tool_revision):
        raise Problem(403, "not_in_approver_group",
                      f"tool {found.tool_name!r} is routed to approver groups this key is not in")
    done = st.undolog.resolve_effect(effect_id, outcome=body.resolved_as, reason=body.reason, actor=key.identity,
                                     principal=key.principal_ref)
    return ResolutionOut.model_validate(done.to_dict())
