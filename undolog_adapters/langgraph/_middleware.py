"""``UndoLogMiddleware``: the ``create_agent`` middleware routing every tool call through UndoLog."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import AIMessage
from langchain_core.tools import BaseTool
from langgraph.config import get_config

from undolog_core import OnFailure, SessionState, errors

from .._common import TierValue, halted_text, missing_extra
from ._call import arun_call, run_call
from ._guard import _Guard
from ._resume import rollback
from ._sessions import _ADAPTERS

if TYPE_CHECKING:
    from undolog_core import UndoLog


def _no_hook_config(**_: Any) -> Callable[[Any], Any]:
    return lambda f: f


try:
    from langchain.agents.middleware import AgentMiddleware, hook_config

    _HAVE_LANGCHAIN = True
except ImportError:  # pragma: no cover - langgraph without the langchain package: UndoLogToolNode still works
    _HAVE_LANGCHAIN = False
    AgentMiddleware = object  # type: ignore[assignment,misc]
    hook_config = _no_hook_config

# The qualified name LangChain gives the handler of a middleware that has other tool-call wrappers inside it.
_INNER_WRAPPERS = "compose_two.<locals>.composed.<locals>.call_inner"


class UndoLogMiddleware(AgentMiddleware):
    """``create_agent`` middleware routing every tool call through UndoLog (sync and async).

    The tools are checked for a tier when given here (``tools=``), otherwise on the first model
    request; a tool without one raises ``ToolNotClassified`` before anything runs. A new user turn
    on a thread whose session is halted is answered with a message saying so, and nothing runs
    until a person resumes or rolls the session back.

    Args:
        undolog: the ``UndoLog`` instance.
        tools: the agent's tools, to check tiers at construction.
        tiers / compensations / agent_id / on_failure / session_id / approver: as for :class:`UndoLogToolNode`.

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
    ) -> None:
        if not _HAVE_LANGCHAIN:  # pragma: no cover
            raise ImportError(missing_extra("UndoLogMiddleware", "LangChain", "langgraph"))
        super().__init__()
        self._undolog_guard = _Guard(undolog, tiers=tiers, compensations=compensations, agent_id=agent_id,
                                     on_failure=on_failure, session_id=session_id, approver=approver)
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
        if rec.state == SessionState.HALTED:
            text = halted_text(sid, rec.halted_reason)
            return {"messages": [AIMessage(content=text, response_metadata={"undolog": {"refused": "session_halted"}})],
                    "jump_to": "end"}
        if rec.state in (SessionState.ROLLED_BACK, SessionState.COMPLETED):
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
        return run_call(self._undolog_guard, request, handler)

    async def awrap_tool_call(self, request: Any, handler: Callable[[Any], Any]) -> Any:
        _innermost(handler)
        return await arun_call(self._undolog_guard, request, handler)

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
