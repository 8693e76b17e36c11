"""The org policy's SQL: one row per database, changed only with an audit event."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import schema as t
from .base import Store
from .records import OrgPolicy

if TYPE_CHECKING:
    from .audit import OutboxItem


class PolicySQL(Store):
    """Read and write the single policy row.

    Example:
        >>> storage.get_policy().approval_timeout_seconds
        3600
    """

    if TYPE_CHECKING:  # provided by AuditSQL in Storage
        def append_event_in(self, conn: Connection, *, subject: str, action: str, actor: str,
                            payload: Mapping[str, Any], approval_request_id: str | None = None,
                            outbox: Iterable[OutboxItem] = (), now: dt.datetime | None = None) -> int: ...

    def policy_in(self, conn: Connection) -> OrgPolicy:
        """The policy as the caller's transaction sees it."""
        row = conn.execute(sa.select(t.org_policy).where(t.org_policy.c.policy_id == 1)).one()
        return OrgPolicy(int(row.approval_timeout_seconds), bool(row.auto_approve_on_timeout), int(row.context_calls),
                         int(row.approved_ttl_seconds))

    def get_policy(self) -> OrgPolicy:
        with self.read() as conn:
            return self.policy_in(conn)

    def set_policy(self, changes: Mapping[str, Any], *, actor: str, now: dt.datetime) -> tuple[OrgPolicy, OrgPolicy]:
        """Apply validated ``changes`` and audit them (event ``policy.set``) in one transaction; (before, after)."""
        with self.tx() as conn:
            before = self.policy_in(conn)
            conn.execute(
                t.org_policy.update().where(t.org_policy.c.policy_id == 1)
                .values(**dict(changes), updated_at=now, updated_by=actor)
            )
            after = self.policy_in(conn)
            self.append_event_in(conn, subject="policy", action="policy.set", actor=actor,
                                 payload={"before": before.to_dict(), "after": after.to_dict()}, now=now)
        return before, after
