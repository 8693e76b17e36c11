"""The tool results the gateway answers its MCP clients with: errors, replays, "awaiting approval", unknown outcomes.

Held apart from ``gateway`` so that ``elicit``, which answers with them too, does not import the gateway.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from mcp import types

from undolog_core.integration import AwaitingApproval

# Where UndoLog's own fields ride in a result's structured content and _meta.
META_KEY = "dev.undolog/call"


def call_key(name: str, arguments: Mapping[str, Any]) -> str:
    """An IRREVERSIBLE call's id: the same tool with the same arguments in the same session is the same call, so
    asking again after approval runs it once, and asking after that replays its stored result."""
    text = json.dumps({"tool": name, "args": arguments}, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                      default=str)
    return "mcp-" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:40]


def canonical_arguments(spec: Any, arguments: Mapping[str, Any]) -> Any:
    """The arguments as the core stores them (validated by the tool's contract, then its JSON snapshot): ``5`` and
    ``5.0`` for a number field are one value there, so they must be one call here. Arguments the contract refuses
    are given back as they are (the core refuses them with the failing path named, before anything is logged)."""
    try:
        copy = spec.as_is_copy(arguments)
        return copy if copy is not None else spec.snapshot(spec.validate(arguments))
    except Exception:  # noqa: BLE001 - the core's own validation answers these, with the path named
        return arguments


def running_result(name: str, message: str) -> types.CallToolResult:
    """A call that another ask of it is running right now: not an error (it runs once); ask again for its result."""
    info = {"status": "running", "tool": name, "retry_after_seconds": 2}
    text = (f"{name} is running right now (another ask of this same call started it): running; ask again with the "
            f"same arguments in a few seconds for its result. It runs once. ({message})")
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], structuredContent=info,
                                isError=False)


def text_of(result: types.CallToolResult) -> str:
    return "\n".join(c.text for c in result.content if isinstance(c, types.TextContent))


def structured(stored: Any) -> Any:
    """A stored call result as a compensation template reads it: its structured content, else its text parsed as
    JSON, else the text."""
    if not isinstance(stored, Mapping):
        return stored
    if stored.get("structuredContent") is not None:
        return stored["structuredContent"]
    texts = [c.get("text") for c in stored.get("content") or [] if isinstance(c, Mapping) and c.get("type") == "text"]
    if len(texts) == 1 and isinstance(texts[0], str):
        try:
            return json.loads(texts[0])
        except ValueError:
            return texts[0]
    return stored


def error_result(message: str, *, code: str | None = None) -> types.CallToolResult:
    meta = {META_KEY: {"error": code}} if code else None
    return types.CallToolResult(content=[types.TextContent(type="text", text=message)], isError=True,
                                _meta=meta)


def replayed(stored: Any) -> types.CallToolResult:
    result = types.CallToolResult.model_validate(stored)
    meta = dict(result.meta or {})
    meta[META_KEY] = {"replayed": True}
    return result.model_copy(update={"meta": meta})


def awaiting_result(name: str, d: AwaitingApproval, *, note: str = "") -> types.CallToolResult:
    retry = max(1, math.ceil(d.retry_after))
    info = {
        "status": "awaiting_approval",
        "tool": name,
        "approval_request_id": d.approval_request_id,
        "reason": d.reason,
        "risk_tags": list(d.risk_tags),
        "retry_after_seconds": retry,
        "timeout_at": d.timeout_at.isoformat(),
    }
    text = (f"{name} was not run: it needs a person's approval first (request {d.approval_request_id}"
            f"{': ' + d.reason if d.reason else ''}). Call it again with the same arguments in about {retry} s; "
            "it runs once approved." + note)
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], structuredContent=info,
                                isError=False)


def unknown_result(name: str, exc: Exception, settled: str | None) -> types.CallToolResult:
    what = {
        "compensated": "it was undone (its compensation ran) in case it happened",
        "committed": "the upstream confirms it happened",
        "unknown": "its outcome is unknown and the session is halted until a person checks it",
        "not_run": "the upstream confirms it did not happen",
        "settling": "its probe says it has not happened yet, but the request may still land: outcome unknown, "
                    "settling (it is settled once the request can no longer land)",
    }.get(settled or "", "its outcome is unknown; recovery will settle it")
    return error_result(f"{name}: the upstream did not answer ({exc}); {what}.", code="outcome_unknown")


def settling_result(name: str, exc: Exception, effect_id: str, session_id: str) -> types.CallToolResult:
    """A call that timed out and that the upstream was asked to cancel: outcome unknown, settling. Its effect stays
    in flight until the upstream answers it (or its process ends); the client is told what to do meanwhile."""
    text = (f"{name}: outcome unknown, settling. The upstream did not answer in time ({exc}). Effect {effect_id} "
            f"(session {session_id}) stays in flight until the upstream answers the call or its process ends: its "
            "result is then recorded, or the call is settled as not run or undone. Do not send it again as a new "
            f"call: ask again later (`undolog sessions show {session_id}` or the desk shows how it settled); a "
            "call of this same request meanwhile answers that it is running.")
    meta = {META_KEY: {"error": "outcome_unknown", "status": "settling", "effect_id": effect_id,
                       "session_id": session_id}}
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=True, _meta=meta)
