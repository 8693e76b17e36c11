"""The one call driver: every caller walks a tool call through the same states.

decide (intercept: tier, session, contract, approval, re-issue checks) -> run the tool -> mark, fail or release.

``Session.call``/``call_sync``, the framework adapters and the server's proxy all use it, so a check added here
holds on every path. The steps past a tool's failure (classify it, the retry decision, record it, roll back by
policy) are written once, as I/O-free generators (``_walk.CallWalk``, the model: httpx's ``auth_flow``); the sync
and the async drivers are two short loops over them (``_drive``, ``_adrive``) that differ only in how the tool is
called, how they sleep, and, on an event loop, in never waiting for a connection or a lock (a durable step runs in a
worker thread instead). A call that succeeds at once takes the loops' own few lines: set the call's context, call,
record the outcome.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from types import CoroutineType
from typing import Any

from . import _observe as obs
from ._decisions import IRREVERSIBLE, SAFE, AwaitingApproval, Completed, Decision, Execute
from ._decisions import _current as CURRENT_CALL  # noqa: N812 - the ContextVar behind current_call()
from ._engine import Engine
from ._saga import RollbackReport, Saga, run_coro_blocking
from ._session_record import SessionCache, check_id
from ._tools import RetryPolicy, ToolSpec
from ._walk import (
    CallWalk,
    ControlFlow,
    GateSpan,
    NothingHappened,
    Op,
    Outcome,
    Walk,
    failure_reason,
    ran,
    tool_span,
)
from .errors import ApprovalPending
from .limits import clean_text
from .storage.pool import WouldBlock

_set_attr = object.__setattr__
_new = object.__new__


def _ok(value: Any) -> Outcome:
    """``Outcome(value=value)``, built fast: a frozen dataclass's __init__ sets each field through
    object.__setattr__, and this is every successful call's outcome (see ``_decisions.execute_now``)."""
    out = _new(Outcome)
    _set_attr(out, "__dict__", {"value": value, "error": None, "rollback": None, "failure": None, "in_doubt": None})
    return out


def settle(d: AwaitingApproval | Completed) -> Any:
    """A decision that runs nothing: the stored result of a call that already ran, or ``ApprovalPending``."""
    if isinstance(d, Completed):
        return d.result
    raise ApprovalPending(d.effect_id, d.approval_request_id, d.retry_after, d.tool_name)


