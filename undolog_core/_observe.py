"""Logs and traces: the ``undolog.*`` loggers, and OpenTelemetry spans and metrics when an SDK is configured.

Logging: a record for every decision (pause, approve, modify, reject, timeout), rollback, compensation, recovery
action and halt, each naming its session, effect and request ids in the text and as ``extra`` fields
(``undolog_session_id``, ``undolog_effect_id``, ``undolog_approval_request_id``). Nothing is logged per SAFE or
COMPENSABLE call at INFO: those are the hot path.

OpenTelemetry (the ``[otel]`` extra installs ``opentelemetry-api`` only): the core imports fine without it, and with
the API but no SDK every gated path pays one ``isinstance`` check (no span object is made), because a no-op span
still costs a few microseconds. Spans follow the GenAI semantic conventions for tool execution
(``execute_tool {name}``, ``gen_ai.operation.name``, ``gen_ai.tool.name``, ``gen_ai.tool.call.id``) plus
``undolog.*`` attributes.

Example:
    >>> import logging
    >>> logging.getLogger("undolog").setLevel(logging.INFO)      # decisions, rollbacks, recovery, halts
    >>> from opentelemetry.sdk.trace import TracerProvider        # doctest: +SKIP
    >>> trace.set_tracer_provider(TracerProvider())               # spans from now on   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

# A library attaches no handler of its own, only this one: an app that configures no logging must not get UndoLog's
# records on stderr through Python's last-resort handler (an app that configures logging sees them as usual).
logging.getLogger("undolog").addHandler(logging.NullHandler())

engine_log = logging.getLogger("undolog.engine")
saga_log = logging.getLogger("undolog.saga")
approvals_log = logging.getLogger("undolog.approvals")
recovery_log = logging.getLogger("undolog.recovery")

# Set while undolog_core.testing.check_undo recovers the crashes it simulated itself: recovery's halts are then the
# check working as meant, logged at INFO, not WARNING (a real crash's stay warnings).
SIMULATED_CRASHES: contextvars.ContextVar[bool] = contextvars.ContextVar("undolog_simulated_crashes", default=False)


def crash_level() -> int:
    """The level of a "recovered after a crash" record: WARNING, INFO for a crash ``check_undo`` simulated."""
    return logging.INFO if SIMULATED_CRASHES.get() else logging.WARNING


try:  # the [otel] extra; without it every helper below is a no-op
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
    from opentelemetry.trace import ProxyTracerProvider as _ProxyTracerProvider
    from opentelemetry.trace import Status as _Status
    from opentelemetry.trace import StatusCode as _StatusCode
except ImportError:  # pragma: no cover - exercised by tests/core/test_observe.py in a subprocess
    _trace = None  # type: ignore[assignment]
    _metrics = None  # type: ignore[assignment]

_ProxyMeterProvider: type | None
try:  # the API's placeholder before an SDK sets a provider; private, hence the fallback
    from opentelemetry.metrics import _internal as _metrics_internal
    from opentelemetry.metrics._internal import _ProxyMeterProvider
except ImportError:  # pragma: no cover - another API version: always record (the proxy makes it a no-op)
    _ProxyMeterProvider = None
    _metrics_internal = None  # type: ignore[assignment]

SCOPE = "undolog"

# Span and attribute names (GenAI semantic conventions for tool execution, then UndoLog's own).
OP_EXECUTE_TOOL = "execute_tool"
A_OPERATION = "gen_ai.operation.name"
A_TOOL_NAME = "gen_ai.tool.name"
A_TOOL_CALL_ID = "gen_ai.tool.call.id"
A_TOOL_TYPE = "gen_ai.tool.type"
A_TIER = "undolog.tier"
A_SESSION = "undolog.session_id"
A_EFFECT = "undolog.effect_id"
A_REQUEST = "undolog.approval_request_id"
A_DECISION = "undolog.decision"
A_COMPENSATION = "undolog.compensation"
A_ROLLBACK = "undolog.rollback"
A_OUTCOME = "undolog.outcome"


def ids(session_id: str | None = None, effect_id: str | None = None,
        approval_request_id: str | None = None) -> dict[str, Any]:
    """The ``extra=`` of a log record: the ids a log pipeline filters on."""
    return {"undolog_session_id": session_id, "undolog_effect_id": effect_id,
            "undolog_approval_request_id": approval_request_id}


# --------------------------------------------------------------------------------------------------- traces


def _nothing_set(module: Any, attribute: str, env_var: str) -> bool:
    """True when no provider was set in code and none is named in the environment: the API would hand out its
    placeholder. Its own getter reads ``os.environ`` on every call (about a microsecond, on every gated call), so
    the module's global is read first (the environment as it was when UndoLog was imported, which is when the
    OpenTelemetry variables are set), and the getter asked only when the global is set or cannot be read."""
    return getattr(module, attribute, _UNREADABLE) is None and env_var not in _ENV_AT_IMPORT


_UNREADABLE = object()
_ENV_AT_IMPORT = frozenset(k for k in os.environ if k.startswith("OTEL_PYTHON_"))


def tracing() -> bool:
    """True when spans would be recorded: the API is installed and an SDK has set a tracer provider.

    Checked per call (not cached) so an SDK configured after UndoLog starts is picked up.
    """
    if _trace is None or _nothing_set(_trace, "_TRACER_PROVIDER", "OTEL_PYTHON_TRACER_PROVIDER"):
        return False
    return not isinstance(_trace.get_tracer_provider(), _ProxyTracerProvider)


class _NoSpan:
    """What the span helpers yield when nothing is recorded: accepts the same calls, does nothing."""

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict[str, Any]) -> None:
        pass

    def record_exception(self, exc: BaseException) -> None:
        pass

    def set_status(self, *a: Any, **k: Any) -> None:
        pass


NO_SPAN = _NoSpan()


def _clean(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in attrs.items() if v is not None}


@contextlib.contextmanager
def span(name: str, attrs: dict[str, Any]) -> Iterator[Any]:
    """A span named ``name`` (current for what runs inside).

    An exception passing through does not mark it as an error by itself: a framework's control flow (LangGraph's
    interrupt) passes through too. Callers mark failures with :func:`failed`. Callers check :func:`tracing` first on
    hot paths; this checks again, so it is safe to call anywhere.
    """
    if not tracing():
        yield NO_SPAN
        return
    tracer = _trace.get_tracer(SCOPE)
    with tracer.start_as_current_span(name, attributes=_clean(attrs), record_exception=False,
                                      set_status_on_exception=False) as s:
        yield s


def record_span(name: str, attrs: dict[str, Any], start_time_ns: int, *, error: BaseException | None = None) -> None:
    """A span that began at ``start_time_ns`` and ends now (for a step whose outcome decides whether it is one)."""
    if not tracing():
        return
    s = _trace.get_tracer(SCOPE).start_span(name, attributes=_clean(attrs), start_time=start_time_ns)
    if error is not None:
        failed(s, error)
    s.end()


def tool_attrs(tool_name: str, tier: str, *, call_id: str | None, session_id: str | None,
               effect_id: str | None) -> dict[str, Any]:
    """The attributes of an ``execute_tool`` span."""
    return {A_OPERATION: OP_EXECUTE_TOOL, A_TOOL_NAME: tool_name, A_TOOL_TYPE: "function", A_TOOL_CALL_ID: call_id,
            A_TIER: tier, A_SESSION: session_id, A_EFFECT: effect_id}


def failed(s: Any, error: BaseException | str, rollback: str | None = None, *,
           error_type: str = "tool_reported_failure") -> None:
    """Mark a span as failed by the tool (the exception is recorded, not raised through the span)."""
    if s is NO_SPAN:
        return
    if isinstance(error, BaseException):
        s.record_exception(error)
        s.set_attribute("error.type", getattr(error, "code", None) or type(error).__qualname__)
        s.set_status(_Status(_StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    else:
        s.set_attribute("error.type", error_type)
        s.set_status(_Status(_StatusCode.ERROR, str(error)))
    if rollback is not None:
        s.set_attribute(A_ROLLBACK, rollback)


# --------------------------------------------------------------------------------------------------- metrics


class _Instruments:
    def __init__(self) -> None:
        meter = _metrics.get_meter(SCOPE)
        self.calls = meter.create_counter(
            "undolog.tool.calls", unit="{call}", description="Gated tool calls run, by tier (SAFE calls are not counted)")
        self.approvals = meter.create_counter(
            "undolog.approvals", unit="{decision}", description="Approval requests decided, by outcome")
        self.approval_wait = meter.create_histogram(
            "undolog.approval.wait", unit="s", description="Time from an approval request to its decision")
        self.rollbacks = meter.create_counter(
            "undolog.rollbacks", unit="{rollback}", description="Session rollbacks, by outcome (complete, halted)")
        self.compensation_failures = meter.create_counter(
            "undolog.compensation.failures", unit="{failure}",
            description="Compensations that failed for good (the session halted)")


_instruments: _Instruments | None = None
_instruments_lock = threading.Lock()


def metering() -> bool:
    """True when metrics would be recorded (the API is installed and an SDK has set a meter provider)."""
    if _metrics is None:
        return False
    if _nothing_set(_metrics_internal, "_METER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER"):
        return False
    return _ProxyMeterProvider is None or not isinstance(_metrics.get_meter_provider(), _ProxyMeterProvider)


def instruments() -> _Instruments | None:
    """UndoLog's instruments, made once an SDK is configured; None otherwise."""
    global _instruments
    if not metering():
        return None
    if _instruments is None:
        with _instruments_lock:  # made once: two threads' first calls must not register them twice
            if _instruments is None:
                _instruments = _Instruments()
    return _instruments


