"""The interrupt payload an IRREVERSIBLE call pauses the graph with, and the resume values it accepts.

Imports pydantic and ``undolog_core`` only (no framework): the payload is plain data, and the resume
values are validated here before LangGraph stores them.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from undolog_core import AwaitingApproval, RequestState

if TYPE_CHECKING:
    from undolog_core import UndoLog

APPROVAL_INTERRUPT_TYPE = "undolog.approval_request"


class ApprovalDecision(BaseModel):
    """A decision passed in ``Command(resume=...)``.

    ``approve``/``reject``/``modify`` are recorded through UndoLog's approval service (audited) under
    ``approver``; ``from_store`` means "use whatever was decided elsewhere" (what ``undolog_resume``
    sends for requests still undecided, which pauses the graph again).

    Example:
        >>> Command(resume={"decision": "modify", "args": {"user_id": "u-7"}, "approver": "ana"})  # doctest: +SKIP
    """

    model_config = ConfigDict(extra="forbid")

    decision: Literal["approve", "reject", "modify", "from_store"]
    approver: str | None = None
    reason: str | None = None
    args: dict[str, Any] | None = None
    approval_request_id: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ApprovalDecision:
        # Checked here, before LangGraph stores the value, so a bad resume can simply be sent again.
        if self.decision != "from_store" and not (self.approver and self.approver.strip()):
            raise ValueError("a decision needs 'approver' (who decided; it goes into the audit trail)")
        if self.decision == "reject" and not (self.reason and self.reason.strip()):
            raise ValueError("a rejection needs a 'reason' (the agent is told it)")
        if self.decision == "modify" and self.args is None:
            raise ValueError("'modify' needs 'args': the complete edited arguments")
        if self.decision != "modify" and self.args is not None:
            raise ValueError("'args' goes with decision 'modify' only")
        return self


class ApprovalDecisions(BaseModel):
    """Decisions for an interrupt holding several requests (a hand-built graph's ToolNode task).

    ``{"decisions": {approval_request_id or tool_call_id: decision, ...}}``. The map is wrapped in
    ``decisions`` because LangGraph reads a top-level map of 32-hex-digit keys (as approval request
    ids are) as ``{interrupt_id: value}``.

    Example:
        >>> Command(resume={"decisions": {req_a: {"decision": "approve", "approver": "ana"},
        ...                               req_b: {"decision": "reject", "approver": "ana",
        ...                                       "reason": "wrong user"}}})  # doctest: +SKIP
    """

    model_config = ConfigDict(extra="forbid")

    decisions: dict[str, ApprovalDecision]

    @model_validator(mode="before")
    @classmethod
    def _not_single(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "decision" in data:
            raise ValueError(
                "this interrupt holds several approval requests: resume with "
                "{'decisions': {approval_request_id: {'decision': ..., 'approver': ...}, ...}}"
            )
        return data


_ONE = ApprovalDecision | ApprovalDecisions


@dataclass(frozen=True)
class _Pause:
    """A call waiting for a person: what ``interrupt()`` asks about."""

    awaiting: AwaitingApproval
    session_id: str


def payload(pauses: Sequence[_Pause], error: str | None) -> dict[str, Any]:
    """The interrupt value for ``pauses`` (the first request at the top level, all of them in ``requests``)."""
    reqs = [
        {
            "approval_request_id": p.awaiting.approval_request_id,
            "tool_call_id": p.awaiting.call_id,
            "tool": p.awaiting.tool_name,
            "args": dict(p.awaiting.args),
            "reason": p.awaiting.reason,
            "risk_tags": list(p.awaiting.risk_tags),
            "timeout_at": _iso(p.awaiting.timeout_at),
            "effect_id": p.awaiting.effect_id,
        }
        for p in pauses
    ]
    hint = (
        "Command(resume={'decision': 'approve'|'reject'|'modify', 'approver': '<who>', 'reason': '...', "
        "'args': {...}})"
        if len(reqs) == 1
        else "Command(resume={'decisions': {<approval_request_id>: {'decision': ..., 'approver': ...}, ...}})"
    )
    return {
        "type": APPROVAL_INTERRUPT_TYPE,
        "session_id": pauses[0].session_id,
        **reqs[0],
        "requests": reqs,
        "resume_with": hint + " or decide elsewhere and resume with undolog_resume(graph, config)",
        "error": error,
    }


def resume_value_for(u: UndoLog, value: Mapping[str, Any]) -> Any:
    """The resume value for one UndoLog interrupt, built from what the store says was decided."""
    out: dict[str, Any] = {}
    for req in value.get("requests") or [value]:
        rid = req["approval_request_id"]
        rec = u.approvals.get(rid)
        if rec.state == RequestState.APPROVED and rec.decided_by:
            modified = rec.approved_args is not None and rec.approved_args != rec.proposed_args
            dec: dict[str, Any] = {"decision": "modify" if modified else "approve", "approver": rec.decided_by,
                                   "reason": rec.decision_reason, "approval_request_id": rid}
            if modified:
                dec["args"] = rec.approved_args
        elif rec.state == RequestState.REJECTED:
            dec = {"decision": "reject", "approver": rec.decided_by or "unknown",
                   "reason": rec.decision_reason or "rejected", "approval_request_id": rid}
        else:
            # Pending (pauses again), or settled by UndoLog itself (timeout, cancel): read at re-run.
            dec = {"decision": "from_store", "approval_request_id": rid}
        out[rid] = dec
    return next(iter(out.values())) if len(out) == 1 else {"decisions": out}


def ours(interrupts: Iterable[Any]) -> list[Any]:
    """The interrupts UndoLog raised (not the graph's own)."""
    return [i for i in interrupts if isinstance(i.value, Mapping) and i.value.get("type") == APPROVAL_INTERRUPT_TYPE]


def _iso(value: Any) -> str | None:
    if isinstance(value, dt.datetime):
        return value.isoformat(timespec="seconds")
    return None if value is None else str(value)
