"""``UndoLogMiddleware``: the ``create_agent`` middleware routing every tool call through UndoLog."""

from __future__ import annotations

import asyncio
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.runnables.config import var_child_runnable_config
from langchain_core.tools import BaseTool
from langgraph.config import get_config

from undolog_core import OnFailure, SessionState, errors
from undolog_core.integration import WouldBlock

from .._common import TierValue, halted_text, missing_extra
from ._call import _REFUSED, NOT_SAFE, _gated, arun_call, run_known, run_logged
from ._guard import _config_of, _Guard, _Run
from ._payload import _Pause
from ._resume import rollback
from ._sessions import _ADAPTERS

if TYPE_CHECKING:
    from undolog_core import UndoLog


try:
    from langchain.agents.middleware import AgentMiddleware

    _HAVE_LANGCHAIN = True
except ImportError:  # pragma: no cover - langgraph without the langchain package: UndoLogToolNode still works
    _HAVE_LANGCHAIN = False
    AgentMiddleware = object  # type: ignore[assignment,misc]

# The qualified name LangChain gives the handler of a middleware that has other tool-call wrappers inside it.
_INNER_WRAPPERS = "compose_two.<locals>.composed.<locals>.call_inner"
# The session states at a turn's start that _turn_start acts on (refuse the turn, or open the next session).
_STOPS_OR_MOVES = frozenset({SessionState.HALTED.value, SessionState.ROLLED_BACK.value, SessionState.COMPLETED.value})


#: How the middleware pauses, in LangChain's words (``HumanInTheLoopMiddleware(interrupt_mode=...)``).
InterruptMode = Literal["batched", "per_call"]


@dataclass
class _GateRequest:
    """Enough of a ``ToolCallRequest`` for the batched gate, which runs before the tool calls are built."""

    tool_call: Any
    state: Any


