"""The long-lived gateway's local socket: ``undolog mcp serve --socket PATH`` and ``undolog mcp connect``.

A client that starts its MCP server per tool call (``langchain-mcp-adapters``' default ``get_tools()``) would
otherwise start the gateway, and every upstream behind it, per call, and each call would land in a session of its
own. Instead the client's config launches ``undolog mcp connect --socket PATH``: a byte forwarder between its
stdin/stdout and a gateway that stays up, holds its upstreams' connections, and groups the calls of all its
connections by the config's ``session`` key.

The socket is a Unix socket whose file only its owner may open (mode 0600, created so under a umask: there is no
moment it is open to others). Each connection speaks MCP's stdio framing: one JSON-RPC message per line.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from undolog_core.errors import ConfigurationError, UndoLogError

if TYPE_CHECKING:
    from anyio.abc import ByteStream
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
    from mcp.shared.message import SessionMessage

    from .gateway import Gateway

log = logging.getLogger("undolog.mcp")

# A message longer than this (a huge tool call or result) is refused rather than buffered without bound.
_MAX_LINE = 64 << 20


def claim_path(path: Path) -> None:
    """Make ``path`` free for a new socket: a stale one (no gateway listening) is removed; a live one, or anything
    that is not a socket, is refused.

    Raises:
        ConfigurationError: another gateway listens there, or the path holds something else.
    """
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigurationError(f"--socket {path}: that path exists and is not a socket; choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # left by a gateway that was killed: nobody listens
        return
    finally:
        probe.close()
    raise ConfigurationError(f"--socket {path}: another gateway is already serving there; connect to it with "
                             f"`undolog mcp connect --socket {path}`, or stop it first")


@contextlib.asynccontextmanager
async def line_transport(stream: ByteStream) -> AsyncIterator[
        tuple[MemoryObjectReceiveStream[SessionMessage | Exception], MemoryObjectSendStream[SessionMessage]]]:
    """The (read, write) streams of an MCP server over one socket connection, framed as MCP's stdio is."""
    import anyio
    import anyio.lowlevel
    from anyio.streams.buffered import BufferedByteReceiveStream
    from mcp import types
    from mcp.shared.message import SessionMessage

    read_writer: MemoryObjectSendStream[SessionMessage | Exception]
    read_stream: MemoryObjectReceiveStream[SessionMessage | Exception]
    write_stream: MemoryObjectSendStream[SessionMessage]
    write_reader: MemoryObjectReceiveStream[SessionMessage]
    read_writer, read_stream = anyio.create_memory_object_stream(0)
    write_stream, write_reader = anyio.create_memory_object_stream(0)
    buffered = BufferedByteReceiveStream(stream)

    async def reader() -> None:
        try:
            async with read_writer:
                while True:
                    try:
                        line = await buffered.receive_until(b"\n", _MAX_LINE)
                    except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
                            anyio.ClosedResourceError):
                        return
                    text = line.decode("utf-8", errors="replace")
                    if not text.strip():
                        continue
                    try:
                        message = types.JSONRPCMessage.model_validate_json(text)
                    except Exception as exc:  # noqa: BLE001 - handed to the session, as the SDK's stdio does
                        await read_writer.send(exc)
                        continue
                    await read_writer.send(SessionMessage(message))
        except anyio.ClosedResourceError:
            await anyio.lowlevel.checkpoint()

    async def writer() -> None:
        try:
            async with write_reader:
                async for message in write_reader:
                    data = message.message.model_dump_json(by_alias=True, exclude_none=True)
                    await stream.send(data.encode("utf-8") + b"\n")
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            await anyio.lowlevel.checkpoint()

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        tg.start_soon(writer)
        try:
            yield read_stream, write_stream
        finally:
            tg.cancel_scope.cancel()


