"""A probe tool's answer, read as one of three: it happened (with its result), it did not, or it cannot tell.

A probe is a tool of the same upstream that the gateway asks, with the call's arguments and ``do-`` key, whether a
call whose answer was lost happened. Its answer is ``{"happened": true, "result": ...}`` or
``{"happened": false}``, in its structured content or as JSON text (what a FastMCP ``-> dict`` tool answers).
Only an explicit ``false`` says "did not happen": anything else (no ``happened`` key, ``"no"``, ``0``, prose) is
"cannot tell", which is settled as if the tool had no probe. The core takes the three answers as ``True`` or the
result, ``False`` and ``None``.

A "did not happen" settles the call as not run only once its original request can no longer land: the gateway
says so through :class:`OutcomeUnknown`'s ``original_gone``, and a call held meanwhile (``settling``) is settled
again here when its upstream connection ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any

from mcp import types

from undolog_core import UndoLog
from undolog_core.errors import UndoLogError

log = logging.getLogger("undolog.mcp")


def probe_verdict(out: types.CallToolResult, probe_tool: str) -> Any:
    """The core's reading of a probe tool's answer: the result (or True) when it happened, False when it did not,
    None when it cannot tell.

    Raises:
        UndoLogError: the probe answered ``isError`` (counted as a failed recovery attempt, tried again later).

    Example:
        >>> probe_verdict(types.CallToolResult(content=[types.TextContent(type="text", text='{"happened": false}')]),
        ...               "was_applied")
        False
    """
    if out.isError:
        text = "\n".join(c.text for c in out.content if isinstance(c, types.TextContent))
        raise UndoLogError(f"probe {probe_tool} answered an error: {text}")
    answer = _answer(out)
    if answer is None:
        return None
    happened = answer.get("happened")
    if happened is False:
        return False
    if happened is True:
        result = answer.get("result")
        return result if result is not None else True
    return None  # "yes", 1, null: not an explicit answer


def _answer(out: types.CallToolResult) -> Mapping[str, Any] | None:
    """The ``{"happened": ...}`` object of an answer: its structured content (also as FastMCP wraps a value under
    ``result``), else its one text block parsed as JSON."""
    for candidate in (out.structuredContent, (out.structuredContent or {}).get("result")):
        if isinstance(candidate, Mapping) and "happened" in candidate:
            return candidate
    texts = [c.text for c in out.content if isinstance(c, types.TextContent)]
    if len(texts) == 1:
        try:
            parsed = json.loads(texts[0])
        except ValueError:
            return None
        if isinstance(parsed, Mapping) and "happened" in parsed:
            return parsed
    return None


def settle_when_gone(undolog: UndoLog, effect_id: str, ended: asyncio.Event,
                     tasks: set[asyncio.Task[None]]) -> None:
    """Settle again, once ``ended`` is set (the connection the call went over closed: its request can no longer
    land), a call held ``settling``. The task is kept in ``tasks`` until it ends.

    Example:
        >>> settle_when_gone(gw.undolog, effect_id, up.session.ended, gw._settling)
    """
    async def settle_then() -> None:
        await ended.wait()
        settle = undolog.driver.in_doubt
        assert settle is not None  # (set by every UndoLog)
        try:
            outcome = await asyncio.to_thread(settle, effect_id, original_gone=True)
        except Exception as exc:  # noqa: BLE001 - left in flight: recovery settles it when this process ends
            log.warning("effect %s: could not be settled once its request could no longer land: %s", effect_id, exc)
            return
        log.info("effect %s settled once its request could no longer land: %s", effect_id, outcome)

    task = asyncio.ensure_future(settle_then())
    tasks.add(task)
    task.add_done_callback(tasks.discard)
