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
import json
import logging
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.lowlevel
from mcp import types
from mcp.server.lowlevel import Server

from undolog_core import (
    AwaitingApproval,
    Completed,
    NothingHappened,
    ToolSpec,
    ToolTier,
    UndoLog,
)
from undolog_core.errors import ConfigurationError, ContractChanged, SessionHalted, UndoLogError

from .capture import capture_before
from .config import Approval, CompensationTemplate, Decline, GatewayConfig, ToolConfig, UpstreamConfig
from .elicit import elicit_decision
from .lifecycle import changed_elsewhere, refusal, starts_anew, told_new_session
from .probes import probe_verdict, settle_when_gone
from .results import META_KEY as META_KEY  # re-exported: it was defined here
from .results import awaiting_result, call_key, error_result, replayed, structured, text_of, unknown_result
from .templates import BEFORE_KEY
from .upstream import PORTAL, Connections, OutcomeUnknown, Upstream, UpstreamRefused, first_cause
from .variants import pinned_sent, pinned_tool

log = logging.getLogger("undolog.mcp")

# Who the HTTP transport authenticated, in the ASGI scope of the request (absent over stdio).
PRINCIPAL_SCOPE_KEY = "undolog.principal"


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
    """Decide the exposed names: an upstream's own name (a pinned variant's: its config name), prefixed
    ``<upstream>_`` only where two would clash."""
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
    """A compensation's placeholders against what the tool takes (its input schema's properties) and answers
    (its output schema's, when it lists one): a typo found here, not at rollback, where the compensation could
    not be built and the session would halt."""
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


