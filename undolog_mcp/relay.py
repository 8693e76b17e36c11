"""The relay between the gateway's MCP clients and its upstreams, for everything that is not a tool's result.

An upstream session is shared by every client of the gateway (one connection per upstream), and what an upstream
sends on it names no client. So:

- **Server-to-client requests.** ``sampling/createMessage`` and ``elicitation/create`` go to the one client whose
  request to that upstream is in flight, when that client declared the capability. With none in flight, or
  requests of several clients in flight at once, the gateway cannot tell whose the question is: it answers the
  upstream with an MCP error (``INVALID_REQUEST``) saying so, rather than guess and show one client's question to
  another. ``roots/list`` is declared to the upstreams only when the gateway serves one client (stdio): the roots
  are that client's.
- **Progress.** A client's ``progressToken`` is kept by the gateway; the request goes upstream with a token of the
  upstream session's own (unique on that session, so two clients' equal tokens cannot cross), and each progress
  notification is relayed to the client that asked, with its own token.
- **Cancellation.** A client's ``notifications/cancelled`` stops the gateway's handler; a request it had in flight
  upstream is cancelled there too. A logged call (COMPENSABLE, or approved IRREVERSIBLE) is shielded (see
  ``gateway._guarded``): once its pre-write is made it runs to its recorded end, so no cancel reaches the upstream,
  which would leave its outcome unknown.
- **Log messages.** ``logging/setLevel`` from clients: the most verbose level asked goes to every upstream with
  logging; a message (which names no request) is relayed, filtered by that client's own level, to the one client
  with a request in flight to that upstream, or with none in flight to the gateway's one client over stdio. With
  several clients' requests in flight, or none over HTTP, it could be another client's: it is not relayed.
- **List changes and resource updates.** Handed to the gateway (``on_listing_changed``, ``on_resource_updated``),
  which recomputes what it exposes and tells its clients.
- **An upstream started again** (it crashed, or its connection was lost and the next request opened another): the
  log level its clients asked is sent again before anything else goes over the new connection, and the gateway's
  subscriptions to its resources are made again (``on_upstream_opened``): the clients still hold them.
- **A client gone** (its HTTP session ended or idled out, its stdio or socket connection closed): its log level is
  forgotten and its subscriptions released (``on_client_gone``): an upstream is told to unsubscribe from a URI no
  other client holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime as dt
import functools
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
from mcp import types
from mcp.client.session import ClientSession
from mcp.server.lowlevel import Server
from mcp.server.lowlevel.server import request_ctx
from mcp.server.session import ServerSession
from mcp.shared.exceptions import McpError
from mcp.shared.message import ServerMessageMetadata

from .config import UpstreamConfig
from .upstream import Upstream, UpstreamHooks, first_cause

log = logging.getLogger("undolog.mcp")

# The client sessions a run of ``GatewayServer.run`` served (one): set in that run's task, so every handler it
# starts sees the list of its own run.
_SERVED: contextvars.ContextVar[list[ServerSession] | None] = contextvars.ContextVar("undolog_mcp_served",
                                                                                     default=None)

# The MCP log levels, least severe first.
LEVELS: tuple[types.LoggingLevel, ...] = ("debug", "info", "notice", "warning", "error", "critical", "alert",
                                          "emergency")


class GatewayServer(Server[Any, Any]):
    """The SDK's low-level server, knowing its live client sessions (to tell them of list changes) and advertising
    the capabilities and instructions the gateway computes from its upstreams, not those its handlers imply.

    Example:
        >>> server = GatewayServer("undolog-gateway")
        >>> server.advertise = lambda: (types.ServerCapabilities(tools=types.ToolsCapability()), None)
    """

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.sessions: weakref.WeakSet[ServerSession] = weakref.WeakSet()
        # () -> (capabilities, instructions), asked as each client session starts.
        self.advertise: Callable[[], tuple[types.ServerCapabilities, str | None]] | None = None
        # Called with each client session that ended (however: a closed or idled-out HTTP session, an ended stdio
        # or socket connection), once its run is over.
        self.on_session_end: Callable[[ServerSession], None] | None = None

    async def run(self, read_stream: Any, write_stream: Any, initialization_options: Any,
                  raise_exceptions: bool = False, stateless: bool = False) -> None:
        """The SDK's ``run`` of one client session; when it ends, :attr:`on_session_end` is told which it was."""
        served: list[ServerSession] = []
        token = _SERVED.set(served)
        try:
            await super().run(read_stream, write_stream, initialization_options, raise_exceptions, stateless)
        finally:
            _SERVED.reset(token)
            for session in served:
                self.sessions.discard(session)
                if self.on_session_end is not None:
                    self.on_session_end(session)

    async def _handle_message(self, message: Any, session: ServerSession, lifespan_context: Any,
                              raise_exceptions: bool = False) -> None:
        served = _SERVED.get()
        if served is not None and not served:
            served.append(session)  # (the session is made inside the SDK's run: its first message names it)
        self.sessions.add(session)
        await super()._handle_message(message, session, lifespan_context, raise_exceptions)

    def create_initialization_options(self, notification_options: Any = None,
                                      experimental_capabilities: Any = None) -> Any:
        options = super().create_initialization_options(notification_options, experimental_capabilities)
        if self.advertise is not None:
            options.capabilities, options.instructions = self.advertise()
        return options


