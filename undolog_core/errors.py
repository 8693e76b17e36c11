"""Every error UndoLog raises, one class per condition, each with a stable ``code``.

The codes are part of the public contract: the REST API returns them in problem+json
bodies and adapters map them onto their framework's own messages.
"""

from __future__ import annotations

from typing import Any


class UndoLogError(Exception):
    """Base class of every UndoLog error; raised as itself for a condition with no class of its own.

    Fix:
        Read the message: it says what went wrong and what to do. Catch this class to handle every UndoLog error,
        and branch on ``code``, never on the message.

    Example:
        >>> try:
        ...     raise SessionHalted("s1", "rejected")
        ... except UndoLogError as exc:
        ...     exc.code
        'session_halted'
    """

    code = "undolog_error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def to_dict(self) -> dict[str, Any]:
        """The error as JSON-able data: its ``code``, its ``message`` and its details."""
        return {"code": self.code, "message": self.message, **self.details}


class ConfigurationError(UndoLogError):
    """UndoLog, an adapter or the desk was set up in a way that cannot work (an unknown ``on_failure``, a middleware in the wrong place, an ``--app`` on another database).

    Fix:
        Read the message: it names the setting; correct it where the object is built. Nothing ran.
    """

    code = "configuration_error"


class CheckpointInvalid(UndoLogError):
    """An audit checkpoint file that is unreadable or not signed by the given key, or a key file that is not one.

    Fix:
        Check that ``--public-key`` is the pair of the key that signed the directory; a forged or edited checkpoint file is evidence: investigate it.
    """

    code = "checkpoint_invalid"


class AuditChainBroken(UndoLogError):
    """The audit chain failed verification, so its head is not signed: a checkpoint never endorses a rewrite.

    Fix:
        Someone changed audit rows behind the triggers. Run ``undolog audit verify --checkpoints DIR --public-key FILE`` to find the first broken event and restore the database from a backup taken before it.
    """

    code = "audit_chain_broken"


class ToolNotClassified(UndoLogError):
    """A tool was handed to UndoLog without a tier: nothing runs unclassified.

    Fix:
        Declare it with ``@undolog_tool(tier=...)``, or give it an entry in the adapter's ``tiers=`` (for a third-party tool).
    """

    code = "tool_not_classified"

    def __init__(self, tool_name: str) -> None:
        super().__init__(
            f"tool {tool_name!r} has no tier: declare it with @undolog_tool(tier=...) "
            "or give it a tier mapping before it can run",
            tool_name=tool_name,
        )
        self.tool_name = tool_name


class ToolNotRegistered(UndoLogError):
    """A call, a rollback or a lookup named a tool this UndoLog does not know.

    Fix:
        Register it (``undolog.register(tool)``, or pass it to the adapter); from the CLI or the desk, load the app that registers it with ``--app``.
    """

    code = "tool_not_registered"

    def __init__(self, tool_name: str) -> None:
        super().__init__(f"tool {tool_name!r} is not registered with this UndoLog", tool_name=tool_name)
        self.tool_name = tool_name


class InvalidDeclaration(UndoLogError):
    """A tool or compensation declaration that cannot be accepted (bad tier, composite lower than a member...).

    Fix:
        Fix the declaration the message names (the field is given); it is refused at registration, before anything runs.
    """

    code = "invalid_declaration"


class ArgumentsInvalid(UndoLogError):
    """Arguments that do not fit the tool's schema; ``errors`` names each bad field.

    Fix:
        Send arguments that fit the tool's schema (``errors`` lists each path and what is wrong). Nothing was logged or run; a bad edit leaves the request pending.
    """

    code = "arguments_invalid"

    def __init__(self, tool_name: str, errors: list[dict[str, Any]]) -> None:
        fields = ", ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())) or '<arguments>'}: {e.get('msg', 'invalid')}" for e in errors
        )
        super().__init__(f"invalid arguments for tool {tool_name!r}: {fields}", tool_name=tool_name, errors=errors)
        self.tool_name = tool_name
        self.errors = errors

    @property
    def fields(self) -> list[str]:
        """The dotted path of each bad field, in ``errors`` order."""
        return [".".join(str(p) for p in e.get("loc", ())) for e in self.errors]


