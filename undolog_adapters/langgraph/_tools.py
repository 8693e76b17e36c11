"""LangChain tool and message plumbing: a tool's function, its raw result, and message content.

Imports ``langchain_core`` only.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
from collections.abc import Mapping
from typing import Any

from langchain_core.callbacks import dispatch_custom_event
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import BaseTool


class _Box:
    """Holds the raw return value of one tool run (LangChain turns it into message text).

    No ``__init__``: its two fields are class defaults until the tool's value lands (a box is made on every logged
    call, and a Python ``__init__`` is one more frame there, cold inside an agent step)."""

    value: Any = None
    set = False

    def result_of(self, out: Any) -> Any:
        """What is stored as the call's result: the tool's raw value when it landed here, else ``out`` (ToolNode's
        message) read back (``_result_of``)."""
        return self.value if self.set else _result_of(out)


def _declaration(obj: Any) -> Any:
    return getattr(obj, "__undolog_spec__", None) if obj is not None else None


def _function_of(tool: Any) -> Any:
    if isinstance(tool, BaseTool):
        return getattr(tool, "func", None) or getattr(tool, "coroutine", None)
    return tool


# The box of the call running in this context: the capturing copy of a tool drops its raw return value there.
_CAPTURE: contextvars.ContextVar[_Box | None] = contextvars.ContextVar("undolog_lg_capture", default=None)
# One capturing copy per tool, made on its first call: a copy per call would also lose what LangChain caches on the
# tool object (its injected-argument keys, type hints), recomputed on every call at a cost of a sizeable part of a
# step. Keyed by id, holding the tool itself so the id is not reused while the entry lives.
_COPIES: dict[int, tuple[BaseTool, BaseTool]] = {}
_COPIES_MAX = 1024


def _capturing(tool: BaseTool, box: _Box) -> BaseTool:
    """The copy of ``tool`` whose function also drops its raw return value into the current box (``_CAPTURE``).

    LangChain turns a tool's return value into message text; compensations need the value itself
    (the message id to recall, say), so it is taken before that conversion. The caller sets ``_CAPTURE`` to
    ``box`` while the copy runs.
    """
    hit = _COPIES.get(id(tool))
    if hit is not None and hit[0] is tool:
        return hit[1]
    func = getattr(tool, "func", None)
    coro = getattr(tool, "coroutine", None)
    if func is None and coro is None:
        return tool
    update: dict[str, Any] = {}
    if func is not None:

        @functools.wraps(func)
        def f(*args: Any, **kwargs: Any) -> Any:
            out = func(*args, **kwargs)
            current = _CAPTURE.get()
            if current is not None:
                current.value, current.set = out, True
            return out

        update["func"] = _same_signature(f, func)
    if coro is not None:

        @functools.wraps(coro)
        async def c(*args: Any, **kwargs: Any) -> Any:
            out = await coro(*args, **kwargs)
            current = _CAPTURE.get()
            if current is not None:
                current.value, current.set = out, True
            return out

        update["coroutine"] = _same_signature(c, coro)
    try:
        copy = tool.model_copy(update=update)
    except Exception:  # noqa: BLE001 - an exotic tool class: fall back to the message content
        return tool
    if len(_COPIES) >= _COPIES_MAX:
        _COPIES.clear()  # tools made per request: start over rather than grow without bound
    _COPIES[id(tool)] = (tool, copy)
    return copy


def _same_signature(wrapper: Any, wrapped: Any) -> Any:
    """``wrapper`` with ``wrapped``'s signature stored on it.

    LangChain reads a tool function's signature on every run (its RunnableConfig parameter, its injected arguments);
    through ``__wrapped__`` that rebuilds the wrapped function's signature from its code object each time. Stored
    once, it is the same signature, found without rebuilding it.
    """
    try:
        wrapper.__signature__ = inspect.signature(wrapped)
    except (TypeError, ValueError):
        pass  # nothing to store: inspect follows __wrapped__, as without it
    return wrapper


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


def emit(name: str, data: dict[str, Any]) -> None:
    """Tell the run's callbacks (LangSmith and other tracers) what UndoLog did, as a LangChain custom event.

    Outside a run (no parent run to attach the event to) there is nobody to tell, and nothing is sent.
    """
    try:
        dispatch_custom_event(name, data)
    except RuntimeError:
        pass


def rollback_events(report: Any, failed: str | None) -> list[tuple[str, dict[str, Any]]]:
    """The custom events of one rollback: a step per compensation run (newest first), then the rollback's end."""
    if report is None:
        return []
    events: list[tuple[str, dict[str, Any]]] = [
        ("undolog.compensation", {"session_id": report.session_id, **dict(step.__dict__)}) for step in report.steps
    ]
    events.append(("undolog.rollback", {
        "session_id": report.session_id, "failed_effect_id": failed, "complete": report.complete,
        "halted_reason": report.halted_reason, "compensated": sum(1 for st in report.steps
                                                                  if st.outcome == "compensated"),
        "kept_irreversible": list(report.kept_irreversible),
    }))
    return events
