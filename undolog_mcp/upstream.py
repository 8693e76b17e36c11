"""Connections to the upstream MCP servers the gateway fronts (the official SDK's client, 1.x line).

The gateway holds one live session per upstream for its lifetime. A compensation or a probe that runs
elsewhere (``undolog sessions rollback --app gateway.toml``, the desk's recovery loop) opens a short-lived one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
from jsonschema import SchemaError, ValidationError
from jsonschema.validators import validator_for
from mcp import types
from mcp.client.session import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamablehttp_client
from mcp.shared.exceptions import McpError
from referencing import Registry
from referencing.exceptions import Unresolvable

from .config import UpstreamConfig

log = logging.getLogger("undolog.mcp")

# The idempotency key travels in the call's _meta under this name; an upstream that does not know it ignores it.
IDEMPOTENCY_META = "dev.undolog/idempotency-key"
# The call's ownership epoch travels beside it (a fencing token: ``CallContext.epoch``). An upstream that keeps the
# highest epoch it has seen per idempotency key may refuse a write whose epoch is below it: a process stalled past
# its lease then cannot write after recovery (whose probe carries the next epoch) took its call over.
EPOCH_META = "dev.undolog/epoch"
# httpx.codes.REQUEST_TIMEOUT, which the SDK's client answers a timed-out request with.
_TIMEOUT_CODE = 408
# How long sending a cancel may take (a notification: the upstream does not answer it; a stuck pipe must not hold
# the call's answer to its client).
_CANCEL_SEND_SECONDS = 5.0
# How long a request still out when its connection ended may take to be answered "connection closed" by the SDK.
_CLOSING_SECONDS = 1.0
# The JSON-RPC id of the request sent in the current task, filled in by ``_WatchedSession.send_request``: what a
# cancel names.
_SENT_ID: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("undolog_mcp_sent_id", default=None)


def first_cause(exc: BaseException) -> str:
    """The first leaf of an exception group (anyio's task groups wrap what went wrong), as text."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


class OutcomeUnknown(Exception):
    """The upstream did not answer a call (timeout, crash, lost connection): whether it ran is not known.

    ``lost``: the connection itself is gone (the next call opens another), not merely slow.
    ``original_gone`` (read by the core's call driver): the request can no longer land, so a probe's "did not
    happen" may settle it. ``ended``: set when the connection the request went over closes
    (``probes.settle_when_gone``). ``confirmed``: the upstream answered the request with an error after it was
    asked to cancel it (its cancel confirmed: it can no longer land either).

    ``late`` (a timeout): the request is still out, the upstream asked to cancel it (``notifications/cancelled``);
    awaiting it gives the upstream's answer when it comes (a result), or raises an ``OutcomeUnknown`` whose
    request can no longer land (the cancel confirmed, or the connection gone). ``settles_later`` (read by the core's
    call driver) says so: the call is left in flight, held by this process, for its caller to settle on that answer.
    """

    def __init__(self, message: str, *, lost: bool = True,
                 late: asyncio.Future[types.CallToolResult] | None = None) -> None:
        super().__init__(message)
        self.lost = lost
        self.ended: asyncio.Event | None = None
        self.confirmed = False
        self.late = late
        self.timeout: float | None = None  # the upstream's timeout, when that is what passed

    @property
    def original_gone(self) -> bool:
        return self.lost or self.confirmed or (self.ended is not None and self.ended.is_set())

    @property
    def settles_later(self) -> bool:
        return self.late is not None


class UpstreamRefused(Exception):
    """The upstream refused the call with a protocol error (unknown tool, bad params): it did not run."""


class UpstreamUnavailable(UpstreamRefused):
    """The call never left the gateway: the upstream could not be started (or reached) to take it."""


class _NotSent(Exception):
    """The connection was already closed when the call was to be sent (the upstream went away between calls): the
    request never left this process, so it can be sent again on a fresh connection."""


class UpstreamHooks:
    """What the gateway does with an upstream session's traffic beyond tool calls (``relay.py`` implements it):
    the upstream's requests to the client (sampling, elicitation, roots), its notifications (log messages, list
    changes, resource updates), and each request the gateway sends over it (in flight: progress and cancellation).
    A connection opened without hooks (the CLI, the desk's recovery) refuses the upstream's requests, as the SDK
    does."""

    def callbacks(self, config: UpstreamConfig) -> dict[str, Any]:
        """Keyword arguments for the SDK's ``ClientSession`` (its callbacks decide the capabilities declared)."""
        return {}

    async def notified(self, config: UpstreamConfig, notification: types.ServerNotification) -> None:
        """A notification from the upstream (run on its session's receive loop: must not wait for the upstream)."""

    def sending(self, config: UpstreamConfig, session: ClientSession, request_id: int,
                request: Any) -> contextlib.AbstractAsyncContextManager[Any]:
        """Around one request sent upstream; what it yields, when not None, is the request's progress callback."""
        return contextlib.nullcontext()

    async def opened(self, config: UpstreamConfig, up: Upstream) -> None:
        """A connection to the upstream was opened (at start, or again after it was lost), before anything else is
        sent over it: what the gateway's clients asked of the upstream session that ended is said again."""


class _WatchedSession(ClientSession):
    """The SDK's client session, saying when the upstream closed the connection (its receive loop ended): an
    upstream that exits between calls is noticed then, not by the next call."""

    def __init__(self, read: Any, write: Any, config: UpstreamConfig | None = None,
                 hooks: UpstreamHooks | None = None) -> None:
        callbacks = hooks.callbacks(config) if hooks is not None and config is not None else {}
        super().__init__(read, write, message_handler=self._on_message, **callbacks)
        self.ended = asyncio.Event()
        # The upstream said its tools changed (notifications/tools/list_changed): list them again before the next
        # call is sent over this session.
        self.stale = False
        self._config = config
        self._hooks = hooks
        self._answering: set[asyncio.Task[None]] = set()  # the upstream's requests being answered
        self.relisting: asyncio.Future[None] | None = None  # its tools being listed again, while they are

    async def _on_message(self, message: Any) -> None:
        if isinstance(message, types.ServerNotification):
            if isinstance(message.root, types.ToolListChangedNotification):
                self.stale = True
            if self._hooks is not None and self._config is not None:
                await self._hooks.notified(self._config, message)

    async def _received_request(self, responder: Any) -> None:
        if self._hooks is None:
            await super()._received_request(responder)
            return
        # The SDK answers an upstream's request (sampling, elicitation, roots) on the session's receive loop: while
        # the gateway's client thinks (a model, a person at a form), nothing else the upstream sends would be read,
        # not another client's answer, nor a cancel. Answered in a task of its own, the loop reads on.
        task = asyncio.ensure_future(ClientSession._received_request(self, responder))
        self._answering.add(task)
        task.add_done_callback(self._answering.discard)

    async def send_request(self, request: Any, result_type: Any, request_read_timeout_seconds: Any = None,
                           metadata: Any = None, progress_callback: Any = None) -> Any:
        sent = _SENT_ID.get()
        if self._hooks is None or self._config is None:
            if sent is not None:
                sent.append(self._request_id)  # (no await before the SDK takes it)
            return await super().send_request(request, result_type, request_read_timeout_seconds, metadata,
                                              progress_callback)
        # The id the SDK gives this request (read with no await before it is taken): what a cancel names.
        async with self._hooks.sending(self._config, self, self._request_id, request) as progress:
            if sent is not None:
                sent.append(self._request_id)
            return await super().send_request(request, result_type, request_read_timeout_seconds, metadata,
                                              progress or progress_callback)

    async def _receive_loop(self) -> None:
        try:
            await super()._receive_loop()
        finally:
            self.ended.set()


@dataclass
class Upstream:
    """A live client session to one upstream, with the tools it listed."""

    config: UpstreamConfig
    session: ClientSession
    tools: list[types.Tool]
    initialized: types.InitializeResult | None = None  # its capabilities and instructions
    # Each tool's output schema (the very object the SDK's session holds) and its compiled validator.
    _validators: dict[str, tuple[dict[str, Any], Any]] = field(default_factory=dict)

    async def call(self, name: str, args: Mapping[str, Any], idempotency_key: str | None, *,
                   epoch: int | None = None) -> types.CallToolResult:
        """One ``tools/call``; a call that gets no answer raises :class:`OutcomeUnknown`. ``epoch``: the call's
        ownership epoch, sent in ``_meta`` beside the key (:data:`EPOCH_META`).

        A call with no answer within the upstream's ``timeout`` is cancelled upstream (``notifications/cancelled``
        naming its request id) and raises :class:`OutcomeUnknown` with ``late`` set: the request stays out, and
        what the upstream answers to it (its result, or an error confirming the cancel) or the connection's end
        settles it.

        Raises:
            OutcomeUnknown: no answer within the upstream's timeout, or the connection was lost.
            UpstreamRefused: a JSON-RPC error answer (the call did not run).
        """
        meta: dict[str, Any] = {IDEMPOTENCY_META: idempotency_key} if idempotency_key else {}
        if epoch is not None:
            meta[EPOCH_META] = epoch
        request = types.ClientRequest(types.CallToolRequest(params=types.CallToolRequestParams(
            name=name, arguments=dict(args), _meta=types.RequestParams.Meta(**meta) if meta else None)))
        sent: list[int] = []
        ended = self.session.ended if isinstance(self.session, _WatchedSession) else None
        if ended is not None and ended.is_set():
            # Its receive loop is over (the upstream exited, its end seen): a request sent now would never be
            # answered, nor read. Not sent: the caller sends it over a connection opened again.
            raise _NotSent(f"upstream {self.config.name}: the connection was already closed")

        async def send() -> types.CallToolResult:
            _SENT_ID.set(sent)  # (this task's own context)
            answer: types.CallToolResult = await self.session.send_request(request, types.CallToolResult)
            return answer

        # Sent from a task of its own, with no read timeout of the SDK's: past the timeout the request stays out
        # (the SDK would forget it, and drop the upstream's late answer), so its answer can still settle the call.
        pending = asyncio.ensure_future(send())
        ending = asyncio.ensure_future(ended.wait()) if ended is not None else None
        try:
            await asyncio.wait({pending} | ({ending} if ending else set()), timeout=self.config.timeout,
                               return_when=asyncio.FIRST_COMPLETED)
            if not pending.done() and ending is not None and ending.done():
                # The connection ended while the request was out. The SDK answers every request it had registered
                # (connection closed); one registered after its receive loop ended is answered by nobody, and can
                # no longer land either: not waited for until the timeout.
                await asyncio.wait({pending}, timeout=_CLOSING_SECONDS)
                if not pending.done():
                    pending.cancel()
                    pending.add_done_callback(_retrieved)
                    raise OutcomeUnknown(f"upstream {self.config.name}: the connection ended while {name} was out")
        except BaseException:
            # The caller was cancelled (a client's cancel of a SAFE call): the request goes with it (the relay
            # tells the upstream, see ``UpstreamHooks.sending``).
            if not pending.done():
                pending.cancel()
                pending.add_done_callback(_retrieved)
            raise
        finally:
            if ending is not None:
                ending.cancel()
        if pending.done():
            return await self._answered(name, pending)
        rid = sent[0] if sent else None
        if rid is not None:
            await self._cancel(rid, f"no answer within {self.config.timeout:g} s (the gateway's timeout for "
                                    f"upstream {self.config.name})")
        late = asyncio.ensure_future(self._late(name, pending))
        late.add_done_callback(_retrieved)  # (retrieved even when nobody settles on it: a CLI's compensation)
        unknown = OutcomeUnknown(f"upstream {self.config.name}: no answer to {name} within {self.config.timeout:g} s; "
                                 "asked it to cancel the call", lost=False, late=late)
        unknown.timeout = self.config.timeout
        raise unknown

    async def _cancel(self, request_id: int, reason: str) -> None:
        """Tell the upstream to cancel a request it was sent (a notification: nothing answers it)."""
        with anyio.move_on_after(_CANCEL_SEND_SECONDS), contextlib.suppress(Exception):
            await self.session.send_notification(types.ClientNotification(types.CancelledNotification(
                params=types.CancelledNotificationParams(requestId=request_id, reason=reason))))

    async def _late(self, name: str, pending: asyncio.Future[types.CallToolResult]) -> types.CallToolResult:
        """The upstream's answer to a request it was asked to cancel: its result (it ran, or ran on), else an
        ``OutcomeUnknown`` whose request can no longer land."""
        try:
            await asyncio.wait({pending})
            return await self._answered(name, pending)
        except OutcomeUnknown as exc:
            exc.confirmed = True  # answered (an error: the cancel confirmed) or its connection ended
            raise
        except _NotSent as exc:  # (its hand-off failed after the timeout: it never left this process)
            raise OutcomeUnknown(str(exc)) from exc
        except UpstreamRefused as exc:
            gone = OutcomeUnknown(f"upstream {self.config.name} answered the cancelled {name} with an error "
                                  f"({exc}): it can no longer land", lost=False)
            gone.confirmed = True
            raise gone from exc

    async def _answered(self, name: str, pending: asyncio.Future[types.CallToolResult]) -> types.CallToolResult:
        """The result of a request the upstream answered (or whose connection ended), as :meth:`call` gives it."""
        try:
            try:
                result = pending.result()
            except (anyio.ClosedResourceError, anyio.BrokenResourceError) as exc:
                # Raised only by the hand-off of the request to the transport (the session's write stream, closed
                # when the upstream's side ended; unbuffered, so a refused hand-off is a request never taken):
                # the call did not leave this process.
                raise _NotSent(f"upstream {self.config.name}: the connection was already closed") from exc
            if not result.isError:
                if name not in self._schemas():
                    await self.session.list_tools()  # fills the SDK's cache, as its call_tool does for a new tool
                self._check_output(name, result)
        except McpError as exc:
            if exc.error.code in (types.CONNECTION_CLOSED, _TIMEOUT_CODE):
                raise OutcomeUnknown(f"upstream {self.config.name}: {exc.error.message}",
                                     lost=exc.error.code == types.CONNECTION_CLOSED) from exc
            raise UpstreamRefused(f"upstream {self.config.name} refused {name}: {exc.error.message}") from exc
        except _NotSent:
            raise
        except (TimeoutError, OSError, EOFError) as exc:
            raise OutcomeUnknown(f"upstream {self.config.name}: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:
            # anyio's ClosedResourceError / BrokenResourceError: the stream under the session went away.
            if type(exc).__module__.startswith("anyio"):
                raise OutcomeUnknown(f"upstream {self.config.name}: the connection was lost") from exc
            raise
        return result

    # The SDK client's check of a result's structured content against the tool's listed output schema, with the
    # schema compiled once per tool: the SDK's own ``call_tool`` checks the schema against the JSON Schema
    # metaschema again on every call (``jsonschema.validate``), which costs more CPU than the rest of the
    # gateway's hop to the upstream. The outcome is the SDK's: the schemas its session holds (listed again when a
    # tool is new to it), the same errors; a tool with no output schema is not checked.

    def _schemas(self) -> dict[str, dict[str, Any] | None]:
        # The SDK session's own cache of output schemas (mcp 1.x; refreshed by every list_tools).
        schemas: dict[str, dict[str, Any] | None] = self.session._tool_output_schemas
        return schemas

    def _check_output(self, name: str, result: types.CallToolResult) -> None:
        schema = self._schemas().get(name)
        if schema is None:
            return
        compiled = self._validators.get(name)
        if compiled is None or compiled[0] is not schema:  # new, or listed again since: compile what is held now
            compiled = self._validators[name] = (schema, _compile(name, schema))
        if result.structuredContent is None:
            raise RuntimeError(f"Tool {name} has an output schema but did not return structured content")
        try:
            compiled[1].validate(result.structuredContent)
        except ValidationError as e:
            raise RuntimeError(f"Invalid structured content returned by tool {name}: {e}") from None
        except Unresolvable as e:
            raise RuntimeError(f"Invalid schema for tool {name}: {e}") from e


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Take a finished future's outcome, so that one nobody awaits is not reported as never retrieved."""
    if not fut.cancelled():
        fut.exception()


def _compile(name: str, schema: dict[str, Any]) -> Any:
    """A validator for ``schema``, checked against its metaschema once, ``$ref``s resolved within the schema itself
    (an empty registry, as the SDK's)."""
    cls = validator_for(schema)
    try:
        cls.check_schema(schema)
    except SchemaError as e:
        raise RuntimeError(f"Invalid schema for tool {name}: {e}") from None
    return cls(schema, registry=Registry())


@contextlib.asynccontextmanager
async def connect(config: UpstreamConfig, hooks: UpstreamHooks | None = None) -> AsyncIterator[Upstream]:
    """Open a session to ``config``'s upstream, initialise it and list its tools, within the upstream's
    ``start_timeout`` (one that starts and then says nothing must not hold the gateway, or a call, for ever).

    Example:
        >>> async with connect(cfg.upstreams["tickets"]) as up:
        ...     result = await up.call("search_tickets", {"q": "refund"}, None)
    """
    async with contextlib.AsyncExitStack() as stack:
        if config.command:
            # The SDK's safe default environment (PATH, HOME, ...) plus the config's env: never the gateway's own
            # environment, which may hold the database's credentials.
            params = StdioServerParameters(command=config.command[0], args=list(config.command[1:]),
                                           env=dict(config.env) or None,
                                           cwd=str(config.cwd) if config.cwd else None)
            read, write = await stack.enter_async_context(stdio_client(params))
        else:
            assert config.url is not None
            read, write, _ = await stack.enter_async_context(streamablehttp_client(config.url))
        session = await stack.enter_async_context(_WatchedSession(read, write, config, hooks))
        try:
            with anyio.fail_after(config.start_timeout):
                initialized = await session.initialize()
                tools = await _list_all(session)
        except TimeoutError:
            raise TimeoutError(f"it did not answer initialize and tools/list within {config.start_timeout:g} s "
                               "(start_timeout)") from None
        yield Upstream(config, session, tools, initialized)


async def _list_all(session: ClientSession) -> list[types.Tool]:
    """Every tool the session's upstream lists, page after page."""
    listed = await session.list_tools()
    tools = list(listed.tools)
    cursor = listed.nextCursor
    while cursor:
        page = await session.list_tools(cursor=cursor)
        tools.extend(page.tools)
        cursor = page.nextCursor
    return tools


async def list_tools(config: UpstreamConfig) -> list[types.Tool]:
    """The upstream's tools, through a connection opened for this question alone."""
    async with connect(config) as up:
        return up.tools


class Connections:
    """One connection per upstream on the running event loop, opened on first use and opened again after it was
    lost (an upstream that crashed is started again by the next call to it).

    Each connection's context is entered and left by a holder task of its own, as anyio requires of its cancel
    scopes; callers on any task of the same loop share it.

    Example:
        >>> conns = Connections()
        >>> result = await conns.call(cfg.upstreams["tickets"], "close_ticket", {"id": 7}, "undo-12")
        >>> await conns.close()
    """

    def __init__(self, on_open: Callable[[UpstreamConfig, Upstream], Awaitable[None]] | None = None,
                 hooks: UpstreamHooks | None = None) -> None:
        # Called with each connection opened, before any call is sent over it (the gateway re-lists a restarted
        # upstream's tools); what it raises fails the opening.
        self.on_open = on_open
        self.hooks = hooks  # the gateway's relay of what is not a tool call (None: refused, as the SDK does)
        self._open: dict[tuple[Any, ...], asyncio.Future[Upstream]] = {}
        self._holders: dict[asyncio.Task[None], asyncio.Event] = {}  # each holder task, and what stops it

    @staticmethod
    def _ident(config: UpstreamConfig) -> tuple[Any, ...]:
        return (config.name, config.command, config.url, str(config.cwd), tuple(sorted(config.env.items())))

    async def get(self, config: UpstreamConfig) -> Upstream:
        """The live connection to ``config``'s upstream, opened (and its tools listed) when there is none."""
        ident = self._ident(config)
        opened = self._open.get(ident)
        if opened is None:
            opened = self._open[ident] = asyncio.get_running_loop().create_future()
            stop = asyncio.Event()
            for done in [h for h in self._holders if h.done()]:  # connections that ended: nothing to stop
                del self._holders[done]
            self._holders[asyncio.ensure_future(self._hold(config, opened, stop))] = stop
        try:
            return await asyncio.shield(opened)
        except BaseException:
            if self._open.get(ident) is opened:
                del self._open[ident]
            raise

    async def call(self, config: UpstreamConfig, name: str, args: Mapping[str, Any], key: str | None, *,
                   check: Callable[[], None] | None = None, epoch: int | None = None) -> types.CallToolResult:
        """One call over the live connection; a lost connection is dropped, so the next call opens another.
        ``check`` runs once the connection is open, before the call is sent; what it raises is not sent.

        Raises:
            UpstreamUnavailable: the upstream could not be started to take the call (it did not run).
            OutcomeUnknown, UpstreamRefused: as :meth:`Upstream.call`.
        """
        for attempt in (1, 2):
            try:
                up = await self.get(config)
            except Exception as exc:  # noqa: BLE001 - whatever stopped it starting, the call was never sent
                raise UpstreamUnavailable(f"upstream {config.name} could not be started: {first_cause(exc)}") from exc
            while isinstance(up.session, _WatchedSession) and (up.session.stale or up.session.relisting):
                await self._relist(config, up)  # (or waits for the listing in progress: the call goes after it)
            if check is not None:
                check()
            try:
                return await up.call(name, args, key, epoch=epoch)
            except _NotSent as exc:
                # It went away between calls, before its end was noticed: the call was never sent, so it goes
                # to the upstream started again (once: a second closed connection is not a race).
                self._drop(config, up)
                if attempt == 2:
                    raise UpstreamUnavailable(f"{exc}; started again, it closed at once") from exc
            except OutcomeUnknown as exc:
                if isinstance(up.session, _WatchedSession):
                    exc.ended = up.session.ended
                if exc.lost:
                    self._drop(config, up)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    async def _relist(self, config: UpstreamConfig, up: Upstream) -> None:
        """List a live upstream's tools again after it said they changed, and hand them to ``on_open`` as for a
        connection just opened."""
        session = up.session
        assert isinstance(session, _WatchedSession)
        if session.relisting is not None:
            # Listed again already (on the upstream's notice, or by another call): a call waits for that listing
            # and its registration, so it is checked against the contract it finds, never sent before it.
            await asyncio.shield(session.relisting)
            return
        session.relisting = done = asyncio.get_running_loop().create_future()
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even when nobody waited
        session.stale = False  # (before the await: calls meanwhile do not list it twice over)
        try:
            with anyio.fail_after(config.timeout):
                up.tools = await _list_all(session)
            if self.on_open is not None:
                await self.on_open(config, up)
        except Exception as exc:  # noqa: BLE001 - the call is not sent on a listing that could not be read
            session.stale = True
            failed = UpstreamUnavailable(f"upstream {config.name} said its tools changed and could not be listed "
                                         f"again: {first_cause(exc)}")
            done.set_exception(failed)
            raise failed from exc
        except BaseException:
            done.cancel()
            raise
        else:
            done.set_result(None)
        finally:
            session.relisting = None

    def _drop(self, config: UpstreamConfig, up: Upstream) -> None:
        """Forget ``up`` as ``config``'s live connection (if it still is): the next call opens another."""
        ident = self._ident(config)
        current = self._open.get(ident)
        if current is not None and current.done() and not current.exception() and current.result() is up:
            del self._open[ident]

    async def close(self) -> None:
        """Close every connection (each holder leaves its context; stdio upstreams exit)."""
        for stop in self._holders.values():
            stop.set()
        self._open.clear()
        if self._holders:
            await asyncio.gather(*self._holders, return_exceptions=True)
        self._holders.clear()

    async def _hold(self, config: UpstreamConfig, opened: asyncio.Future[Upstream], stop: asyncio.Event) -> None:
        try:
            async with connect(config, self.hooks) as up:
                if self.hooks is not None:
                    await self.hooks.opened(config, up)  # (before any caller is handed the connection)
                if self.on_open is not None:
                    await self.on_open(config, up)
                opened.set_result(up)
                ended = up.session.ended if isinstance(up.session, _WatchedSession) else asyncio.Event()
                waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(ended.wait())]
                try:
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
                if not stop.is_set():
                    # The upstream exited (or closed its side) between calls: the next call starts it again.
                    log.warning("upstream %s closed its connection; the next call to it starts it again", config.name)
                    self._drop(config, up)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting callers; a lost one is reopened
            if not opened.done():
                opened.set_exception(exc)


class Portal:
    """Connections to upstreams for code that runs outside the gateway (the CLI's rollback, the desk's recovery):
    one background event loop in this process holds one connection per upstream, so a rollback of many calls
    starts each upstream once, whatever loop (or none) each compensation is called from.

    Example:
        >>> result = await PORTAL.call(cfg.upstreams["tickets"], "close_ticket", {"id": 7}, "undo-12")
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connections: Connections | None = None

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="undolog-mcp-portal", daemon=True).start()
                self._loop = loop
            return self._loop

    async def call(self, config: UpstreamConfig, name: str, args: Mapping[str, Any],
                   key: str | None, *, epoch: int | None = None) -> types.CallToolResult:
        """One call over this process's connection to ``config``'s upstream (opened on first use)."""
        loop = self._ensure_loop()
        fut: concurrent.futures.Future[types.CallToolResult] = asyncio.run_coroutine_threadsafe(
            self._call(config, name, args, key, epoch), loop)
        return await asyncio.wrap_future(fut)

    async def _call(self, config: UpstreamConfig, name: str, args: Mapping[str, Any],
                    key: str | None, epoch: int | None = None) -> types.CallToolResult:
        if self._connections is None:
            self._connections = Connections()
        return await self._connections.call(config, name, args, key, epoch=epoch)


PORTAL = Portal()
