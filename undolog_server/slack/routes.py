"""The Slack routes under ``/v1/slack``: Slack's interactivity request URL and the admins' channels and users.

``POST /v1/slack/interactivity`` is authenticated by Slack's signature (:meth:`SlackDesk.verify`), not by an API key;
the admin routes (``/users``, ``/channels``) authenticate first, like every ``/v1`` route, and every change is
audited.

Example:
    >>> from fastapi import FastAPI
    >>> FastAPI().include_router(router)
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from fastapi import APIRouter, Depends, Path, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from ..auth import AuthFirstRoute, require, server_state
from ..identity import ApiKey
from ..problems import Problem
from ..storage.slack import SlackChannel
from .desk import SlackDesk
from .sender import slack_store

__all__ = ["admin_router", "router"]

router = APIRouter(prefix="/v1/slack", tags=["slack"])
# The admin routes authenticate before anything else, like every /v1 route; the interactivity route is Slack's and
# is authenticated by its signature instead.
admin_router = APIRouter(route_class=AuthFirstRoute, tags=["slack"])
ADMIN = require("admin")


def _desk(request: Request) -> SlackDesk:
    st = server_state(request)
    desk: SlackDesk | None = getattr(st, "slack", None)
    if desk is None:
        raise Problem(404, "slack_not_configured", "Slack is not configured on this desk: set UNDOLOG_SLACK_BOT_TOKEN, "
                      "UNDOLOG_SLACK_SIGNING_SECRET and UNDOLOG_SLACK_TEAM_ID (see docs/how-to/slack.md)")
    return desk


@router.post("/interactivity", include_in_schema=False)
async def interactivity(request: Request) -> Response:
    """Slack's Interactivity Request URL: button clicks and modal submissions, signed by Slack."""
    desk = _desk(request)
    body = await request.body()
    headers = {k.lower(): v for k, v in request.headers.items()}
    from starlette.concurrency import run_in_threadpool

    await run_in_threadpool(desk.verify, body, headers)
    form = urllib.parse.parse_qs(body.decode("utf-8", "replace"))
    try:
        payload = json.loads((form.get("payload") or [""])[0])
        if not isinstance(payload, dict):
            raise ValueError("not an object")
    except ValueError:
        raise Problem(400, "slack_payload_invalid", "the request has no JSON 'payload' form field") from None
    answer = await run_in_threadpool(desk.handle, payload)
    if answer is not None and "decided" in answer or (answer or {}).get("response_action") == "clear":
        desk.kick()
    if answer is None:
        return Response(status_code=200)
    return JSONResponse(answer)


class SlackUserIn(BaseModel):
    """The API key a Slack user decides with."""

    key_id: str = Field(min_length=1, max_length=32)


class SlackUserOut(BaseModel):
    team_id: str
    user_id: str
    key_id: str
    created_by: str | None = None


class SlackChannelIn(BaseModel):
    """Where an approver group's requests are posted, and what of them is hidden."""

    channel: str = Field(min_length=1, max_length=100, description="Channel id requests are posted to.")
    escalation_channel: str | None = Field(None, min_length=1, max_length=100,
                                           description="Channel an undecided request is re-posted to, at "
                                                       "escalate_after_seconds or else at the notification policy's "
                                                       "escalation time for its risk tags.")
    escalate_after_seconds: int | None = Field(None, ge=1, le=30 * 86400,
                                               description="Seconds after the request was raised (default: "
                                                           "the notification policy's escalation time).")
    sensitive: list[str] = Field(default_factory=list, max_length=200,
                                 description="Argument names (or JSON Pointers) shown as hidden in Slack.")


class SlackChannelOut(SlackChannelIn):
    group: str


def _slack_id() -> Any:
    """A fresh path-parameter declaration of a Slack id (FastAPI binds one FieldInfo to one parameter)."""
    return Path(min_length=1, max_length=32, pattern=r"^[A-Z0-9]+$")


@admin_router.get("/users", response_model=list[SlackUserOut], summary="Slack users mapped to API keys")
def list_users(request: Request, key: ApiKey = Depends(ADMIN)) -> list[SlackUserOut]:
    return [SlackUserOut.model_validate(u) for u in slack_store(server_state(request)).users()]


