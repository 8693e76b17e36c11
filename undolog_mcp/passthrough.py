"""The pass-through: an upstream's resources, prompts, completion and logging, through the gateway unchanged.

Per upstream, ``expose = ["resources", "prompts", "completion"]`` in ``gateway.toml`` chooses what passes (all
unless told; tools are classified one by one, see ``config.py``). Reading a resource and getting a prompt are SAFE
by nature (they change nothing): they do no I/O of the gateway's own, are counted in :attr:`Passthrough.counts`
(and the ``undolog.mcp.passthrough`` metric when OpenTelemetry is configured), and are not written to the audit
chain. Listings are the upstreams' listings merged; a prompt name or a resource URI (or template) listed by two
upstreams is exposed prefixed, as tools are: ``<upstream>_<prompt>`` and ``<upstream>+<uri>`` (a ``+`` keeps the
URI's scheme a valid one). The capabilities the gateway advertises are exactly those it relays.

Subscriptions are counted per URI across the gateway's clients: the upstream is asked to subscribe once, when the
first client subscribes, and to unsubscribe when the last one unsubscribes or goes away (its HTTP session closed or
idled out, its stdio or socket connection ended). An upstream started again is asked to subscribe again to what
its clients still hold.

Example::

    [upstreams.docs]
    command = ["npx", "-y", "@modelcontextprotocol/server-everything"]
    expose = ["resources"]        # its prompts and completion stay hidden
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import re
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mcp import types
from mcp.client.session import ClientSession
from mcp.server.session import ServerSession
from mcp.shared.exceptions import McpError

from undolog_core.integration import metering

from .config import GatewayConfig, UpstreamConfig
from .relay import GatewayServer, Relay
from .upstream import Upstream, first_cause

log = logging.getLogger("undolog.mcp")

_EXPRESSION = re.compile(r"\{[^{}]*\}")


@dataclass(eq=False)
class _Subscription:
    """One URI the gateway's clients subscribed to, and the upstream session the gateway subscribed on."""

    upstream: str
    own: str  # the URI as the upstream names it
    clients: set[ServerSession] = field(default_factory=set)
    on: ClientSession | None = None  # the upstream session subscribed (None: not subscribed upstream)


def _ended(session: ClientSession | None) -> bool:
    """The upstream session is gone (a restarted upstream knows nothing of what was asked on it)."""
    ended = getattr(session, "ended", None)
    return session is None or (isinstance(ended, asyncio.Event) and ended.is_set())


def template_pattern(template: str) -> re.Pattern[str]:
    """A URI template (RFC 6570) as a pattern its URIs match: each expression stands for one or more characters."""
    parts = _EXPRESSION.split(template)
    return re.compile("(?:.+?)".join(re.escape(p) for p in parts) + r"\Z", re.DOTALL)


@dataclass
class _Listing:
    """What the upstreams listed of one kind, and the names it is exposed under."""

    # exposed name -> (upstream, its own name), for resources (URIs), templates (URI templates) and prompts
    routes: dict[str, tuple[str, str]] = field(default_factory=dict)
    # (upstream, its own name) -> exposed name
    exposed: dict[tuple[str, str], str] = field(default_factory=dict)
    items: list[Any] = field(default_factory=list)


def _expose(listed: Mapping[str, list[Any]], key: str, prefix: Callable[[str, str], str]) -> _Listing:
    """Each upstream's items under their own name, or prefixed where two upstreams list the same one."""
    counts = Counter(getattr(item, key) if isinstance(getattr(item, key), str) else str(getattr(item, key))
                     for items in listed.values() for item in items)
    out = _Listing()
    for up, items in listed.items():
        for item in items:
            own = str(getattr(item, key))
            name = own if counts[own] == 1 else prefix(up, own)
            out.routes[name] = (up, own)
            out.exposed[(up, own)] = name
            out.items.append(_renamed(item, key, name) if name != own else item)
    return out


def _renamed(item: Any, key: str, value: str) -> Any:
    """``item`` with ``key`` set to ``value``, validated (a URI field holds a URL object: a ``model_copy`` would
    leave a str there, which the serializer then warns about, formatting the model, on every answer)."""
    return type(item).model_validate({**item.model_dump(by_alias=True, exclude_none=True), key: value})


