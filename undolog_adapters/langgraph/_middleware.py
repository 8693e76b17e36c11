"""``UndoLogMiddleware``: the ``create_agent`` middleware routing every tool call through UndoLog."""

from __future__ import annotations

import asyncio
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from langchain_core.messages import AIMessage, HumanMessage, messages_from_dict, messages_to_dict
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
from ._siblings import CONFIG_KEY_CHECKPOINT_NS, CONFIG_KEY_SCRATCHPAD

if TYPE_CHECKING:
    from undolog_core import UndoLog


try:
    from langchain.agents.middleware import AgentMiddleware, ModelResponse

    _HAVE_LANGCHAIN = True
except ImportError:  # pragma: no cover - langgraph without the langchain package: UndoLogToolNode still works
    _HAVE_LANGCHAIN = False
    AgentMiddleware = object  # type: ignore[assignment,misc]
    ModelResponse = None  # type: ignore[assignment,misc]

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

    # Whether the model call asks about its message's IRREVERSIBLE calls (the batched gate, with a tool that pauses).
    _asks_in_model = False

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
        # The agent's tool names (LangChain's) that pause for a person, as of _names_seen classified names.
        self._gated_names: frozenset[str] = frozenset()
        self._names_seen = 0
        if tools is not None:
            self._undolog_guard.classify(tools)
            self._checked = True
            if approver is None:
                _warn_no_approver(self._undolog_guard)
            if type(self) is _BatchedUndoLogMiddleware and not any(_gated(self._undolog_guard, n)
                                                                 for n in self._undolog_guard.names):
                # No tool of this agent pauses for a person: nothing to batch, so nothing to look for in the model's
                # message (nor a resume to look for before it). The same object, as the plain class.
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
        # The batched gate is a subclass whose model call asks about the message's IRREVERSIBLE calls (per_call asks
        # in each call's own tool task).
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
        if self._asks_in_model:
            # The batched gate's resume: LangGraph re-runs this model call from its start, and the message kept
            # when it paused answers it (the model is never asked twice). Read only when a resume value waits for
            # this task (no I/O otherwise). _resume_waits, inline (a frame less on each model call).
            config = var_child_runnable_config.get()
            pad = (config.get("configurable") or {}).get(CONFIG_KEY_SCRATCHPAD) if config else None
            if pad is not None and (pad.resume or pad.get_null_resume(False) is not None):
                kept = self._resumed()
                if kept is not None:
                    return self._ask_model_message(request, kept, resumed=True)
        messages: Any = getattr(request, "messages", None)
        if messages and isinstance(messages[-1], HumanMessage):
            # _turn and _config_of, inline (two frames less at every user turn).
            g = self._undolog_guard
            rt = getattr(request, "runtime", None)
            # get_config, inline: the run's config (a model request's runtime carries none), None outside a run.
            config = getattr(rt, "config", None) or var_child_runnable_config.get()
            base = None
            if config:
                try:
                    base = g.base_id(config)
                except errors.ConfigurationError:
                    pass  # no thread: every tool call will say so
            if base is not None:
                sid, state, reason = g.turn(base, wait=True)
                if state in _STOPS_OR_MOVES:
                    refused = self._turn_start((base, sid, state, reason))
                    if refused is not None:
                        return refused
        out = handler(request)
        if self._asks_in_model:
            # Whether a call of the answer pauses for a person (_asks, inline: frames less on each model call).
            gated = self._gated_names if self._names_seen == len(self._undolog_guard.names) else self._gated_now()
            for m in getattr(out, "result", None) or _messages_of(out):
                for c in getattr(m, "tool_calls", None) or ():
                    if c.get("name") in gated and c.get("id"):
                        return self._ask_model_message(request, out)
        return out

    async def awrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        # The check and the turn test inline, as in wrap_model_call (frames less on each of a step's two model calls).
        if not self._checked:
            self._check(request)
        if self._asks_in_model and self._resume_waits():
            # The batched gate's resume (see wrap_model_call): the store is read in a worker thread.
            kept = await asyncio.to_thread(self._resumed)
            if kept is not None:
                return await asyncio.to_thread(self._ask_model_message, request, kept, resumed=True)
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
        out = await handler(request)
        if self._asks_in_model:
            gated = self._gated_names if self._names_seen == len(self._undolog_guard.names) else self._gated_now()
            for m in getattr(out, "result", None) or _messages_of(out):
                for c in getattr(m, "tool_calls", None) or ():
                    if c.get("name") in gated and c.get("id"):
                        # The approval requests are written, and the pause raised, in a worker thread (interrupt()
                        # reads the run's config from the context, which asyncio.to_thread carries over).
                        return await asyncio.to_thread(self._ask_model_message, request, out)
        return out

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

    # -- the batched gate (_BatchedUndoLogMiddleware) --------------------------------------------------

    def _gated_now(self) -> frozenset[str]:
        """The tool names that pause for a person, read again (a tool was classified since they were)."""
        g = self._undolog_guard
        names = dict(g.names)
        self._gated_names = frozenset(n for n in names if _gated(g, n))
        self._names_seen = len(names)
        return self._gated_names

    def _resume_waits(self) -> bool:
        """Whether a resume value waits for this task (LangGraph's scratchpad): nothing is read from the store."""
        config = var_child_runnable_config.get()
        pad = (config.get("configurable") or {}).get(CONFIG_KEY_SCRATCHPAD) if config else None
        return pad is not None and bool(pad.resume or pad.get_null_resume(False) is not None)

    def _resumed(self) -> list[Any] | None:
        """The model's messages kept when this task paused; None otherwise.

        Its callers have seen a resume value waiting for this task (``_resume_waits``, or its inline copy in
        ``wrap_model_call``).
        """
        config = var_child_runnable_config.get() or {}
        g = self._undolog_guard
        try:
            sid = g.head(g.base_id(config))
        except errors.ConfigurationError:
            return None
        kept = g.u.approvals.kept_message(sid, _task_key(config))
        # Not found: the pause was not this gate's (another middleware's interrupt in the model call): the model runs.
        return None if kept is None else messages_from_dict(kept["messages"])

    def _ask_model_message(self, request: Any, out: Any, *, resumed: bool = False) -> Any:
        """``out`` (the model's answer, or the messages kept on its pause) after its gated calls were asked about.

        The requests are raised (or found), the message kept beside them on the first run, and all of them asked for
        in one pause; on resume, the decisions are recorded.
        """
        g = self._undolog_guard
        if resumed:
            out = ModelResponse(result=out)
        messages = _messages_of(out)
        message = next(m for m in reversed(messages) if isinstance(m, AIMessage))
        calls = [c for c in message.tool_calls if c.get("id") and _gated(g, c.get("name"))]
        config: Mapping[str, Any] = var_child_runnable_config.get() or get_config()
        state = {"messages": [*(getattr(request, "messages", None) or ()), message]}
        pauses = self._pauses(calls, state, config)
        if pauses and not resumed:
            # Kept before the pause, on every request it asks about (one of them may be another session's, joined):
            # the resume finds it from the session's newest requests.
            kept = {"messages": messages_to_dict(messages)}
            key = _task_key(config)
            for p in pauses:
                g.u.approvals.keep_message(p.awaiting.approval_request_id, p.session_id, key, kept)
        error: str | None = None
        while pauses:
            error = g.ask(pauses, error, batched=True)
            # Decided (approved, rejected, responded) or still pending with a problem to say (an edit that does not
            # fit the tool): the latter are asked about again, with the reason in the pause.
            still = {p.awaiting.call_id for p in pauses}
            pauses = self._pauses([c for c in calls if c.get("id") in still], state, config)
        return out

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



