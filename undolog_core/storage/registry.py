"""The tool registry's SQL: immutable, revisioned contracts; a new revision cancels the approvals bound to the old."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from . import schema as t
from .base import Store
from .records import ContractRevision, RegisteredRevision, StateChange
from .schema import RequestState

#: Attempts at storing a batch when another process takes the same revision number first.
_REGISTER_ATTEMPTS = 3


class RegistrySQL(Store):
    """Tool contracts as rows. A revision is written once and never changed.

    Example:
        >>> [r.revision for r in storage.register_revisions([contract], actor="ci", now=utcnow())[0]]
        [1]
    """

    if TYPE_CHECKING:  # provided by ApprovalsSQL and SessionsSQL in Storage
        def cancel_request_in(
            self, conn: Connection, request_id: str, effect_id: str, why: str, now: dt.datetime
        ) -> bool: ...

        def refresh_changes_in(
            self, conn: Connection, session_id: str, now: dt.datetime
        ) -> builtins.list[StateChange]: ...

    def register_revisions(
        self, contracts: Sequence[ContractRevision], *, actor: str, now: dt.datetime
    ) -> tuple[builtins.list[RegisteredRevision], builtins.list[StateChange]]:
        """Store each contract as the tool's newest revision unless its fingerprint is the newest already.

        One transaction for the batch. A changed contract cancels the approvals bound to another fingerprint
        (pending or approved, not yet run), so a person re-decides under the new contract. Returns the revision of
        each contract, in order, and the session state changes those cancellations made.
        """
        for attempt in range(_REGISTER_ATTEMPTS):
            try:
                return self._register_once(contracts, actor, now)
            except IntegrityError:
                # Another process registered the same revision number first; read again and retry.
                if attempt == _REGISTER_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _register_once(
        self, contracts: Sequence[ContractRevision], actor: str, now: dt.datetime
    ) -> tuple[builtins.list[RegisteredRevision], builtins.list[StateChange]]:
        reg = t.tool_registry
        out: builtins.list[RegisteredRevision] = []
        changes: builtins.list[StateChange] = []
        with self.tx() as conn:
            for c in contracts:
                latest = conn.execute(
                    sa.select(reg.c.revision, reg.c.fingerprint).where(reg.c.tool_name == c.tool_name)
                    .order_by(reg.c.revision.desc()).limit(1)
                ).first()
                if latest is not None and latest.fingerprint == c.fingerprint:
                    out.append(RegisteredRevision(c.tool_name, int(latest.revision), created=False))
                    continue
                revision = 1 if latest is None else int(latest.revision) + 1
                conn.execute(
                    reg.insert().values(
                        tool_name=c.tool_name,
                        revision=revision,
                        tier=c.tier,
                        fingerprint=c.fingerprint,
                        previous_fingerprint=None if latest is None else latest.fingerprint,
                        contract=c.contract,
                        compensation_name=c.compensation_name,
                        compensation_version=c.compensation_version,
                        registered_at=now,
                        registered_by=actor,
                    )
                )
                out.append(RegisteredRevision(c.tool_name, revision, created=True))
                if latest is not None:
                    changes += self._cancel_bound_in(conn, c, revision, now)
        return out, changes

    def _cancel_bound_in(
        self, conn: Connection, c: ContractRevision, revision: int, now: dt.datetime
    ) -> builtins.list[StateChange]:
        """Approvals are bound to (fingerprint, arguments): a contract change cancels the ones not yet run."""
        r = t.approval_requests
        rows = conn.execute(
            sa.select(r.c.approval_request_id, r.c.effect_id, r.c.session_id).where(
                r.c.tool_name == c.tool_name, r.c.tool_fingerprint != c.fingerprint,
                r.c.state.in_([RequestState.PENDING, RequestState.APPROVED, RequestState.AUTO_APPROVED]),
            )
        ).all()
        changes: builtins.list[StateChange] = []
        for row in rows:
            self.cancel_request_in(
                conn, row.approval_request_id, row.effect_id,
                f"the contract of {c.tool_name!r} changed (revision {revision}); re-request approval", now,
            )
            changes += self.refresh_changes_in(conn, row.session_id, now)
        return changes

    def contract_of(self, tool_name: str, revision: int) -> dict[str, Any] | None:
        """The stored contract of one revision (``args_schema``, tier, ...), or None when it is not registered."""
        reg = t.tool_registry
        with self.read() as conn:
            contract = conn.execute(
                sa.select(reg.c.contract).where(reg.c.tool_name == tool_name, reg.c.revision == revision)
            ).scalar()
        return None if contract is None else dict(contract)

    def arguments_jsonschema_of(self, tool_name: str, revision: int) -> dict[str, Any] | None:
        """The JSON schema of one revision's arguments, or None when the revision is not registered."""
        contract = self.contract_of(tool_name, revision)
        return None if contract is None else dict(contract["args_schema"])

    def registry_history(self, tool_name: str | None = None) -> builtins.list[dict[str, Any]]:
        """Every revision (of one tool, or of all), ordered by (tool, revision)."""
        reg = t.tool_registry
        q = sa.select(reg).order_by(reg.c.tool_name, reg.c.revision)
        if tool_name:
            q = q.where(reg.c.tool_name == tool_name)
        with self.read() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]