class SessionNotFound(UndoLogError):
    """No session has this id in this database.

    Fix:
        Check the id (``undolog sessions list``) and that ``--db``/``--schema`` point at the agents' database.
    """

    code = "session_not_found"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {session_id!r} does not exist", session_id=session_id)
        self.session_id = session_id


class SessionHalted(UndoLogError):
    """The session needs a person: it refuses writes until resumed or rolled back.

    Fix:
        Look at why (``undolog sessions show ID``), then ``undolog sessions resume ID`` to let it go on, or roll it back. SAFE calls still run meanwhile.
    """

    code = "session_halted"

    def __init__(self, session_id: str, reason: str | None) -> None:
        super().__init__(
            f"session {session_id!r} is halted ({reason or 'no reason recorded'}); a person must resume "
            "it (`undolog sessions resume`) or roll it back before it accepts further writes",
            session_id=session_id,
            reason=reason,
        )
        self.session_id = session_id
        self.reason = reason


class SessionClosed(UndoLogError):
    """The session is rolled back or completed; it accepts no more calls.

    Fix:
        Start a new session (a LangGraph thread does so by itself on its next turn).
    """

    code = "session_closed"

    def __init__(self, session_id: str, state: str) -> None:
        super().__init__(f"session {session_id!r} is {state} and accepts no more calls", session_id=session_id, state=state)
        self.session_id = session_id
        self.state = state


class InvalidSessionState(UndoLogError):
    """The operation does not apply to the session's current state (resuming a session that is not halted, rolling back one that is closed...).

    Fix:
        Check the session's state (``undolog sessions show ID``); the message says which state was found.
    """

    code = "invalid_session_state"


class InvalidId(UndoLogError):
    """A session_id or call_id that is empty, not a string, padded with spaces, or too long.

    Fix:
        Use a non-empty string of at most 200 characters without surrounding spaces. Nothing was written.
    """

    code = "invalid_id"

    def __init__(self, what: str, value: object, max_length: int) -> None:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        super().__init__(
            f"{what} must be a non-empty string of at most {max_length} characters without surrounding spaces; "
            f"got {shown}",
            field=what,
        )
        self.field = what


class CallIdConflict(UndoLogError):
    """A call_id reused in the same session with other arguments or another tool.

    Fix:
        Give a new call a new ``call_id``; re-issue a call only with its own arguments (an approved modify runs the approved ones).
    """

    code = "call_id_conflict"

    def __init__(self, session_id: str, call_id: str, detail: str) -> None:
        super().__init__(
            f"call_id {call_id!r} was already used in session {session_id!r} {detail}",
            session_id=session_id,
            call_id=call_id,
        )


class ContractChanged(UndoLogError):
    """A tool's contract differs from the revision the session was validated under.

    Fix:
        If the change is intended, revalidate the session (``s.revalidate(actor=...)`` or ``undolog sessions revalidate ID``); otherwise restore the previous declaration.
    """

    code = "contract_changed"

    def __init__(self, session_id: str, tool_name: str, pinned: int, current: int) -> None:
        super().__init__(
            f"tool {tool_name!r} changed since session {session_id!r} was validated (pinned revision {pinned}, "
            f"registered revision {current}); revalidate the session (`session.revalidate(actor=...)` or "
            "`undolog sessions revalidate`) before calling it",
            session_id=session_id,
            tool_name=tool_name,
            pinned_revision=pinned,
            current_revision=current,
        )


