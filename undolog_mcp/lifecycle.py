"""What an MCP client is told when its UndoLog session stopped taking calls, and which stops it can get past.

An MCP client cannot call ``session.revalidate(...)`` or resume a halted session: a person does that, at the CLI
or the desk. So each refusal says which session, why, and what a person runs or presses. A session that was rolled
back to the end is over, not stuck: the gateway starts a new one for the next call and says so, with both ids.
A halted session stays halted (a reject, an unknown outcome: a person must look), whatever the client does.
"""

from __future__ import annotations

from typing import Any

from mcp import types

from undolog_core import SessionState, UndoLog
from undolog_core.errors import ContractChanged, SessionClosed, SessionHalted, UndoLogError
from undolog_core.integration import session_table

from .results import META_KEY, error_result


def starts_anew(exc: UndoLogError) -> bool:
    """Whether the refusal is of a session rolled back to the end: its client's next call starts a new one."""
    return isinstance(exc, SessionClosed) and exc.state == SessionState.ROLLED_BACK


def changed_elsewhere(undolog: UndoLog, exc: UndoLogError, revision: int) -> bool:
    """Whether a refusal from this process's record of the session is out of date: a person resumed or
    revalidated it from another process (the CLI, the desk). Then the record is read again from the store and
    True is returned: decide the call once more. Read only on a refusal: no call pays for it otherwise.

    Example:
        >>> changed_elsewhere(gw.undolog, exc, spec.revision)   # after `undolog sessions resume ID` elsewhere
        True
    """
    sid = exc.details.get("session_id")
    if not isinstance(exc, SessionHalted | ContractChanged) or not isinstance(sid, str):
        return False
    row = undolog.sessions.get(sid)
    if isinstance(exc, SessionHalted):
        fresh = row.state != SessionState.HALTED
    else:
        fresh = row.pinned_revisions.get(str(exc.details.get("tool_name"))) == revision
    if fresh:
        session_table(undolog).remember(row)
    return fresh


def refusal(exc: UndoLogError) -> types.CallToolResult:
    """The client's answer to a refused call: the core's message, with what a person does about it.

    Example:
        >>> refusal(SessionHalted("s-1", "rejected")).content[0].text
        "session 's-1' is halted (rejected); ... `undolog sessions resume s-1` or the desk's Resume button ..."
    """
    if isinstance(exc, SessionHalted):
        message = (f"session {exc.session_id} is halted ({exc.reason or 'no reason recorded'}): no logged call runs "
                   f"until a person resumes it (`undolog sessions resume {exc.session_id}`, or the Resume button on "
                   f"the session's page at the desk) or rolls it back (`undolog sessions rollback {exc.session_id}`).")
        return _with(error_result(message, code=exc.code), session=exc.session_id)
    if isinstance(exc, ContractChanged):
        sid = exc.details.get("session_id")
        message = (f"{exc.message}. A person revalidates the session once the change is reviewed: "
                   f"`undolog sessions revalidate {sid}`, or the Revalidate button on the session's page at the "
                   "desk; until then this tool is refused in this session.")
        return _with(error_result(message, code=exc.code), session=str(sid))
    return error_result(exc.message, code=exc.code)


def told_new_session(result: types.CallToolResult, previous: str, current: str) -> types.CallToolResult:
    """``result``, telling the client that ``previous`` was rolled back and this call started ``current``."""
    note = (f"UndoLog: session {previous} was rolled back and takes no more calls; this call started session "
            f"{current}.")
    content = [*result.content, types.TextContent(type="text", text=note)]
    return _with(result.model_copy(update={"content": content}), session=current, previous_session=previous)


def _with(result: types.CallToolResult, **fields: Any) -> types.CallToolResult:
    meta = dict(result.meta or {})
    meta[META_KEY] = {**dict(meta.get(META_KEY) or {}), **fields}
    return result.model_copy(update={"meta": meta})
