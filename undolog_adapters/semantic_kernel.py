"""UndoLog for Semantic Kernel: kernel filters that gate, log and undo every kernel-function call.

Two filters work as a pair so that each call is intercepted once:

* the AUTO_FUNCTION_INVOCATION filter owns the gate under auto function calling: it has the model's
  call id, and it can pause the loop (``context.terminate``) when an IRREVERSIBLE call waits for a
  person;
* the FUNCTION_INVOCATION filter runs the tool: SK turns tool exceptions into text before the auto
  filter sees them, so only this filter can hand the exception to the saga. Under a plain
  ``kernel.invoke`` it owns the gate too, and raises :class:`ApprovalPending`. It decides every SAFE
  call itself (validated against its contract, checked against the session's pin, counted), last
  before the function runs, whichever way the call came: nothing to gate, nothing to record.

The auto filter hands its decision (for a SAFE call, the contract it routed the call by) to the inner
filter through a context variable.

A COMPENSABLE/IRREVERSIBLE function that raises is never replaced by an UndoLog error: its own
exception object goes on, with the rollback outcome added as a note and as the attribute
``undolog_rollback`` (the :class:`RollbackReport`, or None if nothing was rolled back). Under auto
calling the model reads what failed and what was undone instead.

Example:
    >>> from undolog_adapters.semantic_kernel import install, undolog_session, resume   # doctest: +SKIP
    >>> install(kernel, ul, tiers={"support-search_knowledge_base": "safe"})
    >>> with undolog_session("chat-42"):
    ...     reply = await chat.get_chat_message_content(history, settings, kernel=kernel)
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import sys
import uuid
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MethodType
from typing import Any, NoReturn

from undolog_adapters._common import missing_extra

try:
    from semantic_kernel import Kernel
    from semantic_kernel.connectors.ai.function_choice_behavior import FunctionChoiceBehavior
    from semantic_kernel.connectors.ai.prompt_execution_settings import PromptExecutionSettings
    from semantic_kernel.contents import ChatHistory, FunctionCallContent, FunctionResultContent
    from semantic_kernel.exceptions import KernelInvokeException
    from semantic_kernel.filters import AutoFunctionInvocationContext, FilterTypes, FunctionInvocationContext
    from semantic_kernel.functions import FunctionResult, KernelArguments, KernelFunction
    from semantic_kernel.functions.kernel_function_from_method import KernelFunctionFromMethod
except ImportError as exc:  # exercised by tests/adapters/test_common.py with Semantic Kernel hidden
    raise ImportError(missing_extra("undolog_adapters.semantic_kernel", "Semantic Kernel", "semantic-kernel")) from exc

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
from undolog_core import ApprovalPending, RequestState, ToolTier, UndoLog, errors
from undolog_core.integration import (
    AwaitingApproval,
    Completed,
    Continuation,
    Execute,
    Outcome,
    SessionCache,
    ToolSpec,
    WouldBlock,
    execute_now,
    hot_path,
    session_table,
)

__all__ = [
    "ROLLBACK_ATTR",
    "UndoLogFilter",
    "UndoLogPolicy",
    "install",
    "invoke",
    "resume",
    "resume_agent",
    "resume_pending",
    "undolog_session",
]

log = logging.getLogger(__name__)

PLACEHOLDER_KEY = "undolog_approval_request_id"

# Set on a kernel function's own exception once UndoLog has handled its failure: the RollbackReport, or
# None when nothing was rolled back (policy "continue", or the rollback could not run; the note says which).
ROLLBACK_ATTR = "undolog_rollback"

# Parameters SK fills in itself; they are not part of a call's arguments. Neither is a parameter marked
# ``include_in_function_choices: False``: the app passes it in KernelArguments, the model never sees it. UndoLog's
# schema, snapshot and digest (what an approver sees, what a decision binds) cover only what the model sends; the
# function still receives the rest from SK.
_INJECTED = frozenset({"kernel", "service", "execution_settings", "arguments"})


def _model_params(function: KernelFunction) -> list[Any]:
    return [p for p in function.parameters
            if p.name and p.name not in _INJECTED and p.include_in_function_choices]

_session_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("undolog_sk_session", default=None)
# Set by resume()/resume_agent(): the committed effects of the turn being continued (the calls its history holds),
# replayed to the calls that repeat them: a model may start its task over after the pause.
_continuation: contextvars.ContextVar[Continuation | None] = contextvars.ContextVar(
    "undolog_sk_continuation", default=None)


def _under_auto_invocation() -> AutoFunctionInvocationContext | None:
    """The auto-invocation context of the kernel function being invoked, or None.

    It is there when SK's automatic function calling called the function: its ``function_call_content`` holds the
    model's call id.

    The FUNCTION_INVOCATION filter is not told; SK's ``KernelFunction.invoke`` is awaited straight from
    ``Kernel._inner_auto_function_invoke_handler`` under auto calling, from the app under ``kernel.invoke``. Read
    only when the AUTO_FUNCTION_INVOCATION half is missing (see ``_alone``); the names are pinned against the
    installed SK by tests/adapters/test_semantic_kernel_one_filter.py.
    """
    frame = sys._getframe(1)
    for _ in range(80):
        if frame is None:
            return None
        code = frame.f_code
        if code.co_name == "invoke" and code.co_filename.endswith("kernel_function.py") \
                and "semantic_kernel" in code.co_filename:
            back = frame.f_back
            if back is None or back.f_code.co_name != "_inner_auto_function_invoke_handler":
                return None
            auto = back.f_locals.get("context")
            return auto if isinstance(auto, AutoFunctionInvocationContext) else None
        frame = frame.f_back  # type: ignore[assignment]
    return None

SAFE = ToolTier.SAFE
COMPENSABLE = ToolTier.COMPENSABLE
IRREVERSIBLE = ToolTier.IRREVERSIBLE
_MISSING = object()
# Values that JSON conversion (to_jsonable_python) gives back as the same objects; a subclass (a str enum...) or
# anything else is converted.
_PLAIN = frozenset({str, int, float, bool, type(None)})
# Kernel functions and sessions a filter keeps what it learnt of, each looked up once; past this many, it starts over
# (a long-lived filter serving many conversations must not grow without bound).
_KEEP = 4096


@dataclass(frozen=True)
class _Known:
    """What a filter learnt once of a kernel function.

    Its UndoLog name and the parameters the model sends (its tier is read from the registry on each call: a
    tool registered again under another tier is routed by that).
    """

    function: KernelFunction  # held so that the id it is kept under is not reused by another object
    name: str
    params: frozenset[str]


@dataclass(slots=True)
class _Handover:
    name: str
    decision: Execute
    session_id: str
    consumed: bool = False
    # What the model should read when the function raised (set by the inner filter).
    failure_text: str | None = None
    # The call's arguments as JSON values, as let through: what the inner filter compares the call it runs with.
    approved: dict[str, Any] | None = None


# The gate's decision on a call it let through (a COMPENSABLE or IRREVERSIBLE one), handed by the auto filter to the
# inner filter, which reads it (once) in the same task; sibling calls run in their own asyncio tasks, each with its
# own copy. (A SAFE call is handed over without a context variable: see UndoLogFilter._safe_calls.)
_handover: contextvars.ContextVar[_Handover | None] = contextvars.ContextVar("undolog_sk_handover", default=None)


class undolog_session:  # noqa: N801 - used as a function (``with undolog_session(id):``), as it always was
    """Run what is inside as UndoLog session ``session_id`` (a chat or agent-thread id).

    A plain class rather than a generator-based context manager: it wraps every turn, and this costs a third. It does
    no more than set the context variable and reset it (``__exit__`` reads the token ``__enter__`` stored): each
    statement here is paid on every turn.

    Example:
        >>> with undolog_session(thread.id):                         # doctest: +SKIP
        ...     await agent.get_response(messages="hi", thread=thread)
    """

    __slots__ = ("session_id", "_token")
    _token: contextvars.Token[str | None]

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def __enter__(self) -> str:
        self._token = _session_var.set(self.session_id)
        return self.session_id

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # (Named parameters, not *exc: a call with exactly these arguments is the interpreter's cheap one.)
        _session_var.reset(self._token)


def _is_tool(function: KernelFunction) -> bool:
    # Prompt functions only call a model; they are not tools and pass untouched.
    return isinstance(function, KernelFunctionFromMethod)


def _method_spec(function: KernelFunction) -> Any:
    method = getattr(function, "method", None)
    for candidate in (method, getattr(method, "__func__", None)):
        spec = getattr(candidate, "__undolog_spec__", None)
        if spec is not None:
            return spec
    return None


def _refusal(function: KernelFunction, name: str, exc: errors.UndoLogError) -> FunctionResult:
    """What the model reads of a call UndoLog refused under auto function calling (nothing ran)."""
    return FunctionResult(function=function.metadata, value=refusal_text(name, exc))


def _json_schema(function: KernelFunction) -> dict[str, Any]:
    props: dict[str, Any] = {}
    required: list[str] = []
    for p in _model_params(function):
        props[p.name] = dict(p.schema_data or {})
        if p.is_required:
            required.append(p.name)
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


class UndoLogFilter:
    """The pair of SK filters.

    The object itself is the FUNCTION_INVOCATION filter, ``.auto_invocation`` the AUTO_FUNCTION_INVOCATION
    one. Register them the way SK registers any filter, or with :meth:`install`.

    Args:
        undolog: the :class:`UndoLog` to log into.
        tiers: ``"plugin-function"`` -> tier, in the vocabulary every adapter shares (see
            :class:`~undolog_adapters._common.UndoLogPolicy`): a ``ToolTier``, ``"safe"``/``"low"``...,
            an ``UndoLogPolicy``, or ``{"tier": "compensable", "compensation": cancel_x, ...}``. A
            compensation given as a function is registered. Overrides ``@undolog_tool`` on the kernel
            function.
        compensations: compensation functions to register (``@compensation`` ones, or plain
            functions registered under their ``__name__``).
        session_id: the session for calls made outside :func:`undolog_session`. Default: one new
            session for this filter (see :attr:`session_id`).
        agent_id: recorded on the sessions this filter creates.

    Example:
        >>> f = UndoLogFilter(ul, tiers={"support-delete_user_account": "irreversible"})  # doctest: +SKIP
        >>> kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, f)            # SK's own idiom, after your filters
        >>> kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, f.auto_invocation)
        >>> # or, the same plus a check that every kernel function has a tier:  f.install(kernel)
    """

    def __init__(self, undolog: UndoLog, *, tiers: Mapping[str, TierValue] | None = None,
                 compensations: Iterable[Callable[..., Any]] = (), session_id: str | None = None,
                 agent_id: str = "semantic-kernel", kernel: Kernel | None = None) -> None:
        self.undolog = undolog
        self._registrar = Registrar(undolog, tiers=tiers, compensations=compensations)
        # ``tiers=`` names are SK's "plugin-function" names: checked against each kernel at its first sight (install(),
        # ``kernel=`` here, else the first call), so a bare function name is named at once, not refused call by call.
        self._tier_names = frozenset(tiers or ())
        self._kernels_checked: set[int] = set()
        self._session_id = session_id
        self.agent_id = agent_id
        self._classified: dict[str, ToolTier] = {}
        self._known: dict[int, _Known] = {}
        # The registry's tools by name, read on each call (a tool registered again is a new ToolSpec there).
        self._tools = undolog.registry.tools
        self._driver = undolog.driver  # (one attribute look-up fewer on each SAFE call)
        # The integration contract's per-call decisions (a SAFE call's count and pin check is its note_safe_in) and
        # session lifecycle, held once: the core's own objects, so a call through them costs no frame of its own.
        self._hot = hot_path(undolog)
        self._sessions = session_table(undolog)
        # The sessions this filter has seen, as the engine keeps them (read once; see _cache).
        self._seen: dict[str, SessionCache] = {}
        # SAFE calls (no retry policy) the auto filter routed and the inner filter has not taken yet: id of the call's
        # KernelArguments -> (that object, what the filter knows of the function, the contract the call was routed
        # by). SK hands the auto context's
        # arguments object itself to the function's invocation (sibling calls each have their own copy), so the inner
        # filter finds its call by it, takes it out at first sight (a call the function itself makes is its own), and
        # decides it under that contract right before the function runs (no filter can change it after), a refusal
        # answering the model as the gate's would. An entry lives only while the auto filter awaits (it removes one
        # left untaken; the entry holds the object too), so its id is not reused meanwhile. (A filter between the two halves that puts
        # another arguments object in the call leaves the call to be decided as under a plain invoke: checked all
        # the same, a refusal raised.) A dict, not a context variable: setting and resetting one costs a new context
        # mapping each, on every call.
        self._safe_calls: dict[int, tuple[KernelArguments, _Known, ToolSpec]] = {}
        # Bound methods are created anew on each access; keep one of each so they can be found again.
        self.function_filter = self.function_invocation
        self.auto_filter = self.auto_function_invocation
        #: The AUTO_FUNCTION_INVOCATION half, for ``kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, ...)``.
        self.auto_invocation = self.auto_filter
        if kernel is not None:
            self.check_tiers(kernel)

    def check_tiers(self, kernel: Kernel) -> None:
        """Check ``tiers=`` against the kernel's functions: names matching none warn, naming what the kernel has.

        Raises:
            errors.ConfigurationError: no name of ``tiers=`` is a function of the kernel (every call would be
                refused).

        Example:
            >>> UndoLogFilter(ul, tiers={"delete_user_account": "irreversible"}).check_tiers(kernel)  # doctest: +SKIP
            Traceback (most recent call last):
            ConfigurationError: UndoLogFilter tiers= names no function of this kernel ...
        """
        self._kernels_checked.add(id(kernel))
        if not self._tier_names:
            return
        have = sorted(f.fully_qualified_name for plugin in kernel.plugins.values()
                      for f in plugin.functions.values() if _is_tool(f))
        unmatched = sorted(self._tier_names.difference(have))
        if not unmatched:
            return
        by_bare = {name.split("-", 1)[-1]: name for name in have}
        hints = [f"{n!r} -> {by_bare[n]!r}" for n in unmatched if n in by_bare]
        fix = (f"key them by SK's 'plugin-function' names ({', '.join(hints)})" if hints
               else "key them by SK's 'plugin-function' names")
        detail = f"the kernel's functions are {have}" if have else "the kernel has no kernel functions yet"
        if len(unmatched) == len(self._tier_names):
            raise errors.ConfigurationError(
                f"UndoLogFilter tiers= names no function of this kernel ({unmatched}): {fix}; {detail}")
        warnings.warn(f"UndoLogFilter tiers= names {unmatched} match no function of this kernel: {fix}; {detail}",
                      UserWarning, stacklevel=3)
        log.warning("UndoLog: tiers= names %s match no function of this kernel; %s", unmatched, detail)

    async def __call__(self, context: FunctionInvocationContext, next: Any) -> None:
        """The FUNCTION_INVOCATION filter: ``kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, undolog_filter)``.

        SK calls a filter as ``filter(context, next=...)``, so the parameter must be named ``next``.
        """
        await self.function_invocation(context, next)

    def _is_inner(self, registered: Any) -> bool:
        # The inner half registered either as this object (SK's idiom) or as its bound method (install()'s, else one
        # obtained anew: equal, not the same object).
        return registered is self.function_filter or registered is self or registered == self.function_filter

    # ----------------------------------------------------------------- setup
    def install(self, kernel: Kernel, *, strict: bool = True) -> UndoLogFilter:
        """Register both filters on ``kernel``; with ``strict``, refuse kernels holding unclassified tools.

        Raises:
            errors.ToolNotClassified: a kernel function (not a prompt function) has no tier.
        """
        self.check_tiers(kernel)
        if strict:
            for plugin in kernel.plugins.values():
                for function in plugin.functions.values():
                    if _is_tool(function):
                        self.classify(function)
            self._registrar.check_compensations("UndoLogFilter")
        # SK runs the filter registered last closest to the function. UndoLog's runner must be that one, so
        # that no other filter can change a call between UndoLog's check and the tool: install it after
        # your own filters (one added later makes every call refused, saying so).
        kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, self.function_filter)
        kernel.add_filter(FilterTypes.AUTO_FUNCTION_INVOCATION, self.auto_filter)
        return self

    def classify(self, function: KernelFunction) -> ToolTier:
        """Register ``function`` with UndoLog under its ``plugin-function`` name; returns its tier."""
        name = function.fully_qualified_name
        if name in self._classified:
            return self._classified[name]
        tier = self._registrar.register(name, getattr(function, "method", None), declared=_method_spec(function),
                                        args_schema=_json_schema(function))
        self._classified[name] = tier
        return tier

    # ----------------------------------------------------------------- sessions
    @property
    def session_id(self) -> str:
        """The session of the current context (:func:`undolog_session`), else this filter's own."""
        sid = _session_var.get()
        if sid is None:
            if self._session_id is None:
                self._session_id = str(uuid.uuid4())
            sid = self._session_id
        return sid

    def _learn(self, function: KernelFunction, kernel: Kernel | None = None) -> _Known:
        """The function's name, tier and model parameters, computed once.

        SK computes its name on each access; the filters look them up by the function's id first. A kernel seen for the first time has its ``tiers=``
        names checked (``check_tiers``).
        """
        if kernel is not None and id(kernel) not in self._kernels_checked:
            self.check_tiers(kernel)
        self.classify(function)
        known = _Known(function, function.fully_qualified_name, frozenset(p.name for p in _model_params(function)))
        if len(self._known) >= _KEEP:
            self._known.clear()
        self._known[id(function)] = known
        return known

    async def _cache(self, sid: str) -> SessionCache:
        """The session as this process knows it.

        The first sight reads it (its state and pins, so a session resumed here keeps them; nothing is
        written); a session the store does not have is written by its first COMPENSABLE or IRREVERSIBLE call
        (see _intercept), so a conversation of SAFE calls writes nothing.
        """
        sc = self._seen.get(sid)
        if sc is not None:
            return sc
        sessions = self._sessions
        try:
            sc = sessions.look_up_session(sid, agent_id=self.agent_id, wait=False)
        except WouldBlock:  # no free connection at once: never wait on the event loop
            sc = await asyncio.to_thread(sessions.look_up_session, sid, agent_id=self.agent_id)
        # Bounded by the engine's own bound too: a record held here stays in memory when the engine evicts it (and is
        # put back when used: see Engine._evicted), so this map must not hold more conversations than that.
        if len(self._seen) >= min(_KEEP, sessions.max_sessions):
            self._seen.clear()
        self._seen[sid] = sc
        if sessions.needs_trim():
            # A new conversation took the engine past its bound with records whose counts are not written yet (the
            # look-up above may not write on the event loop): written and evicted in a worker thread, now.
            await asyncio.to_thread(sessions.trim)
        return sc

    @staticmethod
    def _args(known: _Known, arguments: KernelArguments) -> dict[str, Any]:
        """The model's arguments of the call as JSON values (a new plain dict: KernelArguments is a dict subclass)."""
        params = known.params
        if params.issuperset(arguments):
            # All of them the model's, the common case. Exact str/int/float/bool/None values are what the conversion
            # would give back (the same objects): a plain copy is the same dict, without the converter's cost.
            for value in arguments.values():
                if type(value) not in _PLAIN:
                    break
            else:
                return dict(arguments)
            args: dict[str, Any] = to_jsonable_python(dict(arguments))
            return args
        args = to_jsonable_python({k: v for k, v in arguments.items() if k in params})
        return args

    def _unchanged(self, known: _Known, arguments: KernelArguments, handover: _Handover) -> bool:
        """Whether the call about to run is the call let through.

        The same value objects under the same model parameters (no conversion: the common case), else equal
        once converted to JSON.
        """
        let_through = handover.decision.args
        for k, v in let_through.items():
            if arguments.get(k, _MISSING) is not v:
                break
        else:
            if len(known.params & arguments.keys()) == len(let_through):
                return True
        approved = handover.approved
        if approved is None:
            approved = to_jsonable_python(dict(let_through))
        return self._args(known, arguments) == approved

    def _call_id(self, sid: str, name: str, tier: ToolTier, args: dict[str, Any], given: str | None) -> str:
        if tier is ToolTier.IRREVERSIBLE:
            # The model may propose the same call again in a later turn with a new id: it is the
            # same request, so it must not create a second approval.
            found = self.undolog.approvals.find_for_call(sid, name, args)
            if found is not None and found.call_id:
                return str(found.call_id)
        return given or f"sk:{uuid.uuid4().hex}"

    # ----------------------------------------------------------------- the call
    #
    # SK splits one call over two filters (see the module docstring), so the engine's sequence is in parts: a SAFE
    # call (without a retry policy) is decided whole by the inner filter, right before the function runs; any other
    # by _intercept (the decision, asked by whichever filter is the gate), then _run (run, then complete or fail).
    # The filters only route between them.

    async def _intercept(self, known: _Known, spec: ToolSpec, arguments: KernelArguments,
                         given_call_id: str | None) -> tuple[str, Execute | AwaitingApproval | Completed,
                                                             dict[str, Any]]:
        """Find the session and the call id, and ask the engine.

        Returns (session id, decision, the arguments asked about, as JSON values).

        Nothing here waits on the event loop: a SAFE call with a retry policy is decided in memory (the driver's
        ``safe``, as the inner filter decides the others), a COMPENSABLE one by the driver's ``adecide`` inline when
        nothing has to wait (the hot path with a free connection), else in a worker thread, like the session's
        creation at its first logged call and the look-up of an earlier approval.
        """
        name = known.name
        sid = self.session_id
        sc = self._seen.get(sid) or await self._cache(sid)  # (the look-up first: no coroutine for a known session)
        args = self._args(known, arguments)
        driver = self.undolog.driver
        if spec.tier is SAFE:
            values = driver.safe(spec, args, sc)
            return sid, execute_now(None, values, None, SAFE, name, given_call_id, sid), args
        if not sc.persisted:
            # The session's first logged call writes its row (with this filter's agent id): one insert, inline when
            # nothing has to wait (as the pre-write is), else in a worker thread, which also reads a session created
            # elsewhere meanwhile. Not fsynced where the database allows it (SQLite's WAL): the pre-write that
            # follows at once, before the tool runs, is a durable commit and makes the row durable with it; until
            # then nothing in the store refers to the row (a power loss before it loses a session with no call).
            # A per-conversation thread hop and fsync cost this step about what UndoLog's whole per-call bookkeeping
            # did (benchmarks/agent_step.py, "over its lower bound").
            sessions = self._sessions
            try:
                sessions.ensure_session(sid, agent_id=self.agent_id, fresh=True, durable=False, wait=False)
            except WouldBlock:
                await asyncio.to_thread(sessions.ensure_session, sid, agent_id=self.agent_id, fresh=True,
                                        durable=False)
        if spec.tier is IRREVERSIBLE:
            call_id = await asyncio.to_thread(self._call_id, sid, name, spec.tier, args, given_call_id)
        else:
            call_id = self._call_id(sid, name, spec.tier, args, given_call_id)
        return sid, await driver.adecide(sid, spec, args, call_id=call_id), args

    # ----------------------------------------------------------------- filters
    async def auto_function_invocation(self, context: AutoFunctionInvocationContext, next: Any) -> None:
        """AUTO_FUNCTION_INVOCATION filter: the gate under auto function calling."""
        function = context.function
        known = self._known.get(id(function))
        if known is None or known.function is not function:
            if not _is_tool(function):
                await next(context)
                return
            try:
                known = self._learn(function, context.kernel)
            except errors.UndoLogError as exc:
                context.function_result = _refusal(function, function.fully_qualified_name, exc)
                return
        filters = context.kernel.function_invocation_filters
        if not filters or filters[0][1] is not self.function_filter:  # (install()'s pairing: the common case)
            self._check_paired(filters)
        name = known.name
        spec = self._tools.get(name)  # (_spec's look-up, inline: the common case)
        if spec is None:
            try:
                spec = self._spec(name)
            except errors.UndoLogError as exc:
                context.function_result = _refusal(function, name, exc)
                return
        if spec.tier is SAFE and spec.retry is None:
            # Nothing to gate and nothing to record: the inner filter decides it (validated, pinned, counted) right
            # before the function runs, under the contract seen here (see _safe_calls).
            arguments = context.arguments
            key = id(arguments)
            safe_calls = self._safe_calls
            safe_calls[key] = (arguments, known, spec)
            try:
                await next(context)
            finally:
                if key in safe_calls:  # not taken: another filter answered, or put other arguments in the call
                    del safe_calls[key]
            return
        continuation = _continuation.get()
        if continuation is not None:
            try:
                hit = continuation.take(spec, self._args(known, context.arguments))
            except errors.UndoLogError as exc:
                context.function_result = _refusal(function, name, exc)
                return
            if hit is not None:
                context.function_result = FunctionResult(function=function.metadata,
                                                         value=f"{_text(hit.result)}\n{hit.note()}")
                return
        fcc = context.function_call_content
        given = fcc.id if fcc is not None else None
        sid = _session_var.get() or self.session_id
        sc = self._seen.get(sid)
        try:
            if spec.tier is COMPENSABLE and sc is not None and sc.persisted:
                # A COMPENSABLE call in a session already in the store (every call of a conversation but its first
                # logged one): _intercept's steps for it, written out. The engine decides it on the loop, as the
                # driver's adecide would (same call, wait=False), in a worker thread when that would wait; the
                # session's id was checked when this filter first saw it (look_up_session), so it is not again.
                # Inside an SK step each frame is cold: this saves eight, three of them coroutines.
                asked = self._args(known, context.arguments)
                call_id = given or f"sk:{uuid.uuid4().hex}"
                hot = self._hot
                try:
                    decision = hot.intercept_spec(sid, spec, asked, call_id, False, False)
                except WouldBlock:
                    decision = await asyncio.to_thread(hot.intercept_spec, sid, spec, asked, call_id)
            else:
                sid, decision, asked = await self._intercept(known, spec, context.arguments, given)
        except errors.UndoLogError as exc:
            context.function_result = _refusal(function, name, exc)
            return
        if isinstance(decision, AwaitingApproval):
            text = awaiting_text(name, decision.approval_request_id, decision.reason)
            context.function_result = FunctionResult(
                function=function.metadata, value=text,
                metadata={PLACEHOLDER_KEY: decision.approval_request_id, "undolog_session_id": sid},
            )
            # Not running the call and ending the loop hands control back to the app; resume() continues.
            context.terminate = True
            return
        if isinstance(decision, Completed):
            context.function_result = FunctionResult(function=function.metadata, value=decision.result)
            return
        context.arguments.update(decision.args)
        # The arguments let through, as JSON values: those asked about when validation kept them as they were (the
        # common case: one conversion fewer per call), else the validated ones converted.
        approved = asked if decision.args == asked else to_jsonable_python(dict(decision.args))
        handover = _Handover(name, decision, sid, approved=approved)
        token = _handover.set(handover)
        try:
            await next(context)
        finally:
            _handover.reset(token)
        if handover.failure_text is not None:
            # SK turned the function's exception into its own text; the model must learn what was undone.
            context.function_result = FunctionResult(function=function.metadata, value=handover.failure_text)
        if not handover.consumed and decision.effect_id is not None:
            # Another filter answered without running the function: nothing happened.
            self.undolog.driver.fail(decision.effect_id, RuntimeError("the function was not run (a filter answered)"))

    async def function_invocation(self, context: FunctionInvocationContext, next: Any) -> None:
        """FUNCTION_INVOCATION filter.

        Runs the tool; decides a SAFE call; the gate of any other under a plain ``kernel.invoke``.
        """
        arguments = context.arguments
        routed = self._safe_calls.pop(id(arguments), None) if self._safe_calls else None
        if routed is not None and type(next) is MethodType and next.__self__ is routed[1].function:
            # A SAFE call (no retry policy) the auto filter routed, taken, whose ``next`` is its own function's
            # method: nothing runs between this filter and the function (SK wraps any other filter inside this one
            # around it), so there is no filter list to read (install()'s order: the common case). Under the auto
            # gate a refusal answers the model, as the gate's would.
            _, known, spec = routed
            function = known.function
        elif routed is not None and routed[1].function is context.function:
            # The same, with something between this filter and the function: refused unless it is no filter.
            _, known, spec = routed
            function = known.function
            filters = context.kernel.function_invocation_filters
            if filters and filters[0][1] is not self.function_filter:
                self._check_innermost(filters, known.name)
        else:
            function = context.function
            if routed is not None:  # another call's (a filter between the halves passed its arguments on): left
                self._safe_calls[id(arguments)] = routed
                routed = None
            found = self._known.get(id(function))
            if found is None or found.function is not function:
                if not _is_tool(function):
                    await next(context)
                    return
                found = self._learn(function, context.kernel)
            known = found
            filters = context.kernel.function_invocation_filters
            if filters and filters[0][1] is not self.function_filter:
                self._check_innermost(filters, known.name)
            handover = _handover.get()
            if handover is not None and not handover.consumed and handover.name == known.name:
                handover.consumed = True
                decision = handover.decision
                let_through = decision.args
                # The same value objects under the same model parameters: the call let through (_unchanged's common
                # case, inline: a frame fewer on every logged call), else compared once converted.
                for k, v in let_through.items():
                    if arguments.get(k, _MISSING) is not v:
                        same = False
                        break
                else:
                    same = len(known.params & arguments.keys()) == len(let_through)
                if not same and not self._unchanged(known, arguments, handover):
                    # A filter between the gate and the function edited the call: it is not the call that was let
                    # through (approved, for an IRREVERSIBLE one), so it does not run.
                    if handover.decision.effect_id is not None:
                        self.undolog.driver.release(handover.decision)
                    raise errors.ConfigurationError(
                        f"UndoLog refused {known.name}: its arguments were changed after UndoLog's gate; it was NOT run"
                    )
                # (_run's steps, inline: a coroutine fewer on every logged call under auto function calling.)
                outcome = await self._driver.run_async(
                    decision, lambda _a: next(context),
                    result_of=lambda _out: context.result.value if context.result is not None else None, note=False,
                )
                if outcome.error is not None:
                    self._failed(context, decision, handover.session_id, outcome, handover)
                return
            spec = self._spec(known.name)
            if spec.tier is not SAFE or spec.retry is not None:
                await self._gate_plain(context, next, known, spec)
                return
        # A SAFE call's whole decision, here, after every other filter: validated (and converted) against its
        # contract, checked against the session's pin and counted in memory. No I/O once the session is known.
        try:
            sid = _session_var.get() or self.session_id
            sc = self._seen.get(sid) or await self._cache(sid)
            # The common case: only the model's parameters, each an exact str/int/float/bool/None of the type its
            # field keeps. Checked as they are, without a JSON conversion (it would give the same objects back)
            # and nothing to write back; else converted and validated (and converted) by the contract. (The
            # driver's safe_as_is, inline: one frame fewer on every SAFE call.)
            copy = spec._as_is_copy
            values = copy(arguments) if copy is not None and known.params.issuperset(arguments) else None
            if values is not None:
                self._hot.note_safe_in(sc, spec, values)
            else:
                arguments.update(self._driver.safe(spec, self._args(known, arguments), sc))
        except errors.UndoLogError as exc:
            if routed is None:  # under a plain invoke (or not routed here): raised
                raise
            context.result = _refusal(function, known.name, exc)
            return
        await next(context)  # nothing to record, whatever happens: its exception, if any, goes on untouched

    def _check_innermost(self, filters: list[tuple[int, Any]], name: str) -> None:
        """Refuse the call when another FUNCTION_INVOCATION filter runs inside UndoLog's.

        Such a filter (``kernel.function_invocation_filters``, the innermost first) could change the call after
        the check.
        """
        if not self._is_inner(filters[0][1]):
            raise errors.ConfigurationError(
                f"UndoLog refused {name}: another FUNCTION_INVOCATION filter runs inside UndoLog's and could change "
                "the call after its gate; call install(kernel, ...) after adding your own filters"
            )

    async def _gate_plain(self, context: FunctionInvocationContext, next: Any, known: _Known, spec: ToolSpec) -> None:
        """Gate a call under a plain ``kernel.invoke``.

        This filter is the gate of a COMPENSABLE or IRREVERSIBLE call there (or a SAFE one with a retry policy).

        Under automatic function calling with this half alone on the kernel (no AUTO_FUNCTION_INVOCATION twin: the
        one-liner most SK code writes), it is the gate there too, and answers the model itself: an exception would
        reach the model as SK's generic "An error occurred while invoking the function" and the approval request,
        the refusal or the rollback would be lost to it. The "awaiting approval" result carries the request id
        (``PLACEHOLDER_KEY``) as the auto filter's does, so :func:`resume` finds and runs the call once approved.
        """
        function = context.function
        auto = _under_auto_invocation() if self._alone(context.kernel) else None
        alone = auto is not None
        continuation = _continuation.get() if alone else None
        fcc = auto.function_call_content if auto is not None else None
        given = str(fcc.id) if fcc is not None and fcc.id else None
        try:
            if continuation is not None:
                hit = continuation.take(spec, self._args(known, context.arguments))
                if hit is not None:
                    context.result = FunctionResult(function=function.metadata,
                                                    value=f"{_text(hit.result)}\n{hit.note()}")
                    return
            sid, decision, _ = await self._intercept(known, spec, context.arguments, given)
        except errors.UndoLogError as exc:
            if not alone:
                raise
            context.result = _refusal(function, known.name, exc)
            return
        if isinstance(decision, AwaitingApproval):
            if not alone:
                raise ApprovalPending(decision.effect_id, decision.approval_request_id, decision.retry_after,
                                      known.name)
            context.result = FunctionResult(
                function=function.metadata, value=awaiting_text(known.name, decision.approval_request_id,
                                                                decision.reason),
                metadata={PLACEHOLDER_KEY: decision.approval_request_id, "undolog_session_id": sid},
            )
            return
        if isinstance(decision, Completed):
            context.result = FunctionResult(function=function.metadata, value=decision.result)
            return
        context.arguments.update(decision.args)
        if not alone:
            await self._run(context, next, decision, sid)
            return
        handover = _Handover(known.name, decision, sid)
        try:
            await self._run(context, next, decision, sid, handover)
        except Exception:
            if handover.failure_text is None:
                raise
            # What failed and what was undone, as the model's result (SK would give it its own generic text).
            context.result = FunctionResult(function=function.metadata, value=handover.failure_text)

    def _alone(self, kernel: Kernel) -> bool:
        """Whether this filter's AUTO_FUNCTION_INVOCATION twin is missing from ``kernel``."""
        return not any(f is self.auto_filter or f == self.auto_filter
                       for _, f in kernel.auto_function_invocation_filters)

    async def _run(self, context: FunctionInvocationContext, next: Any, decision: Execute, sid: str,
                   handover: _Handover | None = None) -> None:
        """Run the function under ``decision``, then complete its effect, or fail it (rolling back per policy).

        The function's own exception goes on as itself, annotated with the rollback's outcome.
        """
        outcome = await self.undolog.driver.run_async(
            decision, lambda _a: next(context),
            result_of=lambda _out: context.result.value if context.result is not None else None, note=False,
        )
        if outcome.error is not None:
            self._failed(context, decision, sid, outcome, handover)

    def _failed(self, context: FunctionInvocationContext, decision: Execute, sid: str, outcome: Outcome,
                handover: _Handover | None) -> NoReturn:
        """The function raised.

        Its own exception goes on, annotated with the rollback's outcome (and, under auto calling, what the
        model should read, on ``handover``).
        """
        exc = outcome.error
        assert exc is not None
        if decision.effect_id is None or not isinstance(exc, Exception):
            raise exc
        # The user's exception goes on unchanged (same object, same type); UndoLog only annotates it.
        name = context.function.fully_qualified_name
        text = rollback_outcome(outcome.rollback, sid, decision.effect_id)
        exc.add_note(f"undolog: {text}")
        setattr(exc, ROLLBACK_ATTR, outcome.rollback)
        if handover is not None:
            handover.failure_text = failure_text(name, f"{type(exc).__name__}: {exc}", text)
        raise exc

    def _spec(self, name: str) -> ToolSpec:
        """The tool's contract as registered now (a tool registered again is a new ToolSpec).

        The driver's look-up for a name the registry lacks, which raises ``ToolNotRegistered``.
        """
        return self._tools.get(name) or self.undolog.driver.spec(name)

    def _check_paired(self, filters: list[tuple[int, Any]]) -> None:
        """Refuse a kernel whose FUNCTION_INVOCATION filters lack the inner half.

        The filters are read from ``kernel.function_invocation_filters``.
        """
        if not any(self._is_inner(f) for _, f in filters):
            # Without the inner filter a SAFE call would run unchecked, and a tool exception would look like a
            # result and never be undone.
            raise errors.ConfigurationError(
                "UndoLogFilter: the AUTO_FUNCTION_INVOCATION filter needs its FUNCTION_INVOCATION twin on the "
                "same kernel: kernel.add_filter(FilterTypes.FUNCTION_INVOCATION, undolog_filter) last, or "
                "undolog_filter.install(kernel)"
            )


