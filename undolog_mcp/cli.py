"""``undolog mcp serve`` and ``undolog mcp init``; the main CLI calls :func:`register`.

Nothing here imports the MCP SDK until a command runs, so the base install's CLI keeps working without the
mcp extra.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from undolog_core import UndoLog

mcp_app = typer.Typer(help="The MCP gateway: the three tiers in front of any MCP server.", no_args_is_help=True)

DbOpt = Annotated[
    str | None,
    typer.Option("--db", envvar="UNDOLOG_DATABASE_URL", help="Database URL (default: ./undolog.db)."),
]
SchemaOpt = Annotated[str | None, typer.Option("--schema", envvar="UNDOLOG_SCHEMA", help="PostgreSQL schema.")]


def register(app: typer.Typer) -> None:
    app.add_typer(mcp_app, name="mcp")


def _fail(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


@mcp_app.command("serve")
def serve(
    config: Annotated[Path, typer.Option("--config", "-c", help="The gateway's TOML config.")],
    ctx: typer.Context,
    db: DbOpt = None,
    schema: SchemaOpt = None,
    http: Annotated[bool, typer.Option("--http", help="Serve streamable HTTP at /mcp instead of stdio.")] = False,
    host: Annotated[str, typer.Option("--host", help="With --http: the interface (loopback unless told).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="With --http: the port (0: any free one).")] = 8765,
    allowed_host: Annotated[list[str] | None, typer.Option(
        "--allowed-host", help="With --http: also serve this Host header (NAME or NAME:PORT or NAME:*); repeat. "
        "Loopback names are always served; any other Host is answered 421.")] = None,
    allowed_origin: Annotated[list[str] | None, typer.Option(
        "--allowed-origin", help="With --http: also accept this Origin (e.g. https://app.example); repeat. "
        "Any other Origin is answered 403.")] = None,
    idle_timeout: Annotated[float, typer.Option(
        "--idle-timeout", envvar="UNDOLOG_MCP_IDLE_TIMEOUT",
        help="With --http: end an MCP session after this many idle seconds.")] = 300.0,
    sessions_per_key: Annotated[int, typer.Option(
        "--sessions-per-key", envvar="UNDOLOG_MCP_SESSIONS_PER_KEY",
        help="With --http: open MCP sessions one API key may hold.")] = 50,
    max_sessions: Annotated[int, typer.Option(
        "--max-sessions", envvar="UNDOLOG_MCP_MAX_SESSIONS", help="With --http: open MCP sessions in all.")] = 1000,
    socket: Annotated[Path | None, typer.Option(
        "--socket", help="Serve on this local Unix socket (owner-only) for `undolog mcp connect` clients.")] = None,
) -> None:
    """Serve MCP over stdio (the client starts this command), fronting the config's upstreams.

    With ``--socket PATH``, stay up and serve every client that connects through ``undolog mcp connect --socket
    PATH`` (the command a client's config launches), all sharing the upstreams and, with ``session = "process"``,
    one UndoLog session.

    With ``--http``, serve MCP's streamable HTTP transport at ``http://HOST:PORT/mcp`` behind the desk's API keys
    (a key with the agent role; create one with ``undolog keys create --role agent``). Logs go to stderr: over
    stdio, stdout is the protocol.
    """
    import anyio

    from undolog_core import UndoLog
    from undolog_core.errors import UndoLogError

    from . import require_sdk
    from ._sdk_import import defer_inits

    defer_inits()  # before the first SDK import: the SDK's package __init__ files load what this never uses
    try:
        require_sdk()
    except ImportError as exc:
        _fail(str(exc))
    from .config import load_config
    from .gateway import Gateway

    root = ctx.find_root().params if ctx.find_root() is not ctx else {}
    db = db or root.get("db")
    schema = schema or root.get("schema")
    # Logs go to stderr (stdout is the protocol): UndoLog's own at INFO, everything else's warnings.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="undolog-mcp %(levelname)s %(message)s")
    logging.getLogger("undolog").setLevel(logging.INFO)
    try:
        cfg = load_config(config)
        db = db or cfg.database  # the config's database, when neither --db nor UNDOLOG_DATABASE_URL names one
        undolog = UndoLog.open(db, schema=schema) if schema else UndoLog.open(db)
    except UndoLogError as exc:
        _fail(exc.message)
    if http and socket is not None:
        _fail("--http and --socket are two ways to serve: choose one")
    if not http and cfg.session.value == "key":
        _fail('session = "key" groups calls by API key, which only --http has; use session = "process" with '
              "--socket or stdio")
    try:
        gw = Gateway(cfg, undolog)
        if socket is not None:
            from .socket import serve_socket

            def listening(where: Path) -> None:
                typer.echo(f"undolog mcp: serving on socket {where}", err=True)

            try:
                anyio.run(lambda: serve_socket(gw, socket, ready=listening))
            except UndoLogError as exc:
                _fail(exc.message)
            except KeyboardInterrupt:
                pass
            return
        if not http:
            try:
                anyio.run(gw.serve_stdio)
            except UndoLogError as exc:  # an upstream that cannot start, a clash in what it lists: one line
                _fail(exc.message)
            return
        from .front_door import FrontDoor

        try:
            door = FrontDoor.loopback(allowed_host or (), allowed_origin or (), idle_seconds=idle_timeout,
                                      sessions_per_key=sessions_per_key, max_sessions=max_sessions)
        except ValueError as exc:
            _fail(str(exc))
        if host not in ("127.0.0.1", "::1", "localhost", "0.0.0.0", "::"):
            door = FrontDoor.loopback([host, f"{host}:*", *(allowed_host or ())], allowed_origin or (),
                                      idle_seconds=idle_timeout, sessions_per_key=sessions_per_key,
                                      max_sessions=max_sessions)
        authenticate = _agent_keys(undolog)
        if host not in ("127.0.0.1", "::1", "localhost"):
            logging.getLogger("undolog.mcp").warning("listening beyond loopback on %s, as asked", host)

        def ready(bound: int) -> None:
            typer.echo(f"undolog mcp: serving http://{host}:{bound}/mcp", err=True)

        try:
            anyio.run(lambda: gw.serve_http(host, port, authenticate, ready=ready, door=door))
        except UndoLogError as exc:
            _fail(exc.message)
    finally:
        undolog.close()


def _agent_keys(undolog: UndoLog) -> Callable[[str], str | None]:
    """Bearer tokens checked against the desk's API keys: a key with the agent role acts as an MCP client.

    The principal returned (and recorded as the session's owner) is the desk's principal reference ``key:<id>``,
    the one form the desk's checks compare: a key holding the approver role too may then not decide what it
    raised through the gateway.
    """
    from undolog_core.integration import shared_store

    try:
        from undolog_server.identity import Role
        from undolog_server.storage import ServerStore
    except ImportError:
        _fail("--http uses the desk's API keys: pip install 'undolog[server]'")
    store = ServerStore(shared_store(undolog))
    store.migrate()

    def authenticate(token: str) -> str | None:
        key = store.authenticate(token)
        if key is None or not key.has(Role.AGENT):
            return None
        # The desk's reference to the key (``key:<id>``): what a session's owner is recorded as, and what scopes
        # the sessions (and client idempotency keys) a client may name.
        return key.principal_ref

    return authenticate


@mcp_app.command("connect")
def connect(
    socket: Annotated[Path, typer.Option("--socket", help="The socket a long-lived `undolog mcp serve --socket` "
                                                          "listens on.")],
) -> None:
    """The stdio command an MCP client's config launches: forwards its MCP messages to the long-lived gateway
    serving on ``--socket`` (no upstream is started per connection)."""
    from undolog_core.errors import UndoLogError

    from ._sdk_import import defer_inits

    defer_inits()  # the forwarder uses two SDK modules; the SDK's package __init__ files would load all of it
    from .socket import forward

    try:
        status = forward(socket)
    except UndoLogError as exc:
        _fail(exc.message)
        return
    raise typer.Exit(status)


@mcp_app.command("init", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def init(
    ctx: typer.Context,
    upstream: Annotated[str, typer.Option("--upstream", help="A name for the upstream server.")],
    out: Annotated[Path | None, typer.Option("--out", help="Write here instead of stdout.")] = None,
    env: Annotated[list[str] | None, typer.Option("--env", help="KEY=VALUE for the upstream; repeat.")] = None,
) -> None:
    """List an upstream's tools and propose a gateway.toml: ``undolog mcp init --upstream NAME -- COMMAND...``.

    Every line is a proposal to review: MCP's hints are not trusted, the config decides.
    """
    from . import require_sdk
    from ._sdk_import import defer_inits

    defer_inits()  # before the first SDK import: the SDK's package __init__ files load what this never uses
    try:
        require_sdk()
    except ImportError as exc:
        _fail(str(exc))
    command = [a for a in ctx.args if a != "--"]
    if not command:
        _fail("give the upstream's command after --, e.g. undolog mcp init --upstream tickets -- python server.py")
    from .init import propose
    from .upstream import first_cause

    pairs = dict(e.split("=", 1) for e in env or [] if "=" in e)
    try:
        text = propose(upstream, command, env=pairs)
    except Exception as exc:  # noqa: BLE001 - one line saying what went wrong, not a task group's traceback
        _fail(f"could not list the tools of {' '.join(command)}: {first_cause(exc)}")
        return
    if out is None:
        typer.echo(text, nl=False)
    else:
        out.write_text(text, encoding="utf-8")
        typer.echo(f"wrote {out}: review every line before serving", err=True)
