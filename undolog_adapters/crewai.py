"""UndoLog for CrewAI: wrap a crew's tools so every call goes through the UndoLog engine.

CrewAI's tool-call hooks see only the error text of a failed tool, never the exception, so they
cannot drive a saga; wrapping the tool itself is the only place that sees both the arguments and the
exception. Hooks are still offered as a second gate (refusing tools that were not wrapped), made
fail-closed because CrewAI runs the tool anyway when a hook raises anything but ``HookAborted``.

Example:
    >>> from undolog_adapters.crewai import wrap_tools          # doctest: +SKIP
    >>> tools = wrap_tools([search, refund, delete], undolog=ul,
    ...                    tiers={"search": "safe"}, wait_for_approval=0)
    >>> agent = Agent(role="support", goal="...", backstory="...", tools=tools, llm=llm)
    >>> run = tools.kickoff(Crew(agents=[agent], tasks=[task]))
    >>> run.session_id, run.raw, run.pending_approvals
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Self, SupportsIndex

from undolog_adapters._common import missing_extra

try:
    from crewai.hooks import HookAborted, InterceptionPoint
    from crewai.hooks.dispatch import scoped_hooks
    from crewai.tools import BaseTool
    from crewai.tools import tool as _crewai_tool
except ImportError as exc:  # exercised by tests/adapters/test_common.py with CrewAI hidden
    raise ImportError(missing_extra("undolog_adapters.crewai", "CrewAI", "crewai")) from exc

try:
    from crewai.tools.tool_failure import ToolFailure, ToolFailureReason
except ImportError:  # pragma: no cover - CrewAI before structured tool failures
    ToolFailure = None  # type: ignore[assignment,misc]
    ToolFailureReason = None  # type: ignore[assignment,misc]

try:
    from crewai.execution import get_execution_uuid
except ImportError:  # pragma: no cover - older CrewAI without an execution id

    def get_execution_uuid() -> str | None:
        return None


from pydantic import ConfigDict, PrivateAttr
from pydantic_core import to_jsonable_python

from undolog_adapters._common import (
    Registrar,
    TierValue,
    UndoLogPolicy,
    awaiting_text,
    failure_text,
    refusal_text,
    rollback_outcome,
)
from undolog_core import RequestState, ToolTier, UndoLog, errors
from undolog_core.integration import (
    KICKOFF,
    AwaitingApproval,
    Completed,
    Continuation,
    Execute,
    session_table,
)

__all__ = ["KickoffResult", "UndoLogPolicy", "UndoLogTool", "UndoLogToolset", "fail_closed", "wrap_tools"]

log = logging.getLogger(__name__)

# Set by UndoLogToolset.kickoff()/session(): the UndoLog session of the kickoff running in this context.
# A ContextVar (not an attribute) so two kickoffs in two threads sharing one toolset stay apart; CrewAI
# copies the context into the threads it starts for parallel tool calls.
_kickoff_session: contextvars.ContextVar[str | None] = contextvars.ContextVar("undolog_crewai_session", default=None)
# The hooks scoped to that kickoff (the dict CrewAI's ``scoped_hooks`` runs): the gate adds its after-hook there only
# once it has refused a call. CrewAI emits an event for every hook point dispatched (pydantic model, event record,
# a hop to its handler thread), so an after-hook with nothing to rewrite cost a kickoff as much as UndoLog's own call.
_kickoff_hooks: contextvars.ContextVar[dict[InterceptionPoint, list[Callable[[Any], Any]]] | None] = (
    contextvars.ContextVar("undolog_crewai_hooks", default=None))

# Set by UndoLogToolset.resume(): the recorded effects of the kickoff this one continues, replayed to the calls that
# repeat them (a real model given the same task again repeats all of it, the refund it already sent included).
_kickoff_continuation: contextvars.ContextVar[Continuation | None] = contextvars.ContextVar(
    "undolog_crewai_continuation", default=None)

# Frames of CrewAI's native tool-call executors; they hold the provider's tool-call id in a local
# variable named ``call_id`` but never pass it to the tool. CrewAI 1.15 has no public way to the id: not the
# tool's arguments, not ToolCallHookContext, not the ToolUsageStartedEvent. What is read here (these function
# names, their ``call_id`` and ``tool_call`` locals) is pinned by tests/adapters/test_framework_idioms.py
# against the installed CrewAI, so a CrewAI release that changes it fails that test by name; at run time a
# changed executor is logged once and calls fall back to argument digests (as on the ReAct path).
#   crewai.agents.agent_executor.AgentExecutor._execute_single_native_tool_call
#   crewai.utilities.agent_utils.execute_single_native_tool_call
_NATIVE_EXECUTORS = frozenset({"_execute_single_native_tool_call", "execute_single_native_tool_call"})
_warned_no_call_id = False

_BLOCKED_PREFIX = "Tool execution blocked by hook"


def _native_call_id() -> str | None:
    """The provider's tool-call id of the native call being executed, if CrewAI is running one.

    CrewAI does not hand the id to the tool, so it is read from the executor's frame. Ids CrewAI
    makes up from ``id(tool_call)`` (Gemini-style calls) are memory addresses that repeat over time;
    they are treated as absent.
    """
    frame: FrameType | None = sys._getframe(2)
    for _ in range(40):
        if frame is None:
            return None
        if frame.f_code.co_name in _NATIVE_EXECUTORS and "crewai" in frame.f_code.co_filename:
            local = frame.f_locals
            cid, raw = local.get("call_id"), local.get("tool_call")
            if "call_id" not in local or "tool_call" not in local:
                _executor_changed(frame.f_code.co_name)
            if isinstance(cid, str) and cid and cid != "unknown" and cid != f"call_{id(raw)}":
                return cid
            return None
        frame = frame.f_back
    return None


def _executor_changed(name: str) -> None:
    global _warned_no_call_id
    if not _warned_no_call_id:
        _warned_no_call_id = True
        log.warning("UndoLog: CrewAI's %s no longer holds `call_id`/`tool_call`; native calls are matched by "
                    "argument digest instead of the provider's call id (this CrewAI version is not the one UndoLog "
                    "was tested with)", name)


def _sanitize(name: str) -> str:
    try:
        from crewai.utilities.string_utils import sanitize_tool_name

        return str(sanitize_tool_name(name))
    except Exception:  # pragma: no cover - helper moved in another CrewAI version
        return name.lower().replace(" ", "_")


def _failure(message: str, code: str, *, exception: bool = False) -> Any:
    """What the agent sees for a refused or failed call.

    A ``ToolFailure`` (not an exception) so CrewAI records the failure on the task output without
    retrying the call: the ReAct path re-runs a tool that raises, which would repeat a side effect.
    """
    if ToolFailure is None:  # pragma: no cover
        return message
    reason = ToolFailureReason.EXCEPTION if exception else ToolFailureReason.TOOL_REPORTED
    return ToolFailure(message=message, reason=reason, code=code)


def fail_closed(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Make a CrewAI before-tool-call hook refuse the call when it crashes.

    CrewAI swallows any exception but ``HookAborted`` from a hook and runs the tool anyway.

    Example:
        >>> guarded = fail_closed(lambda ctx: ctx.tool_input["amount"] < 100)   # doctest: +SKIP
        >>> register_before_tool_call_hook(guarded)                              # doctest: +SKIP
    """

    def run(ctx: Any) -> Any:
        try:
            return hook(ctx)
        except HookAborted:
            raise
        except Exception as exc:
            log.warning("UndoLog: hook %r failed (%r); refusing the call", hook, exc)
            raise HookAborted(f"policy hook failed ({exc!r}); the call was refused", source=hook) from exc

    run.__name__ = getattr(hook, "__name__", "hook")
    run.__wrapped__ = hook  # type: ignore[attr-defined]
    return run


