"""One tool call through UndoLog, sync and async: intercept, pause or run, then complete, fail or release.

``run_call`` and ``arun_call`` walk a LangGraph call through UndoLog's call driver (the one other decision is
``UndoLogToolNode._gate``, which asks for a message's approvals before any call runs).
Both the node and the middleware call them. Imports LangGraph/LangChain and the sibling modules.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from langchain_core.messages import AIMessage, ToolMessage
from langgraph.config import get_config
from langgraph.errors import GraphBubbleUp

from undolog_core import ToolTier, errors
from undolog_core.integration import AwaitingApproval, Completed, Execute, Outcome, WouldBlock

from ._guard import _config_of, _Guard, _override, _Reply, _Run
from ._payload import _Pause
from ._sessions import SEP
from ._siblings import PUSH, forget_answers, next_interrupt_index
from ._tools import _CAPTURE, _COPIES, _Box, _capturing, _content_of, _result_of, emit, rollback_events

# The tier as the effect's mark on a COMPENSABLE call's message says it (``_Guard.committed``: ``str(d.tier)``).
_COMPENSABLE = str(ToolTier.COMPENSABLE)


@dataclass
class _Batch:
    """Per-node-run state of ``UndoLogToolNode``: approvals are collected, then asked for in one interrupt."""

    done: dict[str, Any] = field(default_factory=dict)
    pending: dict[str, tuple[AwaitingApproval, str]] = field(default_factory=dict)
    # Outcomes of the gate pass that UndoLogToolNode runs before any call of the message executes.
    gated: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


_BATCH: contextvars.ContextVar[_Batch | None] = contextvars.ContextVar("undolog_lg_batch", default=None)


@dataclass
class _Admit:
    """The one call UndoLog let through, checked again where the tool really runs."""

    name: str
    args: dict[str, Any]
    tool: Any
    logged: bool
    runs: int = 0


_ADMIT: contextvars.ContextVar[_Admit | None] = contextvars.ContextVar("undolog_lg_admit", default=None)

_REFUSED = (errors.ApprovalRejected, errors.ApprovalTimedOut, errors.ApprovalCancelled, errors.SessionHalted,
            errors.SessionClosed, errors.ArgumentsInvalid)


def _pending(guard: _Guard, request: Any) -> tuple[_Batch | None, str | None]:
    """Classify an unknown tool (or refuse it); the node run's batch and the call's id."""
    if guard.undolog_name(request) is None:
        guard.classify([request.tool])  # raises ToolNotClassified: nothing runs unclassified
    return _BATCH.get(), request.tool_call.get("id")


def _wait(guard: _Guard, batch: _Batch | None, request: Any, step: _Pause) -> ToolMessage | None:
    """Inside a node run, park the call for the node's one interrupt (returns the placeholder); else None."""
    if batch is None:
        return None
    with batch.lock:
        batch.pending[request.tool_call.get("id")] = (step.awaiting, step.session_id)
    return guard.refusal(request, errors.UndoLogError("waiting for approval"))


_Tokens = tuple["contextvars.Token[_Admit | None] | None", "contextvars.Token[_Box | None] | None"]


def _admit(req: Any, step: _Run, box: _Box | None, admit: bool) -> _Tokens:
    """Set what the innermost ``execute`` checks (``admit``: ``UndoLogToolNode``) and where the tool's raw value goes
    (``box``: a logged call). The middleware is the innermost tool-call wrapper (``_innermost``), so nothing checks
    there; a SAFE call keeps no raw value: then nothing is set at all."""
    a = _ADMIT.set(_Admit(req.tool_call["name"], dict(req.tool_call.get("args") or {}), req.tool,
                          step.execute.effect_id is not None)) if admit else None
    return a, (_CAPTURE.set(box) if box is not None else None)


def _unadmit(tokens: _Tokens) -> None:
    if tokens[1] is not None:
        _CAPTURE.reset(tokens[1])
    if tokens[0] is not None:
        _ADMIT.reset(tokens[0])


@dataclass
class _Answer:
    """The node's answer without running the tool (a refusal, a replay, a parked approval)."""

    value: Any


