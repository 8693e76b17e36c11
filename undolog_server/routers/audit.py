"""``/v1/audit/verify``: the approval events' hash chain."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from ..auth import AuthFirstRoute, server_state
from ..storage import ApiKey
from .common import APPROVER, OutModel

router = APIRouter(route_class=AuthFirstRoute)


class AuditOut(OutModel):
    ok: bool
    events_checked: int | None = None
    detail: Any = None


@router.get("/audit/verify", response_model=AuditOut, tags=["audit"], summary="Verify the approval events hash chain")
def audit_verify(request: Request, key: ApiKey = Depends(APPROVER)) -> AuditOut:
    from ..coreops import verify_audit

    return AuditOut.model_validate(verify_audit(server_state(request).undolog))