class ApprovalPending(UndoLogError):
    """An IRREVERSIBLE call waits for a person. Re-issue the same call (same call_id) once it is decided.

    Fix:
        Not an error to fix: tell the agent to wait, have a person decide (desk, CLI, REST API), then re-issue the same call.

    Example:
        >>> try:
        ...     await s.call(delete_user_account, user_id="u1", call_id="c-7")  # doctest: +SKIP
        ... except ApprovalPending as p:
        ...     print(p.approval_request_id, p.retry_after)
    """

    code = "approval_pending"

    def __init__(self, effect_id: str, approval_request_id: str, retry_after: float, tool_name: str = "") -> None:
        super().__init__(
            f"call to {tool_name or 'tool'!s} awaits human approval (request {approval_request_id}); "
            f"re-issue the same call after it is decided (retry after {retry_after:.0f}s)",
            effect_id=effect_id,
            approval_request_id=approval_request_id,
            retry_after=retry_after,
        )
        self.effect_id = effect_id
        self.approval_request_id = approval_request_id
        self.retry_after = retry_after
        self.tool_name = tool_name


class ApprovalRejected(UndoLogError):
    """A person rejected the call: it never runs, and the session is halted.

    Fix:
        Read the reason (``undolog approvals show ID``). The session stays halted until a person resumes it or rolls it back; do not retry the call another way.
    """

    code = "approval_rejected"

    def __init__(self, approval_request_id: str, reason: str | None, approver: str | None) -> None:
        super().__init__(
            f"approval request {approval_request_id} was rejected by {approver or 'a person'}: {reason or 'no reason given'}",
            approval_request_id=approval_request_id,
            reason=reason,
            approver=approver,
        )
        self.approval_request_id = approval_request_id
        self.reason = reason
        self.approver = approver


class ApprovalTimedOut(UndoLogError):
    """Nobody decided before the request's ``timeout_at``: the call was not run (fail closed) and the session is halted.

    Fix:
        Resume the session and re-issue the call to ask again, or lengthen ``approval_timeout_seconds`` (``undolog policy set``).
    """

    code = "approval_timed_out"

    def __init__(self, approval_request_id: str) -> None:
        super().__init__(
            f"approval request {approval_request_id} timed out without a decision; the call was not run",
            approval_request_id=approval_request_id,
        )
        self.approval_request_id = approval_request_id


class ApprovalCancelled(UndoLogError):
    """The request was cancelled (a sibling's rejection, or the tool's contract changed) and the call was not run.

    Fix:
        Re-issue the call if it is still wanted: it raises a new request under the current contract.
    """

    code = "approval_cancelled"

    def __init__(self, approval_request_id: str, reason: str | None) -> None:
        super().__init__(
            f"approval request {approval_request_id} was cancelled ({reason or 'no reason'}); the call was not run",
            approval_request_id=approval_request_id,
            reason=reason,
        )
        self.approval_request_id = approval_request_id


class ApprovalNotFound(UndoLogError):
    """No approval request has this id in this database.

    Fix:
        Check the id (``undolog approvals list --state all``) and the database the command points at.
    """

    code = "approval_not_found"

    def __init__(self, approval_request_id: str) -> None:
        super().__init__(f"approval request {approval_request_id!r} does not exist", approval_request_id=approval_request_id)


class ApprovalAlreadyDecided(UndoLogError):
    """The request was already decided; a request is decided once, never twice.

    Fix:
        Nothing to do: read its state (``undolog approvals show ID``). A second decision never runs the call a second time.
    """

    code = "approval_already_decided"

    def __init__(self, approval_request_id: str, state: str) -> None:
        super().__init__(
            f"approval request {approval_request_id} is already {state}; a request is decided once",
            approval_request_id=approval_request_id,
            state=state,
        )
        self.state = state