def install(kernel: Kernel, undolog: UndoLog, *, tiers: Mapping[str, TierValue] | None = None,
            compensations: Iterable[Callable[..., Any]] = (), session_id: str | None = None,
            agent_id: str = "semantic-kernel", strict: bool = True) -> UndoLogFilter:
    """Register UndoLog's FUNCTION_INVOCATION and AUTO_FUNCTION_INVOCATION filters on ``kernel``.

    Args:
        kernel: the kernel whose plugins are the tools.
        undolog: the :class:`UndoLog` to log into.
        tiers: ``"plugin-function"`` -> tier; overrides ``@undolog_tool`` on the kernel function.
        compensations: compensation functions to register (as for :class:`UndoLogFilter`).
        session_id: default session (see :class:`UndoLogFilter`).
        agent_id: recorded on new sessions.
        strict: refuse now if a kernel function has no tier (it would be refused at call time anyway).

    Returns:
        The installed :class:`UndoLogFilter`.

    Example:
        >>> kernel.add_plugin(Support(), plugin_name="support")                     # doctest: +SKIP
        >>> install(kernel, ul, tiers={"support-search_knowledge_base": "safe"})
    """
    return UndoLogFilter(undolog, tiers=tiers, compensations=compensations, session_id=session_id,
                         agent_id=agent_id).install(kernel, strict=strict)


