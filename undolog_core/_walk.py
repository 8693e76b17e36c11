"""One call's walk after its tool raised or reported a failure, written once for the sync and the async driver.

The steps (classify the failure, the retry decision, record the failure, roll back by policy) are generators that
do no I/O: each yields what it needs done, an ``(Op, argument)`` pair, and is sent the answer (httpx's
``auth_flow`` is the model). ``CallDriver``'s two short loops (``_drive``, ``_adrive``) do the I/O: the sync loop
calls the tool and the store where it stands; the async loop awaits the tool and sends every durable step to a worker
thread (the event loop never waits on the store). A call that succeeds at once never gets here: its path is the
drivers' own few lines (set the context, call, record the outcome), pinned by the frame- and statement-count tests.

Example:
    >>> walk = CallWalk(None, (), (), rollback=False, note=True, policy=None)
    >>> steps = walk.failed("refund failed: card declined")
    >>> next(steps)
    (<Op.RECORD: 'record'>, ('refund failed: card declined', False))
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _observe as obs
from ._decisions import AwaitingApproval, Decision, Execute
from ._tools import RetryPolicy, ToolSpec
from .errors import UndoLogError
from .limits import clean_text

if TYPE_CHECKING:
    from ._saga import RollbackReport

ControlFlow = tuple[type[BaseException], ...]


class Op(enum.Enum):
    """What a walk asks its driver loop to do; the loop sends back the answer named here."""

    INVOKE = "invoke"  # run the tool again as attempt ``argument``: sends its value, or throws its exception in
    SLEEP = "sleep"  # wait ``argument`` seconds before the next attempt: sends None
    RELEASE = "release"  # hand the call back unrun (a framework's control flow): sends None
    SETTLE = "settle"  # settle the call whose outcome ``argument`` left unknown, as recovery would: sends how
    RECORD = "record"  # record the failure ``(error, rollback requested)``: sends the session's failure policy
    ROLLBACK = "rollback"  # roll the session back ``(exception to note, reason)``: sends the RollbackReport


Walk = Generator[tuple[Op, Any], Any, Any]


@dataclass(frozen=True)
class NothingHappened:
    """What ``failure_of`` returns for a failure that, by the tool's contract, changed nothing (an MCP upstream's
    ``isError`` result): the call is recorded failed and its undo entry dropped, so no rollback compensates it.

    Example:
        >>> failure_of = lambda r: NothingHappened(r.text) if r.isError else None
    """

    text: str

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Outcome:
    """How a run ended: the tool's ``value``, or its ``error`` with what the failure policy did about it.

    Example:
        >>> outcome = undolog.driver.run_sync(decision, lambda args: refund(**args))  # doctest: +SKIP
        >>> outcome.unwrap()            # the value, or the tool's own exception re-raised  # doctest: +SKIP
    """

    value: Any = None
    error: BaseException | None = None
    rollback: RollbackReport | None = None
    failure: str | None = None  # a failure the framework reported as a value (``failure_of``)
    # How a call whose outcome was unknown (an ``unknown_on`` exception) was settled: committed (its probe said
    # it happened), compensated, unknown (the session halted for a person), not_run, settling (its probe says not
    # yet, and its request may still land: held in flight until it cannot); None otherwise.
    in_doubt: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.failure is None

    def unwrap(self) -> Any:
        """The tool's value; when it failed, its own exception (with the rollback noted on it), never another."""
        if self.error is not None:
            raise self.error
        return self.value


class CallWalk:
    """The steps of one call past its first attempt: built only when the tool raised or reported a failure.

    ``d`` is the call's decision (None: a walk of retries alone, for a SAFE call the driver runs without one),
    ``control_flow`` a framework's own exceptions (handed back unrun, never a failure), ``unknown_on`` those that
    leave the outcome unknown (settled as recovery would, never retried blindly), ``rollback`` whether the session
    rolls back by its policy (the caller's wish and the driver's ``failure_rollbacks``), ``note`` whether the
    rollback is noted on the tool's exception, ``policy`` the tool's retry policy (None: no retry).
    """

    __slots__ = ("d", "control_flow", "unknown_on", "rollback", "note", "policy")

    def __init__(self, d: Execute | None, control_flow: ControlFlow, unknown_on: ControlFlow, *, rollback: bool,
                 note: bool, policy: RetryPolicy | None) -> None:
        self.d = d
        self.control_flow = control_flow
        self.unknown_on = unknown_on
        self.rollback = rollback
        self.note = note
        self.policy = policy

    def raised(self, exc: BaseException) -> Walk:
        """The tool's first attempt raised ``exc``: returns ``(value, None)`` when a retry succeeded (the driver
        records the outcome as for a first success), else ``(None, Outcome)``; a framework's control flow is
        released and raised again."""
        if isinstance(exc, self.control_flow):
            yield Op.RELEASE, None
            raise exc
        if not isinstance(exc, self.unknown_on):
            value, error = yield from self.retried(exc)
            if error is None:
                return value, None
            exc = error
            if not isinstance(exc, self.unknown_on):
                return None, (yield from self.failed(exc))
        # Its outcome is unknown (the first attempt's, or a retry's): settled as in doubt, never recorded failed.
        return None, Outcome(error=exc, in_doubt=(yield Op.SETTLE, exc))

    def retried(self, exc: BaseException) -> Walk:
        """Run the tool again per its retry policy: ``(value, None)`` once an attempt succeeds, else ``(None, the
        last error)``. An attempt whose outcome is unknown ends the retries: it may have happened."""
        attempt = 1  # the attempt that failed last, then the one about to run
        policy = self.policy
        while policy is not None and policy.retries(exc, attempt):
            yield Op.SLEEP, policy.delay(attempt)
            attempt += 1
            try:
                value = yield Op.INVOKE, attempt
            except self.control_flow:
                yield Op.RELEASE, None
                raise  # (the exception this handler holds: a generator keeps it across the yield)
            except self.unknown_on as unknown:
                return None, unknown
            except BaseException as again:  # noqa: BLE001 - the attempt's failure: the policy decides
                exc = again
            else:
                return value, None
        if attempt > 1:
            name = self.d.tool_name if self.d is not None else "the tool"
            exc.add_note(f"undolog: {name} failed on each of {attempt} attempts (its retry policy)")
        return None, exc

    def failed(self, error: BaseException | NothingHappened | str, value: Any = None) -> Walk:
        """Record the failure (raised, or reported as ``value`` by ``failure_of``), then roll the session back if
        its policy says so and the caller let it; returns the ``Outcome``."""
        exc = error if isinstance(error, BaseException) else None
        policy = yield Op.RECORD, (error, self.rollback)
        report = None
        if policy == "rollback" and self.rollback:
            name = self.d.tool_name if self.d is not None else "the tool"
            report = yield Op.ROLLBACK, (exc if self.note else None, failure_reason(name, error))
        return Outcome(value=value, error=exc, rollback=report, failure=None if exc else str(error))


