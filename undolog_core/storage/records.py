"""What the storage hands back: plain, frozen records (never SQLAlchemy rows) and the in-memory hooks."""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any

from .base import utcnow
from .schema import EffectState, RequestState, SessionState, UndoState


@dataclass(frozen=True)
class ApprovalRecord:
    """One approval request, as a person sees it."""

    approval_request_id: str
    effect_id: str
    session_id: str
    call_id: str
    tool_name: str
    tool_revision: int
    proposed_args: dict[str, Any]
    approved_args: dict[str, Any] | None
    reason: str | None
    risk_tags: list[str]
    agent_context: list[dict[str, Any]]
    state: RequestState
    timeout_at: dt.datetime
    created_at: dt.datetime
    decided_at: dt.datetime | None
    decided_by: str | None
    decision_reason: str | None
    action_digest: str

    @property
    def seconds_left(self) -> float:
        return max(0.0, (self.timeout_at - utcnow()).total_seconds())

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["state"] = self.state.value
        for k in ("timeout_at", "created_at", "decided_at"):
            d[k] = d[k].isoformat() if d[k] else None
        d["seconds_left"] = self.seconds_left if self.state is RequestState.PENDING else 0.0
        return d


@dataclass(frozen=True)
class ExpiredRequest:
    """A request a timeout sweep settled (``timed_out`` or ``auto_approved``): what the sweep's logs and metrics
    need, without reading each request back."""

    approval_request_id: str
    effect_id: str
    session_id: str
    tool_name: str
    state: RequestState
    created_at: dt.datetime
    decided_at: dt.datetime
    decided_by: str
    decision_reason: str


@dataclass(frozen=True)
class ApprovalEvent:
    """One audit event of an approval request."""

    event_id: int
    approval_request_id: str | None
    action: str
    actor: str
    payload: dict[str, Any]
    created_at: dt.datetime
    prev_hash: str
    hash: str


@dataclass(frozen=True)
class StoredEvent:
    """One row of the audit chain exactly as stored (``payload`` is the canonical JSON text that was hashed)."""

    event_id: int
    approval_request_id: str | None
    subject: str
    action: str
    actor: str
    payload: str
    created_at: dt.datetime
    prev_hash: str
    hash: str


@dataclass(frozen=True)
class SessionRecord:
    """One session, as the CLI, the server and the adapters read it."""

    session_id: str
    agent_id: str | None
    state: SessionState
    tool_calls_total: int
    created_by: str | None
    halted_reason: str | None
    on_failure: str
    pinned_revisions: dict[str, int]
    created_at: dt.datetime
    updated_at: dt.datetime

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["state"] = self.state.value
        d["created_at"] = self.created_at.isoformat()
        d["updated_at"] = self.updated_at.isoformat()
        return d


@dataclass(frozen=True)
class OrgPolicy:
    """The organisation's approval policy (one row per database)."""

    approval_timeout_seconds: int
    auto_approve_on_timeout: bool
    context_calls: int
    # How long an approved call may wait to be re-issued before its approval lapses (``expired``).
    approved_ttl_seconds: int = 24 * 3600

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StateChange:
    """A session state the storage just wrote, for the in-memory session caches to follow."""

    session_id: str
    state: SessionState


@dataclass(frozen=True)
class RegisteredRevision:
    """The revision a tool contract was stored under (an existing one when the fingerprint is unchanged)."""

    tool_name: str
    revision: int
    created: bool


@dataclass(frozen=True)
class ContractRevision:
    """A tool contract to store: what ``store.registry.register`` needs of a ``ToolSpec``."""

    tool_name: str
    tier: str
    fingerprint: str
    contract: dict[str, Any]
    compensation_name: str | None
    compensation_version: int | None


__all__ = [
    "ApprovalEvent",
    "ApprovalRecord",
    "ContractRevision",
    "EffectState",
    "OrgPolicy",
    "RegisteredRevision",
    "RequestState",
    "SessionRecord",
    "SessionState",
    "StateChange",
    "StoredEvent",
    "UndoState",
]
