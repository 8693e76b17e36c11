"""The admin routes under ``/v1/email``: approver addresses mapped to keys, what each group's mail carries, the outbox.

Every change is audited; the mail outbox is listed by status only, never its content.

Example:
    >>> from fastapi import FastAPI
    >>> FastAPI().include_router(api)
"""

from __future__ import annotations

import re
from datetime import datetime

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi import Path as PathParam
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from ..auth import AuthFirstRoute, require, server_state
from ..identity import ApiKey
from ..problems import Problem
from ..storage.email import EmailStore
from .sender import email_store

__all__ = ["ADDRESS_PATTERN", "api"]

#: What the admin API takes for an address (deliberately plain: one mailbox, no display name, no list).
ADDRESS_PATTERN = r"^[^@\s<>\",;]{1,64}@[A-Za-z0-9.-]{1,253}\.[A-Za-z0-9-]{2,63}$"
_ADDRESS = re.compile(ADDRESS_PATTERN)


api = APIRouter(prefix="/v1/email", route_class=AuthFirstRoute, tags=["admin"])
ADMIN = require("admin")


class AddressIn(BaseModel):
    """Which key an approver address stands for."""

    model_config = ConfigDict(extra="forbid")
    key_id: str = Field(min_length=1, max_length=32, description="The approver's API key id.")


class AddressOut(BaseModel):
    """An approver address and its key."""

    address: str
    key_id: str
    created_at: datetime
    created_by: str | None


class GroupMailIn(BaseModel):
    """What the mails of an approver group's requests carry."""

    model_config = ConfigDict(extra="forbid")
    include_arguments: StrictBool = Field(description="Put the call's arguments in the mail (else a link only).")


class GroupMailOut(GroupMailIn):
    """An approver group's mail setting ('*': requests routed to no group)."""

    group: str


class MessageOut(BaseModel):
    """One row of the mail outbox (never its content)."""

    message_id: str
    kind: str
    approval_request_id: str
    status: str
    attempts: int
    last_error: str | None
    created_at: datetime
    sent_at: datetime | None


_ADDRESS_PARAM = PathParam(max_length=320, pattern=ADDRESS_PATTERN, description="The approver's address.")


def _estore(request: Request) -> EmailStore:
    return email_store(server_state(request))


def _address(address: str) -> str:
    address = address.strip().lower()
    if not _ADDRESS.match(address):
        raise Problem(422, "invalid_email_address",
                      f"{address!r} is not an email address; send one like ana@example.com")
    return address


@api.get("/approvers", response_model=list[AddressOut], summary="List approver email addresses")
def list_addresses(request: Request, key: ApiKey = Depends(ADMIN)) -> list[AddressOut]:
    return [AddressOut.model_validate(r) for r in _estore(request).addresses()]


@api.put("/approvers/{address}", response_model=AddressOut, summary="Map an email address to an approver key")
def put_address(request: Request, body: AddressIn, address: str = _ADDRESS_PARAM,
                key: ApiKey = Depends(ADMIN)) -> AddressOut:
    address = _address(address)
    st = server_state(request)
    target = st.store.get_key(body.key_id)
    if target is None:
        raise Problem(409, "key_not_found", f"no active key {body.key_id!r}; create it first (POST /v1/keys)")
    if not target.roles & {"approver", "admin"}:
        raise Problem(409, "key_not_approver",
                      f"key {body.key_id!r} has neither the approver nor the admin role; only approvers get mail")
    store = _estore(request)
    before = store.map_address(address, body.key_id, actor=key.identity)
    st.undolog.record_audit(subject=f"email:{address}", action="email_address_mapped", actor=key.identity,
                            payload={"key_id": body.key_id, "previous_key_id": before})
    return next(AddressOut.model_validate(r) for r in store.addresses() if r["address"] == address)


@api.delete("/approvers/{address}", status_code=204, summary="Remove an approver email address")
def delete_address(request: Request, address: str = _ADDRESS_PARAM, key: ApiKey = Depends(ADMIN)) -> Response:
    address = address.strip().lower()
    before = _estore(request).unmap_address(address)
    if before is None:
        raise Problem(404, "email_address_not_found", f"no approver address {address!r}")
    server_state(request).undolog.record_audit(subject=f"email:{address}", action="email_address_unmapped",
                                               actor=key.identity, payload={"key_id": before})
    return Response(status_code=204)


@api.get("/groups", response_model=list[GroupMailOut], summary="List what each group's mails carry")
def list_group_settings(request: Request, key: ApiKey = Depends(ADMIN)) -> list[GroupMailOut]:
    return [GroupMailOut(group=g, include_arguments=v) for g, v in sorted(_estore(request).group_settings().items())]


@api.put("/groups/{group}", response_model=GroupMailOut, summary="Set whether a group's mails carry the arguments")
def put_group_setting(request: Request, body: GroupMailIn,
                      group: str = PathParam(min_length=1, max_length=100, description="A group's name; '*': no group."),
                      key: ApiKey = Depends(ADMIN)) -> GroupMailOut:
    _estore(request).put_group_setting(group, body.include_arguments)
    server_state(request).undolog.record_audit(subject=f"email-group:{group}", action="email_group_set",
                                               actor=key.identity, payload={"include_arguments": body.include_arguments})
    return GroupMailOut(group=group, include_arguments=body.include_arguments)


@api.get("/messages", response_model=list[MessageOut], summary="The mail outbox (status only)")
def list_messages(request: Request, approval_request_id: str | None = Query(None, max_length=64),
                  key: ApiKey = Depends(ADMIN)) -> list[MessageOut]:
    return [MessageOut.model_validate(r) for r in _estore(request).messages(approval_request_id)]
