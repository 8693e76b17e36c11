"""``/v1/tools``: the tool registry with its revisions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic_core import to_jsonable_python

from undolog_core import errors

from ..auth import AuthFirstRoute, server_state
from ..problems import Problem
from ..state import ServerState
from ..storage import ApiKey
from .common import ANY, OutModel, id_path, page_limit, page_offset

router = APIRouter(route_class=AuthFirstRoute)


class ToolBrief(OutModel):
    name: str
    tier: str
    revision: int | None = None
    fingerprint: str | None = None
    reason: str | None = None
    risk_tags: list[str] = []
    args_schema: dict[str, Any] | None = None


class ToolRevision(OutModel):
    revision: int
    tier: str
    fingerprint: str
    previous_fingerprint: str | None = None
    compensation_name: str | None = None
    compensation_version: int | None = None
    registered_at: datetime
    registered_by: str
    contract: Any = None


class ToolOut(OutModel):
    name: str
    tier: str
    revision: int
    fingerprint: str
    registered_here: bool
    proxied: bool = False
    revisions: list[ToolRevision]


def tool_brief(st: ServerState, name: str) -> ToolBrief | None:
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
                registered_here=tool_brief(st, tool_name) is not None,
                proxied=tool_name in proxied,
                revisions=[ToolRevision.model_validate(to_jsonable_python(r, fallback=str) | {
                    "registered_at": r["registered_at"]}) for r in revs],
            )
        )
    return out


@router.get("/tools", response_model=list[ToolOut], tags=["tools"], summary="Tool registry with revisions")
def list_tools(request: Request, limit: int = page_limit(), offset: int = page_offset(),
               key: ApiKey = Depends(ANY)) -> list[ToolOut]:
    return _tools(server_state(request))[offset: offset + limit]


@router.get("/tools/{tool_name}", response_model=ToolOut, tags=["tools"], summary="One tool and its revisions")
def show_tool(request: Request, tool_name: str = id_path(), key: ApiKey = Depends(ANY)) -> ToolOut:
    found = _tools(server_state(request), tool_name)
    if not found:
        raise Problem(404, "tool_not_registered", f"tool {tool_name!r} is not in the registry")
    return found[0]
