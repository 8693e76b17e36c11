"""The gate's decisions and what a running tool sees: ``Execute``, ``AwaitingApproval``, ``Completed`` (what the
driver and the adapters act on), ``FailureRecord``, ``CallContext`` and ``current_call()``, the kickoff a run's calls
are recorded under (``kickoff_scope``), and the fast builders the hot path uses (``execute_now``, ``call_context``).
No I/O: the engine's parts (``_engine``, ``_compensable``, ``_gate``) and the driver build and read these."""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ._tools import ToolTier

# The tiers, read once (the parts and the driver compare a spec's tier with these by identity).
SAFE = ToolTier.SAFE
COMPENSABLE = ToolTier.COMPENSABLE
IRREVERSIBLE = ToolTier.IRREVERSIBLE


@dataclass(frozen=True)
class FailureRecord:
    """A failure recorded: the session it happened in and what its policy says to do (rollback / continue)."""

    session_id: str
    on_failure: str
    #: Whether the session's rollback was requested with the failure (``record_failure(rollback=...)``).
    rollback_requested: bool = False


@dataclass(frozen=True)
class Execute:
    """Run the tool now with ``args``. SAFE calls carry no effect id and no idempotency key."""

    effect_id: str | None
    args: dict[str, Any]
    idempotency_key: str | None
    tier: ToolTier
    tool_name: str
    call_id: str | None = None
    session_id: str = ""
    # IRREVERSIBLE only: the request a person decided and how ("approve", "modify", "auto_approved"), for traces.
    approval_request_id: str | None = None
    decision: str | None = None
    #: The ownership epoch of this run: the fencing token ``current_call().epoch`` (see ``CallContext``).
    epoch: int = 1


@dataclass(frozen=True)
class AwaitingApproval:
    """The call was not run: a person must decide ``approval_request_id`` first."""

    effect_id: str
    approval_request_id: str
    retry_after: float
    tool_name: str
    args: dict[str, Any]
    reason: str | None
    risk_tags: tuple[str, ...]
    timeout_at: dt.datetime
    call_id: str | None = None


@dataclass(frozen=True)
class Completed:
    """The same call already ran: here is its stored result; do not run it again."""

    effect_id: str
    result: Any
    tool_name: str


Decision = Execute | AwaitingApproval | Completed


@dataclass(frozen=True)
class CallContext:
    """What a running COMPENSABLE or IRREVERSIBLE tool can see through ``current_call()``."""

    session_id: str
    effect_id: str | None
    call_id: str | None
    tool_name: str
    idempotency_key: str | None
    attempt: int = 1  # the tool's retry policy's attempt number; the key is the same on every attempt
    #: The ownership epoch: 1 for a call's first run, one more each time the call is claimed again (an approved
    #: call claimed to run, a released call re-claimed, recovery taking it over). A fencing token for the
    #: upstream, sent beside the idempotency key (never in it: the key stays ``do-{effect_id}``): an upstream
    #: that remembers the highest epoch it has seen for a key refuses a write with a lower one, so a process
    #: stalled past its lease cannot write after recovery took its call over (recovery's probe carries the new
    #: epoch). MCP: ``_meta["dev.undolog/epoch"]``; the proxy: the ``UndoLog-Epoch`` header.
    epoch: int = 1


# The call being run: its CallContext, or (a first attempt run by the driver) the Execute decision it runs under,
# which current_call() turns into one when a tool asks. Every COMPENSABLE call sets it; few tools read it, so the
# CallContext is built on the read instead of on every call.
_current: contextvars.ContextVar[CallContext | Execute | None] = contextvars.ContextVar(
    "undolog_current_call", default=None)

# The framework run (a CrewAI kickoff, a Semantic Kernel turn) the calls in this context belong to, set by an adapter
# around the run (``kickoff_scope``): recorded on each effect they log (``effect_log.kickoff_id``), so that a
# continuation of the run can replay what it already did instead of doing it again. Such calls take the general
# pre-write (a transaction) rather than the hot path's one statement, which has no column for it.
KICKOFF: contextvars.ContextVar[str | None] = contextvars.ContextVar("undolog_kickoff", default=None)


@contextlib.contextmanager
def kickoff_scope(kickoff_id: str | None) -> Iterator[None]:
    """Record ``kickoff_id`` on every effect logged inside the block (this context and those copied from it).

    Example:
        >>> with kickoff_scope("kickoff-7"):                      # doctest: +SKIP
        ...     crew.kickoff()
    """
    token = KICKOFF.set(kickoff_id)
    try:
        yield
    finally:
        KICKOFF.reset(token)


# A frozen dataclass's generated __init__ sets each field through object.__setattr__: about a microsecond for
# Execute's nine fields, on every COMPENSABLE call. The hot path builds the same objects by setting their __dict__
# at once (equal, hashable and frozen like any other: tests/core/test_hot_path.py holds the field lists to the
# classes').
_set_attr = object.__setattr__
_new = object.__new__


def execute_now(effect_id: str | None, args: dict[str, Any], idempotency_key: str | None, tier: ToolTier,
                tool_name: str, call_id: str | None, session_id: str) -> Execute:
    """``Execute(effect_id, args, idempotency_key, tier, tool_name, call_id, session_id)``, built fast."""
    d = _new(Execute)
    _set_attr(d, "__dict__", {"effect_id": effect_id, "args": args, "idempotency_key": idempotency_key, "tier": tier,
                              "tool_name": tool_name, "call_id": call_id, "session_id": session_id,
                              "approval_request_id": None, "decision": None, "epoch": 1})
    return d


def call_context(session_id: str, effect_id: str | None, call_id: str | None, tool_name: str,
                  idempotency_key: str | None, attempt: int, epoch: int = 1) -> CallContext:
    """``CallContext(...)``, built fast (see :func:`execute_now`)."""
    ctx = _new(CallContext)
    _set_attr(ctx, "__dict__", {"session_id": session_id, "effect_id": effect_id, "call_id": call_id,
                                "tool_name": tool_name, "idempotency_key": idempotency_key, "attempt": attempt,
                                "epoch": epoch})
    return ctx


def current_call() -> CallContext | None:
    """The call being run, for tools that pass ``idempotency_key`` on to an external API.

    Example:
        >>> @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="refund_undo")
        ... def refund(amount: int) -> dict:
        ...     return payments.refund(amount, idempotency_key=current_call().idempotency_key)
    """
    running = _current.get()
    if running is None or running.__class__ is CallContext:
        return running
    return call_context(running.session_id, running.effect_id, running.call_id, running.tool_name,
                        running.idempotency_key, 1, running.epoch)


class _Running:
    """The context of a running tool; a plain class, because this is on every COMPENSABLE call's path."""

    __slots__ = ("ctx", "token")

    def __init__(self, ctx: CallContext) -> None:
        self.ctx = ctx
        self.token: contextvars.Token[CallContext | Execute | None] | None = None

    def __enter__(self) -> CallContext:
        self.token = _current.set(self.ctx)
        return self.ctx

    def __exit__(self, *exc: object) -> None:
        if self.token is not None:
            _current.reset(self.token)


