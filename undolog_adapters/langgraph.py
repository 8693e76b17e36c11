"""UndoLog for LangGraph and LangChain agents: a drop-in ``ToolNode`` and a ``create_agent`` middleware.

Every tool call the graph makes goes through UndoLog's engine first:

* SAFE tools run freely;
* COMPENSABLE tools run with an undo entry; if one fails, the session is rolled back per policy and
  the model is told what was undone;
* IRREVERSIBLE tools pause the graph with LangGraph's own ``interrupt()`` until a person decides,
  either in the resume value (``Command(resume={"decision": "approve", "approver": "ana"})``) or
  elsewhere (CLI, REST, dashboard) followed by ``Command(resume=undolog_resume(graph, config))``.

The UndoLog session is the LangGraph thread (``thread_id``) and the tool call id is UndoLog's
``call_id``: LangGraph re-runs a whole interrupted node on resume, and UndoLog's call-id
de-duplication turns each re-run call into a replay of the stored result (or of the same pending
approval request), so nothing runs twice.

Example:
    >>> from undolog_adapters.langgraph import UndoLogMiddleware, UndoLogToolNode
    >>> builder.add_node("tools", UndoLogToolNode(tools, undolog=undolog))        # doctest: +SKIP
    >>> agent = create_agent(model, tools, middleware=[UndoLogMiddleware(undolog)],  # doctest: +SKIP
    ...                      checkpointer=saver)
"""

from __future__ import annotations

import contextvars
import datetime as dt
import functools
import inspect
import json
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

try:
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import BaseTool
    from langgraph.config import get_config
    from langgraph.errors import GraphBubbleUp
    from langgraph.prebuilt import ToolNode
    from langgraph.types import Command, interrupt
except ImportError as exc:  # pragma: no cover - exercised only without the extra installed
    raise ImportError(
        "undolog_adapters.langgraph needs LangGraph and LangChain, which are not installed: "
        "pip install 'undolog[langgraph]'"
    ) from exc

try:
    from langchain.agents.middleware import AgentMiddleware, hook_config

    _HAVE_LANGCHAIN = True
except ImportError:  # pragma: no cover - langgraph without the langchain package
    _HAVE_LANGCHAIN = False
    AgentMiddleware = object  # type: ignore[assignment,misc]

    def hook_config(**_: Any) -> Callable[[Any], Any]:  # type: ignore[no-redef]
        return lambda f: f


from pydantic import BaseModel, ConfigDict, model_validator

from undolog_core import ToolTier, errors
from undolog_core._engine import AwaitingApproval, Completed, Execute
from undolog_core._tools import CompensationDescriptor, compensation, tool_name_of

if TYPE_CHECKING:
    from langchain_core.runnables import RunnableConfig
    from langgraph.runtime import Runtime

    from undolog_core import UndoLog

__all__ = [
    "APPROVAL_INTERRUPT_TYPE",
    "ApprovalDecision",
    "UndoLogMiddleware",
    "UndoLogPolicy",
    "UndoLogToolNode",
    "arollback",
    "aresume_decided",
    "aundolog_resume",
    "new_session",
    "resume_decided",
    "rollback",
    "session_for_thread",
    "undolog_resume",
]

APPROVAL_INTERRUPT_TYPE = "undolog.approval_request"
_SEP = "#"  # thread "t1" -> sessions "t1", "t1#2", "t1#3"... (a new one after each rollback)


# --------------------------------------------------------------------------------------------------
# Tier mapping for tools that cannot carry @undolog_tool
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UndoLogPolicy:
    """The tier of a third-party tool, given in ``tiers=`` where ``@undolog_tool`` cannot be applied.

    A bare ``ToolTier`` is enough for SAFE and IRREVERSIBLE tools; COMPENSABLE ones need their undo.

    Args:
        tier: ``ToolTier.SAFE``, ``COMPENSABLE`` or ``IRREVERSIBLE`` (or its string value).
        compensation: for COMPENSABLE tools: a function ``fn(ctx)`` (an ``@compensation`` function, or a
            plain one, registered under its ``__name__``), or the name of a registered compensation.
        reason: for IRREVERSIBLE tools, why; shown to the approver.
        risk_tags: labels used to route approvals, e.g. ``["pii"]``.

    Example:
        >>> tiers = {
        ...     "search": ToolTier.SAFE,
        ...     "send_refund_email": UndoLogPolicy(ToolTier.COMPENSABLE, compensation=cancel_refund_email),
        ...     "delete_user_account": UndoLogPolicy(ToolTier.IRREVERSIBLE, reason="erases the customer"),
        ... }
        >>> node = UndoLogToolNode(tools, undolog=undolog, tiers=tiers)  # doctest: +SKIP
    """

    tier: ToolTier | str
    compensation: Callable[..., Any] | str | CompensationDescriptor | None = None
    reason: str | None = None
    risk_tags: Sequence[str] = ()


# --------------------------------------------------------------------------------------------------
# Resume values
# --------------------------------------------------------------------------------------------------


class ApprovalDecision(BaseModel):
    """A decision passed in ``Command(resume=...)``.

    ``approve``/``reject``/``modify`` are recorded through UndoLog's approval service (audited) under
    ``approver``; ``from_store`` means "use whatever was decided elsewhere" (what ``undolog_resume``
    sends for requests still undecided, which pauses the graph again).

    Example:
        >>> Command(resume={"decision": "modify", "args": {"user_id": "u-7"}, "approver": "ana"})  # doctest: +SKIP
    """

    model_config = ConfigDict(extra="forbid")

    decision: Literal["approve", "reject", "modify", "from_store"]
    approver: str | None = None
    reason: str | None = None
    args: dict[str, Any] | None = None
    approval_request_id: str | None = None

    @model_validator(mode="after")
    def _complete(self) -> ApprovalDecision:
        # Checked here, before LangGraph stores the value, so a bad resume can simply be sent again.
        if self.decision != "from_store" and not (self.approver and self.approver.strip()):
            raise ValueError("a decision needs 'approver' (who decided; it goes into the audit trail)")
        if self.decision == "reject" and not (self.reason and self.reason.strip()):
            raise ValueError("a rejection needs a 'reason' (the agent is told it)")
        if self.decision == "modify" and self.args is None:
            raise ValueError("'modify' needs 'args': the complete edited arguments")
        if self.decision != "modify" and self.args is not None:
            raise ValueError("'args' goes with decision 'modify' only")
        return self