@dataclass
class KickoffResult:
    """The outcome of :meth:`UndoLogToolset.kickoff`: the crew's output plus its UndoLog session.

    Attribute access falls through to the ``CrewOutput`` (``.raw``, ``.tasks_output``...).
    """

    output: Any
    session_id: str
    _pending: list[Any] | None = field(default=None, repr=False)
    _undolog: Any = field(default=None, repr=False)

    @property
    def pending_approvals(self) -> list[Any]:
        """The session's approval requests still pending, read from the store when first asked for.

        A kickoff whose result nobody asks about costs no read (two statements, a few per cent of a short
        kickoff).
        """
        if self._pending is None:
            self._pending = (self._undolog.approvals.pending(session_id=self.session_id)
                             if self._undolog is not None else [])
        return self._pending

    @property
    def raw(self) -> str:
        """The crew's final answer as text (``CrewOutput.raw``)."""
        return str(getattr(self.output, "raw", self.output))

    @property
    def awaiting_approval(self) -> bool:
        """Whether a request of this kickoff's session still waits for a person."""
        return bool(self.pending_approvals)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "output":
            raise AttributeError(name)
        return getattr(self.output, name)


class UndoLogTool(BaseTool):
    """A CrewAI tool whose every call is intercepted by UndoLog; built by :func:`wrap_tools`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    inner: BaseTool
    undolog_name: str
    tier: ToolTier
    _toolset: UndoLogToolset = PrivateAttr()

    def _run(self, **kwargs: Any) -> Any:
        return self._toolset._call(self, kwargs)

    async def _arun(self, **kwargs: Any) -> Any:
        # The engine does blocking database I/O; keep it off the event loop (context is copied).
        return await asyncio.to_thread(self._toolset._call, self, kwargs)


def _is_wrapped(tool: Any) -> bool:
    """Whether the tool a hook sees is an UndoLog tool.

    CrewAI hands hooks the ``CrewStructuredTool`` it made from the ``BaseTool`` (``_original_tool``). None (a
    CrewAI path that gives no tool object) cannot be told apart: the name check stands alone, as before.
    """
    if tool is None:
        return True
    return isinstance(tool, UndoLogTool) or isinstance(getattr(tool, "_original_tool", None), UndoLogTool)


def _no_cache(_args: Any = None, _result: Any = None) -> bool:
    # A cached "awaiting approval" text would be replayed after the approval, and a cached side
    # effect would skip the engine; UndoLog replays completed calls itself.
    return False


class UndoLogToolset(list):  # type: ignore[type-arg]
    """The wrapped tools (a plain list of :class:`UndoLogTool` for ``Agent(tools=...)``) and their policy.

    Example:
        >>> tools = wrap_tools([search, refund], undolog=ul)     # doctest: +SKIP
        >>> run = tools.kickoff(crew, inputs={"user": "u1"})     # doctest: +SKIP
        >>> run.session_id                                       # doctest: +SKIP
    """

    def __init__(
        self,
        tools: Iterable[UndoLogTool],
        *,
        undolog: UndoLog,
        session_id: str | None,
        wait_for_approval: float,
        agent_id: str,
        poll_interval: float,
        hooks: Sequence[Callable[[Any], Any]],
        allow_unwrapped: Iterable[str],
    ) -> None:
        super().__init__(tools)
        self.undolog = undolog
        self._sessions = session_table(undolog)
        self.fixed_session_id = session_id
        self.wait_for_approval = float(wait_for_approval)
        self.agent_id = agent_id
        self.poll_interval = poll_interval
        self.user_hooks = [fail_closed(h) for h in hooks]
        self.allow_unwrapped = {_sanitize(n) for n in allow_unwrapped}
        self._refresh_gate()
        self.last_session_id: str | None = session_id
        self._fallback_session: str | None = None
        self._ensured: set[str] = set()
        self._lock = threading.Lock()
        self._blocked: dict[int, str] = {}

    # ----------------------------------------------------------------- the gate's names
    def _refresh_gate(self) -> None:
        """The names the gate lets through: UndoLog's own tools and ``allow_unwrapped``.

        Built when the list is made or changed, not per call (CrewAI's name sanitising is a few regex passes per
        tool). A plain CrewAI tool put into the list is not among them: it has no tier, so it is refused like any
        other unwrapped tool.
        """
        self._gated = frozenset({_sanitize(t.name) for t in self if isinstance(t, UndoLogTool)} | self.allow_unwrapped)

    # The list's changes keep the gate's names in step (a tool appended after wrap_tools is gated like the others).
    def append(self, item: Any) -> None:
        """Add a tool; the gate lets it through from now on."""
        super().append(item)
        self._refresh_gate()

    def extend(self, items: Iterable[Any]) -> None:
        """Add tools; the gate lets them through from now on."""
        super().extend(items)
        self._refresh_gate()

    def insert(self, index: SupportsIndex, item: Any) -> None:
        """Insert a tool; the gate lets it through from now on."""
        super().insert(index, item)
        self._refresh_gate()

    def remove(self, item: Any) -> None:
        """Remove a tool; the gate refuses it from now on."""
        super().remove(item)
        self._refresh_gate()

    def pop(self, index: SupportsIndex = -1) -> Any:
        """Remove and return a tool; the gate refuses it from now on."""
        item = super().pop(index)
        self._refresh_gate()
        return item

    def clear(self) -> None:
        """Remove every tool; the gate refuses them from now on."""
        super().clear()
        self._refresh_gate()

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        self._refresh_gate()

    def __delitem__(self, index: Any) -> None:
        super().__delitem__(index)
        self._refresh_gate()

    # (mypy: ``+`` gives a plain list, ``+=`` keeps the toolset, as for any list subclass.)
    def __iadd__(self, items: Iterable[Any]) -> Self:  # type: ignore[misc]
        super().__iadd__(items)
        self._refresh_gate()
        return self

    # ----------------------------------------------------------------- sessions
    @property
    def session_id(self) -> str | None:
        """The session of the kickoff running in this context, else of the last one that called a tool."""
        return _kickoff_session.get() or self.last_session_id

    def _resolve_session(self) -> str:
        sid = _kickoff_session.get() or self.fixed_session_id
        if sid is None:
            # A plain crew.kickoff(): CrewAI's execution id is per kickoff, so it is the session.
            sid = get_execution_uuid()
        minted = False
        if sid is None:
            with self._lock:
                if self._fallback_session is None:
                    self._fallback_session = str(uuid.uuid4())
                    minted = True
                sid = self._fallback_session
        self.last_session_id = sid
        self._ensure(sid, minted=minted)
        return sid

    def _ensure(self, sid: str, *, minted: bool = False) -> None:
        """Learn the session at its first sight here.

        Read once (its state and pins, so a session resumed here keeps them), nothing written; not even read
        when ``minted`` here. A session the store does not have is written by its first logged call
        (``_call``), or by the flush of its SAFE calls' count, so a kickoff of SAFE calls writes nothing, as
        in the other adapters; writing it at the kickoff's start was an insert and an fsync per session (per
        kickoff, by default), several times what UndoLog adds to the calls of a SAFE kickoff.
        """
        with self._lock:
            if sid in self._ensured:
                return
        self._sessions.look_up_session(sid, agent_id=self.agent_id, minted=minted)
        with self._lock:
            if len(self._ensured) >= self._sessions.max_sessions:
                # A kickoff is a session: bounded like the engine's records. A session forgotten here is looked up
                # again (one read, idempotent) at its next tool call.
                self._ensured.clear()
            self._ensured.add(sid)

    @contextlib.contextmanager
    def session(self, session_id: str | None = None, *, resume: bool = False) -> Iterator[str]:
        """Run what is inside (e.g. ``crew.kickoff()``) as one UndoLog session and one kickoff; yields its id.

        With ``resume=True`` the kickoff continues the session's last kickoff that ended with approvals pending
        (see :meth:`resume`): the calls that repeat its committed effects get their recorded results back.

        Example:
            >>> with tools.session("ticket-42") as sid:          # doctest: +SKIP
            ...     crew.kickoff()
        """
        sid = session_id or self.fixed_session_id
        if sid is None:
            if resume:
                raise ValueError("resume needs the session to continue: pass session_id= (the KickoffResult's "
                                 "session_id), or build the toolset with wrap_tools(..., session_id=...)")
            sid = str(uuid.uuid4())
            self._ensure(sid, minted=True)
        else:
            self._ensure(sid)
        continuation = Continuation.of_session(self.undolog, sid) if resume else None
        kickoff_id = continuation.kickoff_id if continuation is not None else str(uuid.uuid4())
        # The after-hook only rewrites the text of a call the gate refused: it joins this dict when one is (_refuse).
        hooks: dict[InterceptionPoint, list[Callable[[Any], Any]]] = {InterceptionPoint.PRE_TOOL_CALL: [self.before_hook]}
        token = _kickoff_session.set(sid)
        hooks_token = _kickoff_hooks.set(hooks)
        kickoff_token = KICKOFF.set(kickoff_id)
        continuation_token = _kickoff_continuation.set(continuation)
        try:
            with scoped_hooks(hooks):
                yield sid
        finally:
            _kickoff_continuation.reset(continuation_token)
            KICKOFF.reset(kickoff_token)
            _kickoff_hooks.reset(hooks_token)
            _kickoff_session.reset(token)
            self.last_session_id = sid

    def kickoff(self, crew: Any, inputs: Mapping[str, Any] | None = None, *, session_id: str | None = None,
                **kwargs: Any) -> KickoffResult:
        """Run ``crew.kickoff()`` as one UndoLog session with the hook gate scoped to it.

        Args:
            crew: the ``Crew`` whose agents use these tools.
            inputs: passed to ``crew.kickoff``.
            session_id: resume this session (e.g. after an approval); default: the toolset's
                ``session_id=`` or a new one.
            **kwargs: passed on to ``crew.kickoff``.

        Returns:
            A :class:`KickoffResult` with the output, the session id and the approvals still pending.

        Example:
            >>> run = tools.kickoff(crew)                           # doctest: +SKIP
            >>> if run.awaiting_approval:                           # doctest: +SKIP
            ...     later = tools.kickoff(crew, session_id=run.session_id)
        """
        with self.session(session_id) as sid:
            output = crew.kickoff(inputs=dict(inputs) if inputs is not None else None, **kwargs)
        return KickoffResult(output=output, session_id=sid, _undolog=self.undolog)

    def resume(self, crew: Any, inputs: Mapping[str, Any] | None = None, *, session_id: str | None = None,
               **kwargs: Any) -> KickoffResult:
        """Continue a session after its approvals were decided: a kickoff that does not repeat what was done.

        A real model given the same task again repeats all of it. So this kickoff replays the committed COMPENSABLE
        and IRREVERSIBLE effects of the kickoff it continues (the session's last one that ended with approvals
        pending, and the continuations of it), matched by (tool, canonical arguments, n-th occurrence): the tool
        does not run again and the agent reads its recorded result with a note saying it was replayed. An approved
        call runs once; a call that matches nothing runs as in any kickoff. A plain :meth:`kickoff` on the same
        session runs every call, as a new task on a long-lived session does.

        Args:
            crew: the ``Crew`` whose agents use these tools (a new one or the same).
            inputs: passed to ``crew.kickoff``.
            session_id: the session to continue (``KickoffResult.session_id``); default the toolset's
                ``session_id=``.
            **kwargs: passed on to ``crew.kickoff``.

        Returns:
            A :class:`KickoffResult`, as :meth:`kickoff`.

        Example:
            >>> run = tools.kickoff(crew, inputs={"ticket": t})                      # doctest: +SKIP
            >>> ul.approvals.approve(run.pending_approvals[0].approval_request_id, approver="ana")
            >>> done = tools.resume(crew, inputs={"ticket": t}, session_id=run.session_id)
        """
        with self.session(session_id, resume=True) as sid:
            output = crew.kickoff(inputs=dict(inputs) if inputs is not None else None, **kwargs)
        return KickoffResult(output=output, session_id=sid, _undolog=self.undolog)

    # ----------------------------------------------------------------- hooks (second gate)
    def before_hook(self, ctx: Any) -> Any:
        """Fail-closed before-tool-call hook: refuses unwrapped tools, then runs the user's hooks."""
        try:
            name = _sanitize(str(ctx.tool_name))
            if name not in self._gated:
                reason = (f"UndoLog refused tool {ctx.tool_name!r}: it has no UndoLog tier "
                          "(wrap it with undolog_adapters.crewai.wrap_tools)")
                self._refuse(ctx, reason)
                raise HookAborted(reason, source="undolog")
            if name not in self.allow_unwrapped and not _is_wrapped(getattr(ctx, "tool", None)):
                # The name is a wrapped tool's, the tool is not: an unwrapped tool of the same name (a Task's own
                # tools run in place of its agent's) would run ungated.
                reason = (f"UndoLog refused tool {ctx.tool_name!r}: it is not the UndoLog-wrapped tool of that name "
                          "(a task's or agent's tools must be wrapped with undolog_adapters.crewai.wrap_tools too)")
                self._refuse(ctx, reason)
                raise HookAborted(reason, source="undolog")
            for hook in self.user_hooks:
                try:
                    if hook(ctx) is False:
                        self._refuse(ctx, f"UndoLog policy hook refused {ctx.tool_name!r}")
                        return False
                except HookAborted as exc:
                    self._refuse(ctx, f"refused by policy: {exc.reason}")
                    raise
            return None
        except HookAborted:
            raise
        except Exception as exc:
            raise HookAborted(f"UndoLog gate failed ({exc!r}); the call was refused", source="undolog") from exc

    def _refuse(self, ctx: Any, reason: str) -> None:
        """Keep the reason for the after-hook, and scope the after-hook to the kickoff if it is not there yet."""
        self._blocked[id(ctx.tool_input)] = reason
        hooks = _kickoff_hooks.get()
        if hooks is not None:
            with self._lock:  # two parallel calls refused at once add it once
                after = hooks.setdefault(InterceptionPoint.POST_TOOL_CALL, [])
                if self.after_hook not in after:
                    after.append(self.after_hook)

    def after_hook(self, ctx: Any) -> Any:
        """Turns CrewAI's bare "blocked by hook" text into the reason the agent should read."""
        reason = self._blocked.pop(id(ctx.tool_input), None)
        result = getattr(ctx, "tool_result", None)
        if reason and isinstance(result, str) and result.startswith(_BLOCKED_PREFIX):
            return f"{reason}. Do not retry this call."
        return None

    # ----------------------------------------------------------------- the call
    def _call(self, tool: UndoLogTool, kwargs: dict[str, Any]) -> Any:
        """One tool call, start to end: intercept, wait for a person, run, then complete or fail.

        The engine's whole sequence for a CrewAI call is in this one function on purpose: it is the one
        place to change when the engine's call protocol changes.
        """
        ul = self.undolog
        name = tool.undolog_name
        args = to_jsonable_python(kwargs)
        try:
            sid = self._resolve_session()
            if tool.tier is not ToolTier.SAFE:
                continuation = _kickoff_continuation.get()
                if continuation is not None:
                    hit = continuation.take(ul.tool_spec(name), args)
                    if hit is not None:
                        return f"{_as_text(hit.result)}\n{hit.note()}"
                if KICKOFF.get() is None:
                    # A plain crew.kickoff() outside kickoff()/session(): CrewAI's execution id is the kickoff.
                    return self._in_kickoff(tool, kwargs, get_execution_uuid() or sid)
                self._start(sid)
            call_id = self._call_id(sid, tool, args)
            decision = ul.driver.decide(sid, name, args, call_id=call_id)
            deadline = time.monotonic() + self.wait_for_approval
            while isinstance(decision, AwaitingApproval):
                if not self._decided(decision.approval_request_id, deadline):
                    return awaiting_text(name, decision.approval_request_id, decision.reason)
                decision = ul.driver.decide(sid, name, args, call_id=call_id)
        except errors.UndoLogError as exc:
            return _failure(refusal_text(name, exc), exc.code)
        if isinstance(decision, Completed):
            return decision.result
        assert isinstance(decision, Execute)
        # CrewAI's own exceptions that steer the agent are not the tool failing: none exist for tools today, so
        # every exception the tool raises is its failure (recorded, rolled back per the session's policy).
        outcome = ul.driver.run_sync(decision, lambda a: tool.inner.run(**a), note=False)
        if outcome.ok:
            return outcome.value
        failed = outcome.error
        assert failed is not None
        if decision.effect_id is None or not isinstance(failed, Exception):
            # SAFE: nothing to undo; CrewAI handles (and may retry) it as usual. A process interrupt is never
            # turned into a message.
            raise failed
        text = failure_text(name, f"{type(failed).__name__}: {failed}",
                            rollback_outcome(outcome.rollback, sid, decision.effect_id))
        return _failure(text, "tool_failed", exception=True)

    def _in_kickoff(self, tool: UndoLogTool, kwargs: dict[str, Any], kickoff_id: str) -> Any:
        token = KICKOFF.set(kickoff_id)
        try:
            return self._call(tool, kwargs)
        finally:
            KICKOFF.reset(token)

    def _start(self, sid: str) -> None:
        """Write the session's row before its first logged call, if the store does not have it yet.

        Not fsynced where the database allows it (SQLite's WAL): the pre-write that follows at once, before the tool
        runs, is a durable commit and makes the row durable with it; until then nothing in the store refers to the
        row. As the Semantic Kernel filter does; the engine's own fallback would read the session again and fsync
        the insert.
        """
        sc = self._sessions.cached(sid)
        if sc is None or not sc.persisted:
            self._sessions.ensure_session(sid, agent_id=self.agent_id, fresh=True, durable=False)

    def _call_id(self, sid: str, tool: UndoLogTool, args: dict[str, Any]) -> str:
        if tool.tier is ToolTier.IRREVERSIBLE:
            # A new kickoff brings new call ids (and the ReAct path has none): the approval asked for
            # in an earlier kickoff is found by (tool, argument digest) and its call is re-issued.
            found = self.undolog.approvals.find_for_call(sid, tool.undolog_name, args)
            if found is not None and found.call_id:
                return str(found.call_id)
        native = _native_call_id()
        # Scoped to the kickoff: scripted and some real providers reuse ids across runs.
        scope = get_execution_uuid() or sid
        return f"crewai:{scope}:{native}" if native else f"crewai:{uuid.uuid4().hex}"

    def _decided(self, approval_request_id: str, deadline: float) -> bool:
        """Poll the store until the request leaves ``pending`` (a decision from any process counts).

        True when it did before ``deadline`` (``wait_for_approval`` seconds after the call), else False.
        """
        while time.monotonic() < deadline:
            if self.undolog.approvals.get(approval_request_id).state != RequestState.PENDING:
                return True
            time.sleep(min(self.poll_interval, max(0.0, deadline - time.monotonic())))
        return False


