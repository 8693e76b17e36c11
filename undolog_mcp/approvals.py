"""Approvals shared across sessions of one API key, narrowly (over HTTP only).

A client that opens an MCP session per call may land its re-issue of an IRREVERSIBLE call in another UndoLog
session than the ask (``session = "mcp"``, or a ``key`` session that ended while the person decided). The
approved request is then released to that re-issue only when all of these hold:

- the same tool with the same canonical arguments (the call's id, ``call_key``), asked with the same API key;
- from a later session of that key than the request's own;
- the request's own session is still active (never halted, rolling back or rolled back);
- the tool's contract revision is the one the person approved;
- the approved call has not run yet (a release happens once; a later identical call asks a person anew).

The run is recorded on the request's own effect (in its own session), and a ``released`` audit event names the
session it ran for. While the request is pending, the same ask from another session of the key joins it (a
``joined`` audit event, no second request); a reject halts the request's session and every session that joined.

Over stdio and the local socket there is no key to tell one client from another: approvals stay bound to their
session there.
"""

from __future__ import annotations

from dataclasses import dataclass

from undolog_core import EffectState, RequestState, SessionState, UndoLog
from undolog_core.errors import SessionNotFound
from undolog_core.integration import ApprovalRecord

# Where the request's own session may be for its approval to be released to another (the seed's "active").
_OPEN = (SessionState.ACTIVE, SessionState.AWAITING_APPROVAL)


@dataclass(frozen=True)
class SharedRequest:
    """A request of another session of the same key that this call joins (``pending``) or is released."""

    request: ApprovalRecord
    pending: bool


def find_shared(undolog: UndoLog, *, session_id: str, principal: str, tool_name: str, call_id: str,
                revision: int) -> SharedRequest | None:
    """The request of an earlier session of ``principal`` for this very call that this session may join or be
    released, or None (then the call is decided in its own session as always).

    Example:
        >>> shared = find_shared(undolog, session_id=sid, principal="key:4f2a", tool_name="delete_project",
        ...                      call_id=call_key("delete_project", {"name": "acme"}), revision=3)
    """
    mine = None
    for state, pending in ((RequestState.PENDING, True), (RequestState.APPROVED, False),
                           (RequestState.AUTO_APPROVED, False)):
        for rec in undolog.approvals.list(state=state.value, tool_name=tool_name):
            if rec.call_id != call_id or rec.session_id == session_id or rec.tool_revision != revision:
                continue
            try:
                origin = undolog.sessions.get(rec.session_id)
            except SessionNotFound:
                continue
            if origin.created_by != principal or origin.state not in _OPEN:
                continue
            if mine is None:
                mine = undolog.sessions.get(session_id)  # written first if it was not yet: a joiner can be halted
            if mine.created_at <= origin.created_at:
                continue  # only a later session of the key
            if not pending and not _not_run_yet(undolog, rec):
                continue
            return SharedRequest(rec, pending)
    return None


def _not_run_yet(undolog: UndoLog, rec: ApprovalRecord) -> bool:
    effects = undolog.sessions.effects(rec.session_id)
    return any(e["effect_id"] == rec.effect_id and e["state"] == EffectState.APPROVED for e in effects)
