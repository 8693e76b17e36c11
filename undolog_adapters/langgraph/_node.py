"""``UndoLogToolNode``: ``langgraph.prebuilt.ToolNode`` with every call routed through UndoLog."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from langchain_core.tools import BaseTool
from langgraph.prebuilt import ToolNode

from undolog_core import OnFailure, ToolTier, errors

from .._common import TierValue
from ._call import _BATCH, _REFUSED, _admitted, _Batch, arun_call, run_call
from ._guard import _Guard, _Run
from ._payload import _Pause
from ._resume import rollback
from ._sessions import _ADAPTERS
from ._siblings import forget_answers, next_interrupt_index

if TYPE_CHECKING:
    from langchain_core.runnables import RunnableConfig
    from langgraph.runtime import Runtime

    from undolog_core import UndoLog


@dataclass(frozen=True)
class _GateRequest:
    """Enough of a ``ToolCallRequest`` for the gate pass, which runs before ToolNode builds the real ones."""

    tool_call: Any
    state: Any


class UndoLogToolNode(ToolNode):
    """``langgraph.prebuilt.ToolNode`` with every call routed through UndoLog.

    Tools without a tier are refused here, at construction, before anything runs. All approvals
    needed by one model message are asked for in one ``interrupt()`` (ToolNode runs the calls of a
    message as one task, and LangGraph matches resume values to interrupts by order within a task);
    calls already run are replayed from the log on resume, never run again.

    Args:
        tools: LangChain tools or plain functions, as for ``ToolNode``.
        undolog: the ``UndoLog`` instance.
        tiers: tiers for tools without ``@undolog_tool``: ``{name: ToolTier | "safe" | UndoLogPolicy | dict}``,
            the vocabulary every adapter shares (a compensation given as a function is registered).
        compensations: compensation functions to register (those of decorated tools): ``@compensation``
            ones, or plain functions registered under their ``__name__``.
        agent_id: recorded on the sessions this node opens.
        on_failure: ``OnFailure.ROLLBACK`` / ``"rollback"`` (default) or ``"continue"`` when a COMPENSABLE or
            IRREVERSIBLE tool fails; anything else is refused here, at construction.
        approver: who answers a LangChain-style decision (``{"type": "approve"}`` names nobody) when LangGraph's
            auth gives no ``langgraph_auth_user``: a name, or ``fn(config) -> name``. With neither, such an answer
            is refused (nothing saved) and can be sent again in UndoLog's form, with ``approver``.
        session_id: ``fn(config) -> str`` if the session is not the thread id; a run can also pass
            ``configurable={"undolog_session_id": ...}``.
        wrap_tool_call: your own wrapper; it runs inside UndoLog's.
        awrap_tool_call: your own async wrapper; it runs inside UndoLog's.
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
        tiers: Mapping[str, TierValue] | None = None,
        compensations: Iterable[Callable[..., Any]] = (),
        agent_id: str = "langgraph",
        on_failure: OnFailure | str = OnFailure.ROLLBACK,
        session_id: Callable[[Mapping[str, Any]], str] | None = None,
        approver: str | Callable[[Mapping[str, Any]], str | None] | None = None,
        wrap_tool_call: Callable[..., Any] | None = None,
        awrap_tool_call: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> None:
        guard = _Guard(undolog, tiers=tiers, compensations=compensations, agent_id=agent_id,
                       on_failure=on_failure, session_id=session_id, approver=approver)
        guard.classify(tools)  # before the graph exists: nothing runs unclassified
        self._undolog_guard = guard

        def sync_wrapper(request: Any, execute: Callable[[Any], Any]) -> Any:
            def checked(r: Any) -> Any:
                refused = _admitted(r)
                return refused if refused is not None else execute(r)

            inner = checked if wrap_tool_call is None else (lambda r: wrap_tool_call(r, checked))
            return run_call(guard, request, inner)

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
            return await arun_call(guard, request, inner)

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
        walk = self._walk(input, config, batch)
        try:
            next(walk)
            while True:  # each time the walk says the message's calls run now: ToolNode runs them
                walk.send(super()._func(input, config, runtime))
        except StopIteration as done:
            return done.value
        finally:
            self._release_gated(batch)
            _BATCH.reset(token)

    async def _afunc(self, input: Any, config: RunnableConfig, runtime: Runtime) -> Any:  # noqa: A002
        batch = _Batch()
        token = _BATCH.set(batch)
        walk = self._walk(input, config, batch)
        try:
            next(walk)
            while True:  # as in _func, ToolNode's calls awaited
                walk.send(await super()._afunc(input, config, runtime))
        except StopIteration as done:
            return done.value
        finally:
            self._release_gated(batch)
            _BATCH.reset(token)

    def _walk(self, input: Any, config: Mapping[str, Any], batch: _Batch) -> Generator[None, Any, Any]:  # noqa: A002
        """The node run's steps, for ``_func`` and ``_afunc`` alike; returns ToolNode's output.

        Gate the message's IRREVERSIBLE calls and ask for their decisions in one pause (``interrupt()`` raises out of
        the walk on the first pass) until none is pending; then yield for ToolNode to run the calls (sent back its
        output), and ask again for any call decided, then re-opened meanwhile.
        """
        error: str | None = None
        asked, start = 0, None  # the node's pauses answered in this run, and the index of the first
        while True:
            pauses = self._gate(input, config, batch)
            if not pauses:
                forget_answers(config, start, asked)  # a tool's own interrupt() must not be handed them
                asked = 0
                batch.pending.clear()
                out = yield
                if not batch.pending:
                    return out
                pauses = self._ordered(input, batch)  # decided, then re-opened meanwhile: ask again
            if not asked:
                start = next_interrupt_index(config)
            error = self._undolog_guard.ask(pauses, error, batched=True)
            asked += 1

    def _gate(self, input: Any, config: Mapping[str, Any], batch: _Batch) -> list[_Pause]:
        """Intercept the message's IRREVERSIBLE calls, in message order, before any call runs."""
        guard = self._undolog_guard
        self._release_gated(batch)
        calls, _ = self._parse_input(input)
        pauses: list[_Pause] = []
        for call in calls:
            name = guard.names.get(call.get("name"))
            cid = call.get("id")
            if name is None or not cid or guard.u.tool_spec(name).tier is not ToolTier.IRREVERSIBLE:
                continue
            request = _GateRequest(call, input)
            try:
                step: Any = guard.prepare(request, config)
            except _REFUSED as exc:
                step = guard.refusal(request, exc)
            if isinstance(step, _Pause):
                pauses.append(step)
            else:
                batch.gated[cid] = step
        if pauses:
            self._release_gated(batch)  # approved calls wait for their siblings' decisions, unclaimed
        return pauses

    def _release_gated(self, batch: _Batch) -> None:
        for step in batch.gated.values():
            if isinstance(step, _Run) and step.execute.effect_id is not None:
                # Approved but not run: handed back unclaimed, so the node's next pass can claim it again.
                self._undolog_guard.u.driver.release(step.execute)
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