async def invoke(kernel: Kernel, *args: Any, **kwargs: Any) -> FunctionResult | None:
    """``kernel.invoke`` that lets UndoLog's errors (``ApprovalPending``...) and the functions' own out unwrapped.

    ``Kernel.invoke`` wraps every exception in ``KernelInvokeException``. A COMPENSABLE/IRREVERSIBLE
    function's exception comes out as itself, after the rollback, with the outcome as a note and as
    ``exc.undolog_rollback``.

    Example:
        >>> try:                                                                  # doctest: +SKIP
        ...     await invoke(kernel, plugin_name="support", function_name="delete_user_account", user_id="u1")
        ... except ApprovalPending as p:
        ...     print(p.approval_request_id)
    """
    try:
        return await kernel.invoke(*args, **kwargs)
    except KernelInvokeException as exc:
        cause = exc.__cause__
        if cause is None or not (isinstance(cause, errors.UndoLogError) or hasattr(cause, ROLLBACK_ATTR)):
            raise
    # Raised outside the handler so that the exception keeps its own __cause__ and __context__.
    try:
        raise cause
    finally:
        del cause


def _text(value: Any) -> str:
    """A recorded result as SK gives a function's value to the model (its ``str``)."""
    return value if isinstance(value, str) else str(value)


def _history_continuation(undolog: UndoLog, history: ChatHistory, session_id: str | None) -> Continuation | None:
    """The committed effects of the calls ``history`` holds, for the calls of a resumed turn that repeat them."""
    if session_id is None:
        return None
    ids = [str(i.id) for m in history.messages for i in m.items if isinstance(i, FunctionCallContent) and i.id]
    if not ids:
        return None
    return Continuation.of_calls(undolog, session_id, ids)


