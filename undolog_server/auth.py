"""Bearer-key authentication and role checks for the REST API.

Roles are checked from the key alone, before any handler looks up an object, so a
wrong-role caller learns nothing about which ids exist.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from fastapi import Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .identity import ApiKey
from .identity import is_admin as is_admin  # re-exported: it was defined here
from .identity import owns_session as owns_session  # re-exported: it was defined here
from .problems import Problem

if TYPE_CHECKING:
    from .state import ServerState

bearer_scheme = HTTPBearer(
    auto_error=False,
    description="An UndoLog API key (`undolog keys create`), sent as `Authorization: Bearer ulk_...`.",
)

_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="undolog"'}


def server_state(request: Request) -> ServerState:
    """Return the server state attached to the app."""
    return request.app.state.undolog_server  # type: ignore[no-any-return]


def authenticate(
    request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer_scheme)
) -> ApiKey:
    """Resolve the caller's API key.

    Raises:
        Problem: 401 when no valid key was presented.
    """
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise Problem(401, "unauthenticated", "send an API key as 'Authorization: Bearer <key>'", headers=_CHALLENGE)
    return _resolve(request, credentials.credentials)


def _resolve(request: Request, token: str) -> ApiKey:
    key = server_state(request).store.authenticate(token.strip())
    if key is None:
        raise Problem(401, "invalid_api_key", "the API key is unknown or revoked", headers=_CHALLENGE)
    request.state.api_key = key
    return key


def _check_roles(key: ApiKey, wanted: frozenset[str]) -> None:
    if not (key.roles & wanted):
        raise Problem(
            403,
            "role_forbidden",
            f"this endpoint needs one of the roles {', '.join(sorted(wanted))}; "
            f"the key has {', '.join(sorted(key.roles)) or 'none'}",
            required_roles=sorted(wanted),
        )


def _authorize_now(request: Request, wanted: frozenset[str]) -> None:
    """The role check done outside FastAPI's dependency resolution (see :class:`AuthFirstRoute`)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Problem(401, "unauthenticated", "send an API key as 'Authorization: Bearer <key>'", headers=_CHALLENGE)
    _check_roles(_resolve(request, token), wanted)


def require(*roles: str) -> Callable[..., Coroutine[Any, Any, ApiKey]]:
    """Build a dependency admitting keys holding any of ``roles``.

    Args:
        *roles: Accepted roles.

    Returns:
        A FastAPI dependency returning the caller's key.
    """
    wanted = frozenset(roles)

    # Async: the role check reads only the key, and a sync dependency would cost each request one more hop
    # through the thread pool (under load, a wait for a thread and for the GIL; see undolog_server.lanes).
    async def dependency(key: ApiKey = Depends(authenticate)) -> ApiKey:
        _check_roles(key, wanted)
        return key

    dependency.__name__ = "require_" + "_or_".join(sorted(wanted))
    dependency.undolog_roles = wanted  # type: ignore[attr-defined]
    return dependency


def _route_roles(route: APIRoute) -> frozenset[str] | None:
    stack = list(route.dependant.dependencies)
    while stack:
        dep = stack.pop()
        roles = getattr(dep.call, "undolog_roles", None)
        if roles is not None:
            return frozenset(roles)
        stack.extend(dep.dependencies)
    return None


class AuthFirstRoute(APIRoute):
    """A route whose 401/403 come before any complaint about the request body.

    FastAPI parses a JSON body before it resolves dependencies, so a malformed body would
    otherwise answer 422 to a caller with no key or the wrong role. When a request fails
    validation before the role check ran, the role check runs now and wins.
    """

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        roles = _route_roles(self)
        if roles is None:
            return handler

        async def auth_first(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError:
                if getattr(request.state, "api_key", None) is None:
                    await run_in_threadpool(_authorize_now, request, roles)
                raise

        return auth_first