class UndoLogMiddleware(AgentMiddleware):
    """``create_agent`` middleware routing every tool call through UndoLog (sync and async).

    The tools are checked for a tier when given here (``tools=``), otherwise on the first model
    request; a tool without one raises ``ToolNotClassified`` before anything runs. A new user turn
    on a thread whose session is halted is answered with a message saying so, and nothing runs
    until a person resumes or rolls the session back.

    Args:
        undolog: the ``UndoLog`` instance.
        tools: the agent's tools, to check tiers at construction.
        tiers: as for :class:`UndoLogToolNode`.
        compensations: as for :class:`UndoLogToolNode`.
        agent_id: as for :class:`UndoLogToolNode`.
        on_failure: as for :class:`UndoLogToolNode`.
        session_id: as for :class:`UndoLogToolNode`.
        approver: as for :class:`UndoLogToolNode`.
        interrupt_mode: how IRREVERSIBLE calls pause, as LangChain's ``HumanInTheLoopMiddleware`` does:
            ``"batched"`` (the default, as LangChain's): one ``HITLRequest`` per model message listing its gated
            calls, answered with ``{"decisions": [...]}`` in their order; ``"per_call"``: one ``ToolApprovalRequest``
            per call, each answered with one ``Decision`` keyed by its interrupt id.

    Example:
        >>> agent = create_agent(model, [search, send_refund_email, delete_user_account],
        ...                      middleware=[UndoLogMiddleware(undolog, compensations=[cancel_refund_email])],
        ...                      checkpointer=InMemorySaver())                            # doctest: +SKIP
        >>> agent.invoke({"messages": [{"role": "user", "content": "..."}]},
        ...              {"configurable": {"thread_id": "ticket-1042"}})                   # doctest: +SKIP
    """

    def __init__(
        self,
        undolog: UndoLog,
        *,
        tools: Sequence[BaseTool | Callable[..., Any]] | None = None,
        tiers: Mapping[str, TierValue] | None = None,
        compensations: Iterable[Callable[..., Any]] = (),
        agent_id: str = "langchain-agent",
        on_failure: OnFailure | str = OnFailure.ROLLBACK,
        session_id: Callable[[Mapping[str, Any]], str] | None = None,
        approver: str | Callable[[Mapping[str, Any]], str | None] | None = None,
        interrupt_mode: InterruptMode = "batched",
    ) -> None:
        if not _HAVE_LANGCHAIN:  # pragma: no cover
            raise ImportError(missing_extra("UndoLogMiddleware", "LangChain", "langgraph"))
        super().__init__()
        self.interrupt_mode = interrupt_mode
        self._undolog_guard = _Guard(undolog, tiers=tiers, compensations=compensations, agent_id=agent_id,
                                     on_failure=on_failure, session_id=session_id, approver=approver)
        self._checked = False
        if tools is not None:
            self._undolog_guard.classify(tools)
            self._checked = True
            if approver is None:
                _warn_no_approver(self._undolog_guard)
            if type(self) is _BatchedUndoLogMiddleware and not any(_gated(self._undolog_guard, n)
                                                                 for n in self._undolog_guard.names):
                # No tool of this agent pauses for a person: nothing to batch, so no after_model node (a node per
                # turn costs a step about what a whole middleware does). The same object, as the plain class.
                self.__class__ = UndoLogMiddleware  # type: ignore[assignment]
        # LangChain wraps every hook in LangSmith's ``traceable``, which asks for the hook's signature on each call,
        # traced or not. Of a bound method, ``inspect`` builds a new one every time (its function's without ``self``);
        # of a plain function carrying its signature, it reads it as it is. So the hooks are bound here, once, as such
        # functions: some 70,000 instructions less a hook call, 0.5% of a SAFE step (callgrind).
        # A subclass's own hook is left as it is.
        for name in _HOOKS:
            if getattr(type(self), name) is getattr(UndoLogMiddleware, name):
                setattr(self, name, _plain_hook(getattr(self, name)))
        _ADAPTERS.add(self)

    def __new__(cls, *args: Any, interrupt_mode: InterruptMode = "batched", **kwargs: Any) -> UndoLogMiddleware:
        # create_agent adds an after_model node for a middleware whose class defines the hook, so the batched gate is
        # a subclass: per_call costs no node per turn (a node costs a step about what a whole middleware does).
        if interrupt_mode not in get_args(InterruptMode):
            raise errors.ConfigurationError(
                f"UndoLogMiddleware: interrupt_mode must be 'batched' or 'per_call', not {interrupt_mode!r} "
                "(the modes of LangChain's HumanInTheLoopMiddleware)")
        if cls is UndoLogMiddleware and interrupt_mode == "batched":
            cls = _BatchedUndoLogMiddleware
        return super().__new__(cls)

    @property
    def name(self) -> str:
        """``UndoLogMiddleware`` in either mode (LangChain names the middleware's graph nodes after it)."""
        return "UndoLogMiddleware" if type(self) in (UndoLogMiddleware, _BatchedUndoLogMiddleware) \
            else type(self).__name__

    @property
    def undolog(self) -> UndoLog:
        return self._undolog_guard.u

    # A new user turn: refuse it on a halted thread; open a fresh session after a rollback. This runs inside the
    # model call that starts the turn (its request ends with the user's message), not in a before_agent hook: a
    # hook is a graph node, and a node per turn costs as much as a whole middleware of LangChain's (a task, a
    # checkpoint write, a superstep). The answer on a halted thread replaces the model's, so the agent ends there.
    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        # _check and _turn_starts inline, and _turn_start called only for a state that stops or moves the turn:
        # this runs twice per agent step, where each frame's code and data are cold (1-3 us a frame).
        if not self._checked:
            self._check(request)
        messages: Any = getattr(request, "messages", None)
        if messages and isinstance(messages[-1], HumanMessage):
            # _turn and _config_of, inline (two frames less at every user turn).
            g = self._undolog_guard
            rt = getattr(request, "runtime", None)
            # get_config, inline: the run's config (a model request's runtime carries none), None outside a run.
            config = getattr(rt, "config", None) or var_child_runnable_config.get()
            if not config:
                return handler(request)  # no thread: every tool call will say so
            try:
                base = g.base_id(config)
            except errors.ConfigurationError:
                return handler(request)  # no thread: every tool call will say so
            sid, state, reason = g.turn(base, wait=True)
            if state in _STOPS_OR_MOVES:
                refused = self._turn_start((base, sid, state, reason))
                if refused is not None:
                    return refused
        return handler(request)

    async def awrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        # The check and the turn test inline, as in wrap_model_call (frames less on each of a step's two model calls).
        if not self._checked:
            self._check(request)
        messages: Any = getattr(request, "messages", None)
        if messages and isinstance(messages[-1], HumanMessage):
            try:
                # One read on the loop when a connection is free at once; a wait (or the thread's first turn, which
                # creates its session) in a worker thread.
                turn = self._turn(request, wait=False)
            except WouldBlock:
                turn = await asyncio.to_thread(self._turn, request, wait=True)
            if turn is not None and turn[2] in _STOPS_OR_MOVES:
                # Opening the next session after a rollback writes: in a worker thread too.
                needs_write = turn[2] in (SessionState.ROLLED_BACK, SessionState.COMPLETED)
                refused = await asyncio.to_thread(self._turn_start, turn) if needs_write else self._turn_start(turn)
                if refused is not None:
                    return refused
        return await handler(request)

    def _turn(self, request: Any, *, wait: bool) -> tuple[str, str, str | None, str | None] | None:
        """(base id, session id, state, halted reason) of the thread, or None outside a thread."""
        g = self._undolog_guard
        try:
            base = g.base_id(_config_of(request))
        except (RuntimeError, errors.ConfigurationError):
            return None  # no thread: every tool call will say so
        return (base, *g.turn(base, wait=wait))

    def _turn_start(self, turn: tuple[str, str, str | None, str | None] | None) -> AIMessage | None:
        if turn is None or turn[2] is None:
            return None
        base, sid, state, reason = turn
        if state == SessionState.HALTED:
            text = halted_text(sid, reason)
            return AIMessage(content=text, response_metadata={"undolog": {"refused": "session_halted"}})
        if state in (SessionState.ROLLED_BACK, SessionState.COMPLETED):
            self._undolog_guard.advance(base, sid)
        return None

    def _check(self, request: Any) -> None:
        if not self._checked:
            self._undolog_guard.classify(getattr(request, "tools", None) or [])
            self._checked = True

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        if _INNER_WRAPPERS in getattr(handler, "__qualname__", ""):
            _innermost(handler)  # refuses: _innermost's test, inline (a frame less on every tool call)
        # run_call's own first step, taken here (a frame less on every call): the SAFE or COMPENSABLE call of a known
        # thread.
        out = run_known(self._undolog_guard, request, handler)
        return out if out is not NOT_SAFE else run_logged(self._undolog_guard, request, handler, admit=False)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        if _INNER_WRAPPERS in getattr(handler, "__qualname__", ""):
            _innermost(handler)  # refuses: _innermost's test, inline, as in wrap_tool_call
        return await arun_call(self._undolog_guard, request, handler, admit=False)

    def rollback(self, thread_id: str, *, reason: str | None = None) -> Any:
        """Roll back the thread's current session; see :func:`rollback`."""
        return rollback(thread_id, undolog=self.undolog, reason=reason)


