"""The MCP gateway: an MCP server that fronts upstream MCP servers and routes every ``tools/call`` by its tier.

SAFE calls pass through. COMPENSABLE calls are pre-written (effect and undo entry), forwarded with their
idempotency key in ``_meta``, and marked. IRREVERSIBLE calls are not forwarded until a person approves them at
the desk, the REST API or the CLI (or, opted in per tool, through the client's own elicitation form). A tool the
config does not classify is not exposed, so nothing unclassified can run.

Every call goes through the core's one call driver, so the checks are those of every other caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
from mcp import types
from mcp.server.lowlevel import Server

from undolog_core import ToolTier, UndoLog
from undolog_core.errors import (
    CallIdConflict,
    CallRunning,
    ConfigurationError,
    ContractChanged,
    InvalidEffectState,
    SessionClosed,
    SessionHalted,
    UndoLogError,
)
from undolog_core.integration import (
    IN_FLIGHT,
    WAKE_SIGNAL,
    AwaitingApproval,
    Completed,
    NothingHappened,
    ToolSpec,
    find_call,
    session_of_client_key,
)

from .approvals import SharedRequest, find_shared
from .capture import capture_before
from .client_keys import CLIENT_KEY_META, checked_key, client_call_id, reused
from .config import Approval, CompensationTemplate, Decline, GatewayConfig, ToolConfig, UpstreamConfig
from .elicit import elicit_decision
from .front_door import FrontDoor, SessionBook, live_sessions
from .lifecycle import changed_elsewhere, refusal, told_new_session
from .passthrough import Passthrough
from .probes import probe_verdict, settle_when_gone
from .relay import GatewayServer, Relay
from .results import META_KEY as META_KEY  # re-exported: it was defined here
from .results import (
    awaiting_result,
    call_key,
    canonical_arguments,
    error_result,
    replayed,
    running_result,
    settling_result,
    structured,
    text_of,
    unknown_result,
)
from .sessions import SESSION_HEADER, SESSION_META, SessionRouter
from .stdio_limits import MAX_LINE_BYTES
from .templates import BEFORE_KEY
from .upstream import PORTAL, Connections, OutcomeUnknown, Upstream, UpstreamRefused, first_cause
from .variants import pinned_sent, pinned_tool

log = logging.getLogger("undolog.mcp")

# Who the HTTP transport authenticated, in the ASGI scope of the request (absent over stdio).
PRINCIPAL_SCOPE_KEY = "undolog.principal"
# How often a gateway that cannot be woken by a signal (not on the main thread's loop) looks for rollbacks filed
# for the sessions it serves (one indexed read).
OWNER_POLL_SECONDS = 0.25
# The UndoLog session the request being served was logged under, and whether its client named it (per request:
# each tools/call is handled in a task of its own).
_SESSION_USED: contextvars.ContextVar[str | None] = contextvars.ContextVar("undolog_mcp_session", default=None)
_SESSION_NAMED: contextvars.ContextVar[bool] = contextvars.ContextVar("undolog_mcp_session_named", default=False)
# The client's own idempotency key of the request being served (``_meta`` ``dev.undolog/idempotency-key``), if any.
_CLIENT_KEY: contextvars.ContextVar[Any] = contextvars.ContextVar("undolog_mcp_client_key", default=None)
# The API key (``key:<id>``) the HTTP transport authenticated for the request being served; None over stdio.
_PRINCIPAL: contextvars.ContextVar[str | None] = contextvars.ContextVar("undolog_mcp_principal", default=None)


async def _plain(send: Any, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"error": message}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


@dataclass
class ExposedTool:
    """One upstream tool as the gateway's clients see it."""

    exposed_name: str
    config: ToolConfig
    listed: types.Tool
    spec: ToolSpec | None = None


@dataclass
class Exposure:
    """What the gateway exposes after reading the upstreams' listings, and what it said it left out."""

    tools: dict[str, ExposedTool] = field(default_factory=dict)
    unclassified: list[str] = field(default_factory=list)  # "upstream/tool": listed upstream, no tier in the config
    missing: list[str] = field(default_factory=list)  # classified in the config, not listed by its upstream