@admin_router.put("/users/{team_id}/{user_id}", response_model=SlackUserOut,
                  summary="Map a Slack user (workspace id, user id) to an approver key (audited)")
def put_user(request: Request, body: SlackUserIn, team_id: str = _slack_id(), user_id: str = _slack_id(),
             key: ApiKey = Depends(ADMIN)) -> SlackUserOut:
    st = server_state(request)
    target = st.store.get_key(body.key_id)
    if target is None or target.revoked_at is not None:
        # 409: the body is valid; the key it names is not there now (create it, then map again).
        raise Problem(409, "key_not_found", f"no active key {body.key_id!r}: create it first (POST /v1/keys)")
    if not target.roles & {"approver", "admin"}:
        raise Problem(409, "key_not_approver", f"key {body.key_id!r} has no approver role: a Slack user decides with "
                      "an approver key")
    before = slack_store(st).put_user(team_id, user_id, body.key_id, key.identity)
    st.undolog.record_audit(subject=f"slack:{team_id}/{user_id}", action="slack_user_mapped", actor=key.identity,
                            payload={"team_id": team_id, "user_id": user_id, "key_id": body.key_id, "before": before})
    return SlackUserOut(team_id=team_id, user_id=user_id, key_id=body.key_id, created_by=key.identity)


@admin_router.delete("/users/{team_id}/{user_id}", status_code=204, summary="Unmap a Slack user (audited)")
def delete_user(request: Request, team_id: str = _slack_id(), user_id: str = _slack_id(),
                key: ApiKey = Depends(ADMIN)) -> Response:
    st = server_state(request)
    before = slack_store(st).delete_user(team_id, user_id)
    if before is None:
        raise Problem(404, "slack_user_not_found", f"Slack user {team_id}/{user_id} is not mapped")
    st.undolog.record_audit(subject=f"slack:{team_id}/{user_id}", action="slack_user_unmapped", actor=key.identity,
                            payload={"team_id": team_id, "user_id": user_id, "key_id": before})
    return Response(status_code=204)


@admin_router.get("/channels", response_model=list[SlackChannelOut], summary="Slack channels per approver group")
def list_channels(request: Request, key: ApiKey = Depends(ADMIN)) -> list[SlackChannelOut]:
    return [SlackChannelOut(group=c.group, channel=c.channel, escalation_channel=c.escalation_channel,
                            escalate_after_seconds=c.escalate_after_seconds, sensitive=list(c.sensitive))
            for c in slack_store(server_state(request)).channels()]


@admin_router.put("/channels/{group}", response_model=SlackChannelOut,
                  summary="Route an approver group's requests to a Slack channel ('*': requests no group claims)")
def put_channel(request: Request, body: SlackChannelIn, group: str = Path(min_length=1, max_length=100),
                key: ApiKey = Depends(ADMIN)) -> SlackChannelOut:
    st = server_state(request)
    if group != "*" and group not in {g.name for g in st.store.groups()}:
        raise Problem(409, "group_not_found", f"no approver group {group!r}: create it first "
                      "(PUT /v1/approver-groups/{name}) or use '*'")
    slack_store(st).put_channel(SlackChannel(group, body.channel, body.escalation_channel,
                                                          body.escalate_after_seconds, tuple(body.sensitive)))
    st.undolog.record_audit(subject=f"slack-channel:{group}", action="slack_channel_set", actor=key.identity,
                            payload={"group": group, **body.model_dump()})
    return SlackChannelOut(group=group, **body.model_dump())


@admin_router.delete("/channels/{group}", status_code=204, summary="Stop posting an approver group's requests")
def delete_channel(request: Request, group: str = Path(min_length=1, max_length=100),
                   key: ApiKey = Depends(ADMIN)) -> Response:
    st = server_state(request)
    if not slack_store(st).delete_channel(group):
        raise Problem(404, "slack_channel_not_found", f"no Slack channel configured for {group!r}")
    st.undolog.record_audit(subject=f"slack-channel:{group}", action="slack_channel_removed", actor=key.identity,
                            payload={"group": group})
    return Response(status_code=204)


# Included last: a router's routes are copied when it is included.
router.include_router(admin_router)
