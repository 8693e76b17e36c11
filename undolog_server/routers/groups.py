"""``/v1/approver-groups``: which tools and risk tags route to which approvers."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, ConfigDict

from ..auth import AuthFirstRoute, server_state
from ..problems import Problem
from ..storage import ApiKey, ApproverGroup
from .common import ADMIN, page_limit, page_offset

router = APIRouter(route_class=AuthFirstRoute)


class GroupIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tools: list[str] = []
    risk_tags: list[str] = []
    description: str | None = None


class GroupOut(GroupIn):
    name: str


@router.get("/approver-groups", response_model=list[GroupOut], tags=["admin"], summary="List approver groups")
def list_groups(request: Request, limit: int = page_limit(), offset: int = page_offset(),
                key: ApiKey = Depends(ADMIN)) -> list[GroupOut]:
    return [GroupOut(name=g.name, tools=list(g.tools), risk_tags=list(g.risk_tags), description=g.description)
            for g in server_state(request).store.groups()[offset: offset + limit]]


@router.put("/approver-groups/{name}", response_model=GroupOut, tags=["admin"], summary="Create or replace a group")
def put_group(
    request: Request, body: GroupIn, name: str = Path(min_length=1, max_length=100), key: ApiKey = Depends(ADMIN)
) -> GroupOut:
    server_state(request).store.put_group(ApproverGroup(name, tuple(body.tools), tuple(body.risk_tags), body.description))
    return GroupOut(name=name, **body.model_dump())


@router.delete("/approver-groups/{name}", status_code=204, tags=["admin"], summary="Delete a group")
def delete_group(request: Request, name: str = Path(min_length=1, max_length=100), key: ApiKey = Depends(ADMIN)) -> Response:
    if not server_state(request).store.delete_group(name):
        raise Problem(404, "group_not_found", f"no approver group {name!r}")
    return Response(status_code=204)