def _decide(guard: _Guard, request: Any, wait: bool = True) -> tuple[_Run | _Answer, _Batch | None, str | None]:
    """The decision for one call, shared by the sync and the async run: a ``_Run`` to execute, or the answer.

    A pause for approval outside a node run asks LangGraph's ``interrupt`` here (it raises on the first pass
    and returns the decision on resume), then decides again. ``wait=False`` (on an event loop): the first decision
    raises ``WouldBlock`` (nothing written, nothing asked) when it would wait for the store.
    """
    batch, call_id = _pending(guard, request)
    if batch is None:
        _one_pause_per_task(guard, request)
    if batch is not None and call_id in batch.done:
        return _Answer(batch.done[call_id]), batch, call_id
    # What the node's gate pass decided for this call, if it ran one (IRREVERSIBLE calls only).
    gated = batch.gated.pop(call_id, None) if batch is not None and call_id else None
    config = _config_of(request)
    error: str | None = None
    asked, start = 0, None  # this call's pauses answered in this run, and the index of the first
    while True:
        try:
            step = gated if gated is not None else guard.prepare(request, config, wait=wait)  # the driver's decision
        except _REFUSED as exc:
            return _Answer(_remember(batch, call_id, guard.refusal(request, exc))), batch, call_id
        gated = None
        if isinstance(step, ToolMessage):
            return _Answer(_remember(batch, call_id, step)), batch, call_id
        if isinstance(step, _Reply):
            return _Answer(_remember(batch, call_id, step.message)), batch, call_id
        if isinstance(step, _Pause):
            parked = _wait(guard, batch, request, step)
            if parked is not None:
                return _Answer(parked), batch, call_id
            if not asked:
                start = next_interrupt_index(config)  # where this call's pauses begin among the task's interrupts
            error = guard.ask([step], error)
            asked += 1
            wait = True  # after an interrupt was asked, never retried elsewhere: it would be asked twice
            continue
        if asked and batch is None and _own_task(config):
            # Decided: the tool runs next, and its own interrupt() must not be handed UndoLog's answers.
            forget_answers(config, start, asked)
        return step, batch, call_id


def _own_task(config: Mapping[str, Any]) -> bool:
    """Whether the call runs as a LangGraph task of its own (``create_agent`` sends each call as one)."""
    return PUSH in ((config.get("metadata") or {}).get("langgraph_triggers") or ())


def _gated(guard: _Guard, tool_name: Any) -> bool:
    """Whether the tool a call names is one of the adapter's IRREVERSIBLE tools (it pauses for a person)."""
    name = guard.names.get(tool_name)
    spec = guard.u.registry.tools.get(name) if name is not None else None
    return spec is not None and spec.tier is ToolTier.IRREVERSIBLE


def _one_pause_per_task(guard: _Guard, request: Any) -> None:
    """Refuse an IRREVERSIBLE call that would pause beside another in the same LangGraph task.

    The middleware pauses with one ``interrupt()`` per call, which is sound where each call is its own task
    (``create_agent`` sends each call as one). A plain ``ToolNode`` given the middleware's hook runs every call of a
    model message in one task, where LangGraph hands resume values to interrupts in the order they are raised: not
    stable (a call approved in one resume does not pause again, so its sibling takes the first value next time), so
    one call could run on another's approval. Refused before anything is asked; ``UndoLogToolNode`` pauses once for
    the whole message."""
    if not _gated(guard, request.tool_call.get("name")):
        return
    if _own_task(_config_of(request)):
        return  # a task of its own (create_agent's Send)
    state = getattr(request, "state", None)
    messages = state if isinstance(state, list) else (
        state.get("messages") if isinstance(state, dict) else getattr(state, "messages", None))
    cid = request.tool_call.get("id")
    for m in reversed(messages or []):
        calls = getattr(m, "tool_calls", None)
        if isinstance(m, AIMessage) and calls and any(tc.get("id") == cid for tc in calls):
            if sum(_gated(guard, tc.get("name")) for tc in calls) > 1:
                raise errors.ConfigurationError(
                    f"UndoLog refused {request.tool_call.get('name')}: UndoLogMiddleware pauses each call as its own "
                    "LangGraph task (create_agent), and this ToolNode runs several IRREVERSIBLE calls in one task, "
                    "where LangGraph could hand one call another's decision. In a hand-built graph use "
                    "UndoLogToolNode (it asks for the whole message in one pause). Nothing was asked or run."
                )
            return


