"""Who a principal is, for the desk and the MCP gateway alike: API keys, their roles, approver groups and the
principal reference ``key:<id>`` stored as a session's owner.

One model for both, so that the desk's checks (no key decides what it raised; approver groups) see a gateway
session's owner in the very form they compare. Before this module the gateway stored ``"<name> (key <id>)"``
and the desk compared ``"key:<id>"``: a key holding the agent and approver roles could approve its own
IRREVERSIBLE request. Nothing here imports a web framework or the database, so the gateway imports it freely.

Example:
    >>> ref = principal_ref("3f2c9a1b0d4e")
    >>> ref
    'key:3f2c9a1b0d4e'
    >>> key_id_of(ref)
    '3f2c9a1b0d4e'
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from undolog_core.limits import MAX_ID_LENGTH

__all__ = [
    "KEY_ID_BYTES",
    "KEY_NAME_MAX",
    "PRINCIPAL_PREFIX",
    "ROLES",
    "ApiKey",
    "ApproverGroup",
    "Role",
    "is_admin",
    "key_id_of",
    "legacy_owner_key_id",
    "owns",
    "owns_session",
    "principal_ref",
]


class Role(StrEnum):
    """What a key may do: ``agent`` runs sessions (and acts as an MCP client of the gateway), ``approver``
    decides requests, ``admin`` manages keys and groups (and sees everything)."""

    AGENT = "agent"
    APPROVER = "approver"
    ADMIN = "admin"


ROLES: tuple[str, ...] = tuple(r.value for r in Role)

#: Random bytes in a key id (12 hex digits).
KEY_ID_BYTES = 6
#: The longest key name: its identity ``<name> (key <12 hex>)`` then fits the core's one length rule.
KEY_NAME_MAX = MAX_ID_LENGTH - len(" (key )") - 2 * KEY_ID_BYTES

#: A principal reference is this prefix and a key id: the only owner form the desk's checks accept.
PRINCIPAL_PREFIX = "key:"

# The owner form the gateway wrote before revision 0012_principal_refs: "<name> (key <hex id>)". Anchored on the
# last "(key ...)" so a name holding parentheses still parses.
_LEGACY_OWNER = re.compile(r"^.* \(key ([0-9a-f]{1,64})\)$", re.DOTALL)


def principal_ref(key_id: str) -> str:
    """The reference a key's sessions are recorded with (``sessions.created_by``).

    Args:
        key_id: The key's id.

    Returns:
        ``key:<key_id>``.

    Example:
        >>> principal_ref("ab12")
        'key:ab12'
    """
    return PRINCIPAL_PREFIX + key_id


def key_id_of(ref: str | None) -> str | None:
    """The key id of a principal reference, or None for anything else (a legacy form, a free-text name).

    Example:
        >>> key_id_of("key:ab12"), key_id_of("bot (key ab12)")
        ('ab12', None)
    """
    if ref and ref.startswith(PRINCIPAL_PREFIX) and len(ref) > len(PRINCIPAL_PREFIX):
        return ref[len(PRINCIPAL_PREFIX):]
    return None


def legacy_owner_key_id(owner: str | None) -> str | None:
    """The key id inside an owner stored in the pre-0012 gateway form ``"<name> (key <id>)"``, else None.

    Used only by the migration that rewrites such owners; no check compares this form.

    Example:
        >>> legacy_owner_key_id("bot (key ab12)")
        'ab12'
    """
    if not owner:
        return None
    m = _LEGACY_OWNER.match(owner)
    return m.group(1) if m else None


@dataclass(frozen=True)
class ApiKey:
    """A stored API key (never holds the secret).

    Example:
        >>> from datetime import UTC, datetime
        >>> k = ApiKey("ab12", "bot", frozenset({"agent"}), frozenset(), datetime.now(UTC))
        >>> k.principal_ref, k.identity
        ('key:ab12', 'bot (key ab12)')
    """

    key_id: str
    name: str
    roles: frozenset[str]
    groups: frozenset[str]
    created_at: datetime
    created_by: str | None = None
    revoked_at: datetime | None = None
    last_used_at: datetime | None = None

    @property
    def identity(self) -> str:
        """What decisions and the audit trail record about this key's holder (a display name, never compared)."""
        return f"{self.name} (key {self.key_id})"

    @property
    def principal_ref(self) -> str:
        """The stable reference stored in ``sessions.created_by``: what ownership checks compare."""
        return principal_ref(self.key_id)

    def has(self, role: Role | str) -> bool:
        """Whether the key holds ``role``."""
        return str(role) in self.roles


@dataclass(frozen=True)
class ApproverGroup:
    """An approver group: who may see and decide requests for some tools or risk tags.

    Example:
        >>> ApproverGroup("finance", tools=("pay",)).matches("pay", [])
        True
    """

    name: str
    tools: tuple[str, ...] = ()
    risk_tags: tuple[str, ...] = ()
    description: str | None = None

    def matches(self, tool_name: str, risk_tags: Iterable[str]) -> bool:
        return tool_name in self.tools or bool(set(self.risk_tags) & set(risk_tags))


def is_admin(key: ApiKey) -> bool:
    """Whether the key holds the admin role."""
    return key.has(Role.ADMIN)


def owns(key: ApiKey, created_by: str | None) -> bool:
    """Whether a session recorded as created by ``created_by`` is this key's: only the ``key:<id>`` form counts.

    Example:
        >>> from datetime import UTC, datetime
        >>> k = ApiKey("ab12", "bot", frozenset({"agent"}), frozenset(), datetime.now(UTC))
        >>> owns(k, "key:ab12"), owns(k, "bot (key ab12)")
        (True, False)
    """
    return created_by is not None and created_by == key.principal_ref


def owns_session(key: ApiKey, session: Any) -> bool:
    """Whether the session (an object or a row mapping with ``created_by``) was created by this key."""
    created_by = session.get("created_by") if isinstance(session, dict) else getattr(session, "created_by", None)
    return owns(key, created_by)
