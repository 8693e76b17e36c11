"""Bearer-key authentication and role checks for the REST API.

Roles are checked from the key alone, before any handler looks up an object, so a
wrong-role caller learns nothing about which ids exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .problems import Problem
from .store import ApiKey

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
    key = server_state(request).store.authenticate(credentials.credentials.strip())
    if key is None:
        raise Problem(401, "invalid_api_key", "the API key is unknown or revoked", headers=_CHALLENGE)
    request.state.api_key = key
    return key


def require(*roles: str) -> Callable[..., ApiKey]:
    """Build a dependency admitting keys holding any of ``roles``.

    Args:
        *roles: Accepted roles.

    Returns:
        A FastAPI dependency returning the caller's key.
    """
    wanted = frozenset(roles)

    def dependency(key: ApiKey = Depends(authenticate)) -> ApiKey:
        if not (key.roles & wanted):
            raise Problem(
                403,
                "role_forbidden",
                f"this endpoint needs one of the roles {', '.join(sorted(wanted))}; "
                f"the key has {', '.join(sorted(key.roles)) or 'none'}",
                required_roles=sorted(wanted),
            )
        return key

    dependency.__name__ = "require_" + "_or_".join(sorted(wanted))
    return dependency


def is_admin(key: ApiKey) -> bool:
    return "admin" in key.roles


def owns_session(key: ApiKey, session: Any) -> bool:
    """Whether the session was created by this key."""
    return getattr(session, "created_by", None) == key.principal_ref