def run_call(guard: _Guard, request: Any, execute: Callable[[Any], Any], *, admit: bool = True) -> Any:
    """One tool call through UndoLog (sync): decide, pause or run, then mark, fail or release.

    ``arun_call`` is its async twin; both share ``_decide``, ``_hooks`` and ``_settled`` and differ only in
    awaiting the tool. A LangGraph interrupt inside the tool (``GraphBubbleUp``) releases the call untouched; the
    tool's own exception is recorded and answered with the rollback message, or re-raised as itself.
    ``admit``: record the call let through, for ``_admitted`` (``UndoLogToolNode``'s innermost ``execute``).
    """
    if request.tool is None:
        return execute(request)  # an unknown tool name: ToolNode answers with its own error, nothing runs
    if not admit:
        out = run_known(guard, request, execute)
        if out is not NOT_SAFE:
            return out
    return run_logged(guard, request, execute, admit=admit)


def run_logged(guard: _Guard, request: Any, execute: Callable[[Any], Any], *, admit: bool = True) -> Any:
    """:func:`run_call` past its short path (``run_known``, which the caller tried first, or skipped)."""
    if request.tool is None:
        return execute(request)  # an unknown tool name: ToolNode answers with its own error, nothing runs
    step, batch, call_id = _decide(guard, request)
    if isinstance(step, _Answer):
        return step.value
    req, box = guard.runnable(request, step)
    token = _admit(req, step, box, admit)
    try:
        # The driver runs it: a LangGraph interrupt inside the tool (GraphBubbleUp) is control flow, never a
        # failure: the call is handed back without an outcome and LangGraph re-runs it on resume under the same
        # call id and effect.
        outcome = guard.u.driver.run_sync(step.execute, lambda _a: execute(req), control_flow=(GraphBubbleUp,),
                                          note=False, **_hooks(request, step, box))
    finally:
        _unadmit(token)
    return _settled(guard, batch, call_id, request, step, outcome, box)


class _NotSafe:
    """``run_known``'s answer for a call it leaves to ``run_logged`` (a sentinel: a tool may answer None)."""


NOT_SAFE: Any = _NotSafe()


def _known(guard: _Guard, request: Any, wait: bool) -> Any:
    """The decision for the middleware's SAFE or COMPENSABLE call of a thread whose session is known here: the
    engine's ``Execute`` (its ``session_id`` the thread's session), the call's answer without running it (a refusal,
    a replayed result), or ``NOT_SAFE`` with nothing written when the call takes ``run_logged``'s path (a thread not
    seen here yet, an IRREVERSIBLE tool, an unclassified one, a node run's batch, a closed session; with ``wait``
    False, a decision that would wait).

    A SAFE call: the engine's ``decide_safe`` (the arguments validated against the contract, the session's pin
    checked, the call counted). A COMPENSABLE call: the engine's ``intercept_spec`` (validated, snapshotted, the
    durable pre-write before the tool), as ``prepare`` asks it through the driver, without the driver's look-up by
    name and second check of the session id (checked when the thread's session was started or found).
    """
    if request.tool is None or _BATCH.get() is not None:
        return NOT_SAFE
    # The tool's spec and the thread's current session, for both tiers.
    call = request.tool_call
    name = guard.names.get(call["name"])
    spec = guard.u.registry.tools.get(name) if name is not None else None
    if spec is None:
        return NOT_SAFE
    tier = spec.tier
    if tier is not ToolTier.SAFE and tier is not ToolTier.COMPENSABLE:
        return NOT_SAFE
    rt = getattr(request, "runtime", None)  # _config_of, inline
    base = guard.base_id(getattr(rt, "config", None) or get_config())
    n = guard.heads.get(base)  # known from the turn's check (its session exists); else prepare creates it
    if n is None or (n > 1 and tier is ToolTier.COMPENSABLE):
        # A thread past a rollback: prepare asks whether the call belongs to an earlier session (time travel).
        return NOT_SAFE
    sid = base if n <= 1 else f"{base}{SEP}{n}"
    d: Execute | AwaitingApproval | Completed
    try:
        if tier is ToolTier.SAFE:
            d = guard.hot.decide_safe(sid, spec, call.get("args") or {}, call.get("id"), wait)
        else:
            d = guard.hot.intercept_spec(sid, spec, call.get("args") or {}, call.get("id"), False, wait)
    except WouldBlock:
        return NOT_SAFE  # nothing written: decided again where it may wait
    except _REFUSED as exc:
        if tier is ToolTier.COMPENSABLE and isinstance(exc, errors.SessionClosed):
            # Rolled back or completed (nothing was written): prepare opens the thread's next session for a new
            # plan, or refuses a call of the plan that was undone.
            return NOT_SAFE
        return guard.refusal(request, exc)
    if d.__class__ is Execute:
        return d
    if isinstance(d, Completed):  # a re-issued call id (LangGraph re-runs a task): its stored result, as prepare says
        return guard.message(request, _content_of(d.result), meta={"effect_id": d.effect_id, "replayed": True})
    return NOT_SAFE  # not a decision this path makes (nothing was written for it): prepare decides again