class _BatchedUndoLogMiddleware(UndoLogMiddleware):
    """``UndoLogMiddleware(interrupt_mode="batched")``.

    The model message's IRREVERSIBLE calls are asked about in one ``HITLRequest`` after the model, before any
    of them runs, as LangChain's own middleware asks by default.
    """

    def after_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        """Raise (or find) the approval requests of the last model message's gated calls, in one pause.

        All of them are asked for in that one pause; on resume, the decisions are recorded. The calls then run, or are refused, in the tool node as in
        ``per_call`` mode, each by its decision.
        """
        calls = _gated_calls(self._undolog_guard, state)
        if not calls:
            return None
        g = self._undolog_guard
        try:
            config: Mapping[str, Any] = get_config()
        except RuntimeError:
            return None
        pauses = self._pauses(calls, state, config)
        error: str | None = None
        while pauses:
            error = g.ask(pauses, error, batched=True)
            # Decided (approved, rejected, responded) or still pending with a problem to say (an edit that does not
            # fit the tool): the latter are asked about again, with the reason in the pause.
            still = {p.awaiting.call_id for p in pauses}
            pauses = self._pauses([c for c in calls if c.get("id") in still], state, config)
        return None

    async def aafter_model(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        if not _gated_calls(self._undolog_guard, state):
            return None  # (no I/O for a message without a gated call: on the loop)
        return await asyncio.to_thread(self.after_model, state, runtime)

    def _pauses(self, calls: list[Any], state: Any, config: Mapping[str, Any]) -> list[_Pause]:
        g = self._undolog_guard
        pauses: list[_Pause] = []
        for call in calls:
            try:
                step = g.prepare(_GateRequest(call, state), config)
            except _REFUSED:
                continue  # the tool node answers it with the refusal
            except errors.UndoLogError:
                continue  # (likewise: a configuration problem is the tool node's to report)
            if isinstance(step, _Pause):
                pauses.append(step)
            elif isinstance(step, _Run) and step.execute.effect_id is not None:
                # Approved and claimed by this pass: handed back unclaimed for the tool node to claim and run.
                g.u.driver.release(step.execute)
        return pauses


def _warn_no_approver(guard: _Guard) -> None:
    """Say at build time, not at the first decision, that LangChain-form answers will name nobody."""
    gated = sorted(n for n in guard.names if _gated(guard, n))
    if gated:
        warnings.warn(
            f"UndoLogMiddleware has no approver= and {', '.join(gated)} pause for a person: a LangChain decision "
            "names nobody, so it is refused unless LangGraph's auth names the user (langgraph_auth_user). Pass "
            "approver='name' or approver=lambda config: ..., or answer in UndoLog's form with 'approver'",
            UserWarning, stacklevel=3)


def _gated_calls(guard: _Guard, state: Any) -> list[Any]:
    """The IRREVERSIBLE calls of the state's last model message (those with an id), in message order."""
    messages = state.get("messages") if isinstance(state, Mapping) else getattr(state, "messages", None)
    if not messages:
        return []
    last = messages[-1]
    calls = getattr(last, "tool_calls", None) if isinstance(last, AIMessage) else None
    if not calls:
        return []
    return [c for c in calls if c.get("id") and _gated(guard, c.get("name"))]


# ``create_agent`` wraps every ``wrap_*`` hook in LangSmith's ``traceable``, which asks for the hook's signature on
# each call, traced or not (rebuilt from the code object: some 10 us, three hook calls a step). Stored once here, it is
# the same signature, found without rebuilding it (for a subclass's hooks; UndoLogMiddleware's own are bound as plain
# functions by __init__, see _plain_hook).
_HOOKS = ("wrap_model_call", "awrap_model_call", "wrap_tool_call", "awrap_tool_call")
for _hook in _HOOKS:
    _fn = getattr(UndoLogMiddleware, _hook)
    _fn.__signature__ = inspect.signature(_fn)
# The hooks' (request, handler), without self: what _plain_hook's functions carry (the same for all four).
_with_self = inspect.signature(UndoLogMiddleware.wrap_tool_call)
_HOOK_SIGNATURE = _with_self.replace(parameters=list(_with_self.parameters.values())[1:])


def _plain_hook(method: Callable[[Any, Callable[[Any], Any]], Any]) -> Callable[[Any, Callable[[Any], Any]], Any]:
    """The bound hook ``method`` as a plain callable of ``(request, handler)`` carrying its signature.

    What LangSmith's ``traceable`` reads on every call without rebuilding it.

    A ``functools.partial`` of the method's function on its instance: called from C, it adds no Python frame of its
    own (a wrapper function did: one frame more on each of a step's three hook calls, where each frame's code is
    cold). ``inspect`` sees it as a coroutine function when the method is one, and reads the signature set here.
    """
    hook: Any = functools.partial(method.__func__, method.__self__)  # type: ignore[attr-defined]
    hook.__name__, hook.__qualname__, hook.__doc__ = method.__name__, method.__qualname__, method.__doc__
    hook.__signature__ = _HOOK_SIGNATURE
    return hook  # type: ignore[no-any-return]


def _innermost(handler: Any) -> None:
    """Refuse to gate a call that other middleware could still change (or repeat) before it runs."""
    if _INNER_WRAPPERS in getattr(handler, "__qualname__", ""):
        raise errors.ConfigurationError(
            "UndoLogMiddleware must be the last middleware that wraps tool calls (middleware=[..., "
            "UndoLogMiddleware(...)]): a tool-call wrapper inside it could switch the tool, edit its arguments "
            "or run it again after UndoLog's gate. Nothing was run."
        )
