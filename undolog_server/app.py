"""The FastAPI application factory of ``undolog serve``."""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from undolog_core import UndoLog, errors, load_app
from undolog_core.integration import shared_store

from . import dashboard, email_approvals, problems, proxy_api, routers, slack
from . import proxy as proxy_mod
from .guard import body_problem
from .lanes import Lanes
from .state import ServerSettings, ServerState
from .storage import ServerStore
from .sweeper import Sweeper
from .views import CoreViews

API_DESCRIPTION = """\
The UndoLog approval desk: review irreversible agent tool calls, roll sessions back,
proxy upstream tools. Authenticate with `Authorization: Bearer <API key>`.
Errors are RFC 9457 `application/problem+json` with a stable `code`.
"""


def _same_database(a: UndoLog, b: UndoLog) -> bool:
    sa, sb = shared_store(a), shared_store(b)
    return (sa.url, sa.schema) == (sb.url, sb.schema)


_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
#: Swagger UI's bundle and stylesheet come from this CDN (pinned version); nothing else is allowed from outside.
_SWAGGER_CDN = "https://cdn.jsdelivr.net"
_SWAGGER_VERSION = "5.17.14"
# The dashboard's policy, with the one CDN Swagger UI is loaded from: no inline script, no framing.
_DOCS_CSP = (
    f"default-src 'self'; script-src 'self' {_SWAGGER_CDN}; style-src 'self' {_SWAGGER_CDN}; "
    "img-src 'self' data:; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)
_DOCS_HTML = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>UndoLog approval desk API</title>
<link rel="stylesheet" href="{_SWAGGER_CDN}/npm/swagger-ui-dist@{_SWAGGER_VERSION}/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="{_SWAGGER_CDN}/npm/swagger-ui-dist@{_SWAGGER_VERSION}/swagger-ui-bundle.js"></script>
<script src="/ui/static/docs.js"></script>
</body></html>
"""


class _Guard:
    """The door of every HTTP request (plain ASGI: no per-request task overhead).

    - A body larger than ``max_body_bytes`` is answered 413 before it is buffered: a ``Content-Length`` over the
      limit up front, and a body without one (chunked) as soon as the bytes read pass the limit.
    - NUL characters are refused (PostgreSQL text cannot hold NUL; refusing it at the door keeps both databases
      alike and turns what would be a database error into a 422), as are JSON bodies nested deeper than
      :data:`undolog_core.limits.MAX_JSON_DEPTH` or holding a lone surrogate. The checks walk the parsed body
      iteratively (no recursion, whatever the depth) and only when a byte scan finds something to look at.
    - Security headers are added to every response.
    """

    def __init__(self, app: Any, max_body_bytes: int = 1 << 20) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        query: bytes = scope.get("query_string", b"")
        if "\x00" in path or b"%00" in query.lower() or b"\x00" in query:
            await self._refuse(scope, receive, send, "nul_character", "NUL characters are not accepted")
            return
        length: bytes | None = None
        chunked = False
        ctype = ""
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                length = v
            elif k == b"transfer-encoding":
                chunked = True
            elif k == b"content-type":
                ctype = v.decode("latin-1")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            await self._too_large(scope, receive, send)
            return
        if chunked or (length is not None and length != b"0") or scope.get("method") in ("POST", "PUT", "PATCH"):
            chunks = []
            size = 0
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":
                    break
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.max_body_bytes:
                    # Counted while reading: nothing past the limit is ever held.
                    await self._too_large(scope, receive, send)
                    return
                chunks.append(chunk)
                more = message.get("more_body", False)
            body = b"".join(chunks)
            refused = body_problem(body, ctype)
            if refused is not None:
                await self._refuse(scope, receive, send, *refused)
                return
            replayed = False

            async def replay() -> Any:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            receive = replay
        is_ui = path == "/" or path.startswith("/ui")
        is_docs = path == "/docs"

        async def send_with_headers(message: Any) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                names = {k.lower() for k, _ in headers}
                extra = [(b"x-content-type-options", b"nosniff"), (b"referrer-policy", b"no-referrer")]
                if is_ui:
                    extra += [(b"content-security-policy", _CSP.encode()), (b"x-frame-options", b"DENY")]
                elif is_docs:
                    extra += [(b"content-security-policy", _DOCS_CSP.encode()), (b"x-frame-options", b"DENY")]
                headers += [(k, v) for k, v in extra if k not in names]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)

    @staticmethod
    async def _refuse(scope: Any, receive: Any, send: Any, code: str, detail: str,
                      errors: list[dict[str, str]] | None = None) -> None:
        extra = {"errors": errors} if errors else {}
        body = problems.problem_body(422, code, detail, scope.get("path"), **extra)
        await problems.SafeJSONResponse(body, status_code=422, media_type=problems.PROBLEM_MEDIA_TYPE)(
            scope, receive, send)

    async def _too_large(self, scope: Any, receive: Any, send: Any) -> None:
        body = problems.problem_body(
            413, "payload_too_large",
            f"the request body is larger than the limit of {self.max_body_bytes} bytes (--max-body-bytes)",
            scope.get("path"), limit=self.max_body_bytes,
        )
        # The rest of the body is never read: the connection closes after this answer.
        await problems.SafeJSONResponse(body, status_code=413, media_type=problems.PROBLEM_MEDIA_TYPE,
                                        headers={"Connection": "close"})(scope, receive, send)


def create_app(
    undolog: Any,
    *,
    app_spec: str | None = None,
    proxy_config: str | Path | Mapping[str, Any] | proxy_mod.ProxyTools | None = None,
    settings: ServerSettings | None = None,
) -> FastAPI:
    """Build the approval desk application on an open UndoLog.

    Args:
        undolog: An open ``UndoLog`` (its database holds the server's tables too; they are created or
            upgraded here, see :func:`undolog_server.storage.migrate`).
        app_spec: ``module:attribute`` whose tools and compensations rollback may need (see
            :func:`undolog_core.load_app`, the loader every ``--app`` goes through); when it names the
            app's UndoLog, that instance is served.
        proxy_config: A TOML file (or parsed mapping) of upstream tools to proxy.
        settings: Tunables; defaults suit production.

    Returns:
        The FastAPI app. Its lifespan starts this process's sweeper and webhook loops.
    """
    settings = settings or ServerSettings()
    if app_spec:
        loaded = load_app(app_spec, into=undolog)
        if loaded is not undolog:
            if not _same_database(loaded, undolog):
                raise errors.ConfigurationError(
                    f"--app {app_spec} opens another database than the server's; point both at the same one"
                )
            # The app's UndoLog holds the registrations (and probes) rollback needs: serve that one.
            undolog = loaded
    proxy_tools: proxy_mod.ProxyTools | None = None
    if proxy_config is not None:
        proxy_tools = proxy_config if isinstance(proxy_config, proxy_mod.ProxyTools) else proxy_mod.ProxyTools.load(proxy_config)
        proxy_tools.register(undolog)
    if settings.audit_checkpoint_key:
        # Fail at start, not at the first interval: a key that cannot be read means no checkpoints at all.
        UndoLog.check_checkpoint_key(settings.audit_checkpoint_key)
    store = ServerStore(shared_store(undolog))
    # The server's tables are its own migration branch: bring them to head before anything reads them.
    store.migrate()
    state = ServerState(
        undolog=undolog,
        store=store,
        views=CoreViews(undolog),
        settings=settings,
        secret=store.server_secret(),
        proxy=proxy_tools,
        app_spec=app_spec,
        worker_id=f"{socket.gethostname()}:{os.getpid()}",
    )
    if settings.slack is not None:
        from .slack import SlackDesk

        state.slack = SlackDesk(state, settings.slack)
    sweeper = Sweeper(state)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if settings.background:
            await sweeper.start()
        try:
            yield
        finally:
            await sweeper.stop()

    app = FastAPI(
        title="UndoLog approval desk",
        version="1",
        description=API_DESCRIPTION,
        lifespan=lifespan,
        openapi_url="/openapi.json",
        # Swagger UI loads from a CDN: off unless the operator turns it on (``--docs``), and then served without
        # inline script, under a CSP that admits that one CDN, and never framed (see _Guard).
        docs_url=None,
        redoc_url=None,
        # Every JSON answer survives a lone surrogate read back from the database (escaped, never a 500).
        default_response_class=problems.SafeJSONResponse,
    )
    if settings.docs:
        from fastapi.responses import HTMLResponse

        @app.get("/docs", include_in_schema=False)
        def docs() -> HTMLResponse:
            return HTMLResponse(_DOCS_HTML)

    app.state.undolog_server = state
    app.state.sweeper = sweeper
    problems.install_handlers(app)

    def openapi() -> dict[str, Any]:
        # Every error is problem+json: the schema says so for each operation (schemathesis checks it).
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            app.openapi_schema = problems.document_problems(get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.include_router(routers.router)
    app.include_router(proxy_api.router)
    app.include_router(slack.router)
    dashboard.install(app)
    email_approvals.install(app)
    app.mount("/ui/static", StaticFiles(directory=str(Path(__file__).parent / "static")), name="static")

    # Inside the guard: a body is checked (and a hostile one refused) before the request waits for a lane.
    app.add_middleware(Lanes, general=settings.max_concurrent_requests, decisions=settings.decision_lane,
                       queue_timeout=settings.queue_timeout)
    app.add_middleware(_Guard, max_body_bytes=settings.max_body_bytes)
    return app