def failure_reason(tool_name: str, error: BaseException | NothingHappened | str) -> str:
    """A call's failure as a rollback's stored reason."""
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return clean_text(f"{tool_name} failed: {text}")


# -- the call's spans: what the steps above are seen as -----------------------------------------------------------
# An IRREVERSIBLE call's gate gets its own ``execute_tool`` span only when the tool does not run now (it waits for a
# person, was refused, or replays a stored result): a call let through is traced once, by its run's span, which
# carries the approval request and the decision. So each attempt of the agent to call the tool is one span.

_REFUSALS = {"approval_rejected": "rejected", "approval_timed_out": "timed_out",
             "approval_cancelled": "cancelled"}


class GateSpan:
    """The traced IRREVERSIBLE gate, for ``decide`` and ``adecide`` alike: the span of a decision that runs nothing
    now (``decided``), or of a refusal (an ``UndoLogError`` leaving the ``with`` block)."""

    __slots__ = ("spec", "session_id", "call_id", "start")

    def __init__(self, spec: ToolSpec, session_id: str, call_id: str | None) -> None:
        self.spec, self.session_id, self.call_id = spec, session_id, call_id
        self.start = time.time_ns()

    def __enter__(self) -> GateSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if isinstance(exc, UndoLogError):
            attrs = self._attrs()
            attrs[obs.A_DECISION] = _REFUSALS.get(exc.code, "refused")
            attrs[obs.A_REQUEST] = getattr(exc, "approval_request_id", None)
            obs.record_span(f"{obs.OP_EXECUTE_TOOL} {self.spec.name}", attrs, self.start, error=exc)

    def decided(self, d: Decision) -> Decision:
        if isinstance(d, Execute):
            return d
        attrs = self._attrs()
        attrs[obs.A_EFFECT] = d.effect_id
        if isinstance(d, AwaitingApproval):
            attrs.update({obs.A_REQUEST: d.approval_request_id, obs.A_DECISION: "awaiting_approval",
                          obs.A_TOOL_CALL_ID: d.call_id})
        else:
            attrs[obs.A_DECISION] = "replayed"
        obs.record_span(f"{obs.OP_EXECUTE_TOOL} {self.spec.name}", attrs, self.start)
        return d

    def _attrs(self) -> dict[str, Any]:
        spec = self.spec
        return obs.tool_attrs(spec.name, spec.tier.value, call_id=self.call_id, session_id=self.session_id,
                              effect_id=None)


@contextlib.contextmanager
def tool_span(d: Execute) -> Iterator[Any]:
    """The ``execute_tool`` span around a COMPENSABLE or IRREVERSIBLE tool's run.

    The tool's failure comes back in the ``Outcome`` (see :func:`ran`); only a framework's control flow passes
    through here: the call was handed back unrun (``released``), which is not an error."""
    attrs = obs.tool_attrs(d.tool_name, d.tier.value, call_id=d.call_id, session_id=d.session_id,
                           effect_id=d.effect_id)
    if d.approval_request_id is not None:
        attrs[obs.A_REQUEST] = d.approval_request_id
        attrs[obs.A_DECISION] = d.decision
    with obs.span(f"{obs.OP_EXECUTE_TOOL} {d.tool_name}", attrs) as s:
        try:
            yield s
        except BaseException:
            s.set_attribute(obs.A_OUTCOME, "released")
            raise


def ran(s: Any, outcome: Outcome) -> Outcome:
    """Mark the tool span as failed when the tool failed, with what the failure policy did about it."""
    if outcome.ok:
        return outcome
    if outcome.rollback is None:
        what = "none"
    elif outcome.rollback.complete:
        what = "rolled_back"
    else:
        what = "halted"
    obs.failed(s, outcome.error if outcome.error is not None else str(outcome.failure), what)
    return outcome


__all__ = ["CallWalk", "ControlFlow", "GateSpan", "NothingHappened", "Op", "Outcome", "Walk", "failure_reason", "ran",
           "tool_span"]