class _BatchedUndoLogMiddleware(UndoLogMiddleware):
    """``UndoLogMiddleware(interrupt_mode="batched")``.

    The model message's IRREVERSIBLE calls are asked about in one ``HITLRequest`` before any of them runs, as
    LangChain's own middleware asks by default; but inside the model call the middleware already wraps, not in an
    ``after_model`` node: a graph node runs (a task, channel writes, a checkpoint) on every model call, and it cost
    an agent step about 0.97 ms of the 1.05 ms UndoLog added (``benchmarks/agent_step.py``, tmpfs row). A message
    without such a call is returned as it is: no I/O, no node.

    A message with some: its approval requests are written (as the tool node would write them), the message is kept
    with them (an audit event of the requests, ``ApprovalService.keep_message``), and the graph pauses. LangGraph
    re-runs the model call from its start on resume; ``wrap_model_call`` finds a resume value waiting for its task
    and answers with the kept message instead of calling the model again (a call is never blindly re-run, and the
    model would answer differently), after the decisions are recorded as before. The calls then run, or are refused,
    in the tool node as in ``per_call`` mode, each by its decision.
    """

    _asks_in_model = True


def _task_key(config: Mapping[str, Any]) -> str:
    """The paused model task, as LangGraph names it again on resume.

    Its checkpoint namespace (``model:<task id>``, under its parent graphs'), after the thread's id.
    """
    conf = config.get("configurable") or {}
    return f"{conf.get('thread_id')}/{conf.get(CONFIG_KEY_CHECKPOINT_NS, '')}"


def _messages_of(out: Any) -> list[Any]:
    """The messages of a model call's answer (``ModelResponse``, ``AIMessage`` or ``ExtendedModelResponse``)."""
    if isinstance(out, AIMessage):
        return [out]
    inner = getattr(out, "model_response", out)
    return list(getattr(inner, "result", None) or ())


def _warn_no_approver(guard: _Guard) -> None:
    """Say at build time, not at the first decision, that LangChain-form answers will name nobody."""
    gated = sorted(n for n in guard.names if _gated(guard, n))
    if gated:
        warnings.warn(
            f"UndoLogMiddleware has no approver= and {', '.join(gated)} pause for a person: a LangChain decision "
            "names nobody, so it is refused unless LangGraph's auth names the user (langgraph_auth_user). Pass "
            "approver='name' or approver=lambda config: ..., or answer in UndoLog's form with 'approver'",
            UserWarning, stacklevel=3)


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