def plan_exposure(config: GatewayConfig, listed: Mapping[str, list[types.Tool]]) -> Exposure:
    """Decide the exposed names.

    An upstream's own name (a pinned variant's: its config name), prefixed ``<upstream>_`` only where two
    would clash.
    """
    exposure = Exposure()
    # (upstream, its config entry, the tool as exposed): the listed tool, with a pinned tool's pins hidden.
    planned: list[tuple[str, ToolConfig, types.Tool]] = []
    for up, tools in listed.items():
        by_name = {t.name: t for t in tools}
        for t in tools:
            cfg = config.tools.get((up, t.name))
            if cfg is None:
                exposure.unclassified.append(f"{up}/{t.name}")
            elif cfg.of is not None:
                raise ConfigurationError(f"gateway config: [tools.{up}.{t.name}] is a variant of {cfg.of}, but "
                                         f"{up} lists a tool of that name itself; name the variant otherwise")
            else:
                planned.append((up, cfg, pinned_tool(t, cfg.pin)))
        for (u2, _name), cfg in config.tools.items():
            if u2 == up and cfg.of is not None and cfg.of in by_name:
                planned.append((up, cfg, pinned_tool(by_name[cfg.of], cfg.pin)))
    counts: dict[str, int] = {}
    for _, cfg, _t in planned:
        counts[cfg.name] = counts.get(cfg.name, 0) + 1
    for up, cfg, t in planned:
        by_name = {x.name: x for x in listed[up]}
        exposed = cfg.name if counts[cfg.name] == 1 else f"{up}_{cfg.name}"
        clash = exposure.tools.get(exposed)
        if clash is not None:
            # A prefixed name can meet another upstream's own tool of that name: one would shadow the other.
            raise ConfigurationError(
                f"gateway config: two tools would be exposed as {exposed!r}: {clash.config.upstream}/"
                f"{clash.config.name} and {up}/{cfg.name}; rename an upstream, or leave one of them unclassified")
        comp = cfg.compensation
        for needed, what in ((comp.tool if comp else None, "compensation"), (cfg.probe, "probe"),
                             (comp.capture.tool if comp and comp.capture else None, "capture")):
            if needed is not None and needed not in by_name:
                raise UndoLogError(f"gateway config: the {what} tool {needed!r} of [tools.{up}.{cfg.name}] is not "
                                   f"a tool of upstream {up!r} (it lists {', '.join(sorted(by_name))})")
        if comp is not None and comp.capture is not None:
            reader = config.tools.get((up, comp.capture.tool))
            if reader is not None and reader.tier is not ToolTier.SAFE:
                raise ConfigurationError(f"gateway config: the capture tool {comp.capture.tool!r} of "
                                         f"[tools.{up}.{cfg.name}] is classified {reader.tier.value}; a capture "
                                         "runs before every call and must be a safe (read-only) tool")
        if comp is not None:
            _check_template(up, t, comp)
        exposure.tools[exposed] = ExposedTool(exposed, cfg, t)
    for (up, name), cfg in config.tools.items():
        if up in listed and cfg.upstream_tool not in {t.name for t in listed[up]}:
            exposure.missing.append(f"{up}/{name}")
    return exposure


def _check_template(up: str, tool: types.Tool, template: CompensationTemplate) -> None:
    """Check a compensation's placeholders against what the tool takes and answers.

    What it takes is its input schema's properties; what it answers, its output schema's, when it lists one. A typo
    is found here, not at rollback, where the compensation could not be built and the session would halt.
    """
    shapes = {"args": tool.inputSchema or {}, "result": tool.outputSchema or {}}
    for source, name, placeholder in template.fields():
        props = shapes[source].get("properties")
        if isinstance(props, Mapping) and name not in props:
            what = "takes" if source == "args" else "answers"
            raise ConfigurationError(
                f"gateway config: [tools.{up}.{tool.name}] compensation uses {{{placeholder}}}, but {tool.name} "
                f"{what} only {', '.join(sorted(props)) or 'nothing'}")


def _listing(tools: list[types.Tool]) -> dict[str, Any]:
    """A listing as compared for changes: each tool's whole definition, by name."""
    return {t.name: t.model_dump(mode="json", exclude_none=True) for t in tools}


def _awaiting(shared: SharedRequest) -> AwaitingApproval:
    """The notice of a pending request another session of the key raised, for a call that joined it."""
    rec = shared.request
    return AwaitingApproval(rec.effect_id, rec.approval_request_id, min(max(rec.seconds_left, 1.0), 30.0),
                            rec.tool_name, dict(rec.proposed_args), rec.reason, tuple(rec.risk_tags), rec.timeout_at,
                            rec.call_id)


_UNKNOWN_ON = (OutcomeUnknown,)


def _failure_of(result: types.CallToolResult) -> NothingHappened | None:
    """A tool result with ``isError``: the call ran and did nothing (the driver records it failed)."""
    return NothingHappened(text_of(result) or "the upstream answered isError") if result.isError else None


def _result_of(result: types.CallToolResult) -> dict[str, Any]:
    """What is recorded of a result: its JSON form as sent on the wire (replayed, and read by compensations)."""
    return result.model_dump(mode="json", by_alias=True, exclude_none=True)


def _guarded(ex: ExposedTool) -> contextlib.AbstractContextManager[Any]:
    """Shield a logged call (COMPENSABLE, or IRREVERSIBLE once approved) from the client's cancel.

    Where such a call is decided, forwarded and marked, the client's cancel (``notifications/cancelled``) or its
    going away must not stop the gateway: the pre-write done,
    the call sent, the upstream does it anyway, and the gateway must record what it answered rather than leave
    the call in flight while the session goes on. The upstream's ``timeout`` bounds how long that takes. A SAFE
    call logs nothing: cancelling it leaves nothing behind.
    """
    if ex.config.tier is ToolTier.SAFE:
        return contextlib.nullcontext()
    return anyio.CancelScope(shield=True)