def _as_text(value: Any) -> str:
    """A recorded result as the agent read it the first time (CrewAI gives the model a tool's value as text)."""
    return value if isinstance(value, str) else str(value)


# --------------------------------------------------------------------------------------------- wrapping
def _spec_of(obj: Any) -> Any:
    for candidate in (obj, getattr(obj, "func", None), type(obj)):
        spec = getattr(candidate, "__undolog_spec__", None)
        if spec is not None:
            return spec
    return None


def _as_crewai_tool(obj: Any) -> BaseTool:
    if isinstance(obj, BaseTool):
        return obj
    if callable(obj):
        spec = getattr(obj, "__undolog_spec__", None)
        name = (getattr(spec, "name", None) or getattr(obj, "__name__", None))
        if not name:
            raise TypeError(f"cannot make a CrewAI tool from {obj!r}: it has no name")
        made = _crewai_tool(name)(obj)
        if not isinstance(made, BaseTool):  # pragma: no cover - CrewAI's @tool always makes one
            raise TypeError(f"cannot make a CrewAI tool from {obj!r}")
        return made
    raise TypeError(f"expected a CrewAI BaseTool or a function, got {obj!r}")


def wrap_tools(
    tools: Iterable[Any],
    *,
    undolog: UndoLog,
    tiers: Mapping[str, TierValue] | None = None,
    session_id: str | None = None,
    wait_for_approval: float = 0,
    agent_id: str = "crewai",
    compensations: Iterable[Callable[..., Any]] = (),
    hooks: Sequence[Callable[[Any], Any]] = (),
    allow_unwrapped: Iterable[str] = (),
    poll_interval: float = 0.25,
) -> UndoLogToolset:
    """Wrap CrewAI tools (or plain functions) so each call is gated, logged and undoable by UndoLog.

    Args:
        tools: CrewAI ``BaseTool`` instances or functions (``@undolog_tool``-decorated or not).
        undolog: the :class:`UndoLog` to log into.
        tiers: tool name -> tier, in the vocabulary every adapter shares (see
            :class:`~undolog_adapters._common.UndoLogPolicy`): a ``ToolTier``, ``"safe"``/``"low"``...,
            an ``UndoLogPolicy``, or ``{"tier": "compensable", "compensation": cancel_x, "reason": ...,
            "risk_tags": [...]}``. A compensation given as a function is registered. Overrides
            ``@undolog_tool``. A tool with no tier anywhere is refused here, naming it.
        session_id: use this UndoLog session for every kickoff (e.g. a ticket id). Default: one
            session per kickoff.
        wait_for_approval: seconds an IRREVERSIBLE call waits for a decision (polling the store)
            before telling the agent it is awaiting approval. 0 (default) never blocks.
        agent_id: recorded on the sessions this toolset creates.
        compensations: compensation functions to register with ``undolog`` (``@compensation`` ones, or
            plain functions registered under their ``__name__``).
        hooks: extra before-tool-call policy hooks, run fail-closed inside the toolset's gate.
        allow_unwrapped: tool names the gate lets through unwrapped (e.g. CrewAI's delegation tools).
        poll_interval: seconds between store polls while waiting for approval.

    Returns:
        An :class:`UndoLogToolset`: a list of tools with the same names, descriptions and argument
        schemas, plus ``kickoff()``/``session()`` helpers.

    Raises:
        errors.ToolNotClassified: a tool has no tier.

    Example:
        >>> tools = wrap_tools([search_kb, send_refund_email], undolog=ul,      # doctest: +SKIP
        ...                    tiers={"search_kb": "safe"}, compensations=[cancel_refund_email])
    """
    registrar = Registrar(undolog, tiers=tiers, compensations=compensations)
    wrapped: list[UndoLogTool] = []
    for obj in tools:
        inner = _as_crewai_tool(obj)
        name = str(inner.name)
        tier = registrar.register(name, inner.run, declared=_spec_of(inner), args_schema=inner.args_schema)
        cache = inner.cache_function if tier is ToolTier.SAFE else _no_cache
        wrapped.append(
            UndoLogTool(
                name=inner.name,
                description=inner.description,
                args_schema=inner.args_schema,
                inner=inner,
                undolog_name=name,
                tier=tier,
                cache_function=cache,
                result_as_answer=inner.result_as_answer,
            )
        )
    registrar.check_compensations("wrap_tools")
    toolset = UndoLogToolset(
        wrapped,
        undolog=undolog,
        session_id=session_id,
        wait_for_approval=wait_for_approval,
        agent_id=agent_id,
        poll_interval=poll_interval,
        hooks=hooks,
        allow_unwrapped=allow_unwrapped,
    )
    for t in wrapped:
        t._toolset = toolset
    return toolset