def _uri_prefix(up: str, uri: str) -> str:
    return f"{up}+{uri}"


def _name_prefix(up: str, name: str) -> str:
    return f"{up}_{name}"


class Passthrough:
    """The gateway's handlers of ``resources/*``, ``prompts/*``, ``completion/complete`` and ``logging/setLevel``.

    Example:
        >>> passthrough = Passthrough(config, server, relay)
        >>> passthrough.connect = connections.get     # how an upstream's live session is reached
    """

    def __init__(self, config: GatewayConfig, server: GatewayServer, relay: Relay) -> None:
        self.config = config
        self.server = server
        self.relay = relay
        # How the live session of an upstream is reached (the gateway's connections, while running).
        self.connect: Callable[[UpstreamConfig], Awaitable[Upstream]] | None = None
        self.initialized: dict[str, types.InitializeResult] = {}  # each upstream's, as it last connected
        self.counts: Counter[str] = Counter()  # "resources/read", "prompts/get", ... served
        self._listings: dict[str, _Listing] = {}  # "resources", "templates", "prompts": as last listed
        self._patterns: list[tuple[re.Pattern[str], str, str, str]] = []  # (pattern, exposed, upstream, own)
        self._subscriptions: dict[str, _Subscription] = {}  # exposed URI -> its subscribers
        self._subscribing: dict[str, asyncio.Lock] = {}  # per upstream: one change of its subscriptions at a time
        self._counter: Any = None
        self._exposing: dict[str, list[UpstreamConfig]] = {}
        handlers: dict[type, Callable[[Any], Awaitable[types.ServerResult]]] = {
            types.ListResourcesRequest: self._list_resources,
            types.ListResourceTemplatesRequest: self._list_templates,
            types.ReadResourceRequest: self._read,
            types.SubscribeRequest: self._subscribe,
            types.UnsubscribeRequest: self._unsubscribe,
            types.ListPromptsRequest: self._list_prompts,
            types.GetPromptRequest: self._get_prompt,
            types.CompleteRequest: self._complete,
            types.SetLevelRequest: self._set_level,
        }
        server.request_handlers.update(handlers)
        relay.on_upstream_opened = self._subscribe_again
        relay.on_client_gone = self.release

    # -- what is exposed ----------------------------------------------------------------------------

    def note(self, up: Upstream) -> None:
        """An upstream connected (or connected again): its capabilities and instructions as it said them."""
        if up.initialized is not None and self.initialized.get(up.config.name) is not up.initialized:
            self.initialized[up.config.name] = up.initialized
            self._exposing.clear()

    def _caps(self, name: str) -> types.ServerCapabilities | None:
        init = self.initialized.get(name)
        return init.capabilities if init is not None else None

    def exposing(self, kind: str) -> list[UpstreamConfig]:
        """The upstreams that pass ``kind`` through: "resources", "prompts", "completion" (chosen in the config
        and offered by the upstream) or "logging" (every upstream that offers it)."""
        found = self._exposing.get(kind)  # asked on every request: kept until an upstream connects again
        if found is None:
            found = self._exposing[kind] = self._find_exposing(kind)
        return found

    def _find_exposing(self, kind: str) -> list[UpstreamConfig]:
        out = []
        for name, cfg in self.config.upstreams.items():
            caps = self._caps(name)
            if caps is None:
                continue
            offered = {"resources": caps.resources, "prompts": caps.prompts, "completion": caps.completions,
                       "logging": caps.logging}[kind]
            if offered is not None and (kind == "logging" or kind in cfg.expose):
                out.append(cfg)
        return out

    def capabilities(self) -> types.ServerCapabilities:
        """Exactly what the gateway relays: its tools (whose list it recomputes and says changed), and what its
        upstreams offer and the config passes through."""
        resources = [c for c in (self._caps(u.name) for u in self.exposing("resources")) if c and c.resources]
        prompts = [c for c in (self._caps(u.name) for u in self.exposing("prompts")) if c and c.prompts]
        return types.ServerCapabilities(
            tools=types.ToolsCapability(listChanged=True),
            resources=types.ResourcesCapability(
                subscribe=any(c.resources.subscribe for c in resources if c.resources),
                listChanged=any(c.resources.listChanged for c in resources if c.resources)) if resources else None,
            prompts=types.PromptsCapability(
                listChanged=any(c.prompts.listChanged for c in prompts if c.prompts)) if prompts else None,
            completions=types.CompletionsCapability() if self.exposing("completion") else None,
            logging=types.LoggingCapability() if self.exposing("logging") else None,
        )

    def instructions(self) -> str | None:
        """The upstreams' instructions: one upstream's as it wrote them; several, each under its name."""
        said = [(name, init.instructions) for name, init in self.initialized.items() if init.instructions]
        if not said:
            return None
        if len(said) == 1:
            return said[0][1]
        return "\n\n".join(f"[{name}]\n{text}" for name, text in said)

    def describe(self) -> list[str]:
        """One line per upstream: what it passes through beside its tools (printed as the gateway starts)."""
        lines = []
        for name, cfg in self.config.upstreams.items():
            chosen = sorted(cfg.expose) or ["nothing"]
            offered = [k for k in ("resources", "prompts", "completion", "logging")
                       if cfg in self.exposing(k)]
            lines.append(f"upstream {name}: expose = [{', '.join(chosen)}]; passing through "
                         f"{', '.join(offered) or 'nothing'} beside its classified tools")
        return lines

    def _require(self, kind: str) -> None:
        """What is not advertised is not served: the answer a server without that capability gives."""
        if not self.exposing(kind):
            raise McpError(types.ErrorData(code=types.METHOD_NOT_FOUND, message="Method not found"))

    # -- talking to upstreams -------------------------------------------------------------------------

    async def _session(self, cfg: UpstreamConfig) -> ClientSession:
        if self.connect is None:
            raise McpError(types.ErrorData(code=types.INTERNAL_ERROR, message="the gateway is not running"))
        try:
            up = await self.connect(cfg)
        except Exception as exc:  # noqa: BLE001 - said to the client as an MCP error naming the upstream
            raise McpError(types.ErrorData(code=types.INTERNAL_ERROR,
                                           message=f"upstream {cfg.name} could not be reached: {first_cause(exc)}")) from exc
        self.note(up)
        return up.session

    async def _send(self, cfg: UpstreamConfig, request: Any, result: type[Any],
                    session: ClientSession | None = None) -> Any:
        """``request`` to ``cfg``'s upstream (over ``session`` when given, else its live one), its answer or the
        upstream's error as an MCP error naming it."""
        if session is None:
            session = await self._session(cfg)
        try:
            return await session.send_request(types.ClientRequest(request), result,
                                              request_read_timeout_seconds=dt.timedelta(seconds=cfg.timeout))
        except McpError:
            raise  # the upstream's own error, passed through as it said it
        except Exception as exc:  # noqa: BLE001 - a lost connection, said as an MCP error naming the upstream
            raise McpError(types.ErrorData(code=types.INTERNAL_ERROR,
                                           message=f"upstream {cfg.name}: {first_cause(exc)}")) from exc

    async def _all_pages(self, cfg: UpstreamConfig, make: Callable[[Any], Any], result: type[Any],
                         attr: str) -> list[Any]:
        items: list[Any] = []
        cursor = None
        while True:
            page = await self._send(cfg, make(types.PaginatedRequestParams(cursor=cursor) if cursor else None),
                                    result)
            items.extend(getattr(page, attr))
            cursor = page.nextCursor
            if not cursor:
                return items

    def _count(self, what: str, upstream: str) -> None:
        self.counts[what] += 1
        if self._counter is None:
            if not metering():
                return
            from opentelemetry import metrics

            self._counter = metrics.get_meter("undolog").create_counter(
                "undolog.mcp.passthrough", unit="{request}",
                description="Requests passed through the MCP gateway beside tool calls (SAFE: not audited)")
        self._counter.add(1, {"mcp.method": what, "undolog.mcp.upstream": upstream})

    # -- resources ----------------------------------------------------------------------------------

    async def _relist_resources(self) -> None:
        resources: dict[str, list[types.Resource]] = {}
        templates: dict[str, list[types.ResourceTemplate]] = {}
        for cfg in self.exposing("resources"):
            resources[cfg.name] = await self._all_pages(
                cfg, lambda p: types.ListResourcesRequest(params=p), types.ListResourcesResult, "resources")
            templates[cfg.name] = await self._all_pages(
                cfg, lambda p: types.ListResourceTemplatesRequest(params=p), types.ListResourceTemplatesResult,
                "resourceTemplates")
        self._listings["resources"] = _expose(resources, "uri", _uri_prefix)
        self._listings["templates"] = listing = _expose(templates, "uriTemplate", _uri_prefix)
        self._patterns = [(template_pattern(name), name, up, own) for name, (up, own) in listing.routes.items()]

    async def _list_resources(self, req: types.ListResourcesRequest) -> types.ServerResult:
        self._require("resources")
        await self._relist_resources()
        return types.ServerResult(types.ListResourcesResult(resources=self._listings["resources"].items))

    async def _list_templates(self, req: types.ListResourceTemplatesRequest) -> types.ServerResult:
        self._require("resources")
        await self._relist_resources()
        return types.ServerResult(types.ListResourceTemplatesResult(
            resourceTemplates=self._listings["templates"].items))

    def _route_uri(self, uri: str) -> tuple[UpstreamConfig, str] | None:
        found = self._listings.get("resources", _Listing()).routes.get(uri)
        if found is not None:
            return self.config.upstreams[found[0]], found[1]
        exposing = self.exposing("resources")
        for cfg in exposing:  # a prefixed URI of a resource not listed (yet)
            if uri.startswith(f"{cfg.name}+"):
                return cfg, uri[len(cfg.name) + 1:]
        matched = {up: (name, own) for pattern, name, up, own in self._patterns if pattern.match(uri)}
        if len(matched) == 1:
            up, (name, own) = next(iter(matched.items()))
            return self.config.upstreams[up], uri if name == own else uri[len(up) + 1:]
        if len(exposing) == 1 and not matched:
            return exposing[0], uri  # one upstream: a URI it does not list may still be its to answer
        return None

    async def _resource(self, uri: str) -> tuple[UpstreamConfig, str]:
        route = self._route_uri(uri)
        if route is None:
            await self._relist_resources()
            route = self._route_uri(uri)
        if route is None:
            raise McpError(types.ErrorData(
                code=types.INVALID_PARAMS,
                message=f"no upstream of the gateway lists resource {uri!r}: list resources/list and "
                        "resources/templates/list for what it exposes"))
        return route

    async def _read(self, req: types.ReadResourceRequest) -> types.ServerResult:
        self._require("resources")
        uri = str(req.params.uri)
        cfg, own = await self._resource(uri)
        self._count("resources/read", cfg.name)
        params = req.params if own == uri else _renamed(req.params, "uri", own)
        result: types.ReadResourceResult = await self._send(cfg, types.ReadResourceRequest(params=params),
                                                            types.ReadResourceResult)
        if own != uri:  # prefixed: the contents are named as the client knows them
            result = result.model_copy(update={"contents": [
                _renamed(c, "uri", uri) if str(c.uri) == own else c for c in result.contents]})
        return types.ServerResult(result)

    async def _subscribe(self, req: types.SubscribeRequest) -> types.ServerResult:
        self._require("resources")
        uri = str(req.params.uri)
        cfg, own = await self._resource(uri)
        client = self.server.request_context.session
        session = await self._session(cfg)  # (opened before the lock: an opening subscribes again under it)
        async with self._subscribing.setdefault(cfg.name, asyncio.Lock()):
            if _ended(session):  # it went away meanwhile: the one started in its place (its hooks do not wait)
                session = await self._session(cfg)
            sub = self._subscriptions.setdefault(uri, _Subscription(cfg.name, own))
            added = client not in sub.clients
            sub.clients.add(client)
            try:
                await self._settle(cfg, uri, sub, session)
            except BaseException:
                if added:  # not subscribed: the client is told so by the error, and holds nothing
                    sub.clients.discard(client)
                    if not sub.clients and sub.on is None:
                        self._subscriptions.pop(uri, None)
                raise
        return types.ServerResult(types.EmptyResult())

    async def _unsubscribe(self, req: types.UnsubscribeRequest) -> types.ServerResult:
        self._require("resources")
        uri = str(req.params.uri)
        sub = self._subscriptions.get(uri)
        if sub is not None:
            await self._drop(self.config.upstreams[sub.upstream], uri, self.server.request_context.session)
        return types.ServerResult(types.EmptyResult())

    async def _settle(self, cfg: UpstreamConfig, uri: str, sub: _Subscription, session: ClientSession) -> None:
        """While any client holds ``uri``, the upstream is subscribed to it on ``session`` (its live one): asked
        once, and again on a session started since. Called holding the upstream's lock."""
        if sub.clients and (sub.on is not session or _ended(session)):
            await self._send(cfg, types.SubscribeRequest(params=types.SubscribeRequestParams(
                uri=sub.own)), types.EmptyResult, session)  # type: ignore[arg-type]
            sub.on = session

    async def _drop(self, cfg: UpstreamConfig, uri: str, client: ServerSession) -> None:
        """``client`` no longer holds ``uri``; when no client does, the upstream is told to unsubscribe, on the
        session it subscribed on (one that ended knows nothing of it: nothing is sent, nothing is started)."""
        async with self._subscribing.setdefault(cfg.name, asyncio.Lock()):
            sub = self._subscriptions.get(uri)
            if sub is None or client not in sub.clients:
                return
            sub.clients.discard(client)
            if sub.clients:
                return
            del self._subscriptions[uri]
            held, sub.on = sub.on, None
            if held is not None and not _ended(held):
                await self._send(cfg, types.UnsubscribeRequest(params=types.UnsubscribeRequestParams(
                    uri=sub.own)), types.EmptyResult, held)  # type: ignore[arg-type]

    async def release(self, client: ServerSession) -> None:
        """A client session ended: its subscriptions are released, and each URI no other client holds is
        unsubscribed upstream."""
        for uri, sub in list(self._subscriptions.items()):
            if client in sub.clients:
                try:
                    await self._drop(self.config.upstreams[sub.upstream], uri, client)
                except Exception as exc:  # noqa: BLE001 - the rest are released all the same
                    log.warning("upstream %s did not take resources/unsubscribe %s for a client gone: %s",
                                sub.upstream, sub.own, exc.error.message if isinstance(exc, McpError)
                                else first_cause(exc))

    async def _subscribe_again(self, cfg: UpstreamConfig) -> None:
        """``cfg``'s upstream was started again: what its clients still hold is subscribed again on it."""
        if not any(sub.upstream == cfg.name for sub in self._subscriptions.values()):
            return
        try:
            session = await self._session(cfg)
        except McpError as exc:  # gone again at once: its next start subscribes again
            log.warning("%s; its subscriptions are made again when it starts", exc.error.message)
            return
        async with self._subscribing.setdefault(cfg.name, asyncio.Lock()):
            for uri, sub in list(self._subscriptions.items()):
                if sub.upstream == cfg.name and sub.clients:
                    try:
                        await self._settle(cfg, uri, sub, session)
                    except McpError as exc:
                        log.warning("upstream %s, started again, did not take resources/subscribe %s: %s",
                                    cfg.name, sub.own, exc.error.message)

    async def resource_updated(self, cfg: UpstreamConfig, own: str) -> None:
        """An upstream's ``notifications/resources/updated``: told to the clients subscribed to that URI, under the
        name each knows it by."""
        for uri, sub in list(self._subscriptions.items()):
            if sub.upstream != cfg.name or sub.own != own:
                continue
            note = types.ServerNotification(types.ResourceUpdatedNotification(
                params=types.ResourceUpdatedNotificationParams(uri=uri)))  # type: ignore[arg-type]
            for client in list(sub.clients):
                try:
                    await client.send_notification(note)
                except Exception:  # noqa: BLE001 - a subscriber gone meanwhile is not told
                    log.debug("a resource update could not be sent to a client", exc_info=True)

    async def listing_changed(self, cfg: UpstreamConfig, kind: str) -> None:
        """An upstream's resources or prompts changed: the clients are told (when that upstream passes them)."""
        if cfg not in self.exposing(kind):
            return
        self._listings.pop(kind, None)
        if kind == "resources":
            self._listings.pop("templates", None)
            note: Any = types.ResourceListChangedNotification()
        else:
            note = types.PromptListChangedNotification()
        await self.relay.broadcast(types.ServerNotification(note))

    # -- prompts --------------------------------------------------------------------------------------

    async def _relist_prompts(self) -> _Listing:
        prompts = {cfg.name: await self._all_pages(cfg, lambda p: types.ListPromptsRequest(params=p),
                                                   types.ListPromptsResult, "prompts")
                   for cfg in self.exposing("prompts")}
        self._listings["prompts"] = listing = _expose(prompts, "name", _name_prefix)
        return listing

    async def _prompt(self, name: str) -> tuple[UpstreamConfig, str]:
        found = self._listings.get("prompts", _Listing()).routes.get(name)
        if found is None:
            found = (await self._relist_prompts()).routes.get(name)
        if found is None:
            raise McpError(types.ErrorData(code=types.INVALID_PARAMS,
                                           message=f"no upstream of the gateway lists prompt {name!r}: list "
                                                   "prompts/list for what it exposes"))
        return self.config.upstreams[found[0]], found[1]

    async def _list_prompts(self, req: types.ListPromptsRequest) -> types.ServerResult:
        self._require("prompts")
        return types.ServerResult(types.ListPromptsResult(prompts=(await self._relist_prompts()).items))

    async def _get_prompt(self, req: types.GetPromptRequest) -> types.ServerResult:
        self._require("prompts")
        cfg, own = await self._prompt(req.params.name)
        self._count("prompts/get", cfg.name)
        params = req.params.model_copy(update={"name": own})
        return types.ServerResult(await self._send(cfg, types.GetPromptRequest(params=params),
                                                   types.GetPromptResult))

    # -- completion and logging -----------------------------------------------------------------------

    async def _complete(self, req: types.CompleteRequest) -> types.ServerResult:
        self._require("completion")
        ref = req.params.ref
        if isinstance(ref, types.PromptReference):
            cfg, own = await self._prompt(ref.name)
            forwarded: Any = ref.model_copy(update={"name": own})
        else:
            listing = self._listings.get("templates")
            if listing is None or ref.uri not in listing.routes:
                await self._relist_resources()
                listing = self._listings["templates"]
            found = listing.routes.get(ref.uri) or self._listings["resources"].routes.get(ref.uri)
            if found is None:
                raise McpError(types.ErrorData(code=types.INVALID_PARAMS,
                                               message=f"no upstream of the gateway lists {ref.uri!r}: list "
                                                       "resources/templates/list for what it exposes"))
            cfg, own = self.config.upstreams[found[0]], found[1]
            forwarded = ref.model_copy(update={"uri": own})
        if cfg not in self.exposing("completion"):
            raise McpError(types.ErrorData(code=types.INVALID_PARAMS,
                                           message=f"upstream {cfg.name} does not pass completion through (its "
                                                   "expose in gateway.toml, or it offers none)"))
        self._count("completion/complete", cfg.name)
        params = req.params.model_copy(update={"ref": forwarded})
        return types.ServerResult(await self._send(cfg, types.CompleteRequest(params=params),
                                                   types.CompleteResult))

    async def _set_level(self, req: types.SetLevelRequest) -> types.ServerResult:
        self._require("logging")
        await self.relay.set_level(self.server.request_context.session, req.params.level)
        return types.ServerResult(types.EmptyResult())

    async def live(self) -> list[tuple[UpstreamConfig, ClientSession, types.ServerCapabilities | None]]:
        """Every upstream's live session, with what it offers (for the relay's ``logging/setLevel``)."""
        out = []
        for cfg in self.config.upstreams.values():
            try:
                session = await self._session(cfg)
            except McpError as exc:
                log.warning("%s", exc.error.message)
                continue
            out.append((cfg, session, self._caps(cfg.name)))
        return out
