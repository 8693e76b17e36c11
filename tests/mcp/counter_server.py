"""A real upstream MCP server (the SDK's low-level ``Server`` with FastMCP's tools: ``lowlevel_tools.py``, copied beside
it) whose world is a counter in a JSON file (``COUNTER_STATE``).

``add`` adds to it and remembers each ``do-`` key it applied; its compensation is ``subtract``.
``add`` can die before or after applying (``crash``), or apply late (``delay`` seconds), so the gateway's probes can
be asked while the original is gone or still running. Every call it gets (``add``, ``subtract``) is recorded with its
key in ``calls``, and every cancel (``notifications/cancelled``) in ``cancels``: a late ``add`` honours a cancel (it
stops, records ``cancelled`` and applies nothing; the SDK answers "Request cancelled"), or, with
``COUNTER_CANCEL=ignore``, ignores it (it applies and answers as if none had come). Two probes answer the same question: ``was_applied``
in structured content, ``was_applied_text`` as JSON text (a FastMCP ``-> dict`` tool); ``COUNTER_PROBE`` makes
them answer ``{"maybe": true}`` (cannot tell) instead.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio
from lowlevel_tools import ToolServer  # before the SDK: it imports the SDK the way a gateway does
from mcp.types import CallToolResult, TextContent

STATE = Path(os.environ["COUNTER_STATE"])
KEY = "dev.undolog/idempotency-key"

mcp = ToolServer("counter")


def _watch_cancels() -> None:
    """Record each cancel the SDK's server session receives (the request id it names), and honour or ignore it."""
    from mcp.shared.session import RequestResponder

    honour = RequestResponder.cancel
    ignore = os.environ.get("COUNTER_CANCEL", "") == "ignore"

    async def cancel(self: Any) -> None:
        state = load()
        state.setdefault("cancels", []).append({"request_id": self.request_id, "ignored": ignore})
        save(state)
        if not ignore:
            await honour(self)

    RequestResponder.cancel = cancel  # type: ignore[method-assign]


_watch_cancels()


def load() -> dict[str, Any]:
    if STATE.exists():
        return dict(json.loads(STATE.read_text()))
    return {"value": 0, "history": [0], "applied": {}, "calls": [], "cancels": [], "cancelled": []}


def save(state: dict[str, Any]) -> None:
    tmp = STATE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(STATE)


def key_of() -> Any:
    return mcp.meta().get(KEY)


@mcp.tool()
async def add(n: int, crash: str = "", delay: float = 0.0) -> str:
    """Add n to the counter (once per idempotency key). Async, so that while a late ``add`` sleeps, the same
    upstream process answers a probe: the gateway asks its probes over the live connection that did the work."""
    key = key_of()
    state = load()
    state["calls"].append({"n": n, "key": key})
    save(state)
    if n < 0:
        raise ValueError(f"n must be 0 or more, got {n}")  # a tool error: the call failed, nothing applied
    if crash == "before":
        os._exit(3)
    if delay:
        try:
            await anyio.sleep(delay)
        except anyio.get_cancelled_exc_class():
            state = load()
            state.setdefault("cancelled", []).append(key)
            save(state)
            raise
        state = load()
    if key is None or key not in state["applied"]:
        state["value"] += n
        state["history"].append(state["value"])
        if key is not None:
            state["applied"][key] = state["value"]
    save(state)
    if crash == "after":
        os._exit(3)
    return f"counter is {state['value']}"


@mcp.tool()
def add_final(n: int) -> str:
    """Add n to the counter for good (once per idempotency key): the gateway classifies it IRREVERSIBLE."""
    key = key_of()
    state = load()
    state["calls"].append({"n": n, "key": key, "final": True})
    if key is None or key not in state["applied"]:
        state["value"] += n
        state["history"].append(state["value"])
        if key is not None:
            state["applied"][key] = state["value"]
    save(state)
    return f"counter is {state['value']}"


@mcp.tool()
def read_counter() -> dict[str, Any]:
    """The counter, and which process answers (a SAFE read)."""
    return {"value": load()["value"], "pid": os.getpid()}


@mcp.tool()
def subtract(n: int, of: str = "") -> str:
    """Take n from the counter (once per idempotency key): add's compensation. ``of``: the ``do-`` key of the add
    it undoes, when the gateway's template passes it (``{forward_key}``): an add that never applied is not undone
    (a compensation that tolerates "never happened")."""
    key = key_of()
    state = load()
    state["calls"].append({"n": -n, "key": key, "of": of})
    if of and of not in state["applied"]:
        save(state)
        return f"counter is {state['value']} ({of} never applied: nothing to undo)"
    if key is None or key not in state["applied"]:
        state["value"] -= n
        state["history"].append(state["value"])
        if key is not None:
            state["applied"][key] = state["value"]
    save(state)
    return f"counter is {state['value']}"


def _verdict(idempotency_key: str) -> dict[str, Any]:
    mode = os.environ.get("COUNTER_PROBE", "")
    if mode == "cant_tell":
        return {"maybe": True}
    applied = load()["applied"]
    if idempotency_key in applied:
        return {"happened": True, "result": {"counter": applied[idempotency_key]}}
    return {"happened": False}


@mcp.tool()
def was_applied(tool: str, args: dict[str, Any], idempotency_key: str) -> CallToolResult:
    """Whether the call with this key was applied (structured content)."""
    verdict = _verdict(idempotency_key)
    return CallToolResult(content=[TextContent(type="text", text="see structured content")],
                          structuredContent=verdict)


@mcp.tool()
def was_applied_text(tool: str, args: dict, idempotency_key: str) -> dict:  # type: ignore[type-arg]
    """Whether the call with this key was applied (FastMCP answers a bare ``dict`` as JSON text)."""
    return _verdict(idempotency_key)


if __name__ == "__main__":
    mcp.run()