def _placeholders(history: ChatHistory) -> list[FunctionResultContent]:
    return [i for m in history.messages for i in m.items
            if isinstance(i, FunctionResultContent) and PLACEHOLDER_KEY in (i.metadata or {})]


def _paused_session(history: ChatHistory) -> str | None:
    for frc in _placeholders(history):
        sid = frc.metadata.get("undolog_session_id")
        if sid:
            return str(sid)
    return None


async def resume_pending(kernel: Kernel, history: ChatHistory, undolog: UndoLog, *,
                         session_id: str | None = None) -> list[str]:
    """Replace "awaiting approval" placeholders by the real calls once every one is decided.

    Drops each placeholder result, then re-dispatches its function call through the kernel (the
    filter then runs it with the approved, possibly modified, arguments, or tells the model it
    was rejected or timed out).

    Returns:
        The approval request ids that were resumed (empty if there was nothing to resume).

    Raises:
        ApprovalPending: a request is still undecided and within its deadline; nothing was changed.
            A request past its deadline is timed out first (or auto-approved, per policy), never
            reported as pending.

    Example:
        >>> await resume_pending(kernel, history, ul, session_id="chat-42")         # doctest: +SKIP
    """
    holders = _placeholders(history)
    if not holders:
        return []
    for frc in holders:
        # approvals.get applies the timeout on read: a request past its deadline comes back timed out.
        record = undolog.approvals.get(frc.metadata[PLACEHOLDER_KEY])
        if record.state == RequestState.PENDING:
            left = record.seconds_left
            raise ApprovalPending(record.effect_id, record.approval_request_id, min(left, 30.0) if left else 1.0,
                                  record.tool_name)
    ids = {frc.id for frc in holders}
    sid = session_id or holders[0].metadata.get("undolog_session_id")
    calls = [i for m in history.messages for i in m.items if isinstance(i, FunctionCallContent) and i.id in ids]
    kept = []
    for m in history.messages:
        items = [i for i in m.items if not (isinstance(i, FunctionResultContent) and i.id in ids)]
        if items:
            m.items[:] = items
            kept.append(m)
    history.messages[:] = kept
    ctx = undolog_session(sid) if sid else contextlib.nullcontext()
    with ctx:
        for fcc in calls:
            await kernel.invoke_function_call(fcc, history, function_behavior=FunctionChoiceBehavior.Auto())
    return [str(frc.metadata[PLACEHOLDER_KEY]) for frc in holders]