class Gateway:
    """The gateway over one config and one UndoLog.

    Example:
        >>> gw = Gateway(load_config("gateway.toml"), UndoLog.open("sqlite:///undolog.db"))
        >>> anyio.run(gw.serve_stdio)
    """

    def __init__(self, config: GatewayConfig, undolog: UndoLog) -> None:
        self.config = config
        self.undolog = undolog
        self.exposure = Exposure()
        self._listed: dict[str, list[types.Tool]] = {}  # what each upstream listed when last registered
        self.connections: Connections | None = None  # the live upstreams, while running
        self._loop: asyncio.AbstractEventLoop | None = None
        # Which UndoLog session each call is logged under (the config's ``session`` grouping).
        self.sessions = SessionRouter(undolog, config.session, config.session_idle)
        self._upstream_calls: dict[str, Callable[..., Awaitable[types.CallToolResult]]] = {}  # see _upstream_call
        self._joined: set[tuple[str, str]] = set()  # (request, session) joins written, so a re-ask writes none
        # Calls held ``settling`` (a probe said "not yet" while the request could still land), each waiting for its
        # connection to end (probes.settle_when_gone).
        self._settling: set[asyncio.Task[None]] = set()
        self.server: Server[Any, Any] = self._build_server()
        # Everything but tool calls: the upstreams' requests to the client, notifications, progress, cancels
        # (relay.py), and their resources, prompts, completion and logging (passthrough.py).
        assert isinstance(self.server, GatewayServer)
        self.relay = Relay(self.server, one_client=False)
        self.passthrough = Passthrough(config, self.server, self.relay)
        self.server.advertise = lambda: (self.passthrough.capabilities(), self.passthrough.instructions())

    # -- registration -------------------------------------------------------------------------------

    def register(self, listed: Mapping[str, list[types.Tool]]) -> Exposure:
        """Register every classified tool of the upstreams' listings with the UndoLog.

        Each with its compensation and probe. The contract holds the upstream's identity, the tool's input and output schemas and the compensation's
        template (not its description or annotations): an upstream that changes those makes a new revision, which
        cancels approvals bound to the old.
        """
        exposure = plan_exposure(self.config, listed)
        for ex in exposure.tools.values():
            cfg, tool = ex.config, ex.listed
            up = self.config.upstreams[cfg.upstream]
            schema = dict(tool.inputSchema or {"type": "object"})
            binding: dict[str, Any] = {
                "kind": "mcp",
                "upstream": cfg.upstream,
                "upstream_tool": tool.name,
                **({"pin": dict(cfg.pin)} if cfg.pin else {}),
                "server": up.describe(),
                # Not the description nor the annotations: an upstream rewords them at will (or lists them otherwise
                # when started again), and no MCP client can revalidate a session; what the call does is its
                # identity, its schemas and its undo.
                "output_schema": tool.outputSchema,
            }
            kwargs: dict[str, Any] = {
                "name": ex.exposed_name, "tier": cfg.tier.value, "reason": cfg.reason_or_default,
                "risk_tags": list(cfg.risk_tags), "args_schema": schema,
            }
            if cfg.compensation is not None:
                binding["compensation"] = cfg.compensation.describe()
                comp_name = f"mcp:{cfg.upstream}.{cfg.name}.undo"
                self.undolog.register_compensation(self._compensator(cfg), name=comp_name)
                kwargs["compensation"] = comp_name
                kwargs["compensation_needs_result"] = cfg.compensation.needs_result
            if cfg.probe is not None:
                binding["probe"] = cfg.probe
                kwargs["probe"] = self._prober(cfg)
            ex.spec = self.undolog.register_tool(None, binding=binding, registered_by="undolog:mcp-gateway",
                                                 **kwargs)
        # Swapped in whole: calls running meanwhile (a re-listing while serving) see the old exposure or the new.
        self.exposure = exposure
        self._listed = {name: list(tools) for name, tools in listed.items()}
        return exposure

    async def _relisted(self, config: UpstreamConfig, up: Upstream) -> None:
        """List an upstream's tools anew when it started again or said its tools changed.

        An upstream started again (after a crash, or for a call after it exited), or one that said its tools
        changed, lists its tools anew: when a classified tool changed (an upgrade, ``npx pkg@latest``, a plugin
        loaded), it is registered as a new revision at once, which cancels approvals bound to the old contract; a
        call decided against the old one is not sent (see call).
        """
        before = self._listed.get(config.name)
        if before is None or _listing(before) == _listing(up.tools):
            return
        changed = sorted(n for n in set(_listing(before)) | set(_listing(up.tools))
                         if _listing(before).get(n) != _listing(up.tools).get(n)
                         and (config.name, n) in self.config.tools)
        listed = {**self._listed, config.name: list(up.tools)}
        await asyncio.to_thread(self.register, listed)
        if changed:
            log.warning("upstream %s lists changed tools (%s): registered anew; approvals bound to the old contracts "
                        "are cancelled", config.name, ", ".join(changed))

    def _upstream_call(self, upstream: str) -> Callable[..., Awaitable[types.CallToolResult]]:
        """A coroutine function calling one tool of ``upstream``.

        Over the gateway's live session when this runs on the gateway's own loop, else over a connection
        opened for it (the CLI, the desk, recovery). Made once per upstream (every call reads the live
        connections when it runs, so one function serves for the gateway's life).
        """
        made = self._upstream_calls.get(upstream)
        if made is None:
            made = self._upstream_calls[upstream] = self._make_upstream_call(upstream)
        return made

    def _make_upstream_call(self, upstream: str) -> Callable[..., Awaitable[types.CallToolResult]]:
        cfg = self.config.upstreams[upstream]

        async def call(name: str, args: Mapping[str, Any], key: str | None,
                       check: Callable[[], None] | None = None, epoch: int | None = None) -> types.CallToolResult:
            connections, loop = self.connections, self._loop
            if connections is not None and asyncio.get_running_loop() is loop:
                return await connections.call(cfg, name, args, key, check=check, epoch=epoch)
            if connections is not None and loop is not None and loop.is_running():
                # Called off the gateway's loop while it serves (the settle-at-once of an unknown outcome runs in
                # a worker thread): still over the live connection, so the compensation or the probe reaches the
                # upstream process that did the work (or the one started again in its place), never a second one.
                fut = asyncio.run_coroutine_threadsafe(
                    connections.call(cfg, name, args, key, check=check, epoch=epoch), loop)
                return await asyncio.wrap_future(fut)
            return await PORTAL.call(cfg, name, args, key, epoch=epoch)

        return call

    def _compensator(self, cfg: ToolConfig) -> Any:
        template = cfg.compensation
        assert template is not None
        call = self._upstream_call(cfg.upstream)
        pins = dict(cfg.pin)

        async def compensate(ctx: Any) -> None:
            args = dict(ctx.args)
            before = args.pop(BEFORE_KEY, None)  # what capture read before the call, stored with the undo entry
            calls = template.calls({**args, **pins}, structured(ctx.result), undo_key=ctx.idempotency_key,
                                   forward_key=f"do-{ctx.effect_id}", before=before)
            # One call per element (for_each), newest first, each with its own key: a retry after a crash sends
            # the ones already done again with the same key.
            for comp_args, key in calls:
                out = await call(template.tool, comp_args, key)
                if out.isError:
                    raise UndoLogError(f"compensation {template.tool} of {cfg.name} answered an error: "
                                       f"{text_of(out)}")

        compensate.__name__ = f"compensate_{cfg.name}"
        return compensate

    def _prober(self, cfg: ToolConfig) -> Any:
        """Recovery's question to the upstream.

        Did this call happen? The probe tool gets the call's arguments and idempotency key, and answers
        ``{"happened": bool, "result": ...}`` (three answers: see ``probes``).
        """
        probe_tool = cfg.probe
        assert probe_tool is not None
        call = self._upstream_call(cfg.upstream)

        async def probe(ctx: Any) -> Any:
            # The probe carries the claim's epoch in _meta: an upstream fencing by epoch learns of the take-over.
            out = await call(probe_tool, {"tool": cfg.name, "args": ctx.args, "idempotency_key": ctx.idempotency_key},
                             None, None, ctx.epoch)
            return probe_verdict(out, probe_tool)

        return probe

    # -- the MCP server -----------------------------------------------------------------------------

    def _build_server(self) -> Server[Any, Any]:
        # No per-session lifespan: the upstreams are connected once for the gateway (``running``), however many
        # MCP client sessions the HTTP transport serves.
        server: Server[Any, Any] = GatewayServer("undolog-gateway")

        @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
        async def _list() -> list[types.Tool]:
            return [self._advertised(ex) for ex in self.exposure.tools.values()]

        # Input is validated here, against the upstream's schema, so a bad call names the failing path.
        @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
        async def _call(name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
            result = await self.call(name, arguments or {})
            used = _SESSION_USED.get()
            if used is not None:
                # Every answer says which UndoLog session the call was logged in: the id a client may name later.
                result = result.model_copy(update={"meta": {**(result.meta or {}), SESSION_META: used}})
            # A client that cancelled while a logged call finished (shielded, see _guarded) was already answered by
            # the SDK ("Request cancelled"): the cancellation is taken here, so the SDK does not answer twice (it
            # asserts it does not, and the assertion would stop the gateway).
            await anyio.lowlevel.checkpoint_if_cancelled()
            return result

        return server

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Gateway]:
        """Connect the upstreams, register their classified tools, and finish what a crash left in flight."""
        self._loop = asyncio.get_running_loop()
        self.connections = connections = Connections(hooks=self.relay)
        self.passthrough.connect = connections.get
        self.relay.upstreams = self.passthrough.live
        self.relay.on_listing_changed = self._listing_changed
        self.relay.on_resource_updated = self.passthrough.resource_updated
        try:
            listed: dict[str, list[types.Tool]] = {}
            for name, cfg in self.config.upstreams.items():
                try:
                    up = await connections.get(cfg)
                    self.passthrough.note(up)
                    listed[name] = up.tools
                except Exception as exc:  # noqa: BLE001 - said in one line naming the upstream, not a task group's trace
                    raise ConfigurationError(f"upstream {name!r} could not be started and listed: "
                                             f"{first_cause(exc)}") from exc
            exposure = self.register(listed)
            connections.on_open = self._opened  # from now on, an upstream started again is listed anew
            for line in self.passthrough.describe():
                log.info("%s", line)
            for skipped in exposure.unclassified:
                log.warning("not exposed (no tier in the config): %s", skipped)
            for gone in exposure.missing:
                log.warning("classified in the config but not listed by its upstream: %s", gone)
            report = await asyncio.to_thread(self.undolog.recover)
            if report.reconciled or report.rollbacks_resumed:
                log.warning("recovery at start: %s", report.to_dict())
            owning = asyncio.ensure_future(self._own_sessions())
            try:
                yield self
            finally:
                owning.cancel()
                with contextlib.suppress(BaseException):
                    await owning
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(self.undolog.owners.let_go)
        finally:
            # Calls still settling are left in flight (their lease lapses with this process): with the upstream
            # closed below, the next start's recovery settles them, their request then unable to land.
            for task in list(self._settling):
                task.cancel()
            if self._settling:
                await asyncio.gather(*self._settling, return_exceptions=True)
            self.connections = None
            self._loop = None
            await connections.close()

    async def _opened(self, config: UpstreamConfig, up: Upstream) -> None:
        self.passthrough.note(up)
        await self._relisted(config, up)

    def _exposed_listing(self) -> dict[str, Any]:
        return {name: self._advertised(ex).model_dump(mode="json", exclude_none=True)
                for name, ex in self.exposure.tools.items()}

    async def _listing_changed(self, config: UpstreamConfig, kind: str) -> None:
        """An upstream said its tools, resources or prompts changed.

        Its tools are listed again at once (and registered: see _relisted); the clients are told when what the
        gateway exposes changed (a tool the config does not classify stays hidden, so its coming says
        nothing).
        """
        if kind != "tools":
            await self.passthrough.listing_changed(config, kind)
            return
        if self.connections is None:
            return
        before = self._exposed_listing()
        up = await self.connections.get(config)
        if getattr(up.session, "stale", False):  # (not yet listed again by a call meanwhile)
            await self.connections._relist(config, up)
        if self._exposed_listing() != before:
            await self.relay.broadcast(types.ServerNotification(types.ToolListChangedNotification()))

    async def _own_sessions(self) -> None:
        """Hold a lease on every session this gateway serves, and run the rollbacks filed for them here.

        The rollbacks (filed from the CLI, the desk) run over the live upstream connections that did the work: an
        upstream whose state lives in its own process is undone in that process, not in a fresh one started for
        the rollback.

        No statement between calls but the lease's renewal: a new session is held as it starts; a requester on
        this host wakes the loop with a signal (``_owners.WAKE_SIGNAL``) to look for what it filed; one on another
        host is found at the next renewal.
        """
        owners = self.undolog.owners
        loop = asyncio.get_running_loop()
        renew_every = owners.lease_seconds / 3.0
        renewed = loop.time()
        filed = asyncio.Event()
        signalled = False
        if WAKE_SIGNAL is not None:
            with contextlib.suppress(ValueError, RuntimeError, NotImplementedError):  # not the main thread's loop
                loop.add_signal_handler(WAKE_SIGNAL, filed.set)
                signalled = owners.wakes_on_signal = True
        look = True  # at start: what was filed while no gateway served
        try:
            while True:
                try:
                    self.sessions.changed.clear()
                    new = self.sessions.served() - owners.held
                    if new:
                        await asyncio.to_thread(owners.hold, new)
                    now = loop.time()
                    if now - renewed >= renew_every:
                        await asyncio.to_thread(owners.renew)
                        renewed, look = now, True
                    if look or filed.is_set():
                        filed.clear()
                        look = not signalled  # without the signal, every wake-up looks
                        for row in await asyncio.to_thread(owners.filed):
                            await self._run_filed_rollback(row.session_id, row.rollback_actor or "undolog")
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the database may be briefly away: the loop goes on
                    log.warning("holding the served sessions: %s", exc)
                waits = [asyncio.ensure_future(self.sessions.changed.wait()), asyncio.ensure_future(filed.wait())]
                try:
                    await asyncio.wait(waits, timeout=max(0.05, renew_every - (loop.time() - renewed))
                                       if signalled else OWNER_POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waits:
                        w.cancel()
        finally:
            if signalled:
                owners.wakes_on_signal = False
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(WAKE_SIGNAL)  # type: ignore[arg-type]

    async def _run_filed_rollback(self, session_id: str, actor: str) -> None:
        owners = self.undolog.owners
        log.info("rolling back session %s here, as filed by %s", session_id, actor)
        try:
            report = await self.undolog.arollback(session_id, actor=actor)
        except UndoLogError as exc:
            await asyncio.to_thread(owners.answer, session_id, None, exc)
            return
        # A grouping's next call finds the session closed and starts a new one, telling its client both ids
        # (see ``call``): forgetting it here would start the new one silently.
        await asyncio.to_thread(owners.answer, session_id, report)

    def _advertised(self, ex: ExposedTool) -> types.Tool:
        tool = ex.listed.model_copy(update={"name": ex.exposed_name})
        if ex.config.tier is ToolTier.IRREVERSIBLE:
            # Before approval the gateway answers with a notice, not the upstream's result shape; SDK clients
            # reject a result that does not match an advertised outputSchema.
            tool = tool.model_copy(update={"outputSchema": None})
        note = {
            ToolTier.SAFE: "",
            ToolTier.COMPENSABLE: " [UndoLog: compensable: logged and undoable]",
            ToolTier.IRREVERSIBLE: " [UndoLog: irreversible: runs only after a person approves it]",
        }[ex.config.tier]
        return tool.model_copy(update={"description": (tool.description or "") + note})

    # -- one call -----------------------------------------------------------------------------------

    async def call(self, name: str, arguments: Mapping[str, Any]) -> types.CallToolResult:
        """Route one ``tools/call`` by its tier; always answers with a tool result (never a protocol error)."""
        ex = self.exposure.tools.get(name)
        if ex is None or ex.spec is None:
            return error_result(f"unknown tool {name!r}: this gateway exposes "
                                f"{', '.join(sorted(self.exposure.tools)) or 'no tools'}")
        pinned = pinned_sent(name, arguments, ex.config.pin)
        if pinned is not None:
            return error_result(pinned, code="arguments_invalid")
        # The upstream's input schema is the tool's contract: the core validates every call against it (full
        # JSON Schema) before anything is logged, and its error names the failing path.
        with _guarded(ex):
            try:
                session_id = await self._session_id()
            except UndoLogError as exc:
                return error_result(exc.message, code=exc.code)
            # Keyed by the arguments as the core stores them: {"amount": 5} then {"amount": 5.0} is one request.
            call_id = (call_key(name, canonical_arguments(ex.spec, arguments))
                       if ex.config.tier is ToolTier.IRREVERSIBLE else None)
            released_to: str | None = None
            shared: SharedRequest | None = None
            principal = _PRINCIPAL.get()
            client_key = _CLIENT_KEY.get()
            if client_key is not None and ex.config.tier is not ToolTier.SAFE:
                # The client's key names the call (see client_keys.py); over HTTP it may live in an earlier
                # session of the same API key, where it is answered.
                try:
                    client_key = checked_key(client_key)
                    call_id = client_call_id(client_key, name, principal=principal, session_id=session_id)
                    if principal is not None:
                        session_id = await self._session_of_key(call_id, session_id)
                except UndoLogError as exc:
                    return error_result(exc.message, code=exc.code)
            elif call_id is not None and principal is not None and ex.config.approval is Approval.DESK:
                # Over HTTP only: the same ask from another session of the key joins a pending request, or is
                # released an approved one (see approvals.py).
                shared = await asyncio.to_thread(find_shared, self.undolog, session_id=session_id,
                                                 principal=principal, tool_name=name, call_id=call_id,
                                                 revision=ex.spec.revision)
                if shared is not None and shared.pending:
                    await asyncio.to_thread(self._join, shared, session_id, principal)
                    return awaiting_result(name, _awaiting(shared), note=(
                        f" (Asked already in session {shared.request.session_id} with this API key: this call "
                        "waits on that request.)"))
                if shared is not None:
                    released_to, session_id = session_id, shared.request.session_id
                    _SESSION_USED.set(session_id)  # logged (and run) in the request's own session
            previous = None
            try:
                try:
                    d = await self._decide(session_id, ex, arguments, call_id, client_key)
                except (SessionHalted, ContractChanged) as exc:
                    # Resumed or revalidated from another process meanwhile: decided once more.
                    if not await asyncio.to_thread(changed_elsewhere, self.undolog, exc, ex.spec.revision):
                        raise
                    d = await self._decide(session_id, ex, arguments, call_id, client_key)
            except CallRunning as exc:
                return running_result(name, exc.message)
            except UndoLogError as exc:
                # A grouping's session rolled back or completed (from the CLI, the desk): the grouping goes on in a
                # new session, as a new agent run would, and the client is told both ids. A session the client
                # named stays closed, and a halted one stays halted (a person resumes it).
                if not isinstance(exc, SessionClosed) or _SESSION_NAMED.get() or not self.sessions.forget(session_id):
                    return refusal(exc)
                previous, session_id = session_id, await self._session_id()
                try:
                    d = await self._decide(session_id, ex, arguments, call_id, client_key)
                except CallRunning as running:
                    return running_result(name, running.message)
                except UndoLogError as again:
                    return refusal(again)
            answer = await self._decided(name, arguments, ex, d, client_key=client_key,
                                         released=(released_to, shared, principal))
        if previous is not None:
            return told_new_session(answer, previous, session_id)
        return answer

    async def _decide(self, session_id: str, ex: ExposedTool, arguments: Mapping[str, Any], call_id: str | None,
                      client_key: Any) -> Any:
        """The core's decision on one call: named by the client's own key (see ``_decide_keyed``), or not."""
        assert ex.spec is not None
        if client_key is not None and call_id is not None and ex.config.tier is not ToolTier.SAFE:
            return await self._decide_keyed(session_id, ex, arguments, call_id, client_key)
        return await self.undolog.driver.adecide(session_id, ex.spec, arguments, call_id=call_id)

    async def _decided(self, name: str, arguments: Mapping[str, Any], ex: ExposedTool, d: Any, *,
                       client_key: Any = None,
                       released: tuple[str | None, SharedRequest | None, str | None] = (None, None, None),
                       ) -> types.CallToolResult:
        """The rest of :meth:`call`, once the call is decided."""
        released_to, shared, principal = released
        if isinstance(d, Completed):
            return replayed(d.result)
        if released_to is not None and shared is not None and principal is not None and not isinstance(d, Completed):
            # Audited before it runs: a crash mid-call still shows which session the approval went to.
            await asyncio.to_thread(self.undolog.approvals.note_released, shared.request.approval_request_id,
                                    released_to, actor=principal)
        if isinstance(d, AwaitingApproval):
            if ex.config.approval is Approval.ELICIT:
                decided = await self._elicit(ex, d)  # not guarded: a client that cancels the form leaves it pending
                if decided is not None:
                    return decided
                return await self.call(name, arguments)
            return awaiting_result(name, d)
        upstream = self._upstream_call(ex.config.upstream)
        tool_name = ex.listed.name
        assert ex.spec is not None  # (call answered an unregistered tool before deciding)
        revision = ex.spec.revision

        def unchanged() -> None:
            # Run once the connection is open, before sending: an upstream started again for this call may list
            # this tool changed (registered anew meanwhile): what was validated and approved is not what it is now.
            now = self.exposure.tools.get(name)
            if now is None or now.spec is None or now.spec.revision != revision:
                raise UpstreamRefused(f"upstream {ex.config.upstream} changed {tool_name} since this call was "
                                      "decided (it lists another contract now): not sent")

        # A SAFE call's own key goes upstream as the client sent it (nothing is recorded); a logged call's key is
        # its effect's ``do-`` key.
        forwarded_key = d.idempotency_key or (client_key if isinstance(client_key, str) else None)
        pins = dict(ex.config.pin)
        capture = ex.config.compensation.capture if ex.config.compensation is not None else None

        async def invoke(args: dict[str, Any]) -> types.CallToolResult:
            sent = {**args, **pins}
            try:
                if capture is not None and d.effect_id is not None:
                    # Read before it changes, stored with the undo entry before the call is sent: an undo that
                    # could not be captured is a call not run.
                    refused = await capture_before(self.undolog, upstream, capture, name, sent, d.args, d.effect_id)
                    if refused is not None:
                        return refused
                # The epoch beside the key (a SAFE call has neither: nothing is logged for it).
                return await upstream(tool_name, sent, forwarded_key, unchanged,
                                      d.epoch if d.idempotency_key else None)
            except UpstreamRefused as exc:
                return error_result(str(exc))  # a protocol refusal, or no upstream to take it: it did not run

        # Shielded already: ``call`` holds the tier's shield (``_guarded``) around the decision and this, its only
        # caller. A second scope here cost every logged call another anyio cancel scope (11 Python frames, 4-5 us
        # of CPU warm, more cold) and shielded nothing more.
        outcome = await self._run(d, invoke)
        if outcome.error is not None:
            if isinstance(outcome.error, OutcomeUnknown):
                late = outcome.error.late
                if outcome.in_doubt == "settling" and late is not None and d.effect_id is not None:
                    # Timed out, the upstream asked to cancel: in flight until it answers or its connection ends.
                    self._hold(self._settle_late(d, late, name))
                    return settling_result(name, outcome.error, d.effect_id, d.session_id)
                if outcome.in_doubt == "settling" and outcome.error.ended is not None and d.effect_id is not None:
                    settle_when_gone(self.undolog, d.effect_id, outcome.error.ended, self._settling)
                return unknown_result(name, outcome.error, outcome.in_doubt)
            raise outcome.error
        value: types.CallToolResult = outcome.value
        return value

    async def _run(self, d: Any, invoke: Callable[[dict[str, Any]], Awaitable[types.CallToolResult]]) -> Any:
        """Run a decided call through the core's call driver, as every gateway call is recorded."""
        return await self.undolog.driver.run_async(d, invoke, rollback_on_failure=False, note=False,
                                                   unknown_on=_UNKNOWN_ON, failure_of=_failure_of,
                                                   result_of=_result_of)

    def _hold(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_late(self, d: Any, late: asyncio.Future[types.CallToolResult], name: str) -> None:
        """Settle a timed-out call on what its upstream answers once asked to cancel it.

        Its result: recorded as if it had come in time (it ran). An error or the connection's end: its request
        can no longer land, and it is settled as recovery would settle it (its probe's "did not happen" then
        settles it as not run; else a COMPENSABLE call is compensated, an IRREVERSIBLE one is ``unknown``).
        """
        try:
            answer: types.CallToolResult | None = await asyncio.shield(late)
            raised: BaseException | None = None
        except asyncio.CancelledError:
            return  # the gateway stops: left in flight, settled by the next start's recovery (its process gone)
        except BaseException as exc:  # noqa: BLE001 - recorded by the driver, as the call's own outcome
            answer, raised = None, exc

        async def answered(args: dict[str, Any]) -> types.CallToolResult:
            if raised is not None:
                raise raised
            assert answer is not None
            return answer

        try:
            outcome = await self._run(d, answered)
        except Exception as exc:  # noqa: BLE001 - left in flight: recovery settles it when this process ends
            log.warning("%s (effect %s): could not be settled on its upstream's late answer: %s", name,
                        d.effect_id, exc)
            return
        log.info("%s (effect %s), timed out and cancelled upstream, settled on the upstream's answer: %s", name,
                 d.effect_id, outcome.in_doubt or ("committed" if outcome.error is None and outcome.failure is None
                                                   else "failed"))

    async def _session_id(self) -> str:
        """The UndoLog session of the request being served, by the config's grouping (see ``sessions.py``)."""
        context = self.server.request_context
        session = context.session
        request = getattr(context, "request", None)
        scope = getattr(request, "scope", None)
        principal = scope.get(PRINCIPAL_SCOPE_KEY) if isinstance(scope, Mapping) else None
        meta = context.meta.model_extra if context.meta is not None else None
        named = (meta or {}).get(SESSION_META)
        if named is None and principal is not None:
            named = request.headers.get(SESSION_HEADER) if request is not None else None
        info = session.client_params.clientInfo if session.client_params else None
        label = f"mcp:{info.name}/{info.version}" if info else "mcp:unknown-client"
        session_id = await self.sessions.session_for(mcp_session=session, principal=principal, named=named,
                                                     label=label)
        _SESSION_USED.set(session_id)
        _SESSION_NAMED.set(named is not None)
        _PRINCIPAL.set(principal)
        _CLIENT_KEY.set((meta or {}).get(CLIENT_KEY_META))
        return session_id

    async def _session_of_key(self, call_id: str, session_id: str) -> str:
        """The session holding the call this client key names over HTTP, else ``session_id``.

        The session found is an earlier session of the same API key.
        """
        found = await asyncio.to_thread(session_of_client_key, self.undolog, call_id)
        if found is not None and found != session_id:
            _SESSION_USED.set(found)
            return found
        return session_id

    async def _decide_keyed(self, session_id: str, ex: ExposedTool, arguments: Mapping[str, Any], call_id: str,
                            key: str) -> Any:
        """Decide a call named by a client's key.

        The recorded result, the running call joined (waited for, up to the upstream's timeout), a conflict
        named as the key's, or a new call.
        """
        assert ex.spec is not None
        driver = self.undolog.driver
        timeout = self.config.upstreams[ex.config.upstream].timeout
        deadline = asyncio.get_running_loop().time() + timeout + 5.0
        asked_after_end = False
        while True:
            try:
                return await driver.adecide(session_id, ex.spec, arguments, call_id=call_id)
            except CallIdConflict:
                raise reused(key, ex.exposed_name) from None
            except InvalidEffectState:
                # The same key in flight (another connection's call, running now), or a concurrent first use from
                # another session of the key (the partial unique index refused this one's pre-write).
                if _PRINCIPAL.get() is not None:
                    moved = await self._session_of_key(call_id, session_id)
                    if moved != session_id:
                        session_id = moved
                        continue
                row = await asyncio.to_thread(find_call, self.undolog, session_id, call_id)
                if row is not None and row.state not in IN_FLIGHT and not asked_after_end:
                    # It ended between the refusal and this read: asked once more, it answers as it now stands
                    # (the recorded result), not "running".
                    asked_after_end = True
                    continue
                if row is None or row.state not in IN_FLIGHT or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.05)

    def _join(self, shared: SharedRequest, session_id: str, principal: str) -> None:
        """Record once per session that it joined another session's pending request (a reject halts it too)."""
        joined = (shared.request.approval_request_id, session_id)
        if joined in self._joined:
            return
        self.undolog.approvals.join(shared.request.approval_request_id, session_id, actor=principal)
        self._joined.add(joined)
        if len(self._joined) > 100_000:  # a memory of what was written, not the record: the audit trail is
            self._joined.clear()

    async def _elicit(self, ex: ExposedTool, d: AwaitingApproval) -> types.CallToolResult | None:
        return await elicit_decision(self.server.request_context, self.undolog, ex.exposed_name, ex.listed, d,
                                     decline_rejects=ex.config.decline is Decline.REJECT)

    # -- transports ---------------------------------------------------------------------------------

    async def serve_stdio(self) -> None:
        """Serve one MCP client over stdin/stdout until it disconnects.

        On the loop itself when they are pipes: see ``stdio.py``.
        """
        from .stdio import stdio_transport

        self.relay.one_client = True  # the upstreams' connections serve this one client: its roots are theirs
        async with self.running(), stdio_transport() as (read, write):
            await self.server.run(read, write, self.server.create_initialization_options())

    async def serve_http(self, host: str, port: int, authenticate: Any, *,
                         ready: Any = None, door: FrontDoor | None = None) -> None:
        """Serve MCP's streamable HTTP transport at ``http://host:port/mcp``.

        ``authenticate(token)`` returns the principal of a bearer token allowed to act as an agent, or None
        (401); every request must carry one. ``ready(port)`` is called once listening (the port actually bound).
        ``door``: the Host/Origin served and the session bounds (default: loopback, 5 min idle, 50 per key).
        """
        import uvicorn
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
        from mcp.server.transport_security import TransportSecuritySettings

        door = door or FrontDoor.loopback()
        manager = StreamableHTTPSessionManager(
            app=self.server, stateless=False, session_idle_timeout=door.idle_seconds, max_sessions=door.max_sessions,
            max_request_body_size=MAX_LINE_BYTES,  # the same bound as a stdio line (413 past it)
            security_settings=TransportSecuritySettings(allowed_hosts=list(door.allowed_hosts),
                                                        allowed_origins=list(door.allowed_origins)))
        # MCP session id -> the principal whose request opened it. The SDK accepts any request naming a live
        # session; here only its opener's are let through (another key's DELETE would end it, its GET read it,
        # its POST answer the elicitation forms sent to it). Unknown and foreign ids get the same 404.
        book = SessionBook(door.sessions_per_key)
        owners = book.owners

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            if scope.get("path", "").rstrip("/") != "/mcp":
                await _plain(send, 404, "not found: the MCP endpoint is /mcp")
                return
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            refused = door.refusal(headers)  # before the key: a rebound page learns nothing
            if refused is not None:
                await _plain(send, *refused)
                return
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            principal = await asyncio.to_thread(authenticate, token) if token else None
            if principal is None:
                await _plain(send, 401, "an agent API key is required: Authorization: Bearer <key>",
                             [(b"www-authenticate", b"Bearer")])
                return
            # The request's handler runs in the MCP session's own task, not this one: the principal travels in
            # the ASGI scope, which the SDK hands to it as the request context's request.
            scope[PRINCIPAL_SCOPE_KEY] = principal
            named = headers.get("mcp-session-id")
            if named is not None:
                if owners.get(named) != principal:
                    await _plain(send, 404, "no such MCP session for this key")
                    return
                if scope.get("method") == "DELETE":
                    await manager.handle_request(scope, receive, send)
                    owners.pop(named, None)
                    return
                await manager.handle_request(scope, receive, send)
                return
            book.prune(live_sessions(manager))  # sessions ended by idle timeout or a crash free their places
            if book.full_for(principal):
                await _plain(send, 429, f"this API key already holds {book.per_key} open MCP sessions (the "
                                        "per-key cap): end one (DELETE /mcp) or let it idle out, or raise "
                                        "--sessions-per-key")
                return

            async def opening(message: MutableMapping[str, Any]) -> None:
                # A request naming no session may open one: the id the SDK answers with is this principal's.
                if message["type"] == "http.response.start":
                    for key, value in message.get("headers", []):
                        if key.decode("latin-1").lower() == "mcp-session-id":
                            owners[value.decode("latin-1")] = principal
                await send(message)

            await manager.handle_request(scope, receive, opening)

        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        async with self.running(), manager.run():
            serving = asyncio.ensure_future(server.serve())
            while not server.started and not serving.done():
                await asyncio.sleep(0.02)
            if ready is not None and server.started:
                bound = server.servers[0].sockets[0].getsockname()[1]
                ready(bound)
            await serving
