"""``store.registry``: the tool registry table (``undolog_tool_registry``), immutable revisioned contracts; a new
revision cancels the approvals bound to the old."""

from __future__ import annotations

import builtins
import datetime as dt
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from . import schema as t
from .base import Store
from .records import ContractRevision, RegisteredRevision, StateChange
from .schema import RequestState

#: Attempts at storing a batch when another process takes the same revision number first.
_REGISTER_ATTEMPTS = 3

_R = t.tool_registry
_LATEST = sa.select(_R.c.revision, _R.c.fingerprint).order_by(_R.c.revision.desc()).limit(1)
_CONTRACT = sa.select(_R.c.contract)
_HISTORY = sa.select(_R).order_by(_R.c.tool_name, _R.c.revision)
_Q = t.approval_requests
_UNRUN_REQUESTS = sa.select(_Q.c.approval_request_id, _Q.c.effect_id, _Q.c.session_id).where(
    _Q.c.state.in_([RequestState.PENDING, RequestState.APPROVED, RequestState.AUTO_APPROVED]))

#: ``store.approvals.cancel_request_in``: cancel one request (and its effect) in the caller's transaction.
CancelRequestIn = Callable[[Connection, str, str, str, dt.datetime], bool]
#: ``SessionsSQL.refresh_changes_in``: the session state changes a cancellation made.
RefreshChangesIn = Callable[[Connection, str, dt.datetime], "builtins.list[StateChange]"]


class RegistrySQL:
    """``store.registry``: tool contracts as rows; a revision is written once and never changed
    (``contract.RegistryRepository``). It receives the two approval-side writes a new revision makes (cancelling
    the requests bound to the old contract, refreshing their sessions' states) rather than reaching for them.

    Example:
        >>> [r.revision for r in storage.registry.register([contract], actor="ci", now=utcnow())[0]]
        [1]
    """

    def __init__(self, store: Store, *, cancel_request_in: CancelRequestIn,
                 refresh_changes_in: RefreshChangesIn) -> None:
        self._store = store
        self._cancel_request_in = cancel_request_in
        self._refresh_changes_in = refresh_changes_in

    def register(
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
        out: builtins.list[RegisteredRevision] = []
        changes: builtins.list[StateChange] = []
        with self._store.tx() as conn:
            for c in contracts:
                latest = conn.execute(_LATEST.where(_R.c.tool_name == c.tool_name)).first()
                if latest is not None and latest.fingerprint == c.fingerprint:
                    out.append(RegisteredRevision(c.tool_name, int(latest.revision), created=False))
                    continue
                revision = 1 if latest is None else int(latest.revision) + 1
                conn.execute(
                    _R.insert().values(
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
        rows = conn.execute(
            _UNRUN_REQUESTS.where(_Q.c.tool_name == c.tool_name, _Q.c.tool_fingerprint != c.fingerprint)
        ).all()
        changes: builtins.list[StateChange] = []
        for row in rows:
            self._cancel_request_in(
                conn, row.approval_request_id, row.effect_id,
                f"the contract of {c.tool_name!r} changed (revision {revision}); re-request approval", now,
            )
            changes += self._refresh_changes_in(conn, row.session_id, now)
        return changes

    def contract_of(self, tool_name: str, revision: int) -> dict[str, Any] | None:
        """The stored contract of one revision (``args_schema``, tier, ...), or None when it is not registered."""
        with self._store.read() as conn:
            contract = conn.execute(_CONTRACT.where(_R.c.tool_name == tool_name, _R.c.revision == revision)).scalar()
        return None if contract is None else dict(contract)

    def arguments_jsonschema_of(self, tool_name: str, revision: int) -> dict[str, Any] | None:
        """The JSON schema of one revision's arguments, or None when the revision is not registered."""
        contract = self.contract_of(tool_name, revision)
        return None if contract is None else dict(contract["args_schema"])

    def history(self, tool_name: str | None = None) -> builtins.list[dict[str, Any]]:
        """Every revision (of one tool, or of all), ordered by (tool, revision)."""
        q = _HISTORY.where(_R.c.tool_name == tool_name) if tool_name else _HISTORY
        with self._store.read() as conn:
            return [dict(r._mapping) for r in conn.execute(q)]