async def resume(kernel: Kernel, history: ChatHistory, chat_service: Any, undolog: UndoLog, *,
                 settings: PromptExecutionSettings | None = None, session_id: str | None = None) -> Any:
    """Resume a chat paused for approval: :func:`resume_pending`, then ask the model to continue.

    Returns:
        The model's next message (``get_chat_message_content``).

    Raises:
        ApprovalPending: a request is still undecided; nothing was changed.

    Example:
        >>> ul.approvals.approve(request_id, approver="ana")                             # doctest: +SKIP
        >>> reply = await resume(kernel, history, chat, ul, session_id="chat-42")
    """
    session_id = session_id or _paused_session(history)
    await resume_pending(kernel, history, undolog, session_id=session_id)
    settings = settings or PromptExecutionSettings(function_choice_behavior=FunctionChoiceBehavior.Auto())
    ctx = undolog_session(session_id) if session_id else contextlib.nullcontext()
    token = _continuation.set(_history_continuation(undolog, history, session_id))
    try:
        with ctx:
            return await chat_service.get_chat_message_content(history, settings, kernel=kernel)
    finally:
        _continuation.reset(token)


async def resume_agent(agent: Any, thread: Any, undolog: UndoLog, *, session_id: str | None = None) -> Any:
    """Resume a ``ChatCompletionAgent`` thread paused for approval; returns ``agent.get_response``.

    Example:
        >>> response = await resume_agent(agent, thread, ul, session_id=thread.id)      # doctest: +SKIP
    """
    # ChatHistoryAgentThread keeps its history privately; it is the history the agent reads next turn.
    history: ChatHistory = thread._chat_history
    session_id = session_id or _paused_session(history)
    await resume_pending(agent.kernel, history, undolog, session_id=session_id)
    ctx = undolog_session(session_id) if session_id else contextlib.nullcontext()
    token = _continuation.set(_history_continuation(undolog, history, session_id))
    try:
        with ctx:
            return await agent.get_response(thread=thread)
    finally:
        _continuation.reset(token)
