"""``store.policy``: the org policy table (``undolog_org_policy``), one row per database, changed only with an audit
event."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from . import schema as t
from .base import Store
from .records import OrgPolicy

if TYPE_CHECKING:
    from .audit import AuditSQL

_P = t.org_policy
_THE_ROW = sa.select(_P).where(_P.c.policy_id == 1)
_UPDATE_THE_ROW = _P.update().where(_P.c.policy_id == 1)


class PolicySQL:
    """``store.policy``: read and write the single policy row (``contract.PolicyRepository``).

    Example:
        >>> storage.policy.get().approval_timeout_seconds
        3600
    """

    def __init__(self, store: Store, *, audit: AuditSQL) -> None:
        self._store = store
        self._audit = audit

    @staticmethod
    def get_in(conn: Connection) -> OrgPolicy:
        """The policy as the caller's transaction sees it."""
        row = conn.execute(_THE_ROW).one()
        return OrgPolicy(int(row.approval_timeout_seconds), bool(row.auto_approve_on_timeout), int(row.context_calls),
                         int(row.approved_ttl_seconds))

    def get(self) -> OrgPolicy:
        """The policy, in a read transaction of its own."""
        with self._store.read() as conn:
            return self.get_in(conn)

    def set(self, changes: Mapping[str, Any], *, actor: str, now: dt.datetime) -> tuple[OrgPolicy, OrgPolicy]:
        """Apply validated ``changes`` and audit them (event ``policy.set``) in one transaction; (before, after)."""
        with self._store.tx() as conn:
            before = self.get_in(conn)
            conn.execute(_UPDATE_THE_ROW.values(**dict(changes), updated_at=now, updated_by=actor))
            after = self.get_in(conn)
            self._audit.append_event_in(conn, subject="policy", action="policy.set", actor=actor,
                                        payload={"before": before.to_dict(), "after": after.to_dict()}, now=now)
        return before, after