def run_known(guard: _Guard, request: Any, execute: Callable[[Any], Any]) -> Any:
    """The middleware's SAFE or COMPENSABLE call of a thread whose session is known here, decided (``_known``) and
    run: the tool's answer (or the call's answer without running it), or ``NOT_SAFE`` with nothing done when the call
    takes ``run_logged``'s path.

    A SAFE call runs as ``run_sync`` runs one (``current_call()`` set, the retry policy, ``GraphBubbleUp`` passed
    on); a COMPENSABLE call through ``run_sync`` (the durable commit mark, or the failure and its rollback), as
    ``run_logged`` runs it. Both with the fewest frames: every tool call of an agent step comes here, and inside a
    step each frame's code and data are cold (a frame costs 1-3 us there, 0.1-0.3 us in a loop).
    """
    d = _known(guard, request, True)
    if d.__class__ is not Execute:
        return d  # the answer, or NOT_SAFE
    # _to_run and _known_answer, inline: two frames fewer on every call of an agent step, which the frame tests of a
    # later SAFE and COMPENSABLE turn pin (tests/adapters/test_speed_paths.py); arun_call calls them.
    call = request.tool_call
    args = call.get("args") or {}
    # The validated arguments (guard.runnable's test, inline).
    same = (args if args.__class__ is dict else dict(args)) == d.args
    if d.effect_id is None:  # SAFE: nothing is stored, ToolNode's answer is the result
        req = request if same else request.override(tool_call={**call, "args": dict(d.args)})
        return guard.u.driver.run_safe_sync(d, lambda _a: execute(req), control_flow=(GraphBubbleUp,))
    # guard.runnable, inline: the tool's capturing copy drops its raw value into the box (what is stored as the
    # result), through the request to run.
    box = _Box()
    tool = request.tool
    hit = _COPIES.get(id(tool))  # _capturing's own first test, inline (its copy is made once per tool)
    copy = hit[1] if hit is not None and hit[0] is tool else _capturing(tool, box)
    overrides: dict[str, Any] = {} if same else {"tool_call": {**call, "args": dict(d.args)}}
    if copy is not tool:
        overrides["tool"] = copy
    req = _override(request, overrides) if overrides else request
    token = _CAPTURE.set(box)
    try:
        outcome = guard.u.driver.run_sync(d, lambda _a: execute(req), control_flow=(GraphBubbleUp,), note=False,
                                          failure_of=partial(_failure_of, call["name"]), result_of=box.result_of)
    finally:
        _CAPTURE.reset(token)
    out = outcome.value
    if (outcome.error is None and outcome.failure is None and outcome.rollback is None and box.set
            and box.value is not out and out.__class__ is ToolMessage and out.response_metadata.__class__ is dict):
        # guard.committed's common case, inline: ToolNode built this message for this call, marked in place.
        out.response_metadata["undolog"] = {"tier": _COMPENSABLE, "effect_id": d.effect_id, "session_id": d.session_id}
        return out
    return _settled(guard, None, call.get("id"), request, _Run(d, d.session_id), outcome, box)


