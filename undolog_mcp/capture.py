"""Capture: what a COMPENSABLE call is about to change, read before it is sent and stored with its undo entry.

``capture = { tool = "read_text_file", args = { path = "{args.path}" } }`` on a tool calls that read-only tool of
the same upstream first; its result (structured content, else its text parsed as JSON) is what the compensation
reads as ``{before...}``: an overwrite is undone by writing back what was there. The capture is stored before the
call is sent, so a crash between the two leaves an undo that can still be built. A capture that fails, or whose
answer is larger than a stored value may be (the desk's limit, 1 MiB), refuses the call: it did not run, and an
undo that cannot restore everything is never stored cut short.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from mcp import types

from undolog_core import UndoLog
from undolog_core.errors import UndoLogError
from undolog_core.integration import put_undo_args
from undolog_core.limits import MAX_RESULT_BYTES

from .results import error_result, structured, text_of
from .templates import BEFORE_KEY, Capture
from .upstream import OutcomeUnknown, UpstreamRefused


async def capture_before(undolog: UndoLog, upstream: Callable[..., Awaitable[types.CallToolResult]],
                         capture: Capture, name: str, sent: Mapping[str, Any], stored_args: Mapping[str, Any],
                         effect_id: str) -> types.CallToolResult | None:
    """Run ``capture`` for the call of ``name`` about to send ``sent``, and store its answer with the effect's undo
    entry (beside the call's ``stored_args``). None when stored; else the error result that refuses the call.

    Example:
        >>> refused = await capture_before(gw.undolog, call, template.capture, "write_file", args, args, effect_id)
    """
    def refuse(why: str) -> types.CallToolResult:
        return error_result(f"{name} was not run: what it would change could not be captured first, so it could "
                            f"not be undone: {why}", code="capture_failed")

    try:
        args = capture.render(sent)
    except UndoLogError as exc:
        return refuse(exc.message)
    try:
        out = await upstream(capture.tool, args, None)
    except (OutcomeUnknown, UpstreamRefused) as exc:
        return refuse(f"{capture.tool}: {exc}")
    if out.isError:
        return refuse(f"{capture.tool} answered an error: {text_of(out)}")
    before = structured(out.model_dump(mode="json", by_alias=True, exclude_none=True))
    size = len(json.dumps(before, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > MAX_RESULT_BYTES:
        return refuse(f"{capture.tool} answered {size} bytes, more than the {MAX_RESULT_BYTES} a stored value may "
                      "be (kept whole or not at all: a cut copy would restore the wrong thing)")
    stored = await asyncio.to_thread(put_undo_args, undolog, effect_id, {**stored_args, BEFORE_KEY: before})
    if not stored:
        return refuse("its undo entry is no longer armed")
    return None