class CallDriver:
    """Walks one call through intercept, run, and mark / fail / release.

    Example:
        >>> d = undolog.driver.decide(session_id, "send_refund_email", {"user_id": "u1"}, call_id="c-1")
        >>> if isinstance(d, Execute):
        ...     value = undolog.driver.run_sync(d, lambda args: send_refund_email(**args)).unwrap()
    """

    def __init__(self, engine: Engine, saga: Saga, spec_for: Callable[[Any], ToolSpec]) -> None:
        self.engine = engine
        self.saga = saga
        self._spec_for = spec_for
        # False while undolog_core.testing.check_undo runs a scenario: failures are recorded, but no session rolls
        # back on its own (policy, adapters, a `with` block left by an exception); the harness rolls back itself.
        self.failure_rollbacks = True
        # Settles one call of this process whose outcome is unknown, as recovery would (bound by the facade).
        self.in_doubt: Callable[..., str | None] | None = None

    # -- deciding --------------------------------------------------------------------------------

    def decide(
        self, session_id: str, tool: Any, args: Mapping[str, Any], *, call_id: str | None = None,
        match_digest: bool = False, wait: bool = True,
    ) -> Decision:
        """What happens to this call: ``Execute`` (run it now), ``AwaitingApproval`` or ``Completed``.

        ``tool`` is a registered function, its name or its ``ToolSpec``. ``wait=False`` (code on an event loop that
        is not a coroutine itself, like a framework's sync hook inside ``ainvoke``) raises ``WouldBlock`` before
        anything is written when the decision would wait for a connection or a lock, or needs more than the hot
        path: decide again in a worker thread (what :meth:`adecide` does).
        """
        spec = self.spec(tool)
        check_id("session_id", session_id)
        if spec.tier is IRREVERSIBLE and obs.tracing():
            with GateSpan(spec, session_id, call_id) as gate:
                return gate.decided(self.engine.intercept_spec(session_id, spec, args, call_id, match_digest, wait))
        return self.engine.intercept_spec(session_id, spec, args, call_id, match_digest, wait)

    async def adecide(
        self, session_id: str, tool: Any, args: Mapping[str, Any], *, call_id: str | None = None,
        match_digest: bool = False,
    ) -> Decision:
        """:meth:`decide` on an event loop: the COMPENSABLE hot path inline when nothing has to wait, else in a
        worker thread (a gated call, a session's first call, a busy pool or write lock)."""
        spec = self.spec(tool)
        check_id("session_id", session_id)
        if spec.tier is IRREVERSIBLE and obs.tracing():
            with GateSpan(spec, session_id, call_id) as gate:
                return gate.decided(await self._adecide(session_id, spec, args, call_id, match_digest))
        return await self._adecide(session_id, spec, args, call_id, match_digest)

    async def _adecide(self, session_id: str, spec: ToolSpec, args: Mapping[str, Any], call_id: str | None,
                       match_digest: bool) -> Decision:
        try:
            return self.engine.intercept_spec(session_id, spec, args, call_id, match_digest, False)
        except WouldBlock:
            return await asyncio.to_thread(self.engine.intercept_spec, session_id, spec, args, call_id, match_digest)

    def spec(self, tool: Any) -> ToolSpec:
        return tool if isinstance(tool, ToolSpec) else self._spec_for(tool)

    def safe(self, spec: ToolSpec, args: Mapping[str, Any], cache: SessionCache) -> dict[str, Any]:
        """A SAFE call's whole decision, as :meth:`call_sync` makes it: the arguments validated, the session's pin
        on the tool checked (``ContractChanged``) and the call counted in memory; returns the values to run it with.

        For an adapter that keeps the session's ``cache`` (``engine.look_up_session``) and runs the tool itself:
        nothing is written, no ``Execute`` is built, and ``current_call()`` stays None, as on the core's SAFE path.
        """
        values = spec.checked(args)
        self.engine.note_safe_in(cache, spec, values)
        return values

    def safe_as_is(self, spec: ToolSpec, args: Mapping[str, Any], cache: SessionCache) -> dict[str, Any] | None:
        """:meth:`safe` for arguments the contract's model would give back unchanged (``ToolSpec.as_is_copy``: a
        framework's own mapping, like Semantic Kernel's ``KernelArguments``, checked as it is), else None with
        nothing checked or counted: the caller then converts them and calls :meth:`safe`.

        Example:
            >>> driver.safe_as_is(spec, {"order_id": "A-17"}, cache)     # doctest: +SKIP
            {'order_id': 'A-17'}
        """
        copy = spec._as_is_copy  # (spec.as_is_copy without its own call: this is every such SAFE call's path)
        values = copy(args) if copy is not None else None
        if values is not None:
            self.engine.note_safe_in(cache, spec, values)
        return values

    # -- running ---------------------------------------------------------------------------------

    def run_sync(
        self, d: Execute, invoke: Callable[[dict[str, Any]], Any], *, control_flow: ControlFlow = (),
        rollback_on_failure: bool = True, failure_of: Callable[[Any], str | NothingHappened | None] | None = None,
        result_of: Callable[[Any], Any] | None = None, note: bool = True, unknown_on: ControlFlow = (),
    ) -> Outcome:
        """Run ``invoke(args)`` under the decision, then record its outcome.

        ``control_flow`` exceptions (a framework's own, like LangGraph's ``GraphInterrupt``) hand the call back
        without an outcome (``release``) and propagate untouched; the re-issued call runs it again under the same
        effect. Any other exception is the tool's failure: recorded, the session rolled back per its policy (unless
        ``rollback_on_failure`` is False: the caller rolls back itself), and returned in the ``Outcome``.
        A framework that turns a tool's exception into a value (an error message) says so with ``failure_of``
        (the failure's text, or None); ``result_of`` picks what is stored as the result (default: the value).
        ``note=False``: the caller tells the rollback's outcome itself, so it is not noted on the exception.
        ``unknown_on`` exceptions leave the call's outcome unknown (a lost connection, a timeout): it is settled at
        once as recovery would (``Outcome.in_doubt``), never recorded as a failure that nothing happened in.
        """
        if d.effect_id is None:  # SAFE: no span, no metric (its budget is a few microseconds)
            return self._run_sync(d, invoke, control_flow, rollback_on_failure, failure_of, result_of, note, unknown_on)
        if not obs.count_gated(d.tier, d.tool_name):  # counted; traced only with an SDK
            return self._run_sync(d, invoke, control_flow, rollback_on_failure, failure_of, result_of, note, unknown_on)
        with tool_span(d) as s:
            return ran(s, self._run_sync(d, invoke, control_flow, rollback_on_failure, failure_of, result_of, note, unknown_on))

    def _run_sync(
        self, d: Execute, invoke: Callable[[dict[str, Any]], Any], control_flow: ControlFlow,
        rollback_on_failure: bool, failure_of: Callable[[Any], str | NothingHappened | None] | None,
        result_of: Callable[[Any], Any] | None, note: bool, unknown_on: ControlFlow,
    ) -> Outcome:
        # What `with self.engine.running(d):` does, without its three Python-level calls (the common case).
        token = CURRENT_CALL.set(d)  # current_call() builds its CallContext (attempt 1) if a tool asks
        try:
            try:
                value = invoke(d.args)
            except BaseException as exc:
                # The walk: released (control flow), settled (unknown), retried per the tool's policy (same effect,
                # same key), or recorded failed and rolled back per the session's policy.
                value, out = self._drive(self._walk(d, exc, control_flow, unknown_on, rollback_on_failure, note)
                                         .raised(exc), d, invoke)
                if out is not None:
                    return out  # type: ignore[no-any-return]
        finally:
            CURRENT_CALL.reset(token)
        failure = failure_of(value) if failure_of is not None else None
        if failure is not None:
            return self._drive(self._walk(d, None, control_flow, unknown_on, rollback_on_failure, note)  # type: ignore[no-any-return]
                               .failed(failure, value), d, invoke)
        if d.effect_id is not None:
            self.engine.complete(d.effect_id, result_of(value) if result_of is not None else value)
        return _ok(value)

    def run_safe_sync(self, d: Execute, invoke: Callable[[dict[str, Any]], Any], *,
                      control_flow: ControlFlow = ()) -> Any:
        """:meth:`run_sync` for a SAFE decision, returning the tool's value or raising its exception.

        The same steps as there for a call nothing is recorded for (``current_call()`` set around it, a framework's
        ``control_flow`` exceptions passed on, the tool's retry policy applied before it counts as failed, no
        rollback), in one frame and without an ``Outcome``: a framework adapter runs it on every SAFE tool call,
        inside a step where each frame's code and data are cold.

        Example:
            >>> driver.run_safe_sync(decision, lambda args: lookup_order(**args))     # doctest: +SKIP
            'order A-17: shipped'
        """
        if d.effect_id is not None:
            raise ValueError(f"run_safe_sync runs SAFE decisions only; {d.tool_name} has effect {d.effect_id}")
        token = CURRENT_CALL.set(d)
        try:
            try:
                return invoke(d.args)
            except control_flow:
                raise  # a SAFE call holds nothing to release
            except BaseException as exc:
                value, error = self._drive(self._walk(d, exc, control_flow, (), False, True).retried(exc), d, invoke)
        finally:
            CURRENT_CALL.reset(token)
        if error is not None:
            raise error  # raised as run_sync's Outcome hands it back to be raised: outside any handler
        return value

    def run_async(
        self, d: Execute, invoke: Callable[[dict[str, Any]], Awaitable[Any] | Any], *,
        control_flow: ControlFlow = (), rollback_on_failure: bool = True,
        failure_of: Callable[[Any], str | NothingHappened | None] | None = None,
        result_of: Callable[[Any], Any] | None = None, note: bool = True, unknown_on: ControlFlow = (),
    ) -> Coroutine[Any, Any, Outcome]:
        """The async twin of :meth:`run_sync`: the same steps, the tool and the rollback awaited on this loop.

        Awaited as a coroutine function's call is (``await driver.run_async(...)``); a plain function returning the
        coroutine that runs the call, so that an untraced call (the common case) is one coroutine, not two nested.
        """
        if d.effect_id is None or not obs.count_gated(d.tier, d.tool_name):  # SAFE, or counted and not traced
            return self._run_async(d, invoke, control_flow, rollback_on_failure, failure_of, result_of, note, unknown_on)
        return self._run_traced_async(d, invoke, control_flow, rollback_on_failure, failure_of, result_of, note,
                                      unknown_on)

    async def _run_traced_async(
        self, d: Execute, invoke: Callable[[dict[str, Any]], Awaitable[Any] | Any], control_flow: ControlFlow,
        rollback_on_failure: bool, failure_of: Callable[[Any], str | NothingHappened | None] | None,
        result_of: Callable[[Any], Any] | None, note: bool, unknown_on: ControlFlow,
    ) -> Outcome:
        with tool_span(d) as s:
            return ran(s, await self._run_async(d, invoke, control_flow, rollback_on_failure, failure_of,
                                                 result_of, note, unknown_on))

    async def _run_async(
        self, d: Execute, invoke: Callable[[dict[str, Any]], Awaitable[Any] | Any], control_flow: ControlFlow,
        rollback_on_failure: bool, failure_of: Callable[[Any], str | NothingHappened | None] | None,
        result_of: Callable[[Any], Any] | None, note: bool, unknown_on: ControlFlow,
    ) -> Outcome:
        token = CURRENT_CALL.set(d)
        try:
            try:
                value = invoke(d.args)
                if value.__class__ is CoroutineType or inspect.isawaitable(value):
                    value = await value
            except BaseException as exc:
                value, out = await self._adrive(self._walk(d, exc, control_flow, unknown_on, rollback_on_failure,
                                                           note).raised(exc), d, invoke)
                if out is not None:
                    return out  # type: ignore[no-any-return]
        finally:
            CURRENT_CALL.reset(token)
        failure = failure_of(value) if failure_of is not None else None
        if failure is not None:
            return await self._adrive(self._walk(d, None, control_flow, unknown_on,  # type: ignore[no-any-return]
                                                 rollback_on_failure, note).failed(failure, value), d, invoke)
        result = result_of(value) if result_of is not None else value
        if d.effect_id is not None:
            try:
                self.engine.complete(d.effect_id, result, wait=False)
            except WouldBlock:
                await asyncio.to_thread(self._complete, d, result)
        # _ok, inline: a frame fewer on every call run on an event loop (Semantic Kernel's frame test pins it).
        out = _new(Outcome)
        _set_attr(out, "__dict__", {"value": value, "error": None, "rollback": None, "failure": None, "in_doubt": None})
        return out

    def _settle_in_doubt(self, d: Execute, exc: BaseException) -> str | None:
        if d.effect_id is None or self.in_doubt is None:
            return None  # a SAFE call: nothing was logged, nothing to settle
        if getattr(exc, "settles_later", False):
            # Its request is still out (a timeout, the tool asked to cancel it) and its caller settles the call on
            # what the tool answers to it: settled now, a compensation could run before the original lands. Left in
            # flight, held (its lease renewed) by this process; a process that ends first leaves it to recover().
            return "settling"
        # An exception may say whether its request can still land (``original_gone``, e.g. a timeout whose request
        # is still running): a probe's "did not happen" settles nothing until it cannot. Unsaid: the call is over.
        try:
            # ``told_when_gone`` False: nothing will say when it can no longer land (see ``settle_in_doubt``).
            return self.in_doubt(d.effect_id, original_gone=bool(getattr(exc, "original_gone", True)),
                                 told_when_gone=bool(getattr(exc, "told_when_gone", True)))
        except Exception as book:  # noqa: BLE001 - the caller's exception wins; recovery settles it later
            _note(exc, f"undolog: {d.tool_name} (effect {d.effect_id}) could not be settled now: {book}; "
                       "run recover()")
            return None

    # -- whole calls -----------------------------------------------------------------------------

    def call_sync(
        self, session_id: str, tool: Any, args: Mapping[str, Any], *, call_id: str | None = None,
        invoke: Callable[[dict[str, Any]], Any] | None = None, cache: SessionCache | None = None,
    ) -> Any:
        """Decide, run and record one call; the tool's value (or its own exception, or ``ApprovalPending``).

        ``invoke`` runs the tool (default: the registered function; an async one is run to completion). ``cache``
        is the session's in-memory record when the caller holds it (``Session``), saving a lookup per SAFE call.
        """
        spec = tool if tool.__class__ is ToolSpec else self._spec_for(tool)
        if spec.tier is SAFE and invoke is None:
            # The whole SAFE path: validate, count in memory, call. No I/O, no effect, no context to set.
            values = spec.checked(args)
            self.engine.note_safe_in(cache or self.engine.session_cache(session_id), spec, values)
            try:
                out = spec.fn(**values)  # type: ignore[misc]
                return run_coro_blocking(out) if spec.is_async else out
            except Exception as exc:
                if spec.retry is None:
                    raise
                return self._retry_safe_sync(spec, values, exc)
        if spec.tier is IRREVERSIBLE:
            d = self.decide(session_id, spec, args, call_id=call_id)
        else:  # what decide() does for a COMPENSABLE call, without resolving the spec again
            if cache is None or cache.session_id is not session_id or not cache.persisted:
                check_id("session_id", session_id)  # (a stored session's id was checked before it was stored)
            d = self.engine.intercept_spec(session_id, spec, args, call_id)
        if d.__class__ is not Execute:
            return settle(d)  # type: ignore[arg-type]
        return self.run_sync(d, invoke or (lambda a: _call_blocking(spec, a))).unwrap()

    async def call_async(
        self, session_id: str, tool: Any, args: Mapping[str, Any], *, call_id: str | None = None,
        invoke: Callable[[dict[str, Any]], Any] | None = None, cache: SessionCache | None = None,
    ) -> Any:
        """The async twin of :meth:`call_sync`."""
        spec = tool if tool.__class__ is ToolSpec else self._spec_for(tool)
        if spec.tier is SAFE and invoke is None:
            values = spec.checked(args)
            if cache is None:
                try:
                    cache = self.engine.session_cache(session_id, wait=False)
                except WouldBlock:  # a session evicted from the cache is read again: not on the event loop
                    cache = await asyncio.to_thread(self.engine.session_cache, session_id)
            self.engine.note_safe_in(cache, spec, values)
            try:
                out = spec.fn(**values)  # type: ignore[misc]
                return (await out) if spec.is_async else out
            except Exception as exc:
                if spec.retry is None:
                    raise
                return await self._retry_safe_async(spec, values, exc)
        if spec.tier is IRREVERSIBLE:
            d = await self.adecide(session_id, spec, args, call_id=call_id)
        else:
            if cache is None or cache.session_id is not session_id or not cache.persisted:
                check_id("session_id", session_id)
            d = await self._adecide(session_id, spec, args, call_id, False)
        if d.__class__ is not Execute:
            return settle(d)  # type: ignore[arg-type]
        return (await self.run_async(d, invoke or (lambda a: spec.fn(**a)))).unwrap()  # type: ignore[misc]

    # -- retries (only after a tool raised: the call that succeeds at once never comes here) ---------

    def _retry_policy(self, d: Execute, exc: BaseException) -> RetryPolicy | None:
        if d.tier is IRREVERSIBLE or not isinstance(exc, Exception):
            return None  # an approved irreversible call is never re-run blindly; an interrupt is never retried
        try:
            return self._spec_for(d.tool_name).retry
        except Exception:  # noqa: BLE001 - no spec here (a caller's own name): no retry, the failure stands
            return None

    def _walk(self, d: Execute, exc: BaseException | None, control_flow: ControlFlow, unknown_on: ControlFlow,
              rollback: bool, note: bool) -> CallWalk:
        """The walk of a call whose first attempt raised ``exc`` (None: reported a failure as its value)."""
        policy = self._retry_policy(d, exc) if exc is not None else None
        return CallWalk(d, control_flow, unknown_on, rollback=rollback and self.failure_rollbacks, note=note,
                        policy=policy)

    def _drive(self, walk: Walk, d: Execute, invoke: Callable[[dict[str, Any]], Any]) -> Any:
        """The sync loop over a walk: each step it asks for done here, in this thread; returns what it returns."""
        try:
            step = next(walk)
            while True:
                op, arg = step
                answer: Any = None
                if op is Op.INVOKE:
                    error: BaseException | None = None
                    try:
                        with self.engine.running(d, attempt=arg):
                            answer = invoke(d.args)
                    except BaseException as exc:  # noqa: BLE001 - the walk classifies it
                        error = exc
                    step = walk.send(answer) if error is None else walk.throw(error)
                    continue
                if op is Op.SLEEP:
                    time.sleep(arg)
                elif op is Op.RELEASE:
                    self.release(d)
                elif op is Op.SETTLE:
                    answer = self._settle_in_doubt(d, arg)
                elif op is Op.RECORD:
                    answer = self._record_failure(d, *arg)
                else:
                    try:
                        answer = self._rollback_sync(d.session_id, *arg)
                    finally:
                        self.engine.leases.rolling.discard(d.session_id)  # the walk is over here, however it ended
                step = walk.send(answer)
        except StopIteration as done:
            return done.value

    async def _adrive(self, walk: Walk, d: Execute, invoke: Callable[[dict[str, Any]], Any]) -> Any:
        """The async loop over a walk: the tool and the rollback awaited on this loop, every other durable step in a
        worker thread (the loop never waits on the store)."""
        try:
            step = next(walk)
            while True:
                op, arg = step
                answer: Any = None
                if op is Op.INVOKE:
                    error: BaseException | None = None
                    try:
                        with self.engine.running(d, attempt=arg):
                            answer = invoke(d.args)
                            if inspect.isawaitable(answer):
                                answer = await answer
                    except BaseException as exc:  # noqa: BLE001 - the walk classifies it
                        error = exc
                    step = walk.send(answer) if error is None else walk.throw(error)
                    continue
                if op is Op.SLEEP:
                    await asyncio.sleep(arg)
                elif op is Op.RELEASE:
                    await self._off_loop(self.release, d)
                elif op is Op.SETTLE:
                    answer = await self._off_loop(self._settle_in_doubt, d, arg)
                elif op is Op.RECORD:
                    answer = await self._off_loop(self._record_failure, d, *arg)
                else:
                    try:
                        answer = await self._rollback_async(d.session_id, *arg)
                    finally:
                        self.engine.leases.rolling.discard(d.session_id)  # the walk is over here, however it ended
                step = walk.send(answer)
        except StopIteration as done:
            return done.value

    def _retry_safe_sync(self, spec: ToolSpec, values: dict[str, Any], exc: Exception) -> Any:
        d = Execute(None, values, None, SAFE, spec.name, None, "")
        invoke = lambda a: _call_blocking(spec, a)  # noqa: E731
        value, error = self._drive(self._walk(d, exc, (), (), False, True).retried(exc), d, invoke)
        if error is not None:
            raise error
        return value

    async def _retry_safe_async(self, spec: ToolSpec, values: dict[str, Any], exc: Exception) -> Any:
        d = Execute(None, values, None, SAFE, spec.name, None, "")
        invoke = lambda a: spec.fn(**a)  # type: ignore[misc]  # noqa: E731
        value, error = await self._adrive(self._walk(d, exc, (), (), False, True).retried(exc), d, invoke)
        if error is not None:
            raise error
        return value

    # -- the shared steps ------------------------------------------------------------------------

    def _complete(self, d: Execute, value: Any) -> None:
        if d.effect_id is not None:
            self.engine.complete(d.effect_id, value)

    def release(self, d: Execute) -> None:
        """Hand a decided call back without running it (a framework paused before it ran, or a filter changed
        it after the gate): its re-issue decides again, under the same effect."""
        if d.effect_id is not None:
            self.engine.release(d.effect_id)

    def _record_failure(self, d: Execute, error: BaseException | NothingHappened | str,
                        rollback: bool = False) -> str | None:
        """The failure's policy, or None when nothing is to be done (a SAFE call, or a store that is down).

        ``rollback``: the caller rolls the session back if its policy says so, requested with the failure."""
        if d.effect_id is None:
            return None
        request = (d.session_id, failure_reason(d.tool_name, error)) if rollback else None
        try:
            if isinstance(error, NothingHappened):
                return self.engine.record_failure(d.effect_id, error.text, nothing_happened=True,
                                                  rollback=request).on_failure
            return self.engine.record_failure(d.effect_id, error, rollback=request).on_failure
        except Exception as book:  # noqa: BLE001 - the user's exception wins; ours is noted on it
            # The effect stays in flight without a live owner, so recover() settles it.
            _note(error, f"undolog: the failure of {d.tool_name} (effect {d.effect_id}) could not be recorded: "
                         f"{book}; run recover() once the store answers")
            return None

    def _rollback_sync(self, session_id: str, exc: BaseException | None, reason: str) -> RollbackReport | None:
        try:
            report = self.saga.rollback_sync(session_id, reason=reason)
        except Exception as rb:  # noqa: BLE001 - the user's exception wins; the rollback problem is noted on it
            return self._rollback_failed(session_id, exc, reason, rb)
        _note(exc, f"undolog: session {session_id} rolled back ({summary(report)})")
        return report

    async def _rollback_async(self, session_id: str, exc: BaseException | None, reason: str) -> RollbackReport | None:
        try:
            report = await self.saga.rollback(session_id, reason=reason)
        except Exception as rb:  # noqa: BLE001 - the user's exception wins; the rollback problem is noted on it
            failed: RollbackReport = await self._off_loop(self._rollback_failed, session_id, exc, reason, rb)
            return failed
        _note(exc, f"undolog: session {session_id} rolled back ({summary(report)})")
        return report

    def _rollback_failed(self, session_id: str, exc: BaseException | None, reason: str,
                         rb: Exception) -> RollbackReport:
        """The policy's rollback could not run: the session halts for a person, and the report says why."""
        _note(exc, f"undolog: rollback of session {session_id} failed: {rb}")
        self.saga.halt_unrolled(session_id, reason, rb)
        return RollbackReport(session_id, complete=False, halted_reason=f"the rollback could not run: {rb}")

    @staticmethod
    async def _off_loop(fn: Callable[..., Any], *args: Any) -> Any:
        # Rare paths (a failure, a release) take a transaction: in a worker thread, never on the loop.
        return await asyncio.to_thread(fn, *args)

    def fail(self, effect_id: str, error: BaseException | str) -> RollbackReport | None:
        """Record a failure reported by a caller that ran the tool itself; by default the session then rolls back,
        this effect's own compensation included. Returns the rollback report, or None when the session's policy
        is "continue"."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        why = clean_text(f"effect {effect_id} failed: {text}")
        # Its session first (a read on this rare path), so that the rollback is requested with the failure.
        session_id = self.engine.store.effects.session_of_effect(effect_id) if self.failure_rollbacks else None
        failure = self.engine.record_failure(effect_id, error,
                                             rollback=(session_id, why) if session_id is not None else None)
        if failure.on_failure != "rollback" or not self.failure_rollbacks:
            return None
        try:
            return self.saga.rollback_sync(failure.session_id, reason=why)
        except Exception as exc:
            self.saga.halt_unrolled(failure.session_id, why, exc)
            raise
        finally:
            self.engine.leases.rolling.discard(failure.session_id)

    def rollback_noting(self, session_id: str, exc: BaseException, reason: str) -> RollbackReport | None:
        """Roll back after ``exc`` ended the caller's work; the outcome is noted on ``exc``, never replacing it."""
        return self._rollback_sync(session_id, exc, reason)

    async def arollback_noting(self, session_id: str, exc: BaseException, reason: str) -> RollbackReport | None:
        return await self._rollback_async(session_id, exc, reason)


def _call_blocking(spec: ToolSpec, args: dict[str, Any]) -> Any:
    """Call the registered function from sync code; an async one runs to completion (even under a running loop)."""
    out = spec.fn(**args)  # type: ignore[misc]
    return run_coro_blocking(out) if spec.is_async else out


def _note(exc: object, text: str) -> None:
    if isinstance(exc, BaseException):
        exc.add_note(text)


def summary(report: RollbackReport) -> str:
    """A rollback in a few words, for notes on exceptions and messages to the model."""
    if report.already_rolled_back:
        return "it was already rolled back"
    done = sum(1 for s in report.steps if s.outcome == "compensated")
    text = f"{done} compensation(s) run"
    if not report.complete:
        text += f"; stopped: {report.halted_reason}"
    return text


__all__ = ["CallDriver", "NothingHappened", "Outcome", "settle", "summary"]