def _to_run(request: Any, d: Execute) -> tuple[Any, _Box | None]:
    """The request to run for a call of a known thread that ``_known`` let through, and the box its raw value goes to
    (None for a SAFE call: nothing is stored): the validated arguments, and the tool's capturing copy
    (``guard.runnable``'s steps, without its ``_Run``). ``run_known`` takes these steps inline (the frame test of a
    COMPENSABLE turn pins the two frames that saves); ``arun_call`` calls them."""
    call = request.tool_call
    args = call.get("args") or {}
    same = (args if args.__class__ is dict else dict(args)) == d.args
    if d.effect_id is None:
        return (request if same else request.override(tool_call={**call, "args": dict(d.args)})), None
    box = _Box()
    tool = request.tool
    hit = _COPIES.get(id(tool))  # _capturing's own first test (its copy is made once per tool)
    copy = hit[1] if hit is not None and hit[0] is tool else _capturing(tool, box)
    overrides: dict[str, Any] = {} if same else {"tool_call": {**call, "args": dict(d.args)}}
    if copy is not tool:
        overrides["tool"] = copy
    return (_override(request, overrides) if overrides else request), box


def _known_answer(guard: _Guard, request: Any, d: Execute, outcome: Outcome, box: _Box) -> Any:
    """ToolNode's answer to a logged call of a known thread the driver ran: its message marked in place when ToolNode
    built it for this call (``guard.committed``'s common case), else what ``_settled`` makes of the outcome."""
    out = outcome.value
    if (outcome.error is None and outcome.failure is None and outcome.rollback is None and box.set
            and box.value is not out and out.__class__ is ToolMessage and out.response_metadata.__class__ is dict):
        out.response_metadata["undolog"] = {"tier": _COMPENSABLE, "effect_id": d.effect_id, "session_id": d.session_id}
        return out
    return _settled(guard, None, request.tool_call.get("id"), request, _Run(d, d.session_id), outcome, box)


async def arun_call(guard: _Guard, request: Any, execute: Callable[[Any], Any], *, admit: bool = True) -> Any:
    """Async :func:`run_call`: the same steps, awaiting the tool."""
    if request.tool is None:
        return await execute(request)
    if not admit:
        # The middleware's call of a known thread (``_known``), decided on the loop: in memory for a SAFE call, the
        # COMPENSABLE hot path when a connection and the write lock are free at once (no thread hop); else NOT_SAFE,
        # with nothing written, and decided below (in a thread when it must wait).
        d = _known(guard, request, False)
        if d.__class__ is Execute:
            req, box = _to_run(request, d)  # the steps run_known takes inline, the tool awaited between them
            if box is None:
                return _safe_answer(await guard.u.driver.run_async(d, lambda _a: execute(req),
                                                                    control_flow=(GraphBubbleUp,), note=False))
            boxed = _CAPTURE.set(box)
            try:
                outcome = await guard.u.driver.run_async(
                    d, lambda _a: execute(req), control_flow=(GraphBubbleUp,), note=False,
                    failure_of=partial(_failure_of, request.tool_call["name"]), result_of=box.result_of)
            finally:
                _CAPTURE.reset(boxed)
            return _known_answer(guard, request, d, outcome, box)
        if d is not NOT_SAFE:
            return d
    try:
        # On the loop when nothing has to wait (SAFE, and the COMPENSABLE hot path with a free connection and
        # write lock): no thread hop. Otherwise (a gated call, a thread's first call, a busy pool) in a thread.
        step, batch, call_id = _decide(guard, request, wait=False)
    except WouldBlock:
        step, batch, call_id = await asyncio.to_thread(_decide, guard, request)
    if isinstance(step, _Answer):
        return step.value
    req, box = guard.runnable(request, step)
    token = _admit(req, step, box, admit)
    try:
        outcome = await guard.u.driver.run_async(step.execute, lambda _a: execute(req),
                                                 control_flow=(GraphBubbleUp,), note=False,
                                                 **_hooks(request, step, box))
    finally:
        _unadmit(token)
    return _settled(guard, batch, call_id, request, step, outcome, box)