class ApprovalDecisions(BaseModel):
    """Decisions for an interrupt holding several requests (a hand-built graph's ToolNode task).

    ``{"decisions": {approval_request_id or tool_call_id: decision, ...}}``. The map is wrapped in
    ``decisions`` because LangGraph reads a top-level map of 32-hex-digit keys (as approval request
    ids are) as ``{interrupt_id: value}``.

    Example:
        >>> Command(resume={"decisions": {req_a: {"decision": "approve", "approver": "ana"},
        ...                               req_b: {"decision": "reject", "approver": "ana",
        ...                                       "reason": "wrong user"}}})  # doctest: +SKIP
    """

    model_config = ConfigDict(extra="forbid")

    decisions: dict[str, ApprovalDecision]

    @model_validator(mode="before")
    @classmethod
    def _not_single(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and "decision" in data:
            raise ValueError(
                "this interrupt holds several approval requests: resume with "
                "{'decisions': {approval_request_id: {'decision': ..., 'approver': ...}, ...}}"
            )
        return data


_ONE = ApprovalDecision | ApprovalDecisions


# --------------------------------------------------------------------------------------------------
# Per-node-run state for UndoLogToolNode: approvals are collected, then asked for in one interrupt
# --------------------------------------------------------------------------------------------------


@dataclass
class _Batch:
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

# The qualified name LangChain gives the handler of a middleware that has other tool-call wrappers inside it.
_INNER_WRAPPERS = "compose_two.<locals>.composed.<locals>.call_inner"

# Adapters alive in this process, so module-level helpers can find "the" UndoLog when there is one.
_ADAPTERS: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass(frozen=True)
class _Run:
    execute: Execute
    session_id: str


@dataclass(frozen=True)
class _Reply:
    message: ToolMessage


@dataclass(frozen=True)
class _Pause:
    awaiting: AwaitingApproval
    session_id: str


class _Box:
    """Holds the raw return value of one tool run (LangChain turns it into message text)."""

    __slots__ = ("value", "set")

    def __init__(self) -> None:
        self.value: Any = None
        self.set = False


# --------------------------------------------------------------------------------------------------
# The guard shared by the node and the middleware
# --------------------------------------------------------------------------------------------------


class _Guard:
    def __init__(
        self,
        undolog: UndoLog,
        *,
        tiers: Mapping[str, ToolTier | str | UndoLogPolicy] | None,
        compensations: Iterable[Callable[..., Any]],
        agent_id: str,
        on_failure: str,
        session_id: Callable[[Mapping[str, Any]], str] | None,
    ) -> None:
        if undolog is None:
            raise errors.ConfigurationError("pass the UndoLog instance: undolog=UndoLog.open(...)")
        self.u = undolog
        self.tiers = dict(tiers or {})
        self.agent_id = agent_id
        self.on_failure = on_failure
        self.session_fn = session_id
        self.names: dict[str, str] = {}  # LangChain tool name -> UndoLog tool name
        self.heads: dict[str, int] = {}
        self.lock = threading.Lock()
        self.create_lock = threading.Lock()
        if compensations:
            self.u.register(*compensations)

    # -- classification ------------------------------------------------------------------------------

    def classify(self, tools: Iterable[Any]) -> None:
        """Register every tool with UndoLog; raise ``ToolNotClassified`` naming the first without a tier."""
        batch: list[tuple[str, Any]] = []
        for tool in tools:
            if isinstance(tool, Mapping):
                # A provider-side tool (a dict) runs at the provider, out of UndoLog's reach.
                name = str(tool.get("name") or tool.get("type") or tool)
                policy = self.tiers.get(name)
                if policy is None or _tier_of(policy) is not ToolTier.SAFE:
                    raise errors.ToolNotClassified(name)
                continue
            name = tool.name if isinstance(tool, BaseTool) else tool_name_of(tool)
            if name in self.names:
                continue
            batch.append((name, tool))
        missing = [
            n for n, t in batch
            if n not in self.tiers and _declaration(_function_of(t)) is None and _declaration(t) is None
            and not self._known(n)
        ]
        if missing:
            raise errors.ToolNotClassified(missing[0])
        for name, tool in batch:
            self.names[name] = self._register(name, tool)

    def _known(self, name: str) -> bool:
        try:
            self.u.tool_spec(name)
            return True
        except errors.ToolNotRegistered:
            return False

    def _register(self, name: str, tool: Any) -> str:
        fn = _function_of(tool)
        policy = self.tiers.get(name)
        if policy is not None:
            p = policy if isinstance(policy, UndoLogPolicy) else UndoLogPolicy(policy)
            comp = p.compensation
            if callable(comp) and not isinstance(comp, CompensationDescriptor):
                comp = self._register_compensation(comp)
            elif isinstance(comp, CompensationDescriptor):
                comp = comp.name
            schema = getattr(tool, "tool_call_schema", None) if isinstance(tool, BaseTool) else None
            self.u.register_tool(
                fn if fn is not None else tool,
                name=name,
                tier=ToolTier.coerce(p.tier),
                compensation=comp,
                reason=p.reason,
                risk_tags=list(p.risk_tags),
                args_schema=schema,
            )
            return name
        target = fn if _declaration(fn) is not None else tool
        if _declaration(target) is not None:
            spec = self.u.register(target)
            specs = spec if isinstance(spec, list) else [spec]
            return str(getattr(specs[0], "name", name)) if specs and specs[0] is not None else name
        return name  # registered with this UndoLog by the application itself

    def _register_compensation(self, fn: Callable[..., Any]) -> str:
        decl = getattr(fn, "__undolog_compensation__", None)
        if decl is None:
            user_fn = fn
            name = getattr(user_fn, "__name__", "compensation")
            if inspect.iscoroutinefunction(user_fn):

                async def wrapper(ctx: Any) -> Any:
                    return await user_fn(ctx)

            else:

                def wrapper(ctx: Any) -> Any:  # type: ignore[misc]
                    return user_fn(ctx)

            # A wrapper carries the declaration, so the user's own function is not modified.
            fn = compensation(name)(wrapper)
            decl = fn.__undolog_compensation__  # type: ignore[attr-defined]
        self.u.register(fn)
        return str(decl.name)

    def undolog_name(self, request: Any) -> str | None:
        return self.names.get(request.tool_call["name"])

    # -- sessions --------------------------------------------------------------------------------------

    def base_id(self, config: Mapping[str, Any]) -> str:
        conf = config.get("configurable") or {}
        if conf.get("undolog_session_id"):
            return str(conf["undolog_session_id"])
        if self.session_fn is not None:
            return str(self.session_fn(config))
        tid = conf.get("thread_id")
        if tid is None:
            raise errors.ConfigurationError(
                "UndoLog keeps one session per LangGraph thread: run the graph with a checkpointer and "
                "config={'configurable': {'thread_id': ...}}"
            )
        return str(tid)

    def head(self, base: str, *, refresh: bool = False) -> str:
        """The thread's current session id (the newest of ``base``, ``base#2``...), created if new."""
        with self.lock:
            n = self.heads.get(base)
        if n is not None and not refresh:
            return _chain(base, n)
        # One creator per process: ToolNode runs a message's calls on parallel threads.
        with self.create_lock:
            n = n or 1
            while True:
                try:
                    self.u.sessions.get(_chain(base, n + 1))
                    n += 1
                except errors.SessionNotFound:
                    break
            sid = _chain(base, n)
            # Created here with our agent id and failure policy, before any call can create it implicitly.
            self.u.engine.ensure_session(sid, agent_id=self.agent_id, on_failure=self.on_failure)
            with self.lock:
                self.heads[base] = n
        return sid

    def advance(self, base: str) -> str:
        """Open the thread's next session (after its current one was rolled back or completed)."""
        current = self.head(base, refresh=True)
        n = _chain_index(base, current) + 1
        sid = _chain(base, n)
        self.u.engine.ensure_session(sid, agent_id=self.agent_id, on_failure=self.on_failure)
        with self.lock:
            self.heads[base] = n
        return sid

    def session_state(self, sid: str) -> Any:
        try:
            return self.u.sessions.get(sid)
        except errors.SessionNotFound:
            return None

    # -- one call ------------------------------------------------------------------------------------

    def prepare(self, request: Any, config: Mapping[str, Any]) -> _Run | _Reply | _Pause:
        call = request.tool_call
        name = self.names[call["name"]]
        base = self.base_id(config)
        sid = self.head(base)
        try:
            d = self.u.engine.intercept(sid, name, dict(call.get("args") or {}), call_id=call.get("id"))
        except errors.SessionClosed:
            sid = self._after_close(base, sid, request)
            if sid is None:
                raise
            d = self.u.engine.intercept(sid, name, dict(call.get("args") or {}), call_id=call.get("id"))
        if isinstance(d, Completed):
            return _Reply(self._message(request, _content_of(d.result), meta={"effect_id": d.effect_id,
                                                                             "replayed": True}))
        if isinstance(d, AwaitingApproval):
            return _Pause(d, sid)
        return _Run(d, sid)

    def _after_close(self, base: str, sid: str, request: Any) -> str | None:
        """A call on a rolled-back/completed session: a new plan gets a new session, the old plan none."""
        known = {e.get("call_id") for e in self.u.sessions.effects(sid)}
        siblings = _sibling_call_ids(request)
        if known & siblings:
            return None  # this call belongs to the plan that was undone: it must not run now
        return self.advance(base)

    def refusal(self, request: Any, exc: errors.UndoLogError, sid: str | None = None) -> ToolMessage:
        tool = request.tool_call["name"]
        if isinstance(exc, errors.ApprovalRejected):
            text = (
                f"UndoLog: {tool} was NOT run. Approval request {exc.approval_request_id} was rejected by "
                f"{exc.approver or 'a person'}: {exc.reason or 'no reason given'}. The session is halted until a "
                "person resumes or rolls it back; do not retry this action."
            )
        elif isinstance(exc, errors.ApprovalTimedOut):
            rec = self._approval(exc.approval_request_id)
            when = f" at {rec.timeout_at.isoformat(timespec='seconds')}" if rec is not None else ""
            text = (
                f"UndoLog: {tool} was NOT run. Approval request {exc.approval_request_id} timed out{when} "
                "without a decision from a person. The session is halted until a person resolves it; do not "
                "retry this action."
            )
        elif isinstance(exc, errors.ApprovalCancelled):
            text = f"UndoLog: {tool} was NOT run. {exc.message}."
        elif isinstance(exc, errors.SessionClosed):
            text = (
                f"UndoLog refused {tool}: {exc.message}. The earlier steps of this plan were undone, so "
                "this one was not run."
            )
        else:
            text = f"UndoLog refused {tool}: {exc.message}"
        return self._message(request, text, status="error", meta={"refused": exc.code})

    def _approval(self, approval_request_id: str) -> Any:
        try:
            return self.u.approvals.get(approval_request_id)
        except errors.UndoLogError:
            return None

    def runnable(self, request: Any, run: _Run) -> tuple[Any, _Box]:
        box = _Box()
        call = request.tool_call
        overrides: dict[str, Any] = {}
        if dict(call.get("args") or {}) != run.execute.args:
            overrides["tool_call"] = {**call, "args": dict(run.execute.args)}
        if request.tool is not None:
            tool = _capturing(request.tool, box)
            if tool is not request.tool:
                overrides["tool"] = tool
        return (request.override(**overrides) if overrides else request), box

    def finished(self, request: Any, run: _Run, out: Any, box: _Box) -> Any:
        d = run.execute
        if d.effect_id is None:
            return out
        if isinstance(out, ToolMessage) and out.status == "error":
            # The tool raised and ToolNode's handle_tool_errors turned it into a message: still a failure.
            report = self.u.driver.fail(d.effect_id, f"{request.tool_call['name']} failed: {out.content}")
            return self._failure_message(request, str(out.content), report, run.session_id, d.effect_id)
        result = box.value if box.set else _result_of(out)
        self.u.engine.complete(d.effect_id, result)
        if isinstance(out, ToolMessage):
            meta = dict(out.response_metadata or {})
            meta["undolog"] = {"tier": d.tier.value, "effect_id": d.effect_id, "session_id": run.session_id}
            return out.model_copy(update={"response_metadata": meta})
        return out

    def released(self, run: _Run) -> None:
        if run.execute.effect_id is not None:
            self.u.engine.release(run.execute.effect_id)

    def failed(self, request: Any, run: _Run, exc: Exception) -> ToolMessage:
        d = run.execute
        if d.effect_id is None:
            raise exc  # SAFE: ToolNode's own error handling already decided to raise it
        try:
            report = self.u.driver.fail(d.effect_id, exc)
        except Exception as book:  # noqa: BLE001 - the user's exception wins; ours is attached to it
            exc.add_note(f"undolog: could not record the failure of effect {d.effect_id}: {book!r}")
            raise exc from None
        return self._failure_message(request, f"{type(exc).__name__}: {exc}", report, run.session_id, d.effect_id)

    def _failure_message(self, request: Any, error: str, report: Any, sid: str, failed_id: str) -> ToolMessage:
        tool = request.tool_call["name"]
        text = f"{tool} failed: {error}."
        steps: list[dict[str, Any]] = []
        if report is None:
            text += f" UndoLog recorded the failure; session {sid} keeps its earlier steps (policy: continue)."
        else:
            steps = [dict(s.__dict__) for s in report.steps]
            # The failed call's own compensation runs too, in case it partly happened; it undid no success.
            undone = [s for s in report.steps
                      if s.outcome in ("compensated", "already_compensated") and s.effect_id != failed_id]
            broken = [s for s in report.steps if s.outcome not in ("compensated", "already_compensated")]
            if undone:
                text += " UndoLog rolled the session back, newest first: " + "; ".join(
                    f"{s.compensation_name} undid {s.tool_name} (effect {s.effect_id[:8]})" for s in undone
                ) + "."
            else:
                text += " UndoLog rolled the session back; no earlier step needed undoing."
            for s in broken:
                text += (
                    f" {s.compensation_name} could NOT undo {s.tool_name} (effect {s.effect_id[:8]}): {s.error}."
                )
            if getattr(report, "kept_irreversible", None):
                text += f" Irreversible steps stay done: {', '.join(report.kept_irreversible)}."
            if not report.complete:
                text += (
                    f" The rollback is incomplete ({report.halted_reason or 'a compensation failed'}); the session "
                    "is halted and a person must check."
                )
            text += " Tell the user plainly what happened; do not retry."
        return self._message(request, text, status="error", meta={"failed": True, "rollback": steps,
                                                                   "session_id": sid, "effect_id": failed_id})

    def _message(self, request: Any, content: Any, *, status: str = "success",
                 meta: dict[str, Any] | None = None) -> ToolMessage:
        call = request.tool_call
        return ToolMessage(
            content=content,
            name=call["name"],
            tool_call_id=call["id"],
            status=status,
            response_metadata={"undolog": meta or {}},
        )

    # -- approvals -------------------------------------------------------------------------------------

    def payload(self, pauses: Sequence[_Pause], error: str | None) -> dict[str, Any]:
        reqs = [
            {
                "approval_request_id": p.awaiting.approval_request_id,
                "tool_call_id": p.awaiting.call_id,
                "tool": p.awaiting.tool_name,
                "args": dict(p.awaiting.args),
                "reason": p.awaiting.reason,
                "risk_tags": list(p.awaiting.risk_tags),
                "timeout_at": _iso(p.awaiting.timeout_at),
                "effect_id": p.awaiting.effect_id,
            }
            for p in pauses
        ]
        hint = (
            "Command(resume={'decision': 'approve'|'reject'|'modify', 'approver': '<who>', 'reason': '...', "
            "'args': {...}})"
            if len(reqs) == 1
            else "Command(resume={'decisions': {<approval_request_id>: {'decision': ..., 'approver': ...}, ...}})"
        )
        return {
            "type": APPROVAL_INTERRUPT_TYPE,
            "session_id": pauses[0].session_id,
            **reqs[0],
            "requests": reqs,
            "resume_with": hint + " or decide elsewhere and resume with undolog_resume(graph, config)",
            "error": error,
        }

    def ask(self, pauses: Sequence[_Pause], error: str | None) -> str | None:
        """Pause the graph for ``pauses``; on resume, record the decisions and return any problem."""
        value = interrupt(self.payload(pauses, error), response_schema=_ONE if len(pauses) == 1 else ApprovalDecisions)
        return self.apply(value, [p.awaiting for p in pauses])

    def apply(self, value: Any, pending: Sequence[AwaitingApproval]) -> str | None:
        if isinstance(value, ApprovalDecisions):
            value = value.decisions
        pairs: list[tuple[AwaitingApproval, ApprovalDecision]] = []
        problems: list[str] = []
        if isinstance(value, ApprovalDecision):
            pairs = [(pending[0], value)]
        else:
            for a in pending:
                dec = value.get(a.approval_request_id) or (value.get(a.call_id) if a.call_id else None)
                if dec is not None:
                    pairs.append((a, dec))
            if not pairs:
                problems.append(
                    "no decision matched a pending request; key the map by approval_request_id (or tool_call_id)"
                )
        # Approvals before rejections: a rejection halts the session and cancels what is still pending.
        pairs.sort(key=lambda p: p[1].decision == "reject")
        for a, dec in pairs:
            if dec.decision == "from_store":
                continue
            if dec.approval_request_id and dec.approval_request_id != a.approval_request_id:
                problems.append(
                    f"the decision names request {dec.approval_request_id}, but the pending one is "
                    f"{a.approval_request_id} ({a.tool_name})"
                )
                continue
            try:
                if dec.decision == "approve":
                    self.u.approvals.approve(a.approval_request_id, approver=dec.approver, reason=dec.reason)
                elif dec.decision == "reject":
                    self.u.approvals.reject(a.approval_request_id, approver=dec.approver, reason=dec.reason)
                else:
                    self.u.approvals.modify(a.approval_request_id, approver=dec.approver, args=dec.args or {},
                                            reason=dec.reason)
            except errors.ApprovalAlreadyDecided:
                continue  # decided elsewhere first (or on an earlier run): the store is the authority
            except errors.UndoLogError as exc:
                problems.append(f"{a.tool_name} ({a.approval_request_id}): {exc.message}")
        return "; ".join(problems) or None


# --------------------------------------------------------------------------------------------------
# The wrapper logic, sync and async
# --------------------------------------------------------------------------------------------------


def _config_of(request: Any) -> Mapping[str, Any]:
    rt = getattr(request, "runtime", None)
    cfg = getattr(rt, "config", None)
    return cfg if cfg else get_config()


def _wrap(guard: _Guard, request: Any, execute: Callable[[Any], Any]) -> Any:
    if request.tool is None:
        return execute(request)  # an unknown tool name: ToolNode answers with its own error, nothing runs
    if guard.undolog_name(request) is None:
        guard.classify([request.tool])  # raises ToolNotClassified: nothing runs unclassified
    batch = _BATCH.get()
    call_id = request.tool_call.get("id")
    if batch is not None and call_id in batch.done:
        return batch.done[call_id]
    config = _config_of(request)
    error: str | None = None
    gated = batch.gated.pop(call_id, None) if batch is not None and call_id else None
    while True:
        try:
            step = gated if gated is not None else guard.prepare(request, config)
        except _REFUSED as exc:
            return _remember(batch, call_id, guard.refusal(request, exc))
        gated = None
        if isinstance(step, ToolMessage):
            return _remember(batch, call_id, step)
        if isinstance(step, _Reply):
            return _remember(batch, call_id, step.message)
        if isinstance(step, _Pause):
            if batch is not None:
                with batch.lock:
                    batch.pending[call_id] = (step.awaiting, step.session_id)
                return guard.refusal(request, errors.UndoLogError("waiting for approval"))
            error = guard.ask([step], error)
            continue
        req, box = guard.runnable(request, step)
        admit = _Admit(req.tool_call["name"], dict(req.tool_call.get("args") or {}), req.tool,
                       step.execute.effect_id is not None)
        token = _ADMIT.set(admit)
        with guard.u.engine.running(step.execute, step.session_id):
            try:
                out = execute(req)
            except GraphBubbleUp:
                # LangGraph control flow (an interrupt inside the tool): never a failure. The call is handed
                # back without an outcome; LangGraph re-runs it on resume under the same call id and effect.
                guard.released(step)
                raise  # LangGraph control flow (an interrupt inside the tool): never a failure
            except Exception as exc:  # noqa: BLE001 - recorded, then re-raised or turned into the rollback message
                return _remember(batch, call_id, guard.failed(request, step, exc))
            finally:
                _ADMIT.reset(token)
        return _remember(batch, call_id, guard.finished(request, step, out, box))


async def _awrap(guard: _Guard, request: Any, execute: Callable[[Any], Any]) -> Any:
    if request.tool is None:
        return await execute(request)
    if guard.undolog_name(request) is None:
        guard.classify([request.tool])
    batch = _BATCH.get()
    call_id = request.tool_call.get("id")
    if batch is not None and call_id in batch.done:
        return batch.done[call_id]
    config = _config_of(request)
    error: str | None = None
    gated = batch.gated.pop(call_id, None) if batch is not None and call_id else None
    while True:
        try:
            step = gated if gated is not None else guard.prepare(request, config)
        except _REFUSED as exc:
            return _remember(batch, call_id, guard.refusal(request, exc))
        gated = None
        if isinstance(step, ToolMessage):
            return _remember(batch, call_id, step)
        if isinstance(step, _Reply):
            return _remember(batch, call_id, step.message)
        if isinstance(step, _Pause):
            if batch is not None:
                with batch.lock:
                    batch.pending[call_id] = (step.awaiting, step.session_id)
                return guard.refusal(request, errors.UndoLogError("waiting for approval"))
            error = guard.ask([step], error)
            continue
        req, box = guard.runnable(request, step)
        admit = _Admit(req.tool_call["name"], dict(req.tool_call.get("args") or {}), req.tool,
                       step.execute.effect_id is not None)
        token = _ADMIT.set(admit)
        with guard.u.engine.running(step.execute, step.session_id):
            try:
                out = await execute(req)
            except GraphBubbleUp:
                # LangGraph control flow (an interrupt inside the tool): never a failure. The call is handed
                # back without an outcome; LangGraph re-runs it on resume under the same call id and effect.
                guard.released(step)
                raise
            except Exception as exc:  # noqa: BLE001
                return _remember(batch, call_id, guard.failed(request, step, exc))
            finally:
                _ADMIT.reset(token)
        return _remember(batch, call_id, guard.finished(request, step, out, box))


_REFUSED = (errors.ApprovalRejected, errors.ApprovalTimedOut, errors.ApprovalCancelled, errors.SessionHalted,
            errors.SessionClosed, errors.ArgumentsInvalid)


def _admitted(request: Any) -> ToolMessage | None:
    """None if ``request`` is exactly the call UndoLog let through (and not run yet), else the refusal.

    Checked at the innermost ``execute``: a wrapper inside UndoLog's could otherwise switch the tool or
    its arguments after the gate (LangChain #40166) or run a logged call a second time.
    """
    admit = _ADMIT.get()
    call = request.tool_call
    problem = None
    if admit is None:
        problem = "it was not let through UndoLog's gate"
    elif call["name"] != admit.name or request.tool is not admit.tool:
        problem = f"a wrapper switched the call from {admit.name} to {call['name']} after UndoLog's gate"
    elif dict(call.get("args") or {}) != admit.args:
        problem = "a wrapper changed its arguments after UndoLog's gate"
    elif admit.logged and admit.runs:
        problem = "a wrapper tried to run it a second time"
    if problem is None:
        admit.runs += 1
        return None
    return ToolMessage(content=f"UndoLog refused {call['name']}: {problem}. It was NOT run.", name=call["name"],
                       tool_call_id=call["id"], status="error", response_metadata={"undolog": {"refused": "bypass"}})


def _remember(batch: _Batch | None, call_id: str | None, out: Any) -> Any:
    if batch is not None and call_id:
        with batch.lock:
            batch.done[call_id] = out
    return out


@dataclass(frozen=True)
class _GateRequest:
    """Enough of a ``ToolCallRequest`` for the gate pass, which runs before ToolNode builds the real ones."""

    tool_call: Any
    state: Any


# --------------------------------------------------------------------------------------------------
# The node
# --------------------------------------------------------------------------------------------------


class UndoLogToolNode(ToolNode):
    """``langgraph.prebuilt.ToolNode`` with every call routed through UndoLog.

    Tools without a tier are refused here, at construction, before anything runs. All approvals
    needed by one model message are asked for in one ``interrupt()`` (ToolNode runs the calls of a
    message as one task, and LangGraph matches resume values to interrupts by order within a task);
    calls already run are replayed from the log on resume, never run again.

    Args:
        tools: LangChain tools or plain functions, as for ``ToolNode``.
        undolog: the ``UndoLog`` instance.
        tiers: tiers for tools without ``@undolog_tool``: ``{name: ToolTier | UndoLogPolicy}``.
        compensations: ``@compensation`` functions to register (those of decorated tools).
        agent_id: recorded on the sessions this node opens.
        on_failure: ``"rollback"`` (default) or ``"continue"`` when a COMPENSABLE/IRREVERSIBLE tool fails.
        session_id: ``fn(config) -> str`` if the session is not the thread id; a run can also pass
            ``configurable={"undolog_session_id": ...}``.
        wrap_tool_call / awrap_tool_call: your own wrappers; they run inside UndoLog's.
        **kwargs: passed on to ``ToolNode`` (``name``, ``handle_tool_errors``, ``messages_key``...).

    Example:
        >>> builder.add_node("tools", UndoLogToolNode([search, send_refund_email], undolog=undolog,
        ...                                            compensations=[cancel_refund_email]))  # doctest: +SKIP
        >>> builder.add_conditional_edges("agent", tools_condition)                         # doctest: +SKIP
    """

    def __init__(
        self,
        tools: Sequence[BaseTool | Callable[..., Any]],
        *,
        undolog: UndoLog,
        tiers: Mapping[str, ToolTier | str | UndoLogPolicy] | None = None,
        compensations: Iterable[Callable[..., Any]] = (),
        agent_id: str = "langgraph",
        on_failure: str = "rollback",
        session_id: Callable[[Mapping[str, Any]], str] | None = None,
        wrap_tool_call: Callable[..., Any] | None = None,
        awrap_tool_call: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> None:
        guard = _Guard(undolog, tiers=tiers, compensations=compensations, agent_id=agent_id,
                       on_failure=on_failure, session_id=session_id)
        guard.classify(tools)  # before the graph exists: nothing runs unclassified
        self._undolog_guard = guard

        def sync_wrapper(request: Any, execute: Callable[[Any], Any]) -> Any:
            def checked(r: Any) -> Any:
                refused = _admitted(r)
                return refused if refused is not None else execute(r)

            inner = checked if wrap_tool_call is None else (lambda r: wrap_tool_call(r, checked))
            return _wrap(guard, request, inner)

        async def async_wrapper(request: Any, execute: Callable[[Any], Any]) -> Any:
            async def checked(r: Any) -> Any:
                refused = _admitted(r)
                return refused if refused is not None else await execute(r)

            if awrap_tool_call is not None:
                async def inner(r: Any) -> Any:
                    return await awrap_tool_call(r, checked)
            elif wrap_tool_call is not None:
                raise errors.ConfigurationError(
                    "UndoLogToolNode got wrap_tool_call but no awrap_tool_call: pass both to run the graph async"
                )
            else:
                inner = checked
            return await _awrap(guard, request, inner)

        super().__init__(tools, wrap_tool_call=sync_wrapper, awrap_tool_call=async_wrapper, **kwargs)
        _ADAPTERS.add(self)

    @property
    def undolog(self) -> UndoLog:
        return self._undolog_guard.u

    # LangGraph injects config and runtime by these exact parameter annotations, as for ToolNode.
    #
    # LangGraph re-runs the whole node on resume, and SAFE calls are not logged (so not replayable): the
    # IRREVERSIBLE calls of the message are therefore gated first, and no call runs until every one of
    # them is decided. The node then runs once, and nothing in it runs twice.
    def _func(self, input: Any, config: RunnableConfig, runtime: Runtime) -> Any:  # noqa: A002
        batch = _Batch()
        token = _BATCH.set(batch)
        try:
            error: str | None = None
            while True:
                pauses = self._gate(input, config, batch)
                if not pauses:
                    batch.pending.clear()
                    out = super()._func(input, config, runtime)
                    if not batch.pending:
                        return out
                    pauses = self._ordered(input, batch)  # decided, then re-opened meanwhile: ask again
                error = self._undolog_guard.ask(pauses, error)
        finally:
            self._release_gated(batch)
            _BATCH.reset(token)

    async def _afunc(self, input: Any, config: RunnableConfig, runtime: Runtime) -> Any:  # noqa: A002
        batch = _Batch()
        token = _BATCH.set(batch)
        try:
            error: str | None = None
            while True:
                pauses = self._gate(input, config, batch)
                if not pauses:
                    batch.pending.clear()
                    out = await super()._afunc(input, config, runtime)
                    if not batch.pending:
                        return out
                    pauses = self._ordered(input, batch)
                error = self._undolog_guard.ask(pauses, error)
        finally:
            self._release_gated(batch)
            _BATCH.reset(token)

    def _gate(self, input: Any, config: Mapping[str, Any], batch: _Batch) -> list[_Pause]:
        """Intercept the message's IRREVERSIBLE calls, in message order, before any call runs."""
        guard = self._undolog_guard
        self._release_gated(batch)
        calls, _ = self._parse_input(input)
        pauses: list[_Pause] = []
        for call in calls:
            name = guard.names.get(call.get("name"))
            if name is None or not call.get("id") or guard.u.tool_spec(name).tier is not ToolTier.IRREVERSIBLE:
                continue
            request = _GateRequest(call, input)
            try:
                step: Any = guard.prepare(request, config)
            except _REFUSED as exc:
                step = guard.refusal(request, exc)
            if isinstance(step, _Pause):
                pauses.append(step)
            else:
                batch.gated[call["id"]] = step
        if pauses:
            self._release_gated(batch)  # approved calls wait for their siblings' decisions, unclaimed
        return pauses

    def _release_gated(self, batch: _Batch) -> None:
        for step in batch.gated.values():
            if isinstance(step, _Run):
                self._undolog_guard.released(step)
        batch.gated.clear()

    def _ordered(self, input: Any, batch: _Batch) -> list[_Pause]:
        # Message order, not thread-completion order: the interrupt must look the same on every re-run.
        calls, _ = self._parse_input(input)
        order = {c["id"]: i for i, c in enumerate(calls)}
        items = sorted(batch.pending.items(), key=lambda kv: order.get(kv[0], len(order)))
        return [_Pause(a, sid) for _, (a, sid) in items]

    def rollback(self, thread_id: str, *, reason: str | None = None) -> Any:
        """Roll back the thread's current session (LIFO compensations); see :func:`rollback`."""
        return rollback(thread_id, undolog=self.undolog, reason=reason)


# --------------------------------------------------------------------------------------------------
# The middleware
# --------------------------------------------------------------------------------------------------


class UndoLogMiddleware(AgentMiddleware):  # type: ignore[misc,valid-type]
    """``create_agent`` middleware routing every tool call through UndoLog (sync and async).

    The tools are checked for a tier when given here (``tools=``), otherwise on the first model
    request; a tool without one raises ``ToolNotClassified`` before anything runs. A new user turn
    on a thread whose session is halted is answered with a message saying so, and nothing runs
    until a person resumes or rolls the session back.

    Args:
        undolog: the ``UndoLog`` instance.
        tools: the agent's tools, to check tiers at construction.
        tiers / compensations / agent_id / on_failure / session_id: as for :class:`UndoLogToolNode`.

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
        tiers: Mapping[str, ToolTier | str | UndoLogPolicy] | None = None,
        compensations: Iterable[Callable[..., Any]] = (),
        agent_id: str = "langchain-agent",
        on_failure: str = "rollback",
        session_id: Callable[[Mapping[str, Any]], str] | None = None,
    ) -> None:
        if not _HAVE_LANGCHAIN:  # pragma: no cover
            raise ImportError("UndoLogMiddleware needs LangChain: pip install 'undolog[langgraph]'")
        super().__init__()
        self._undolog_guard = _Guard(undolog, tiers=tiers, compensations=compensations, agent_id=agent_id,
                                     on_failure=on_failure, session_id=session_id)
        self._checked = False
        if tools is not None:
            self._undolog_guard.classify(tools)
            self._checked = True
        _ADAPTERS.add(self)

    @property
    def undolog(self) -> UndoLog:
        return self._undolog_guard.u

    # A new user turn: refuse it on a halted thread; open a fresh session after a rollback.
    @hook_config(can_jump_to=["end"])
    def before_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        return self._turn_start()

    @hook_config(can_jump_to=["end"])
    async def abefore_agent(self, state: Any, runtime: Any) -> dict[str, Any] | None:
        return self._turn_start()

    def _turn_start(self) -> dict[str, Any] | None:
        g = self._undolog_guard
        try:
            config = get_config()
            base = g.base_id(config)
        except (RuntimeError, errors.ConfigurationError):
            return None  # no thread: every tool call will say so
        sid = g.head(base, refresh=True)
        rec = g.session_state(sid)
        if rec is None:
            return None
        if rec.state == "halted":
            text = (
                f"UndoLog: this conversation is on hold. Session {sid} is halted ({rec.halted_reason or 'no reason'}"
                f"). A person must resume it (`undolog sessions resume {sid}`) or roll it back before the agent can "
                "act again."
            )
            return {"messages": [AIMessage(content=text, response_metadata={"undolog": {"refused": "session_halted"}})],
                    "jump_to": "end"}
        if rec.state in ("rolled_back", "completed"):
            g.advance(base)
        return None

    def wrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        self._check(request)
        return handler(request)

    async def awrap_model_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        self._check(request)
        return await handler(request)

    def _check(self, request: Any) -> None:
        if not self._checked:
            self._undolog_guard.classify(getattr(request, "tools", None) or [])
            self._checked = True

    def wrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        _innermost(handler)
        return _wrap(self._undolog_guard, request, handler)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        _innermost(handler)
        return await _awrap(self._undolog_guard, request, handler)

    def rollback(self, thread_id: str, *, reason: str | None = None) -> Any:
        """Roll back the thread's current session; see :func:`rollback`."""
        return rollback(thread_id, undolog=self.undolog, reason=reason)


def _innermost(handler: Any) -> None:
    """Refuse to gate a call that other middleware could still change (or repeat) before it runs."""
    if _INNER_WRAPPERS in getattr(handler, "__qualname__", ""):
        raise errors.ConfigurationError(
            "UndoLogMiddleware must be the last middleware that wraps tool calls (middleware=[..., "
            "UndoLogMiddleware(...)]): a tool-call wrapper inside it could switch the tool, edit its arguments "
            "or run it again after UndoLog's gate. Nothing was run."
        )


# --------------------------------------------------------------------------------------------------
# Module-level helpers
# --------------------------------------------------------------------------------------------------


def _default_undolog(undolog: UndoLog | None) -> UndoLog:
    if undolog is not None:
        return undolog
    found = {id(a.undolog): a.undolog for a in list(_ADAPTERS)}
    if len(found) == 1:
        return next(iter(found.values()))
    raise errors.ConfigurationError(
        "pass undolog=...: " + ("no UndoLog adapter exists in this process" if not found
                                else "several UndoLog instances are in use")
    )


def session_for_thread(thread_id: str, *, undolog: UndoLog | None = None) -> str:
    """The id of the thread's current UndoLog session (``thread_id``, or ``thread_id#N`` after rollbacks).

    Example:
        >>> undolog.sessions.get(session_for_thread("ticket-1042", undolog=undolog)).state  # doctest: +SKIP
        'active'
    """
    u = _default_undolog(undolog)
    n = 1
    while True:
        try:
            u.sessions.get(_chain(str(thread_id), n + 1))
            n += 1
        except errors.SessionNotFound:
            return _chain(str(thread_id), n)


def new_session(thread_id: str, *, undolog: UndoLog | None = None, agent_id: str = "langgraph") -> str:
    """Open the thread's next session, e.g. after a rollback in a hand-built graph; returns its id.

    ``UndoLogMiddleware`` does this by itself at the next user turn.

    Example:
        >>> new_session("ticket-1042", undolog=undolog)  # doctest: +SKIP
        'ticket-1042#2'
    """
    u = _default_undolog(undolog)
    current = session_for_thread(thread_id, undolog=u)
    sid = _chain(str(thread_id), _chain_index(str(thread_id), current) + 1)
    u.engine.ensure_session(sid, agent_id=agent_id)
    for a in list(_ADAPTERS):
        with a._undolog_guard.lock:
            a._undolog_guard.heads.pop(str(thread_id), None)
    return sid


def rollback(thread_id: str, *, undolog: UndoLog | None = None, reason: str | None = None) -> Any:
    """Undo the thread's current session, newest effect first, for a graph's own failure paths.

    Returns the core's ``RollbackReport``. Irreversible steps stay done (the report lists them); a
    compensation that fails halts the session for a person.

    Example:
        >>> report = rollback("ticket-1042", undolog=undolog)               # doctest: +SKIP
        >>> [(s.tool_name, s.outcome) for s in report.steps]               # doctest: +SKIP
        [('send_refund_email', 'compensated')]
    """
    u = _default_undolog(undolog)
    sid = session_for_thread(thread_id, undolog=u)
    return u.saga.rollback_sync(sid, reason=reason or "requested by the graph", actor="langgraph")


async def arollback(thread_id: str, *, undolog: UndoLog | None = None, reason: str | None = None) -> Any:
    """Async :func:`rollback`."""
    u = _default_undolog(undolog)
    sid = session_for_thread(thread_id, undolog=u)
    return await u.saga.rollback(sid, reason=reason or "requested by the graph", actor="langgraph")


def _resume_value_for(u: UndoLog, value: Mapping[str, Any]) -> Any:
    out: dict[str, Any] = {}
    for req in value.get("requests") or [value]:
        rid = req["approval_request_id"]
        rec = u.approvals.get(rid)
        if rec.state == "approved" and rec.decided_by:
            modified = rec.approved_args is not None and rec.approved_args != rec.proposed_args
            dec: dict[str, Any] = {"decision": "modify" if modified else "approve", "approver": rec.decided_by,
                                   "reason": rec.decision_reason, "approval_request_id": rid}
            if modified:
                dec["args"] = rec.approved_args
        elif rec.state == "rejected":
            dec = {"decision": "reject", "approver": rec.decided_by or "unknown",
                   "reason": rec.decision_reason or "rejected", "approval_request_id": rid}
        else:
            # Pending (pauses again), or settled by UndoLog itself (timeout, cancel): read at re-run.
            dec = {"decision": "from_store", "approval_request_id": rid}
        out[rid] = dec
    return next(iter(out.values())) if len(out) == 1 else {"decisions": out}


def _ours(interrupts: Iterable[Any]) -> list[Any]:
    return [i for i in interrupts if isinstance(i.value, Mapping) and i.value.get("type") == APPROVAL_INTERRUPT_TYPE]


def undolog_resume(graph: Any, config: Mapping[str, Any], *, undolog: UndoLog | None = None) -> dict[str, Any]:
    """The resume value for every UndoLog interrupt of the thread, built from the store.

    Use it when the decisions were made elsewhere (``undolog approvals approve``, the REST API, the
    dashboard). Requests still undecided resume as ``from_store``: nothing runs and the graph
    pauses again.

    Returns:
        ``{interrupt_id: value}``, ready for ``Command(resume=...)``.

    Example:
        >>> undolog.approvals.approve(request_id, approver="ana")                      # doctest: +SKIP
        >>> graph.invoke(Command(resume=undolog_resume(graph, config)), config)          # doctest: +SKIP
    """
    u = _default_undolog(undolog)
    mine = _ours(graph.get_state(config).interrupts)
    if not mine:
        raise errors.UndoLogError(f"thread {_thread(config)!r} is not paused on an UndoLog approval")
    return {i.id: _resume_value_for(u, i.value) for i in mine}


async def aundolog_resume(graph: Any, config: Mapping[str, Any], *, undolog: UndoLog | None = None) -> dict[str, Any]:
    """Async :func:`undolog_resume` (for async checkpointers)."""
    u = _default_undolog(undolog)
    mine = _ours((await graph.aget_state(config)).interrupts)
    if not mine:
        raise errors.UndoLogError(f"thread {_thread(config)!r} is not paused on an UndoLog approval")
    return {i.id: _resume_value_for(u, i.value) for i in mine}


def _decided_threads(u: UndoLog, thread_ids: Iterable[str] | None) -> list[str]:
    u.approvals.expire_due()
    if thread_ids is not None:
        return list(dict.fromkeys(str(t) for t in thread_ids))
    sessions: dict[str, None] = {}
    for state in ("approved", "rejected", "timed_out", "auto_approved", "cancelled"):
        for rec in u.approvals.list(state=state):
            sessions[rec.session_id] = None
    return list(dict.fromkeys(_base_of(s) for s in sessions))


def _all_decided(u: UndoLog, interrupts: Sequence[Any]) -> bool:
    for i in interrupts:
        for req in i.value.get("requests") or [i.value]:
            if u.approvals.get(req["approval_request_id"]).state == "pending":
                return False
    return True


def resume_decided(
    graph: Any, *, undolog: UndoLog | None = None, thread_ids: Iterable[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Resume every thread paused on UndoLog approvals that are now all decided (or timed out).

    Run it from a worker or a cron job next to the approval UI. Threads are found through the store
    (or given in ``thread_ids``); a thread still waiting on any request is left alone.

    Returns:
        ``{thread_id: the graph's output}`` for each thread resumed.

    Example:
        >>> resume_decided(agent, undolog=undolog)  # doctest: +SKIP
        {'ticket-1042': {'messages': [...]}}
    """
    u = _default_undolog(undolog)
    done: dict[str, Any] = {}
    for tid in _decided_threads(u, thread_ids):
        cfg = _thread_config(config, tid)
        mine = _ours(graph.get_state(cfg).interrupts)
        if mine and _all_decided(u, mine):
            done[tid] = graph.invoke(Command(resume={i.id: _resume_value_for(u, i.value) for i in mine}), cfg)
    return done


async def aresume_decided(
    graph: Any, *, undolog: UndoLog | None = None, thread_ids: Iterable[str] | None = None,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Async :func:`resume_decided`."""
    u = _default_undolog(undolog)
    done: dict[str, Any] = {}
    for tid in _decided_threads(u, thread_ids):
        cfg = _thread_config(config, tid)
        mine = _ours((await graph.aget_state(cfg)).interrupts)
        if mine and _all_decided(u, mine):
            done[tid] = await graph.ainvoke(
                Command(resume={i.id: _resume_value_for(u, i.value) for i in mine}), cfg
            )
    return done


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def _chain(base: str, n: int) -> str:
    return base if n <= 1 else f"{base}{_SEP}{n}"


def _chain_index(base: str, sid: str) -> int:
    if sid == base:
        return 1
    return int(sid[len(base) + len(_SEP):])


def _base_of(sid: str) -> str:
    head, sep, tail = sid.rpartition(_SEP)
    return head if sep and tail.isdigit() else sid


def _thread(config: Mapping[str, Any]) -> Any:
    return (config.get("configurable") or {}).get("thread_id")


def _thread_config(config: Mapping[str, Any] | None, thread_id: str) -> dict[str, Any]:
    base = dict(config or {})
    base["configurable"] = {**(base.get("configurable") or {}), "thread_id": thread_id}
    return base


def _tier_of(policy: ToolTier | str | UndoLogPolicy) -> ToolTier:
    return ToolTier.coerce(policy.tier if isinstance(policy, UndoLogPolicy) else policy)


def _declaration(obj: Any) -> Any:
    return getattr(obj, "__undolog_spec__", None) if obj is not None else None


def _function_of(tool: Any) -> Any:
    if isinstance(tool, BaseTool):
        return getattr(tool, "func", None) or getattr(tool, "coroutine", None)
    return tool


def _capturing(tool: BaseTool, box: _Box) -> BaseTool:
    """A copy of ``tool`` whose function also drops its raw return value into ``box``.

    LangChain turns a tool's return value into message text; compensations need the value itself
    (the message id to recall, say), so it is taken before that conversion.
    """
    func = getattr(tool, "func", None)
    coro = getattr(tool, "coroutine", None)
    if func is None and coro is None:
        return tool
    update: dict[str, Any] = {}
    if func is not None:

        @functools.wraps(func)
        def f(*args: Any, **kwargs: Any) -> Any:
            out = func(*args, **kwargs)
            box.value, box.set = out, True
            return out

        update["func"] = f
    if coro is not None:

        @functools.wraps(coro)
        async def c(*args: Any, **kwargs: Any) -> Any:
            out = await coro(*args, **kwargs)
            box.value, box.set = out, True
            return out

        update["coroutine"] = c
    try:
        return tool.model_copy(update=update)
    except Exception:  # noqa: BLE001 - an exotic tool class: fall back to the message content
        return tool


def _result_of(out: Any) -> Any:
    """The result to log when the raw value was not captured: the message content, parsed if JSON."""
    content = out.content if isinstance(out, ToolMessage) else out
    if isinstance(content, str) and content[:1] in ("{", "["):
        try:
            return json.loads(content)
        except ValueError:
            return content
    return content


def _content_of(result: Any) -> Any:
    """Message content for a replayed result, the way LangChain renders a tool's return value."""
    if isinstance(result, str):
        return result
    if isinstance(result, list) and all(
        isinstance(x, str) or (isinstance(x, dict) and "type" in x) for x in result
    ):
        return result
    try:
        return json.dumps(result, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(result)


def _sibling_call_ids(request: Any) -> set[str]:
    """Ids of the calls made in the same model message as this one."""
    call_id = request.tool_call.get("id")
    state = getattr(request, "state", None)
    messages = state.get("messages") if isinstance(state, Mapping) else getattr(state, "messages", None)
    for m in reversed(messages or []):
        if isinstance(m, HumanMessage):
            break
        calls = getattr(m, "tool_calls", None) or []
        ids = {c.get("id") for c in calls}
        if call_id in ids:
            return {i for i in ids if i}
    return {call_id} if call_id else set()


def _iso(value: Any) -> str | None:
    if isinstance(value, dt.datetime):
        return value.isoformat(timespec="seconds")
    return None if value is None else str(value)