def _guarded(ex: ExposedTool) -> contextlib.AbstractContextManager[Any]:
    """Where a logged call (COMPENSABLE, or IRREVERSIBLE once approved) is decided, forwarded and marked, the
    client's cancel (``notifications/cancelled``) or its going away must not stop the gateway: the pre-write done,
    the call sent, the upstream does it anyway, and the gateway must record what it answered rather than leave
    the call in flight while the session goes on. The upstream's ``timeout`` bounds how long that takes. A SAFE
    call logs nothing: cancelling it leaves nothing behind."""
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
        # MCP client session -> (its UndoLog session, the API key that opened it), while the client session lives:
        # weak keys, not id(), so that the map does not grow with every client that ever connected, and a new client
        # session never inherits a dead one's UndoLog session through a reused id().
        self._sessions: weakref.WeakKeyDictionary[Any, tuple[str, str | None]] = weakref.WeakKeyDictionary()
        # Calls held ``settling`` (a probe said "not yet" while the request could still land), each waiting for its
        # connection to end (probes.settle_when_gone).
        self._settling: set[asyncio.Task[None]] = set()
        self.server: Server[Any, Any] = self._build_server()

    # -- registration -------------------------------------------------------------------------------

    def register(self, listed: Mapping[str, list[types.Tool]]) -> Exposure:
        """Register every classified tool of the upstreams' listings with the UndoLog, with its compensation and
        probe. The contract holds the upstream's identity, the tool's input and output schemas and the compensation's
        template (not its description or annotations): an upstream that changes those makes a new revision, which
        cancels approvals bound to the old."""
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
        """An upstream started again (after a crash, or for a call after it exited), or one that said its tools
        changed, lists its tools anew: when a classified tool changed (an upgrade, ``npx pkg@latest``, a plugin
        loaded), it is registered as a new revision at once, which cancels approvals bound to the old contract; a
        call decided against the old one is not sent (see call)."""
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
        """A coroutine function calling one tool of ``upstream``: over the gateway's live session when this runs
        on the gateway's own loop, else over a connection opened for it (the CLI, the desk, recovery)."""
        cfg = self.config.upstreams[upstream]

        async def call(name: str, args: Mapping[str, Any], key: str | None,
                       check: Callable[[], None] | None = None) -> types.CallToolResult:
            if self.connections is not None and asyncio.get_running_loop() is self._loop:
                return await self.connections.call(cfg, name, args, key, check=check)
            return await PORTAL.call(cfg, name, args, key)

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
        """Recovery's question to the upstream: did this call happen? The probe tool gets the call's arguments and
        idempotency key, and answers ``{"happened": bool, "result": ...}`` (three answers: see ``probes``)."""
        probe_tool = cfg.probe
        assert probe_tool is not None
        call = self._upstream_call(cfg.upstream)

        async def probe(ctx: Any) -> Any:
            out = await call(probe_tool, {"tool": cfg.name, "args": ctx.args, "idempotency_key": ctx.idempotency_key},
                             None)
            return probe_verdict(out, probe_tool)

        return probe

    # -- the MCP server -----------------------------------------------------------------------------

    def _build_server(self) -> Server[Any, Any]:
        # No per-session lifespan: the upstreams are connected once for the gateway (``running``), however many
        # MCP client sessions the HTTP transport serves.
        server: Server[Any, Any] = Server("undolog-gateway")

        @server.list_tools()  # type: ignore[no-untyped-call, untyped-decorator]
        async def _list() -> list[types.Tool]:
            return [self._advertised(ex) for ex in self.exposure.tools.values()]

        # Input is validated here, against the upstream's schema, so a bad call names the failing path.
        @server.call_tool(validate_input=False)  # type: ignore[untyped-decorator]
        async def _call(name: str, arguments: dict[str, Any] | None) -> types.CallToolResult:
            result = await self.call(name, arguments or {})
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
        self.connections = connections = Connections()
        try:
            listed: dict[str, list[types.Tool]] = {}
            for name, cfg in self.config.upstreams.items():
                try:
                    listed[name] = (await connections.get(cfg)).tools
                except Exception as exc:  # noqa: BLE001 - said in one line naming the upstream, not a task group's trace
                    raise ConfigurationError(f"upstream {name!r} could not be started and listed: "
                                             f"{first_cause(exc)}") from exc
            exposure = self.register(listed)
            connections.on_open = self._relisted  # from now on, an upstream started again is listed anew
            for skipped in exposure.unclassified:
                log.warning("not exposed (no tier in the config): %s", skipped)
            for gone in exposure.missing:
                log.warning("classified in the config but not listed by its upstream: %s", gone)
            report = await asyncio.to_thread(self.undolog.recover)
            if report.reconciled or report.rollbacks_resumed:
                log.warning("recovery at start: %s", report.to_dict())
            yield self
        finally:
            self.connections = None
            self._loop = None
            await connections.close()

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
            call_id = call_key(name, arguments) if ex.config.tier is ToolTier.IRREVERSIBLE else None
            driver = self.undolog.driver
            previous = None
            try:
                try:
                    d = await driver.adecide(session_id, ex.spec, arguments, call_id=call_id)
                except (SessionHalted, ContractChanged) as exc:
                    if not await asyncio.to_thread(changed_elsewhere, self.undolog, exc, ex.spec.revision):
                        raise
                    d = await driver.adecide(session_id, ex.spec, arguments, call_id=call_id)
            except UndoLogError as exc:
                if not starts_anew(exc):
                    return refusal(exc)
                # Rolled back to the end: the client's next call starts a new session (and is told both ids).
                previous, session_id = session_id, await self._session_anew(session_id)
                try:
                    d = await driver.adecide(session_id, ex.spec, arguments, call_id=call_id)
                except UndoLogError as again:
                    return refusal(again)
        if previous is not None:
            return told_new_session(await self._decided(name, arguments, ex, d), previous, session_id)
        return await self._decided(name, arguments, ex, d)

    async def _decided(self, name: str, arguments: Mapping[str, Any], ex: ExposedTool,
                       d: Any) -> types.CallToolResult:
        """The rest of :meth:`call`, once the call is decided."""
        driver = self.undolog.driver
        if isinstance(d, Completed):
            return replayed(d.result)
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
                return await upstream(tool_name, sent, d.idempotency_key, unchanged)
            except UpstreamRefused as exc:
                return error_result(str(exc))  # a protocol refusal, or no upstream to take it: it did not run

        with _guarded(ex):
            outcome = await driver.run_async(
                d, invoke, rollback_on_failure=False, note=False, unknown_on=(OutcomeUnknown,),
                failure_of=lambda r: NothingHappened(text_of(r) or "the upstream answered isError") if r.isError else None,
                result_of=lambda r: r.model_dump(mode="json", by_alias=True, exclude_none=True),
            )
        if outcome.error is not None:
            if isinstance(outcome.error, OutcomeUnknown):
                if outcome.in_doubt == "settling" and outcome.error.ended is not None and d.effect_id is not None:
                    settle_when_gone(self.undolog, d.effect_id, outcome.error.ended, self._settling)
                return unknown_result(name, outcome.error, outcome.in_doubt)
            raise outcome.error
        value: types.CallToolResult = outcome.value
        return value

    async def _session_id(self) -> str:
        """The UndoLog session of the MCP client session making this request (one for one)."""
        session = self.server.request_context.session
        key = session
        request = getattr(self.server.request_context, "request", None)
        principal = getattr(request, "scope", {}).get(PRINCIPAL_SCOPE_KEY) if request is not None else None
        found = self._sessions.get(key)
        if found is not None:
            if found[1] != principal:
                # Over HTTP an MCP session belongs to the key that opened it.
                raise UndoLogError("this MCP session was opened with another API key")
            return found[0]
        info = session.client_params.clientInfo if session.client_params else None
        label = f"mcp:{info.name}/{info.version}" if info else "mcp:unknown-client"
        s = await asyncio.to_thread(self.undolog.session, agent_id=label, created_by=principal)
        self._sessions[key] = (s.id, principal)
        log.info("MCP client %s is session %s", label, s.id)
        return s.id

    async def _session_anew(self, rolled_back: str) -> str:
        """A new UndoLog session in place of ``rolled_back`` for the client sessions that had it."""
        row = await asyncio.to_thread(self.undolog.sessions.get, rolled_back)
        holders = [(k, v) for k, v in list(self._sessions.items()) if v[0] == rolled_back]
        principal = holders[0][1][1] if holders else None
        s = await asyncio.to_thread(self.undolog.session, agent_id=row.agent_id, created_by=principal)
        for key, (_, who) in holders:
            self._sessions[key] = (s.id, who)
        log.info("session %s was rolled back; its client goes on in session %s", rolled_back, s.id)
        return s.id

    async def _elicit(self, ex: ExposedTool, d: AwaitingApproval) -> types.CallToolResult | None:
        return await elicit_decision(self.server.request_context, self.undolog, ex.exposed_name, ex.listed, d,
                                     decline_rejects=ex.config.decline is Decline.REJECT)

    # -- transports ---------------------------------------------------------------------------------

    async def serve_stdio(self) -> None:
        """Serve one MCP client over stdin/stdout until it disconnects (on the loop itself when they are pipes:
        see ``stdio.py``)."""
        from .stdio import stdio_transport

        async with self.running(), stdio_transport() as (read, write):
            await self.server.run(read, write, self.server.create_initialization_options())

    async def serve_http(self, host: str, port: int, authenticate: Any, *,
                         ready: Any = None) -> None:
        """Serve MCP's streamable HTTP transport at ``http://host:port/mcp``.

        ``authenticate(token)`` returns the principal of a bearer token allowed to act as an agent, or None
        (401); every request must carry one. ``ready(port)`` is called once listening (the port actually bound).
        """
        import uvicorn
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

        manager = StreamableHTTPSessionManager(app=self.server, stateless=False)
        # MCP session id -> the principal whose request opened it. The SDK accepts any request naming a live
        # session; here only its opener's are let through (another key's DELETE would end it, its GET read it,
        # its POST answer the elicitation forms sent to it). Unknown and foreign ids get the same 404.
        owners: dict[str, str] = {}

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            if scope.get("path", "").rstrip("/") != "/mcp":
                await _plain(send, 404, "not found: the MCP endpoint is /mcp")
                return
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
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
