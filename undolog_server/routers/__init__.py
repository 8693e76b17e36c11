"""The REST API under ``/v1``, one router per resource, each with its request and response models beside it.

Every route declares its roles with :func:`undolog_server.auth.require`, which runs before the handler, so
401/403 never depend on whether the addressed object exists.

Example:
    >>> from undolog_server.routers import router
    >>> sorted({r.path.split("/")[2].split(":")[0] for r in router.routes})[:3]
    ['approvals', 'approver-groups', 'audit']
"""

from __future__ import annotations

from fastapi import APIRouter

from ..auth import AuthFirstRoute
from . import approvals, audit, effects, groups, keys, meta, policies, sessions, tools, webhooks

router = APIRouter(prefix="/v1", route_class=AuthFirstRoute)
# Included in the order the routes were declared in before the split: Starlette matches in order.
for _resource in (meta, approvals, sessions, effects, tools, audit, keys, groups, webhooks, policies):
    router.include_router(_resource.router)