@dataclass(eq=False)
class InFlight:
    """One client's request being answered by an upstream request (a tool call, a read, a prompt)."""

    session: ServerSession
    request_id: types.RequestId  # the client's request, for related notifications and requests
    upstream_id: int  # the request's id on the upstream session


def _refused(message: str) -> types.ErrorData:
    return types.ErrorData(code=types.INVALID_REQUEST, message=message)


class Relay(UpstreamHooks):
    """The gateway's side of its upstream sessions (see the module's docstring).

    Example:
        >>> relay = Relay(server, one_client=True)
        >>> connections = Connections(hooks=relay)
    """

    def __init__(self, server: GatewayServer, *, one_client: bool) -> None:
        self.server = server
        self.one_client = one_client  # stdio: the upstreams' connections serve one client (roots are its)
        self._in_flight: dict[str, list[InFlight]] = {}
        self._levels: weakref.WeakKeyDictionary[ServerSession, types.LoggingLevel] = weakref.WeakKeyDictionary()
        self._level_sent: types.LoggingLevel | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        # Set by the gateway: its live upstream sessions (those with logging are told the level), and what to do
        # when an upstream's listing of tools / resources / prompts changed, or a subscribed resource was updated.
        self.upstreams: Callable[[], Awaitable[list[tuple[UpstreamConfig, ClientSession,
                                                         types.ServerCapabilities | None]]]] | None = None
        self.on_listing_changed: Callable[[UpstreamConfig, str], Awaitable[None]] | None = None
        self.on_resource_updated: Callable[[UpstreamConfig, str], Awaitable[None]] | None = None
        # Set by the pass-through: an upstream's connection was opened again (run in a task of its own, once the
        # connection is handed out), and a client session ended.
        self.on_upstream_opened: Callable[[UpstreamConfig], Awaitable[None]] | None = None
        self.on_client_gone: Callable[[ServerSession], Awaitable[None]] | None = None
        server.notification_handlers[types.RootsListChangedNotification] = self._roots_changed
        server.on_session_end = self._client_gone

    # -- UpstreamHooks ---------------------------------------------------------------------------------

    def callbacks(self, config: UpstreamConfig) -> dict[str, Any]:
        callbacks: dict[str, Any] = {
            "sampling_callback": functools.partial(self._sampling, config),
            "elicitation_callback": functools.partial(self._elicitation, config),
            "logging_callback": functools.partial(self._log, config),
        }
        if self.one_client:
            callbacks["list_roots_callback"] = functools.partial(self._roots, config)
        return callbacks

    @contextlib.asynccontextmanager
    async def sending(self, config: UpstreamConfig, session: ClientSession, request_id: int,
                      request: Any) -> AsyncIterator[Any]:
        ctx = request_ctx.get(None)
        if ctx is None or isinstance(getattr(request, "root", None), types.InitializeRequest):
            yield None  # not on a client's behalf (the gateway's own listing, a compensation)
            return
        entry = InFlight(ctx.session, ctx.request_id, request_id)
        token = ctx.meta.progressToken if ctx.meta is not None else None
        progress = None
        if token is not None:
            client, related = ctx.session, ctx.request_id

            async def progress(value: float, total: float | None, message: str | None) -> None:
                await client.send_progress_notification(token, value, total, message,
                                                         related_request_id=str(related))

        in_flight = self._in_flight.setdefault(config.name, [])
        in_flight.append(entry)
        try:
            yield progress
        except anyio.get_cancelled_exc_class():
            # The client cancelled (or went away): the upstream is told, so it stops what it does for nobody.
            with anyio.CancelScope(shield=True), anyio.move_on_after(5), contextlib.suppress(Exception):
                await session.send_notification(types.ClientNotification(types.CancelledNotification(
                    params=types.CancelledNotificationParams(requestId=request_id,
                                                             reason="cancelled by the gateway's client"))))
            raise
        finally:
            in_flight.remove(entry)

    async def opened(self, config: UpstreamConfig, up: Upstream) -> None:
        # Not on any client's behalf, whichever client's request opened the connection (the holder task's context
        # is a copy of that request's): the level sent is not that client's request in flight.
        token = request_ctx.set(None)  # type: ignore[arg-type]
        try:
            await self._say_level(config, up)
        finally:
            request_ctx.reset(token)
        if self.on_upstream_opened is not None:
            self._spawn(self.on_upstream_opened(config))

    async def _say_level(self, config: UpstreamConfig, up: Upstream) -> None:
        level = self._level_sent
        caps = up.initialized.capabilities if up.initialized is not None else None
        if level is None or caps is None or caps.logging is None:
            return
        # A restarted upstream starts at its own default level: the level the clients asked is said again before
        # any request is handed this connection, so nothing it logs from then on ignores it. Bounded as the opening
        # is (start_timeout): an upstream that never answers it must not hold the calls waiting for the connection.
        try:
            await up.session.send_request(
                types.ClientRequest(types.SetLevelRequest(params=types.SetLevelRequestParams(level=level))),
                types.EmptyResult, request_read_timeout_seconds=dt.timedelta(seconds=config.start_timeout))
        except Exception as exc:  # noqa: BLE001 - its tools still serve; the level is said again at its next start
            log.warning("upstream %s, started again, did not take logging/setLevel %s: %s", config.name, level,
                        exc.error.message if isinstance(exc, McpError) else first_cause(exc))

    async def notified(self, config: UpstreamConfig, notification: types.ServerNotification) -> None:
        root = notification.root
        if isinstance(root, types.ToolListChangedNotification):
            self._spawn(self._listing_changed(config, "tools"))
        elif isinstance(root, types.ResourceListChangedNotification):
            self._spawn(self._listing_changed(config, "resources"))
        elif isinstance(root, types.PromptListChangedNotification):
            self._spawn(self._listing_changed(config, "prompts"))
        elif isinstance(root, types.ResourceUpdatedNotification) and self.on_resource_updated is not None:
            self._spawn(self.on_resource_updated(config, str(root.params.uri)))

    def _spawn(self, coro: Awaitable[None]) -> None:
        # Off the upstream session's receive loop: what it does may wait for that upstream's answers.
        async def run() -> None:
            try:
                await coro
            except Exception:  # noqa: BLE001 - a notification's consequence failing must not stop the session
                log.exception("relaying an upstream's notification failed")

        # Not on any client's behalf: the upstream session's tasks may carry the request context of the client
        # whose call opened the connection, and what the task sends upstream must not count as that client's.
        context = contextvars.copy_context()
        context.run(request_ctx.set, None)  # type: ignore[arg-type]
        task = asyncio.get_running_loop().create_task(run(), context=context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _listing_changed(self, config: UpstreamConfig, kind: str) -> None:
        if self.on_listing_changed is not None:
            await self.on_listing_changed(config, kind)

    # -- server-to-client requests ---------------------------------------------------------------------

    def _client_of(self, config: UpstreamConfig, what: str,
                   declared: types.ClientCapabilities) -> InFlight | types.ErrorData:
        """The one client whose request to ``config``'s upstream is in flight, if it declared ``declared``."""
        entries = self._in_flight.get(config.name, [])
        clients = {id(e.session): e for e in entries}  # the latest request of each client
        if not clients:
            return _refused(f"the gateway refused {what}: no client request to upstream {config.name} is in flight, "
                            f"so there is no client to ask (it relays {what} only during a client's request)")
        if len(clients) > 1:
            return _refused(f"the gateway refused {what}: requests of {len(clients)} clients to upstream "
                            f"{config.name} are in flight, and the request names none of them")
        entry = next(iter(clients.values()))
        if not entry.session.check_client_capability(declared):
            return _refused(f"the gateway refused {what}: the client whose request is in flight did not declare "
                            "that capability")
        return entry

    async def _ask(self, entry: InFlight, request: types.ServerRequest, result: type[Any]) -> Any:
        try:
            return await entry.session.send_request(
                request, result, metadata=ServerMessageMetadata(related_request_id=entry.request_id))
        except McpError as exc:
            return exc.error  # the client's own refusal, passed on as it said it
        except Exception as exc:  # noqa: BLE001 - the client went away meanwhile: the upstream gets an answer anyway
            return types.ErrorData(code=types.INTERNAL_ERROR,
                                   message=f"the gateway's client could not be asked: {type(exc).__name__}: {exc}")

    async def _sampling(self, config: UpstreamConfig, context: Any,
                        params: types.CreateMessageRequestParams) -> types.CreateMessageResult | types.ErrorData:
        entry = self._client_of(config, "sampling/createMessage",
                                types.ClientCapabilities(sampling=types.SamplingCapability()))
        if isinstance(entry, types.ErrorData):
            return entry
        answer: types.CreateMessageResult | types.ErrorData = await self._ask(
            entry, types.ServerRequest(types.CreateMessageRequest(params=params)), types.CreateMessageResult)
        return answer

    async def _elicitation(self, config: UpstreamConfig, context: Any,
                           params: types.ElicitRequestParams) -> types.ElicitResult | types.ErrorData:
        entry = self._client_of(config, "elicitation/create",
                                types.ClientCapabilities(elicitation=types.ElicitationCapability()))
        if isinstance(entry, types.ErrorData):
            return entry
        answer: types.ElicitResult | types.ErrorData = await self._ask(
            entry, types.ServerRequest(types.ElicitRequest(params=params)), types.ElicitResult)
        return answer

    async def _roots(self, config: UpstreamConfig, context: Any) -> types.ListRootsResult | types.ErrorData:
        entries = self._in_flight.get(config.name, [])
        clients = {id(e.session): e.session for e in entries} or {id(s): s for s in list(self.server.sessions)}
        if len(clients) != 1:
            return _refused(f"the gateway refused roots/list: {len(clients)} clients, and the roots are one's")
        client = next(iter(clients.values()))
        if not client.check_client_capability(types.ClientCapabilities(roots=types.RootsCapability())):
            return _refused("the gateway refused roots/list: its client did not declare roots")
        try:
            return await client.list_roots()
        except McpError as exc:
            return exc.error
        except Exception as exc:  # noqa: BLE001 - the client went away meanwhile
            return types.ErrorData(code=types.INTERNAL_ERROR,
                                   message=f"the gateway's client could not be asked: {type(exc).__name__}: {exc}")

    async def _roots_changed(self, notification: Any) -> None:
        if not self.one_client or self.upstreams is None:
            return
        for _config, session, _caps in await self.upstreams():
            with contextlib.suppress(Exception):
                await session.send_roots_list_changed()

    # -- logging -------------------------------------------------------------------------------------

    async def set_level(self, session: ServerSession, level: types.LoggingLevel) -> None:
        """A client's ``logging/setLevel``: remembered for it, and the most verbose level asked goes upstream."""
        self._levels[session] = level
        wanted = min((LEVELS.index(lv) for lv in self._levels.values()), default=LEVELS.index(level))
        if self.upstreams is None or LEVELS[wanted] == self._level_sent:
            return
        self._level_sent = LEVELS[wanted]
        for config, up, caps in await self.upstreams():
            if caps is not None and caps.logging is not None:
                try:
                    await up.set_logging_level(LEVELS[wanted])
                except McpError as exc:
                    log.warning("upstream %s refused logging/setLevel %s: %s", config.name, LEVELS[wanted],
                                exc.error.message)

    async def _log(self, config: UpstreamConfig, params: types.LoggingMessageNotificationParams) -> None:
        # A log message names no request: it is relayed only where whose it is cannot be mistaken, as the
        # upstream's questions are: to the one client with a request in flight to that upstream; with none in
        # flight, to the gateway's one client when it serves one (stdio). With several clients' requests in flight,
        # or none over HTTP (many clients, many principals), it could be another client's: it is not relayed.
        targets: dict[ServerSession, types.RequestId | None] = {
            e.session: e.request_id for e in self._in_flight.get(config.name, [])}
        if len(targets) > 1:
            log.debug("a log message of upstream %s not relayed: %d clients' requests in flight", config.name,
                      len(targets))
            return
        if not targets and self.one_client:
            targets = dict.fromkeys(list(self.server.sessions))
        for client, related in targets.items():
            level = self._levels.get(client)
            if level is not None and LEVELS.index(params.level) < LEVELS.index(level):
                continue
            try:
                await client.send_log_message(params.level, params.data, logger=params.logger or config.name,
                                              related_request_id=related)
            except Exception:  # noqa: BLE001 - a client gone meanwhile misses the message, nothing else
                log.debug("a log message of upstream %s could not be relayed", config.name, exc_info=True)

    # -- clients that end --------------------------------------------------------------------------------

    def _client_gone(self, session: ServerSession) -> None:
        self._levels.pop(session, None)
        if self.on_client_gone is not None:
            # In a task of its own: the session's run may be ending because it is cancelled (the gateway stopping).
            self._spawn(self.on_client_gone(session))

    # -- telling every client --------------------------------------------------------------------------

    async def broadcast(self, notification: types.ServerNotification) -> None:
        """Send ``notification`` to every live client session."""
        for client in list(self.server.sessions):
            try:
                await client.send_notification(notification)
            except Exception:  # noqa: BLE001 - a closed session is not told
                log.debug("a notification could not be sent to a client", exc_info=True)