def _safe_answer(outcome: Outcome) -> Any:
    """ToolNode's answer to a SAFE call: nothing was recorded; its exception, if ToolNode raised one, goes on."""
    if outcome.error is not None:
        raise outcome.error
    return outcome.value


def _hooks(request: Any, step: _Run, box: _Box | None) -> dict[str, Any]:
    """How the driver reads a ToolNode answer: an error ToolMessage is the tool failing (ToolNode's
    handle_tool_errors turned the exception into it), and the stored result is the tool's own value."""
    if step.execute.effect_id is None:
        return {}  # SAFE: nothing is recorded, ToolNode's answer goes back as it is
    return {"failure_of": partial(_failure_of, request.tool_call["name"]),
            "result_of": box.result_of if box is not None else _result_of}


def _failure_of(name: str, out: Any) -> str | None:
    """The failure's text when ToolNode's answer says the tool failed (it raised, and ToolNode's handle_tool_errors
    turned that into an error message: still a failure), else None."""
    return f"{name} failed: {out.content}" if isinstance(out, ToolMessage) and out.status == "error" else None


def _settled(guard: _Guard, batch: _Batch | None, call_id: str | None, request: Any, step: _Run,
             outcome: Outcome, box: _Box | None = None) -> Any:
    """The node's answer for a call the driver ran: the tool's message, or the failure and what was undone.
    ``box``: the tool's raw value (a logged call), which tells whether ToolNode built the message."""
    ex, sid = step.execute, step.session_id
    if outcome.rollback is not None:
        for name, data in rollback_events(outcome.rollback, ex.effect_id):
            emit(name, data)  # the run's callbacks see each compensation (LangSmith shows what was undone)
    exc = outcome.error
    if exc is not None and (ex.effect_id is None or not isinstance(exc, Exception)):
        # SAFE: ToolNode's own error handling already decided to raise it; and an interrupt of the process
        # (KeyboardInterrupt, SystemExit) is never turned into a message.
        raise exc
    if exc is not None:
        assert ex.effect_id is not None
        return _remember(batch, call_id, guard.failure(request, f"{type(exc).__name__}: {exc}", outcome.rollback,
                                                       sid, ex.effect_id))
    if outcome.failure is not None:
        assert ex.effect_id is not None
        return _remember(batch, call_id, guard.failure(request, str(outcome.value.content), outcome.rollback, sid,
                                                       ex.effect_id))
    if ex.effect_id is None:
        return _remember(batch, call_id, outcome.value)
    return _remember(batch, call_id, guard.committed(step, outcome.value, box))


def _admitted(request: Any) -> ToolMessage | None:
    """None if ``request`` is exactly the call UndoLog let through (and not run yet), else the refusal.

    Checked at the innermost ``execute``: a wrapper inside UndoLog's could otherwise switch the tool or
    its arguments after the gate (LangChain #40166) or run a logged call a second time.
    """
    admit = _ADMIT.get()
    call = request.tool_call
    problem = None
    if admit is None and request.tool is None:
        # A tool name the node does not have: nothing can run, and ToolNode answers as LangGraph does ("not a valid
        # tool, try one of [...]"), which tells the model what it may call; a gate refusal would not.
        return None
    if admit is None:
        problem = "it was not let through UndoLog's gate"
    elif call["name"] != admit.name or request.tool is not admit.tool:
        problem = f"a wrapper switched the call from {admit.name} to {call['name']} after UndoLog's gate"
    elif dict(call.get("args") or {}) != admit.args:
        problem = "a wrapper changed its arguments after UndoLog's gate"
    elif admit.logged and admit.runs:
        problem = "a wrapper tried to run it a second time"
    if problem is None:
        assert admit is not None
        admit.runs += 1
        return None
    return ToolMessage(content=f"UndoLog refused {call['name']}: {problem}. It was NOT run.", name=call["name"],
                       tool_call_id=call["id"], status="error", response_metadata={"undolog": {"refused": "bypass"}})


def _remember(batch: _Batch | None, call_id: str | None, out: Any) -> Any:
    if batch is not None and call_id:
        with batch.lock:
            batch.done[call_id] = out
    return out
