"""``/v1/notification-policies``: who is told of a request, and when it escalates."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Depends, Path, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from ..auth import AuthFirstRoute, server_state
from ..problems import Problem
from ..storage import ApiKey, NotificationPolicy
from .common import ADMIN, page_limit, page_offset

router = APIRouter(route_class=AuthFirstRoute)


class PolicyIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    notify: list[str] = Field([], description="Webhook target names told of a new request")
    escalate_after_seconds: int | None = Field(None, ge=1, le=30 * 86400)
    escalate_to: list[str] = Field([], description="Webhook target names told when it escalates")


class PolicyOut(PolicyIn):
    risk_tag: str


@router.get(
    "/notification-policies", response_model=list[PolicyOut], tags=["admin"], summary="List notification policies"
)
def list_policies(request: Request, limit: int = page_limit(), offset: int = page_offset(),
                  key: ApiKey = Depends(ADMIN)) -> list[PolicyOut]:
    return [PolicyOut.model_validate(dataclasses.asdict(p)) for p in server_state(request).store.policies()[offset: offset + limit]]


@router.put(
    "/notification-policies/{risk_tag}",
    response_model=PolicyOut,
    tags=["admin"],
    summary="Set the policy for a risk tag ('*' for every request)",
)
def put_policy(
    request: Request, body: PolicyIn, risk_tag: str = Path(min_length=1, max_length=100), key: ApiKey = Depends(ADMIN)
) -> PolicyOut:
    st = server_state(request)
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
    if not server_state(request).store.delete_policy(risk_tag):
        raise Problem(404, "policy_not_found", f"no notification policy for {risk_tag!r}")
    return Response(status_code=204)
