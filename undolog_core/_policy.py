"""The organisation's policy: one row per database, changed only with an audit event."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import _schema as t
from ._audit import append_event
from ._store import utcnow
from .errors import PolicyInvalid

if TYPE_CHECKING:
    from ._undolog import UndoLog


@dataclass(frozen=True)
class OrgPolicy:
    approval_timeout_seconds: int
    auto_approve_on_timeout: bool
    context_calls: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_LIMITS = {"approval_timeout_seconds": (1, 30 * 24 * 3600), "context_calls": (0, 1000)}


class PolicyService:
    """Read and change the org policy.

    Example:
        >>> undolog.policy.set(actor="admin:ana", approval_timeout_seconds=900)
        OrgPolicy(approval_timeout_seconds=900, auto_approve_on_timeout=False, context_calls=10)
    """

    def __init__(self, undolog: UndoLog) -> None:
        self._u = undolog

    def read(self, conn: Connection) -> OrgPolicy:
        row = conn.execute(sa.select(t.org_policy).where(t.org_policy.c.policy_id == 1)).one()
        return OrgPolicy(int(row.approval_timeout_seconds), bool(row.auto_approve_on_timeout), int(row.context_calls))

    def get(self) -> OrgPolicy:
        with self._u.store.read() as conn:
            return self.read(conn)

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
                except (TypeError, ValueError):
                    raise PolicyInvalid(f"{k} must be a whole number, got {v!r}", fields=[k]) from None
                lo, hi = _LIMITS[k]
                if not lo <= v <= hi:
                    raise PolicyInvalid(f"{k} must be between {lo} and {hi}, got {v}", fields=[k])
            clean[k] = v
        now = utcnow()
        with self._u.store.tx() as conn:
            before = self.read(conn)
            conn.execute(
                t.org_policy.update().where(t.org_policy.c.policy_id == 1).values(**clean, updated_at=now, updated_by=actor)
            )
            after = self.read(conn)
            append_event(
                conn,
                self._u.store,
                subject="policy",
                action="policy.set",
                actor=actor,
                payload={"before": before.to_dict(), "after": after.to_dict()},
                now=now,
            )
        return after