class SelfDecisionForbidden(UndoLogError):
    """The decider is the principal that created the session which raised the request (or made the call).

    A request is decided by another person: whoever raised it may not approve, modify or reject it, whatever
    roles its key holds; nor may it resolve one of its own calls whose outcome is unknown
    (``undolog effects resolve``). The refusal is recorded in the audit trail.

    Fix:
        Have another person (another key) decide it.
    """

    code = "self_approval_forbidden"

    def __init__(self, approval_request_id: str | None, principal: str, *, effect_id: str | None = None) -> None:
        if effect_id is not None:
            super().__init__(
                f"{principal} created the session that made the call of effect {effect_id}; another person must "
                "resolve it", effect_id=effect_id, principal=principal,
            )
            return
        super().__init__(
            f"{principal} created the session that raised approval request {approval_request_id}; "
            "another person must decide it",
            approval_request_id=approval_request_id,
            principal=principal,
        )


class OutcomeUnknown(UndoLogError):
    """An approved IRREVERSIBLE call crashed mid-run and no probe could tell whether it happened.

    Fix:
        Check the external system by hand, settle the effect (``undolog effects resolve EFFECT --as committed|compensated|not_happened --reason TEXT``, or the desk), then resume or roll back the halted session. Give the tool a ``probe`` so recovery can tell next time.
    """

    code = "outcome_unknown"

    def __init__(self, effect_id: str) -> None:
        super().__init__(
            f"effect {effect_id} may or may not have happened (its run was interrupted); it is never re-run "
            f"blindly: a person checks, settles it ('undolog effects resolve {effect_id} --as "
            "committed|compensated|not_happened --reason TEXT') and resumes or rolls back the session",
            effect_id=effect_id,
        )


class DatabaseUnavailable(UndoLogError):
    """The store did not answer (a dropped connection, a restart, a failover).

    Nothing is lost: a call that met it either wrote nothing, or left an in-flight effect that ``recover()``
    settles. The next call opens a fresh connection, so it works again as soon as the database is back.

    Fix:
        Retry once the database is back (the desk answers 503 with ``Retry-After``); run ``recover()`` to settle calls that were in flight.
    """

    code = "database_unavailable"

    def __init__(self, operation: str, cause: BaseException | str) -> None:
        text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {str(cause).strip()}"
        super().__init__(f"the database did not answer during {operation}: {text}", operation=operation)


class DatabaseOpenFailed(UndoLogError):
    """``UndoLog.open`` could not open or migrate its database.

    The first line says which (password masked) and what to do; the driver's own report follows.

    Fix:
        Do what the first line says: check the URL (``--db`` / ``UNDOLOG_DATABASE_URL``), that the database runs
        and is reachable, and its credentials; for a missing or outdated database, ``undolog db upgrade``.

    Example:
        >>> str(DatabaseOpenFailed("sqlite:////nope/u.db", "OperationalError: unable to open database file"))[:52]
        'UndoLog could not open its database sqlite:////nope/'
    """

    code = "database_open_failed"

    def __init__(self, url: str, detail: str, hint: str | None = None) -> None:
        fix = hint or "check the URL, that the database is running and reachable, and its credentials"
        super().__init__(f"UndoLog could not open its database {url}: {fix}\n  the database said: {detail}",
                         url=url, detail=detail)


class EffectNotFound(UndoLogError):
    """No effect (logged call) has this id in this database.

    Fix:
        Check the id (``undolog sessions show SESSION``) and the database the command points at.
    """

    code = "effect_not_found"

    def __init__(self, effect_id: str) -> None:
        super().__init__(f"effect {effect_id!r} does not exist", effect_id=effect_id)


class InvalidEffectState(UndoLogError):
    """The operation does not apply to the effect's current state (releasing a call that already ended...).

    Fix:
        Read the effect's state (``undolog sessions show SESSION``); the message says which state was found.
    """

    code = "invalid_effect_state"


class CallRunning(InvalidEffectState):
    """The call asked for is running right now (here or in another live process): ask again later.

    Not a failure of the call: a caller that re-asks an approved call while another ask of it runs gets this, and
    the call still runs once. Its code stays ``invalid_effect_state`` for callers that matched on it.

    Fix:
        Ask again after a moment: the running call's result is then replayed.
    """

    def __init__(self, message: str, *, effect_id: str) -> None:
        super().__init__(message, effect_id=effect_id)
        self.effect_id = effect_id


