"""``undolog mcp serve`` and ``undolog mcp init``; the main CLI calls :func:`register`.

Nothing here imports the MCP SDK until a command runs, so the base install's CLI keeps working without the
mcp extra.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

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
) -> None:
    """Serve MCP over stdio (the client starts this command), fronting the config's upstreams.

    With ``--http``, serve MCP's streamable HTTP transport at ``http://HOST:PORT/mcp`` behind the desk's API keys
    (a key with the agent role; create one with ``undolog keys create --role agent``). Logs go to stderr: over
    stdio, stdout is the protocol.
    """
    import anyio

    from undolog_core import UndoLog
    from undolog_core.errors import UndoLogError

    from . import require_sdk

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
    try:
        gw = Gateway(cfg, undolog)
        if not http:
            try:
                anyio.run(gw.serve_stdio)
            except UndoLogError as exc:  # an upstream that cannot start, a clash in what it lists: one line
                _fail(exc.message)
            return
        authenticate = _agent_keys(undolog)
        if host not in ("127.0.0.1", "::1", "localhost"):
            logging.getLogger("undolog.mcp").warning("listening beyond loopback on %s, as asked", host)

        def ready(bound: int) -> None:
            typer.echo(f"undolog mcp: serving http://{host}:{bound}/mcp", err=True)

        try:
            anyio.run(lambda: gw.serve_http(host, port, authenticate, ready=ready))
        except UndoLogError as exc:
            _fail(exc.message)
    finally:
        undolog.close()


def _agent_keys(undolog: object) -> Callable[[str], str | None]:
    """Bearer tokens checked against the desk's API keys: a key with the agent role acts as an MCP client."""
    try:
        from undolog_server.storage import ServerStore
    except ImportError:
        _fail("--http uses the desk's API keys: pip install 'undolog[server]'")
    store = ServerStore(undolog.store)  # type: ignore[attr-defined]
    store.migrate()

    def authenticate(token: str) -> str | None:
        key = store.authenticate(token)
        if key is None or "agent" not in key.roles:
            return None
        return str(key.identity)

    return authenticate


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
