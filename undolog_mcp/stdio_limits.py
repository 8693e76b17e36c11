"""The desk's input limits on the gateway's stdio, applied to each line before it is parsed, logged or forwarded.

A line too long, not UTF-8, nested too deep, a JSON-RPC batch, or a ``tools/call`` whose arguments are too large
is answered here, once, and goes no further: nothing reaches the core's log or an upstream. A line too long is
never held whole (only its first bytes, to read the request's id), so memory stays at its level.

Example:
    >>> refuse_line(b'[{"jsonrpc": "2.0", "id": 1, "method": "ping"}]', truncated=False) is not None
    True
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from undolog_core import limits

#: The longest line read (bytes): the desk's default request body limit (``undolog serve --max-body-bytes``).
MAX_LINE_BYTES = int(os.environ.get("UNDOLOG_MCP_MAX_LINE_BYTES", str(1 << 20)))
#: The largest ``tools/call`` arguments (bytes of their JSON).
MAX_ARGUMENTS_BYTES = int(os.environ.get("UNDOLOG_MCP_MAX_ARGUMENT_BYTES", str(256 * 1024)))
#: How much of a refused line is kept to find its id.
HEAD_BYTES = 4096

INVALID_REQUEST = -32600
PARSE_ERROR = -32700

_ID = re.compile(rb'"id"\s*:\s*(-?\d{1,18}|"(?:[^"\\]|\\.){0,200}")')


def _id_in(head: bytes) -> int | str | None:
    m = _ID.search(head)
    if m is None:
        return None
    try:
        value = json.loads(m.group(1).decode("utf-8", "replace"))
    except ValueError:
        return None
    return value if isinstance(value, int | str) and not isinstance(value, bool) else None


def _error(request_id: Any, code: int, message: str) -> bytes:
    body = {"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}}
    return json.dumps(body, ensure_ascii=True).encode() + b"\n"


def _tool_error(request_id: Any, message: str) -> bytes:
    result = {"content": [{"type": "text", "text": message}], "isError": True}
    return json.dumps({"jsonrpc": "2.0", "id": request_id, "result": result}, ensure_ascii=True).encode() + b"\n"


def refuse_line(line: bytes, *, truncated: bool) -> bytes | None:
    """The answer (one or more JSON-RPC lines) to a line refused at the door, or None to let it through.

    ``truncated``: the line was longer than :data:`MAX_LINE_BYTES` and only its head is given.
    """
    if truncated:
        return _error(_id_in(line[:HEAD_BYTES]), INVALID_REQUEST,
                      f"the message is longer than the gateway's line limit of {MAX_LINE_BYTES} bytes "
                      "(UNDOLOG_MCP_MAX_LINE_BYTES): not read, not logged, not forwarded; send less")
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _error(_id_in(line[:HEAD_BYTES]), PARSE_ERROR,
                      f"the message is not valid UTF-8 (byte {exc.start}): MCP messages are UTF-8 JSON; not logged")
    stripped = text.lstrip()
    if limits._deeper_than(line, limits.MAX_JSON_DEPTH):
        return _error(_id_in(line[:HEAD_BYTES]), INVALID_REQUEST,
                      f"the message is nested deeper than {limits.MAX_JSON_DEPTH} levels (the desk's JSON depth "
                      "limit): not logged, not forwarded")
    if stripped.startswith("["):
        # MCP 2025-06-18 and later have no JSON-RPC batches (this gateway negotiates those versions): each request
        # in it gets an error, so that no sender waits for ever; one error with a null id when none can be read.
        try:
            items = json.loads(text)
        except (ValueError, RecursionError):
            items = []
        ids = [i.get("id") for i in items if isinstance(i, dict) and "method" in i
               and isinstance(i.get("id"), int | str) and not isinstance(i.get("id"), bool)] \
            if isinstance(items, list) else []
        message = ("JSON-RPC batches are not supported by the negotiated MCP protocol version: send one message "
                   "per line; nothing in the batch was run")
        return b"".join(_error(i, INVALID_REQUEST, message) for i in ids) or _error(None, INVALID_REQUEST, message)
    if b'"tools/call"' in line and len(line) > MAX_ARGUMENTS_BYTES:
        try:
            msg = json.loads(text)
        except (ValueError, RecursionError):
            return None
        params = msg.get("params") if isinstance(msg, dict) else None
        args = params.get("arguments") if isinstance(params, dict) else None
        if msg.get("method") == "tools/call" and args is not None:
            size = len(json.dumps(args, ensure_ascii=False).encode("utf-8", "surrogatepass"))
            if size > MAX_ARGUMENTS_BYTES:
                return _tool_error(msg.get("id"), f"the arguments are {size} bytes, over the gateway's argument "
                                   f"limit of {MAX_ARGUMENTS_BYTES} bytes (UNDOLOG_MCP_MAX_ARGUMENT_BYTES): the call "
                                   "was not logged and not forwarded; send less")
    return None
