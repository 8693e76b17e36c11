"""The guard the node and the middleware share: classification, the thread's session, the decision.

It turns a LangChain tool call into the call driver's decision (``_Run``/``_Reply``/``_Pause``),
builds the messages the model reads, and records approval decisions given in a resume value. The
call sequence itself (run, complete, fail, release) is in ``_call``. Imports LangGraph/LangChain,
``undolog_core`` and the sibling modules.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal

from langchain_core.messages import ToolMessage
from langchain_core.tools import BaseTool
from langchain_core.tools import tool as as_tool
from langgraph.config import get_config
from langgraph.prebuilt.tool_node import ToolCallRequest
from langgraph.types import interrupt
from pydantic import BaseModel

from undolog_core import OnFailure, RequestState, SessionState, ToolTier, errors
from undolog_core.integration import (
    AwaitingApproval,
    Completed,
    Execute,
    WouldBlock,
    hot_path,
    jsonable,
    session_table,
    tool_name_of,
)

from .._common import Registrar, TierValue, failure_text, refusal_text, rollback_outcome
from ._payload import (
    ApprovalDecisions,
    _Pause,
    asking,
    decisions_for,
    done_asking,
    payload,
    response_schema_for,
)
from ._sessions import SEP, _chain, _chain_index
from ._siblings import siblings_rejected
from ._tools import _Box, _capturing, _content_of, _declaration, _function_of, _sibling_call_ids, emit

if TYPE_CHECKING:
    from undolog_core import RollbackReport, UndoLog


@dataclasses.dataclass(frozen=True)
class _Run:
    """Run the tool: the engine's ``Execute`` decision, in the thread's current session."""

    execute: Execute
    session_id: str


@dataclasses.dataclass(frozen=True)
class _Reply:
    """Do not run the tool: answer with this message (a replayed result)."""

    message: ToolMessage


class _Guard:
    def __init__(
        self,
        undolog: UndoLog,
        *,
        tiers: Mapping[str, TierValue] | None,
        compensations: Iterable[Callable[..., Any]],
        agent_id: str,
        on_failure: OnFailure | str,
        session_id: Callable[[Mapping[str, Any]], str] | None,
        approver: str | Callable[[Mapping[str, Any]], str | None] | None = None,
    ) -> None:
        # Checked here, when the adapter is built, not when the first tool fails.
        self.on_failure = OnFailure.coerce(on_failure).value
        if approver is not None and not callable(approver) and not (isinstance(approver, str) and approver.strip()):
            raise errors.ConfigurationError(
                f"approver must be a name or a function of the run's config returning one, got {approver!r}"
            )
        self.registrar = Registrar(undolog, tiers=tiers, compensations=compensations)
        self.u = undolog
        # The session lifecycle and the per-call decisions of the integration contract, held once: a call through
        # them costs no frame of its own (they are the core's objects, typed by its protocols).
        self.table = session_table(undolog)
        self.hot = hot_path(undolog)
        self.agent_id = agent_id
        self.approver = approver
        self.session_fn = session_id
        self.names: dict[str, str] = {}  # LangChain tool name -> UndoLog tool name
        # Thread -> the index of its current session (``thread#n``), for the threads seen here, oldest first. Bounded
        # like the engine's session records (``UndoLog(max_sessions=...)``): a thread whose entry was dropped is
        # found again from the store at its next turn (``turn``/``head`` walk the chain), as after a restart.
        self.heads: dict[str, int] = {}
        self.lock = threading.Lock()
        self.create_lock = threading.Lock()

    # -- classification ------------------------------------------------------------------------------

    def classify(self, tools: Iterable[Any]) -> None:
        """Register every tool with UndoLog; raise ``ToolNotClassified`` naming the first without a tier."""
        batch: list[tuple[str, Any]] = []
        for tool in tools:
            if isinstance(tool, Mapping):
                # A provider-side tool (a dict) runs at the provider, out of UndoLog's reach.
                name = str(tool.get("name") or tool.get("type") or tool)
                policy = self.registrar.policy(name)
                if policy is None or policy.resolved_tier is not ToolTier.SAFE:
                    raise errors.ToolNotClassified(name)
                continue
            name = tool.name if isinstance(tool, BaseTool) else tool_name_of(tool)
            if name in self.names:
                continue
            batch.append((name, tool))
        missing = [
            n for n, t in batch
            if self.registrar.policy(n) is None and _declaration(_function_of(t)) is None
            and _declaration(t) is None and self.registrar.known(n) is None
        ]
        if missing:
            raise errors.ToolNotClassified(missing[0])
        for name, tool in batch:
            self.names[name] = self._register(name, tool)
        if batch:
            self.registrar.check_compensations("UndoLog's LangGraph adapter", [self.names[n] for n, _ in batch])

    def _register(self, name: str, tool: Any) -> str:
        fn = _function_of(tool)
        if self.registrar.policy(name) is not None:
            schema = getattr(tool, "tool_call_schema", None) if isinstance(tool, BaseTool) else _model_schema(tool)
            self.registrar.register(name, fn if fn is not None else tool, args_schema=schema)
            return name
        target = fn if _declaration(fn) is not None else tool
        if _declaration(target) is not None:
            schema = _model_schema(tool)
            if schema is not None:
                # The tool takes values LangChain injects (ToolRuntime, InjectedState, InjectedStore,
                # InjectedToolCallId, a RunnableConfig): UndoLog validates, snapshots and digests only what the
                # model sends (LangChain's tool_call_schema); the tool still gets its injected values from ToolNode.
                spec = self.u.registry.register([(target, _declaration(target), {"args_schema": schema})])[0]
                return spec.name
            # The whole declaration (composite members, probe...) is registered, under its own name.
            specs = self.u.register(target)
            return str(getattr(specs[0], "name", name)) if specs and specs[0] is not None else name
        return name  # registered with this UndoLog by the application itself

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

    def head(self, base: str, *, refresh: bool = False, wait: bool = True) -> str:
        """The thread's current session id (the newest of ``base``, ``base#2``...), created if new.

        ``wait=False`` raises ``WouldBlock`` when that needs the store (a thread seen for the first time here)."""
        n = self.heads.get(base)  # one dict read is atomic: the lock orders the writers only
        if n is not None and not refresh:
            return _chain(base, n)
        if not wait:
            raise WouldBlock()
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
            self.table.ensure_session(sid, agent_id=self.agent_id, on_failure=self.on_failure)
            self._set_head(base, n)
        return sid

    def _set_head(self, base: str, n: int, *, keep: bool = False) -> None:
        """Record the thread's current session (``keep``: unless one is recorded), dropping the oldest entries past
        the bound."""
        with self.lock:
            heads = self.heads
            if keep and base in heads:
                return
            heads[base] = n
            over = len(heads) - self.table.max_sessions
            if over > 0:
                for old in list(islice(heads, over)):
                    del heads[old]

    def turn(self, base: str, *, wait: bool = True) -> tuple[str, str | None, str | None]:
        """The thread's session at the start of a user turn: ``(session_id, state, halted_reason)``, in one read.

        The head and the one after it are read together (another process may have opened the next one after a
        rollback); the state is None when the session does not exist yet (it is created here, once per thread).
        ``wait=False`` (an event loop) raises ``WouldBlock`` when that would wait or write: run it in a thread.
        """
        known = self.heads.get(base)  # one dict read is atomic: the lock orders the writers only
        n = known or 1
        # _chain(base, n) and _chain(base, n + 1), inline: this runs at every user turn.
        sid, nxt = (base if n <= 1 else f"{base}{SEP}{n}"), f"{base}{SEP}{n + 1}"
        if known is None and wait:
            # A thread this process has not seen (most often a new one): its session inserted first, in one
            # statement that writes nothing when it or the next one exists (then read below), where the store has
            # it (SQLite). A new thread's first turn so skips a read, which inside a step costs as much as the
            # insert (both run SQLite's code cold). Not waiting for the disk: see below.
            with self.create_lock:
                sc = self.table.try_start(sid, agent_id=self.agent_id, on_failure=self.on_failure, unless=nxt,
                                             durable=False)
            if sc is not None:
                self._set_head(base, n, keep=True)
                return sid, sc.state, None
        found = self.table.session_states([sid, nxt], wait=wait)
        if nxt in found:
            # Rare: another process opened the thread's next session (after a rollback): walk the chain.
            if not wait:
                raise WouldBlock()
            sid = self.head(base, refresh=True)
            state = self.table.session_states([sid]).get(sid)
            return sid, *(state or (None, None))
        if sid not in found:
            # The thread's first turn: its session is created here (one write per thread, not per turn), with our
            # agent id and failure policy, before any call can create it implicitly.
            if not wait:
                raise WouldBlock()
            with self.create_lock:
                # Just read as missing: inserted first, in one statement where the store has it (``fresh``). Not
                # waiting for the disk (``durable=False``): the row is committed, so every process sees it (a halt
                # finds it), and made durable by the first durable write that refers to it (a pre-write, a halt).
                # Until then a power loss only takes a row nothing refers to. The fsync was most of what UndoLog
                # added to a SAFE agent step on SQLite (one per thread: 0.2-3 ms, a twentieth of it per step).
                sc = self.table.ensure_session(sid, agent_id=self.agent_id, on_failure=self.on_failure, fresh=True,
                                                  durable=False)
                self._set_head(base, n, keep=True)
            return sid, sc.state, None
        if known is None:
            self._set_head(base, n, keep=True)
        return sid, *found[sid]

    def advance(self, base: str, closed: str) -> str:
        """The thread's next session after ``closed`` (its session, found rolled back or completed): opened here, or
        the one another process opened meanwhile when that one is not closed too. A thread has one live session,
        whichever process serves it: opening another beside it would split the thread's calls between two sessions
        and step around a halt made on the newer one (the call that takes it is refused by that halt instead)."""
        current = self.head(base, refresh=True)
        if current != closed:
            found = self.table.session_states([current]).get(current)
            if found is None or found[0] not in (SessionState.ROLLED_BACK, SessionState.COMPLETED):
                return current  # (``head`` recorded it)
        n = _chain_index(base, current) + 1
        sid = _chain(base, n)
        self.table.ensure_session(sid, agent_id=self.agent_id, on_failure=self.on_failure)
        self._set_head(base, n)
        return sid

    def session_state(self, sid: str) -> Any:
        try:
            return self.u.sessions.get(sid)
        except errors.SessionNotFound:
            return None

    # -- one call ------------------------------------------------------------------------------------

    def prepare(self, request: Any, config: Mapping[str, Any], *, wait: bool = True) -> _Run | _Reply | _Pause:
        """The driver's decision for one call. ``wait=False`` (on an event loop) raises ``WouldBlock``, with nothing
        written, when it would wait for the store or needs more than the hot path: decide again in a thread."""
        call = request.tool_call
        name = self.names[call["name"]]
        base = self.base_id(config)
        sid = self.head(base, wait=wait)
        earlier = self.earlier(base, sid, call.get("id"), wait=wait)
        if earlier is not None:
            # A call of an earlier session's plan, re-issued in the thread's current one (LangGraph's time travel
            # re-runs a checkpoint from before a rollback with its tool call ids): answered as that session answers
            # it, its stored result or its refusal (the plan was undone). New to this session, it would run again.
            sid = earlier
        try:
            d = self.u.driver.decide(sid, name, dict(call.get("args") or {}), call_id=call.get("id"), wait=wait)
        except errors.SessionClosed:
            if earlier is not None:
                raise
            after = self._after_close(base, sid, request)
            if after is None:
                raise
            sid = after
            d = self.u.driver.decide(sid, name, dict(call.get("args") or {}), call_id=call.get("id"))
        if isinstance(d, Completed):
            return _Reply(self.message(request, _content_of(d.result), meta={"effect_id": d.effect_id,
                                                                             "replayed": True}))
        if isinstance(d, AwaitingApproval):
            return _Pause(d, sid)
        return _Run(d, sid)

    def earlier(self, base: str, sid: str, call_id: str | None, *, wait: bool = True) -> str | None:
        """The earlier session of the thread (``base`` .. the one before ``sid``) that logged ``call_id``, if any.

        Only a thread past a rollback has earlier sessions: for the others nothing is read. ``wait=False`` raises
        ``WouldBlock`` when there are some to read (nothing was written)."""
        if not call_id or sid == base:
            return None
        n = _chain_index(base, sid)
        if n <= 1:
            return None
        if not wait:
            raise WouldBlock()
        found = self.table.sessions_with_call([_chain(base, k) for k in range(1, n)], call_id)
        # One call id lives in one session of the thread (it is new to every later one): the newest, to be sure.
        return next((_chain(base, k) for k in range(n - 1, 0, -1) if _chain(base, k) in found), None)

    def _after_close(self, base: str, sid: str, request: Any) -> str | None:
        """A call on a rolled-back/completed session: a new plan gets a new session, the old plan none."""
        known = {e.get("call_id") for e in self.u.sessions.effects(sid)}
        siblings = _sibling_call_ids(request)
        if known & siblings:
            return None  # this call belongs to the plan that was undone: it must not run now
        return self.advance(base, sid)

    def refusal(self, request: Any, exc: errors.UndoLogError) -> ToolMessage:
        timeout_at = None
        if isinstance(exc, errors.ApprovalTimedOut):
            rec = self._approval(exc.approval_request_id)
            timeout_at = rec.timeout_at if rec is not None else None
        text = refusal_text(request.tool_call["name"], exc, timeout_at=timeout_at)
        return self.message(request, text, status="error", meta={"refused": exc.code})

    def _approval(self, approval_request_id: str) -> Any:
        try:
            return self.u.approvals.get(approval_request_id)
        except errors.UndoLogError:
            return None

    def runnable(self, request: Any, run: _Run) -> tuple[Any, _Box | None]:
        """The request to run (the validated arguments; for a logged call, the tool copy that keeps its raw value)
        and the box that value lands in (None for a SAFE call: nothing is stored, ToolNode's answer is the result)."""
        call = request.tool_call
        overrides: dict[str, Any] = {}
        args = call.get("args") or {}
        if (args if args.__class__ is dict else dict(args)) != run.execute.args:
            overrides["tool_call"] = {**call, "args": dict(run.execute.args)}
        box = None
        if run.execute.effect_id is not None and request.tool is not None:
            box = _Box()
            tool = _capturing(request.tool, box)
            if tool is not request.tool:
                overrides["tool"] = tool
        return (_override(request, overrides) if overrides else request), box

    def committed(self, run: _Run, out: Any, box: _Box | None = None) -> Any:
        """The tool's message, marked with its effect (what the demo and tests read).

        ``box``: the call's raw value. When the tool returned something other than this message, ToolNode built the
        message for this call and nobody else holds it yet: it is marked in place. A pydantic ``model_copy`` of it
        cost some 10 us of every COMPENSABLE agent step; a message the tool returned itself is still copied (the
        tool's own object is left as it was)."""
        if isinstance(out, ToolMessage):
            d = run.execute
            if d.decision == "modify" and isinstance(out.content, str):
                # A person changed the call's arguments before it ran: the model is told, as LangChain's HITL tells
                # it, or it reads a result that does not match the call it made (it asked for u-1, reads "deleted
                # u-7") and may ask again.
                out = out.model_copy(update={"content": f"{edit_notice(d.tool_name, d.args)}\n\nTool response:\n"
                                                        f"{out.content}"})
                box = None
            # str() of the StrEnum is its value, without the two Python-level calls of ``.value``.
            mark = {"tier": str(d.tier), "effect_id": d.effect_id, "session_id": run.session_id}
            meta = out.response_metadata
            if box is not None and box.set and box.value is not out and meta.__class__ is dict:
                meta["undolog"] = mark
                return out
            meta = dict(meta or {})
            meta["undolog"] = mark
            return out.model_copy(update={"response_metadata": meta})
        return out

    def failure(self, request: Any, error: str, report: RollbackReport | None, sid: str,
                failed_id: str) -> ToolMessage:
        """What the model reads after a COMPENSABLE/IRREVERSIBLE tool failed, with the rollback's steps."""
        text = failure_text(request.tool_call["name"], error, rollback_outcome(report, sid, failed_id))
        steps = [dict(s.__dict__) for s in report.steps] if report is not None else []
        return self.message(request, text, status="error", meta={"failed": True, "rollback": steps,
                                                                  "session_id": sid, "effect_id": failed_id})

    def message(self, request: Any, content: Any, *, status: Literal["success", "error"] = "success",
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

    @staticmethod
    def identity_of(config: Mapping[str, Any]) -> str | None:
        """The run's authenticated user (LangGraph's auth: ``configurable.langgraph_auth_user.identity``), if any."""
        user = (config.get("configurable") or {}).get("langgraph_auth_user")
        identity = user.get("identity") if isinstance(user, Mapping) else getattr(user, "identity", None)
        return str(identity) if identity else None

    def approver_for(self, config: Mapping[str, Any]) -> str | None:
        """Who answers a decision that names nobody: LangGraph's authenticated user, else the adapter's ``approver``."""
        identity = self.identity_of(config)
        if identity:
            return identity
        if callable(self.approver):
            who = self.approver(config)
            return None if who is None else str(who)
        return self.approver

    def ask(self, pauses: Sequence[_Pause], error: str | None, *, batched: bool = False) -> str | None:
        """Pause the graph for ``pauses``; on resume, record the decisions and return any problem.

        A rejection the same resume gives to another UndoLog pause of the session (``create_agent``'s parallel
        calls, one pause each) is recorded first, so an approval here finds the session halted (``_siblings``).

        ``batched``: one ``HITLRequest`` for the message's calls (``UndoLogToolNode``), else one
        ``ToolApprovalRequest`` (the middleware). The answer is checked inside ``interrupt()``, before LangGraph
        saves it: its approver is found from this run's config, an edit is pinned to its tool.
        """
        if len(pauses) == 1:
            spec = self.u.registry.tools.get(pauses[0].awaiting.tool_name)
            schema: Any = response_schema_for(pauses[0].awaiting.tool_name, spec.json_schema if spec else None)
        else:
            schema = ApprovalDecisions
        try:
            config: Mapping[str, Any] = get_config()
        except RuntimeError:
            config = {}
        value_ = payload(pauses, error, batched=batched, undo_plan=self.u.saga.undo_plan(pauses[0].session_id))
        token = asking([p.awaiting.tool_name for p in pauses], lambda: self.approver_for(config))
        try:
            value = interrupt(value_, response_schema=schema)
        finally:
            done_asking(token)
        pending = [p.awaiting for p in pauses]
        # A rejection given in the same resume to a sibling pause (create_agent: one pause per call, each call its
        # own task) halts the session before this task records its own answer: an approved sibling must not run.
        siblings_rejected(self, config, value, pending, pauses[0].session_id)
        return self.apply(value, pending)

    def apply(self, value: Any, pending: Sequence[AwaitingApproval], *, only_rejects: bool = False) -> str | None:
        """Record the decisions ``value`` gives for ``pending`` (``only_rejects``: its rejections only)."""
        pairs, problems = decisions_for(value, pending)
        try:
            identity = self.identity_of(get_config())
        except RuntimeError:  # not inside a run: no authenticated user
            identity = None
        if only_rejects:
            pairs = [p for p in pairs if p[1].decision == "reject"]
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
            approver = dec.approver or ""
            if identity is not None and approver != identity:
                # The run is authenticated: who decided is that user, whatever name the value gives (UndoLog's form
                # names its approver itself). A request already decided is the store's (undolog_resume sends the
                # name of whoever decided it at the desk): nothing is recorded for it here either way.
                rec = self._approval(a.approval_request_id)
                if rec is not None and rec.state == RequestState.PENDING:
                    problems.append(
                        f"{a.tool_name} ({a.approval_request_id}): this run is authenticated as {identity!r}, and a "
                        f"decision cannot be recorded in the name of {approver!r}; answer again as {identity!r} "
                        "(or name no approver)"
                    )
                continue
            try:
                # ApprovalDecision's validator made sure of an approver (and of a reason for a rejection).
                if dec.decision == "approve":
                    self.u.approvals.approve(a.approval_request_id, approver=approver, reason=dec.reason)
                elif dec.decision == "reject":
                    self.u.approvals.reject(a.approval_request_id, approver=approver, reason=dec.reason or "")
                elif dec.decision == "respond":
                    self.u.approvals.respond(a.approval_request_id, approver=approver, response=dec.response or "",
                                             reason=dec.reason)
                else:
                    self.u.approvals.modify(a.approval_request_id, approver=approver, args=dec.args or {},
                                            reason=dec.reason)
            except errors.ApprovalAlreadyDecided:
                continue  # decided elsewhere first (or on an earlier run): the store is the authority
            except errors.UndoLogError as exc:
                problems.append(f"{a.tool_name} ({a.approval_request_id}): {exc.message}")
                continue
            emit("undolog.approval_decision", {
                "approval_request_id": a.approval_request_id, "tool": a.tool_name, "tool_call_id": a.call_id,
                "effect_id": a.effect_id, "decision": dec.decision, "approver": approver, "reason": dec.reason,
                "args": dec.args, "response": dec.response,
            })
        return "; ".join(problems) or None


# Whether ToolCallRequest is the plain dataclass ``_override`` copies: its fields in an instance dict, nothing run at
# construction but the assignments. Checked once: a LangGraph that changes that takes ``override`` again.
_PLAIN_REQUEST = (dataclasses.is_dataclass(ToolCallRequest) and not hasattr(ToolCallRequest, "__slots__")
                  and not hasattr(ToolCallRequest, "__post_init__")
                  and {"tool", "tool_call"} <= {f.name for f in dataclasses.fields(ToolCallRequest)})


def edit_notice(tool: str, args: Mapping[str, Any]) -> str:
    """What the model reads before the result of a call a person edited (LangChain's edit notice, in substance).

    Example:
        >>> edit_notice("delete_user_account", {"user_id": "u-7"})[:44]
        'Note: a human reviewer replaced this tool ca'
    """
    return ("Note: a human reviewer replaced this tool call before it ran (UndoLog recorded the change). The call in "
            "your message is the one you produced, not the one that executed. This was intentional and authorized. "
            f"Do not re-issue your original call. Executed instead: {tool} with arguments "
            f"{json.dumps(jsonable(dict(args)), default=str, sort_keys=True)}.")


def _override(request: Any, overrides: dict[str, Any]) -> Any:
    """``request.override(**overrides)`` for the fields :meth:`_Guard.runnable` replaces (the tool and the tool call).

    ``override`` builds the new request with ``dataclasses.replace``, which runs ``ToolCallRequest.__setattr__`` once
    per field (an import and two ``hasattr`` each, for a deprecation warning): some 10 us of every logged call inside
    an agent step. The new request here is the same one (the other fields copied as they are; neither field
    replaced here touches the runtime, which ``override`` only rebuilds for a new state); any other request type,
    or one without an instance dict, goes through ``override``.
    """
    if request.__class__ is not ToolCallRequest or not _PLAIN_REQUEST:
        return request.override(**overrides)
    new = object.__new__(ToolCallRequest)
    fields = new.__dict__
    fields.update(request.__dict__)
    fields.update(overrides)
    return new


def _config_of(request: Any) -> Mapping[str, Any]:
    rt = getattr(request, "runtime", None)
    cfg = getattr(rt, "config", None)
    return cfg if cfg else get_config()


def _model_schema(tool: Any) -> Any:
    """LangChain's ``tool_call_schema`` when the tool takes values the model never sends (injected ones), else None."""
    if not isinstance(tool, BaseTool):
        try:
            tool = as_tool(tool)  # as ToolNode and create_agent do with a plain function
        except Exception:  # noqa: BLE001 - not convertible here: the function's own signature stays the schema
            return None
    schema = getattr(tool, "tool_call_schema", None)
    fn = _function_of(tool)
    if not (isinstance(schema, type) and issubclass(schema, BaseModel)) or fn is None:
        return None
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    takes = {n for n, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and n not in ("self", "cls")}
    return schema if takes - set(schema.model_fields) else None
