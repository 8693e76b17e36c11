"""The gateway's stdio server transport, on the event loop itself: no worker thread per line read or written.

The SDK's ``stdio_server`` wraps stdin and stdout in ``anyio.wrap_file``: every line read, every write and every
flush is a hop to a worker thread and back (three per request, each a thread wake-up, a self-pipe write and GIL
hand-offs), and the worker that reissues ``readline`` competes for the GIL with the request's own handler, which on
a COMPENSABLE call is where the durable pre-write runs. When stdin and stdout are pipes or sockets (how an MCP
client starts a server), this transport reads and writes them through the loop's own non-blocking pipe transports
instead; anything else (a terminal, a file, Windows) gets the SDK's transport unchanged. The messages are the SDK's:
one JSON-RPC message per line, UTF-8 (undecodable bytes replaced, as the SDK does), a line that is not a message is
handed to the session as the exception it raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
import sys
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from mcp import types
from mcp.shared.message import SessionMessage

from .stdio_limits import HEAD_BYTES, MAX_LINE_BYTES, refuse_line

Streams = tuple[MemoryObjectReceiveStream[SessionMessage | Exception], MemoryObjectSendStream[SessionMessage]]

# A line longer than this (a huge tool call) is still read whole: the reader then collects it chunk by chunk.
_LIMIT = 1 << 20


def _pollable(fd: int) -> bool:
    """Whether ``fd`` is a pipe or a socket: what the loop can watch, and what O_NONBLOCK is safe on (a terminal's
    flags are shared with the shell that owns it)."""
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def loop_native(stdin_fd: int, stdout_fd: int) -> bool:
    """Whether :func:`stdio_transport` serves these descriptors on the loop (else through the SDK's threads)."""
    return sys.platform != "win32" and _pollable(stdin_fd) and _pollable(stdout_fd)


@contextlib.asynccontextmanager
async def stdio_transport(stdin_fd: int | None = None, stdout_fd: int | None = None) -> AsyncIterator[Streams]:
    """The (read, write) streams of an MCP server over this process's stdin and stdout.

    Example:
        >>> async with stdio_transport() as (read, write):
        ...     await server.run(read, write, server.create_initialization_options())
    """
    in_fd = sys.stdin.fileno() if stdin_fd is None else stdin_fd
    out_fd = sys.stdout.fileno() if stdout_fd is None else stdout_fd
    if not loop_native(in_fd, out_fd):
        from io import TextIOWrapper

        from mcp.server.stdio import stdio_server

        if stdin_fd is None and stdout_fd is None:
            async with stdio_server() as streams:
                yield streams
            return
        # Descriptors of the caller's: the SDK's transport over them (not closed: they are the caller's).
        fin = TextIOWrapper(open(in_fd, "rb", closefd=False), encoding="utf-8", errors="replace")  # noqa: SIM115
        fout = TextIOWrapper(open(out_fd, "wb", closefd=False), encoding="utf-8")  # noqa: SIM115
        async with stdio_server(anyio.wrap_file(fin), anyio.wrap_file(fout)) as streams:
            yield streams
        return
    loop = asyncio.get_running_loop()
    # Duplicates, so that closing the transports leaves the process's own stdin and stdout open.
    rfile = open(os.dup(in_fd), "rb", buffering=0)  # noqa: SIM115 - closed by its transport
    wfile = open(os.dup(out_fd), "wb", buffering=0)  # noqa: SIM115 - closed by its transport
    reader = asyncio.StreamReader(limit=_LIMIT, loop=loop)
    rtransport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), rfile)
    wtransport, wprotocol = await loop.connect_write_pipe(
        lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader(loop=loop), loop=loop), wfile)
    writer = asyncio.StreamWriter(wtransport, wprotocol, None, loop)

    read_stream_writer: MemoryObjectSendStream[SessionMessage | Exception]
    read_stream: MemoryObjectReceiveStream[SessionMessage | Exception]
    write_stream: MemoryObjectSendStream[SessionMessage]
    write_stream_reader: MemoryObjectReceiveStream[SessionMessage]
    read_stream_writer, read_stream = anyio.create_memory_object_stream(0)
    write_stream, write_stream_reader = anyio.create_memory_object_stream(0)

    async def read_line() -> tuple[bytes, bool]:
        """One line and whether it was cut: past MAX_LINE_BYTES the rest is read and dropped, never held."""
        try:
            return await reader.readuntil(b"\n"), False
        except asyncio.IncompleteReadError as eof:
            return eof.partial, False  # the last line, unterminated (b"" at the end)
        except asyncio.LimitOverrunError as over:
            # Longer than the reader's buffer: take what it holds, then the rest of the line, up to the limit.
            parts = [await reader.readexactly(over.consumed)]
            size = len(parts[0])
            while True:
                try:
                    part = await reader.readuntil(b"\n")
                    if size + len(part) > MAX_LINE_BYTES:
                        return parts[0][:HEAD_BYTES], True
                    parts.append(part)
                    return b"".join(parts), False
                except asyncio.IncompleteReadError as eof:
                    if size + len(eof.partial) > MAX_LINE_BYTES:
                        return parts[0][:HEAD_BYTES], True
                    return b"".join([*parts, eof.partial]), False
                except asyncio.LimitOverrunError as more:
                    chunk = await reader.readexactly(more.consumed)
                    size += len(chunk)
                    if size > MAX_LINE_BYTES:
                        parts[1:] = []  # over the limit: keep the head (for the id), drop the rest as it comes
                    else:
                        parts.append(chunk)

    async def stdin_reader() -> None:
        try:
            async with read_stream_writer:
                while True:
                    line, cut = await read_line()
                    if not line:
                        break
                    refused = refuse_line(line, truncated=cut)
                    if refused is not None:
                        writer.write(refused)  # whole lines: they cannot interleave with another message
                        continue
                    text = line.decode("utf-8", errors="replace")
                    if not text.strip():
                        continue  # a blank line is no message (the SDK's text reader would hand it over to fail)
                    try:
                        message = types.JSONRPCMessage.model_validate_json(text)
                    except Exception as exc:  # noqa: BLE001 - handed to the session, as the SDK's transport does
                        refusal = _refusal(text, exc)
                        if refusal is not None:
                            writer.write(refusal)  # one whole line: it cannot interleave with another message
                        await read_stream_writer.send(exc)
                        continue
                    await read_stream_writer.send(SessionMessage(message))
        except anyio.ClosedResourceError:
            await anyio.lowlevel.checkpoint()

    async def stdout_writer() -> None:
        try:
            async with write_stream_reader:
                async for session_message in write_stream_reader:
                    json = session_message.message.model_dump_json(by_alias=True, exclude_none=True)
                    writer.write(json.encode("utf-8") + b"\n")
                    await writer.drain()  # waits only when the client does not keep up with the pipe
        except anyio.ClosedResourceError:
            await anyio.lowlevel.checkpoint()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(stdin_reader)
            tg.start_soon(stdout_writer)
            yield read_stream, write_stream
    finally:
        rtransport.close()
        with contextlib.suppress(Exception):
            if not wtransport.is_closing():
                await _flush(writer)
        wtransport.close()
        # The pipe transports set O_NONBLOCK on the open file, which the process's own stdin and stdout share.
        for fd in (in_fd, out_fd):
            with contextlib.suppress(OSError):
                os.set_blocking(fd, True)


def _refusal(text: str, exc: Exception) -> bytes | None:
    """A JSON-RPC error answering a line the SDK could not parse, when it is a request whose id can be read.

    The SDK only logs such a line, so its sender waits for ever for an answer. The usual cause is a lone
    surrogate escape (``"\\ud83d"``, an emoji cut in half by a model): valid JSON text, refused by the SDK's
    parser, read by Python's. Anything without a readable id (a notification, garbage) stays unanswered.
    """
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):  # not JSON, or nested past what Python reads: nothing to answer
        return None
    request_id = raw.get("id") if isinstance(raw, dict) and "method" in raw else None
    if isinstance(request_id, bool) or not isinstance(request_id, int | str):
        return None
    first = str(exc).splitlines()
    why = next((line.strip() for line in first[1:] if line.strip()), first[0] if first else type(exc).__name__)
    error = {"code": types.PARSE_ERROR, "message": f"the message could not be parsed: {why}"}
    line = json.dumps({"jsonrpc": "2.0", "id": request_id, "error": error}, ensure_ascii=True)
    return line.encode("utf-8") + b"\n"


async def _flush(writer: Any) -> None:
    with anyio.move_on_after(1):
        await writer.drain()
