"""``/v1/keys``: API keys (never their secrets)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from ..auth import AuthFirstRoute, server_state
from ..problems import Problem
from ..storage import KEY_NAME_MAX, ApiKey
from .common import ADMIN, OutModel, id_path, page_limit, page_offset

router = APIRouter(route_class=AuthFirstRoute)


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=KEY_NAME_MAX)
    roles: list[Literal["agent", "approver", "admin"]] = Field(min_length=1)
    groups: list[str] = []


class KeyOut(OutModel):
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


@router.get("/keys", response_model=list[KeyOut], tags=["admin"], summary="List API keys (never their secrets)")
def list_keys(request: Request, limit: int = page_limit(), offset: int = page_offset(),
              key: ApiKey = Depends(ADMIN)) -> list[KeyOut]:
    return [KeyOut.model_validate(_key_out(k)) for k in server_state(request).store.list_keys()[offset: offset + limit]]


@router.post("/keys", response_model=KeyCreated, status_code=201, tags=["admin"], summary="Create an API key")
def create_key(request: Request, body: KeyCreate, key: ApiKey = Depends(ADMIN)) -> KeyCreated:
    new, token = server_state(request).store.create_key(body.name, body.roles, body.groups, created_by=key.identity)
    return KeyCreated.model_validate(_key_out(new) | {"key": token})


@router.delete("/keys/{key_id}", status_code=204, tags=["admin"], summary="Revoke an API key")
def revoke_key(request: Request, key_id: str = id_path(), key: ApiKey = Depends(ADMIN)) -> Response:
    if not server_state(request).store.revoke_key(key_id):
        raise Problem(404, "key_not_found", f"no active key {key_id!r}")
    return Response(status_code=204)
