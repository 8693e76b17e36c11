"""``/v1/webhooks``: webhook targets and their delivery log."""

from __future__ import annotations

import dataclasses
from datetime import datetime

from fastapi import APIRouter, Depends, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field

from undolog_core.limits import MAX_ID_LENGTH

from ..auth import AuthFirstRoute, server_state
from ..problems import Problem
from ..storage import ApiKey
from ..webhooks import TargetRefused, check_target
from .common import ADMIN, OutModel, id_path, page_limit, page_offset

router = APIRouter(route_class=AuthFirstRoute)


class WebhookIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100)
    url: str = Field(pattern=r"^https?://", max_length=2000)
    secret: str | None = Field(None, min_length=16, max_length=MAX_ID_LENGTH)
    event_types: list[str] = ["*"]


class WebhookOut(OutModel):
    target_id: str
    name: str
    url: str
    event_types: list[str]
    active: bool


class WebhookCreated(WebhookOut):
    secret: str = Field(description="HMAC secret for UndoLog-Signature; shown at creation")


class DeliveryOut(OutModel):
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


@router.get("/webhooks", response_model=list[WebhookOut], tags=["admin"], summary="List webhook targets")
def list_webhooks(request: Request, limit: int = page_limit(), offset: int = page_offset(),
                  key: ApiKey = Depends(ADMIN)) -> list[WebhookOut]:
    return [WebhookOut.model_validate(dataclasses.asdict(t)) for t in server_state(request).store.targets()[offset: offset + limit]]


@router.post("/webhooks", response_model=WebhookCreated, status_code=201, tags=["admin"], summary="Add a webhook target")
def create_webhook(request: Request, body: WebhookIn, key: ApiKey = Depends(ADMIN)) -> WebhookCreated:
    st = server_state(request)
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
def delete_webhook(request: Request, target_id: str = id_path(), key: ApiKey = Depends(ADMIN)) -> Response:
    if not server_state(request).store.delete_target(target_id):
        raise Problem(404, "webhook_not_found", f"no webhook target {target_id!r}")
    return Response(status_code=204)


@router.get(
    "/webhooks/{target_id}/deliveries", response_model=list[DeliveryOut], tags=["admin"], summary="Delivery log"
)
def webhook_deliveries(
    request: Request, target_id: str = id_path(), limit: int = Query(100, ge=1, le=1000), key: ApiKey = Depends(ADMIN)
) -> list[DeliveryOut]:
    st = server_state(request)
    if st.store.get_target(target_id) is None:
        raise Problem(404, "webhook_not_found", f"no webhook target {target_id!r}")
    return [DeliveryOut.model_validate(d) for d in st.store.deliveries(target_id, limit)]
