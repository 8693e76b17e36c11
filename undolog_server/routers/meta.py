"""``/v1/health`` and ``/v1/me``: liveness and the calling key."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel

from ..auth import AuthFirstRoute, server_state
from ..problems import Problem
from ..storage import ApiKey
from .common import ANY, OutModel

router = APIRouter(route_class=AuthFirstRoute)


class HealthOut(BaseModel):
    status: str
    database: str


class MeOut(OutModel):
    key_id: str
    name: str
    roles: list[str]
    groups: list[str]
    identity: str


@router.get("/health", response_model=HealthOut, tags=["meta"], summary="Liveness and database reachability")
def health(request: Request) -> HealthOut:
    st = server_state(request)
    try:
        st.store.ping()
    except Exception:
        raise Problem(503, "database_unavailable", "the database does not answer",
                      headers={"Retry-After": "1"}) from None
    return HealthOut(status="ok", database="postgresql" if st.store.core.is_postgres else "sqlite")


@router.get("/me", response_model=MeOut, tags=["meta"], summary="The calling key")
def me(key: ApiKey = Depends(ANY)) -> MeOut:
    return MeOut(key_id=key.key_id, name=key.name, roles=sorted(key.roles), groups=sorted(key.groups), identity=key.identity)