async def serve_socket(gateway: Gateway, path: str | Path, *, ready: Callable[[Path], None] | None = None) -> None:
    """Serve the gateway's MCP server on a local Unix socket at ``path`` until cancelled; every connection is an
    MCP client session of its own, all sharing the gateway's upstream connections.

    Example:
        >>> anyio.run(lambda: serve_socket(Gateway(load_config("gateway.toml"), undolog), "/run/user/1000/ul.sock"))
    """
    import anyio

    where = Path(path).expanduser().absolute()
    if sys.platform == "win32":  # pragma: no cover - the CLI refuses it first
        raise ConfigurationError("--socket needs a Unix socket; on Windows serve --http on loopback instead")
    claim_path(where)
    async with gateway.running():
        old = os.umask(0o177)  # the socket file is created owner-only: never open to others, even for a moment
        try:
            listener = await anyio.create_unix_listener(where)
        finally:
            os.umask(old)
        os.chmod(where, 0o600)
        try:
            async with listener:
                if ready is not None:
                    ready(where)

                async def handle(stream: Any) -> None:
                    try:
                        async with stream, line_transport(stream) as (read, write):
                            await gateway.server.run(read, write, gateway.server.create_initialization_options())
                    except Exception as exc:  # noqa: BLE001 - one client's broken connection must not stop the rest
                        log.warning("a socket client's connection ended with %s", exc)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(_stop_on_signal, tg.cancel_scope)
                    await listener.serve(handle, task_group=tg)
        finally:
            with contextlib.suppress(OSError):
                where.unlink()


async def _stop_on_signal(scope: Any) -> None:
    """SIGTERM (a service manager's stop) and SIGINT end the gateway as leaving the block does: the socket file
    removed, the upstreams' connections closed (a stdio upstream exits)."""
    import signal

    import anyio

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            log.info("stopping: the socket is closed and the upstreams' connections too")
            scope.cancel()
            return


def connect_command(args: list[str]) -> int | None:
    """``undolog mcp connect --socket PATH`` run directly (the ``undolog.cli_direct`` entry point ``mcp.connect``):
    the exit status, or None to leave ``args`` to the ``undolog`` app (``--help``, anything else).

    The same command as the app's (``undolog_mcp.cli.connect``), without its imports: an MCP client that opens a
    session per call starts it for every call.

    Example:
        >>> connect_command(["--help"]) is None
        True
    """
    if len(args) == 2 and args[0] == "--socket" and args[1] and not args[1].startswith("-"):
        path = args[1]
    elif len(args) == 1 and args[0].startswith("--socket=") and len(args[0]) > len("--socket="):
        path = args[0][len("--socket="):]
    else:
        return None
    try:
        return forward(path)
    except UndoLogError as exc:
        print(f"error: {exc.message}", file=sys.stderr)  # as the app's command says it (undolog_mcp.cli._fail)
        return 2


def forward(path: str | Path) -> int:
    """``undolog mcp connect``: forward this process's stdin to the gateway's socket and its answers to stdout,
    byte for byte, until either side ends. Returns the exit status.

    Raises:
        ConfigurationError: no gateway listens at ``path`` (the message says how to start one).
    """
    where = Path(path).expanduser()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(where))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        raise ConfigurationError(f"no gateway is listening on {where}: start one with "
                                 f"`undolog mcp serve --config gateway.toml --socket {where}`") from None
    except PermissionError:
        sock.close()
        raise ConfigurationError(f"{where}: permission denied; the gateway's socket is open to its owner only, "
                                 "so connect as the user that started it") from None

    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()

    def upstream() -> None:
        # The client's requests to the gateway; at the client's end of input the gateway is told by a half close,
        # so answers still on their way are delivered.
        try:
            while chunk := os.read(stdin, 65536):
                sock.sendall(chunk)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, name="undolog-connect-in", daemon=True).start()
    try:
        while chunk := sock.recv(65536):
            view = memoryview(chunk)
            while view:
                view = view[os.write(stdout, view):]
    except OSError:
        return 1
    finally:
        sock.close()
    return 0
