"""The organisation's policy: one row per database, changed only with an audit event."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import PolicyInvalid
from .limits import check_identity
from .storage.base import utcnow
from .storage.records import OrgPolicy

if TYPE_CHECKING:
    from .storage.contract import PolicyRepository

_LIMITS = {"approval_timeout_seconds": (1, 30 * 24 * 3600), "context_calls": (0, 1000),
           "approved_ttl_seconds": (1, 365 * 24 * 3600)}


class PolicyService:
    """Read and change the org policy.

    Example:
        >>> undolog.policy.set(actor="admin:ana", approval_timeout_seconds=900)
        OrgPolicy(approval_timeout_seconds=900, auto_approve_on_timeout=False, context_calls=10)
    """

    def __init__(self, policy: PolicyRepository) -> None:
        self._policy = policy

    def read(self, conn: Any) -> OrgPolicy:
        """The policy inside the caller's transaction (``store.policy.get_in``)."""
        return self._policy.get_in(conn)

    def get(self) -> OrgPolicy:
        return self._policy.get()

    def set(self, *, actor: str, **changes: Any) -> OrgPolicy:
        unknown = set(changes) - set(OrgPolicy.__dataclass_fields__)
        if unknown:
            raise PolicyInvalid(
                f"unknown policy setting(s): {', '.join(sorted(unknown))}; known: "
                + ", ".join(OrgPolicy.__dataclass_fields__),
                fields=sorted(unknown),
            )
        if not actor:
            raise PolicyInvalid("a policy change needs an actor")
        check_identity("actor", actor)
        clean: dict[str, Any] = {}
        for k, v in changes.items():
            if v is None:
                continue
            if k == "auto_approve_on_timeout":
                if isinstance(v, str):
                    if v.lower() not in ("true", "false", "1", "0", "yes", "no"):
                        raise PolicyInvalid(f"auto_approve_on_timeout must be true or false, got {v!r}", fields=[k])
                    v = v.lower() in ("true", "1", "yes")
                if not isinstance(v, bool):
                    raise PolicyInvalid(f"auto_approve_on_timeout must be true or false, got {v!r}", fields=[k])
            else:
                try:
                    if isinstance(v, bool):
                        raise ValueError
                    v = int(v)
                except (TypeError, ValueError, OverflowError):  # OverflowError: int() of an infinity
                    raise PolicyInvalid(f"{k} must be a whole number, got {v!r}", fields=[k]) from None
                lo, hi = _LIMITS[k]
                if not lo <= v <= hi:
                    raise PolicyInvalid(f"{k} must be between {lo} and {hi}, got {v}", fields=[k])
            clean[k] = v
        _, after = self._policy.set(clean, actor=actor, now=utcnow())
        return after


__all__ = ["OrgPolicy", "PolicyService"]