class OutcomeConflict(InvalidEffectState):
    """A call finished after another process had taken it over.

    Its owner looked gone (a stall past the lease on another host, or a person's ``recover --take-over``), so its
    side effect happened after its compensation (or while recovery was deciding). The finish is recorded (an audit
    event with the result), the effect is ``unknown`` and the session halted: a person decides, nothing is
    compensated a second time automatically.

    When the tool has a probe it was asked after the finish was recorded; its answer is in the audit trail (an
    ``effect.probe`` event) and in ``details["probe"]``, to inform the person: it settles nothing by itself.

    Fix:
        Check the external system: the call did happen. Settle the effect (``undolog effects resolve EFFECT --as
        committed|compensated|not_happened --reason TEXT``, or the desk's Resolve button), then resume the session
        or roll it back (``undolog sessions show ID`` shows the recorded finish).

    Example:
        >>> try:
        ...     session.call_sync(send_refund_email, user_id="u1", amount=5)
        ... except OutcomeConflict as exc:
        ...     exc.details["effect_id"], exc.details["state_before"]
        ('3f2a...', 'compensated')
    """

    code = "outcome_conflict"

    def __init__(self, effect_id: str, tool_name: str, session_id: str, state_before: str,
                 probe: str | None = None) -> None:
        asked = f" Its probe, asked after the finish, says: {probe}." if probe else ""
        super().__init__(
            f"{tool_name} (effect {effect_id}) finished after another process had taken it over (it was "
            f"{state_before} by then): the side effect happened after its compensation. The effect is now unknown "
            f"and session {session_id!r} halted.{asked} Check the tool's side, settle the effect ('undolog effects "
            f"resolve {effect_id} --as committed|compensated|not_happened --reason TEXT'), then resume or roll back "
            "the session ('undolog sessions resume' / 'undolog sessions rollback', or the desk)",
            effect_id=effect_id, tool_name=tool_name, session_id=session_id, state_before=state_before,
            probe=probe,
        )


class CompensationNotFound(UndoLogError):
    """A rollback needs a compensation this process has not registered; nothing was changed.

    Fix:
        Register it in the app (an adapter's ``compensations=[...]`` or ``undolog.register(fn)``); from the CLI or the desk, load the app with ``--app module:attribute`` (or ``UNDOLOG_APP``).
    """

    code = "compensation_not_found"

    def __init__(self, name: str) -> None:
        super().__init__(
            f"compensation {name!r} is not registered in this process. Nothing was changed. In the app, register "
            "it where the tools are set up (an adapter's compensations=[...] or undolog.register(fn)); from the "
            "CLI or the server, load the app that defines it (--app module:attribute or UNDOLOG_APP).",
            compensation_name=name,
        )
        self.compensation_name = name


class CompensationVersionMismatch(UndoLogError):
    """The registered compensation's version differs from the one logged with the call: it was not called, and the session is halted.

    Fix:
        Register the version the undo entry was logged with (``@compensation(name, version=N)``) beside the new one, then roll back again.
    """

    code = "compensation_version_mismatch"

    def __init__(self, name: str, logged: int, registered: int) -> None:
        super().__init__(
            f"compensation {name!r} is registered at version {registered} but the undo entry was logged with "
            f"version {logged}; it was not called and the session is halted",
            compensation_name=name,
            logged_version=logged,
            registered_version=registered,
        )


class PolicyInvalid(UndoLogError):
    """An approval policy value out of range (a timeout below 1 s or over 30 days, a negative count...).

    Fix:
        Set a value within the range the message gives (``undolog policy set``).
    """

    code = "policy_invalid"


__all__ = [name for name, obj in list(globals().items()) if isinstance(obj, type) and issubclass(obj, UndoLogError)]