_TRACER_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in _ENV_AT_IMPORT
_METER_ENV = "OTEL_PYTHON_METER_PROVIDER" in _ENV_AT_IMPORT


def count_gated(tier: str, tool_name: str) -> bool:
    """``count_call(tier, tool_name)``, then ``tracing()``: what every gated call checks, in one call.

    With no SDK configured (the common case) that is two reads of the API's globals, as ``_nothing_set`` reads them;
    anything else takes the full path.

    Example:
        >>> if count_gated("compensable", "refund"):
        ...     ...  # record a span
    """
    if ((_trace is None or (getattr(_trace, "_TRACER_PROVIDER", _UNREADABLE) is None and not _TRACER_ENV))
            and (_metrics is None
                 or (getattr(_metrics_internal, "_METER_PROVIDER", _UNREADABLE) is None and not _METER_ENV))):
        return False
    count_call(tier, tool_name)
    return tracing()


def count_call(tier: str, tool_name: str) -> None:
    m = instruments()
    if m is not None:
        # str(): a ToolTier (a StrEnum) is its value; its .value, on every gated call, is two Python-level calls.
        m.calls.add(1, {A_TIER: str(tier), A_TOOL_NAME: tool_name})


def count_decision(outcome: str, tool_name: str, created_at: dt.datetime | None,
                   decided_at: dt.datetime | None) -> None:
    m = instruments()
    if m is None:
        return
    m.approvals.add(1, {A_DECISION: outcome, A_TOOL_NAME: tool_name})
    if created_at is not None and decided_at is not None:
        m.approval_wait.record(max(0.0, (decided_at - created_at).total_seconds()),
                               {A_DECISION: outcome, A_TOOL_NAME: tool_name})


def count_rollback(outcome: str) -> None:
    m = instruments()
    if m is not None:
        m.rollbacks.add(1, {A_OUTCOME: outcome})


def count_compensation_failure(compensation: str, tool_name: str) -> None:
    m = instruments()
    if m is not None:
        m.compensation_failures.add(1, {A_COMPENSATION: compensation, A_TOOL_NAME: tool_name})


__all__ = ["NO_SPAN", "approvals_log", "count_call", "count_compensation_failure", "count_decision",
           "count_rollback", "engine_log", "failed", "ids", "instruments", "metering", "recovery_log", "saga_log",
           "span", "tool_attrs", "tracing"]
