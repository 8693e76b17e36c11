"""``undolog serve`` and ``undolog keys ...``; the main CLI calls :func:`register`.

Nothing here imports FastAPI or uvicorn until a command runs, so the base install's
CLI keeps working without the [server] extra.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import typer

DbOpt = Annotated[
    str | None,
    typer.Option("--db", envvar="UNDOLOG_DATABASE_URL", help="Database URL (default: ./undolog.db)."),
]
SchemaOpt = Annotated[
    str | None, typer.Option("--schema", envvar="UNDOLOG_SCHEMA", help="PostgreSQL schema to use.")
]


def _open(db: str | None, schema: str | None) -> Any:
    from undolog_core import UndoLog

    return UndoLog.open(db, schema=schema) if schema else UndoLog.open(db)


def _serve_undolog(db: str | None, schema: str | None, app_spec: str | None) -> tuple[Any, bool]:
    """Open the UndoLog to serve: the app's own when ``--app`` names one, else one on ``--db``.

    Returns:
        The UndoLog, and whether it came from ``--app`` (then it needs no further loading).
    """
    if app_spec and ":" in app_spec:
        from undolog_core import load_app
        from undolog_core.errors import ConfigurationError

        try:
            # The one --app loader; without ``into`` it accepts only an UndoLog or a factory of one, which
            # is what decides whether the app brings its own database.
            return load_app(app_spec), True
        except ConfigurationError:
            pass  # names tools to register: create_app loads them into the UndoLog on --db
    return _open(db, schema), False


def serve(
    db: DbOpt = None,
    schema: SchemaOpt = None,
    app: Annotated[
        str | None,
        typer.Option("--app", envvar="UNDOLOG_APP", help="module:attribute with the tools and compensations to load."),
    ] = None,
    proxy_config: Annotated[
        str | None, typer.Option("--proxy-config", envvar="UNDOLOG_PROXY_CONFIG", help="TOML file of proxied tools.")
    ] = None,
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to bind.")] = 8000,
    sweep_interval: Annotated[float, typer.Option(help="Seconds between sweeps of due approvals.")] = 1.0,
    recover_interval: Annotated[float, typer.Option(help="Seconds between recovery runs.")] = 30.0,
    webhook_backoff: Annotated[float, typer.Option(help="First webhook retry delay in seconds.")] = 1.0,
    webhook_timeout: Annotated[
        float, typer.Option(help="Total deadline of one webhook attempt in seconds (not per read).")
    ] = 5.0,
    webhook_per_target: Annotated[int, typer.Option(help="Most webhook sends in flight to one target.")] = 4,
    webhook_allow_private: Annotated[
        bool,
        typer.Option(
            "--webhook-allow-private/--no-webhook-allow-private",
            envvar="UNDOLOG_WEBHOOK_ALLOW_PRIVATE",
            help="Allow webhook targets on private, loopback and link-local addresses (refused by default).",
        ),
    ] = False,
    audit_checkpoint_key: Annotated[
        str | None,
        typer.Option(envvar="UNDOLOG_AUDIT_KEY", help="Ed25519 private key (PEM) signing audit checkpoints."),
    ] = None,
    audit_checkpoint_dir: Annotated[
        str | None, typer.Option(help="Directory (outside the database) for signed audit checkpoints.")
    ] = None,
    audit_checkpoint_interval: Annotated[float, typer.Option(help="Seconds between audit checkpoints.")] = 300.0,
    secure_cookies: Annotated[
        bool | None, typer.Option("--secure-cookies/--no-secure-cookies", help="Force the cookie Secure flag.")
    ] = None,
    max_body_bytes: Annotated[
        int,
        typer.Option("--max-body-bytes", envvar="UNDOLOG_MAX_BODY_BYTES", min=1,
                     help="Largest request body accepted, in bytes (larger: 413)."),
    ] = 1 << 20,
    max_concurrent_requests: Annotated[
        int,
        typer.Option("--max-concurrent-requests", envvar="UNDOLOG_MAX_CONCURRENT_REQUESTS", min=1,
                     help="Most requests handled at once (decisions have a lane of their own); others queue."),
    ] = 8,
    queue_timeout: Annotated[
        float,
        typer.Option("--queue-timeout", envvar="UNDOLOG_QUEUE_TIMEOUT", min=0.001,
                     help="Seconds a request may queue before it is answered 503 server_busy with Retry-After."),
    ] = 30.0,
    docs: Annotated[
        bool, typer.Option("--docs/--no-docs", envvar="UNDOLOG_DOCS",
                           help="Serve Swagger UI at /docs (loaded from a CDN; off by default).")
    ] = False,
    public_url: Annotated[
        str | None,
        typer.Option("--public-url", envvar="UNDOLOG_PUBLIC_URL",
                     help="The desk's address as approvers reach it (links in approval mail are built from it)."),
    ] = None,
    smtp_host: Annotated[
        str | None, typer.Option("--smtp-host", envvar="UNDOLOG_SMTP_HOST",
                                 help="SMTP server for approval mail (email approvals are off without it).")
    ] = None,
    smtp_port: Annotated[int, typer.Option("--smtp-port", envvar="UNDOLOG_SMTP_PORT", help="SMTP port.")] = 587,
    smtp_security: Annotated[
        str, typer.Option("--smtp-security", envvar="UNDOLOG_SMTP_SECURITY",
                          help="starttls, tls (implicit, port 465) or none (a relay on this host only).")
    ] = "starttls",
    smtp_user: Annotated[
        str | None, typer.Option("--smtp-user", envvar="UNDOLOG_SMTP_USER",
                                 help="SMTP login; its password is read from UNDOLOG_SMTP_PASSWORD only.")
    ] = None,
    smtp_ca_file: Annotated[
        str | None, typer.Option("--smtp-ca-file", envvar="UNDOLOG_SMTP_CA_FILE",
                                 help="PEM file of the CAs the SMTP server's certificate is checked against.")
    ] = None,
    email_from: Annotated[
        str | None, typer.Option("--email-from", envvar="UNDOLOG_EMAIL_FROM", help="The From address of approval mail.")
    ] = None,
    email_token_key_file: Annotated[
        str | None, typer.Option("--email-token-key-file", envvar="UNDOLOG_EMAIL_TOKEN_KEY_FILE",
                                 help="File holding the key that signs mail links (else UNDOLOG_EMAIL_TOKEN_KEY).")
    ] = None,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Run the approval desk: REST API, dashboard, webhooks, tool proxy and the sweeper."""
    try:
        import uvicorn

        from .app import create_app
        from .state import EmailSettings, ServerSettings
    except ImportError as exc:  # pragma: no cover - depends on the installed extras
        typer.echo(f"undolog serve needs the server extra: pip install 'undolog[server]' ({exc})", err=True)
        raise typer.Exit(2) from None
    undolog, from_app = _serve_undolog(db, schema, app)
    try:
        email = None
        if smtp_host:
            email = EmailSettings(
                smtp_host=smtp_host, sender=email_from or "", smtp_port=smtp_port,
                security=smtp_security,  # type: ignore[arg-type]  # checked by EmailSettings
                username=smtp_user, token_key_file=email_token_key_file, ca_file=smtp_ca_file,
            )
        settings = ServerSettings(
            sweep_interval=sweep_interval,
            recover_interval=recover_interval,
            webhook_backoff_base=webhook_backoff,
            webhook_timeout=webhook_timeout,
            webhook_per_target=webhook_per_target,
            webhook_lease=max(60.0, webhook_timeout * 2 + 10),
            webhook_allow_private=webhook_allow_private,
            audit_checkpoint_key=audit_checkpoint_key,
            audit_checkpoint_dir=audit_checkpoint_dir,
            audit_checkpoint_interval=audit_checkpoint_interval,
            secure_cookies=secure_cookies,
            max_body_bytes=max_body_bytes,
            max_concurrent_requests=max_concurrent_requests,
            queue_timeout=queue_timeout,
            docs=docs,
            public_url=public_url,
            email=email,
            slack=_slack_config(),
        )
    except ValueError as exc:
        undolog.close()
        typer.echo(f"error[invalid_input]: {exc}", err=True)
        raise typer.Exit(2) from None
    from undolog_core.errors import UndoLogError

    try:
        application = create_app(
            undolog, app_spec=None if from_app else app, proxy_config=proxy_config, settings=settings
        )
    except UndoLogError as exc:
        # A key it cannot read, a proxy config that does not load: one line, not a traceback.
        undolog.close()
        typer.echo(f"error[{exc.code}]: {exc.message}", err=True)
        raise typer.Exit(2) from None
    try:
        uvicorn.run(application, host=host, port=port, log_level=log_level, proxy_headers=False)
    finally:
        undolog.close()


keys_app = typer.Typer(help="Manage API keys (stored hashed; a key is printed once, at creation).", no_args_is_help=True)


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Option("--name", help="Who holds the key (recorded with each decision).")],
    role: Annotated[list[str], typer.Option("--role", help="agent, approver or admin; repeat for several.")],
    group: Annotated[list[str] | None, typer.Option("--group", help="Approver group; repeat for several.")] = None,
    db: DbOpt = None,
    schema: SchemaOpt = None,
) -> None:
    """Create an API key and print it once."""
    from undolog_core.integration import shared_store

    from .storage import ServerStore

    undolog = _open(db, schema)
    try:
        store = ServerStore(shared_store(undolog))
        store.migrate()
        try:
            key, token = store.create_key(name, role, group or (), created_by="cli")
        except ValueError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2) from None
    finally:
        undolog.close()
    typer.echo(token)
    typer.echo(
        f"key {key.key_id} for {key.name} (roles: {', '.join(sorted(key.roles))}); it is shown only now.", err=True
    )


@keys_app.command("list")
def keys_list(db: DbOpt = None, schema: SchemaOpt = None) -> None:
    """List keys (never their secrets)."""
    from undolog_core.integration import shared_store

    from .storage import ServerStore

    undolog = _open(db, schema)
    try:
        store = ServerStore(shared_store(undolog))
        store.migrate()
        for k in store.list_keys():
            status = "revoked" if k.revoked_at else "active"
            typer.echo(f"{k.key_id}\t{k.name}\t{','.join(sorted(k.roles))}\t{','.join(sorted(k.groups))}\t{status}")
    finally:
        undolog.close()


@keys_app.command("revoke")
def keys_revoke(key_id: str, db: DbOpt = None, schema: SchemaOpt = None) -> None:
    """Revoke a key; requests with it fail from now on."""
    from undolog_core.integration import shared_store

    from .storage import ServerStore

    undolog = _open(db, schema)
    try:
        store = ServerStore(shared_store(undolog))
        store.migrate()
        if not store.revoke_key(key_id):
            typer.echo(f"no active key {key_id}", err=True)
            raise typer.Exit(1)
    finally:
        undolog.close()
    typer.echo(f"revoked {key_id}")


def upgrade_tables(core: Any) -> tuple[str | None, str | None]:
    """Create or migrate the desk's tables on the core's store: ``undolog db upgrade --server`` runs it through the
    ``undolog.table_branches`` entry point (the core imports no server module).

    Args:
        core: The core's ``Store`` (``UndoLog.store``), on the database the tables go to.

    Returns:
        The desk's migration revision before and after (``None`` before its first run).

    Example:
        >>> upgrade_tables(UndoLog.open("sqlite:///undolog.db").store)      # doctest: +SKIP
        (None, 's0003_...')
    """
    from . import storage as server_store

    before = server_store.migration_current(core)
    server_store.migrate(core)
    return before, server_store.migration_current(core)


def register_serve(app: typer.Typer) -> None:
    """Add ``serve`` to the main ``undolog`` CLI (the ``undolog.cli_plugins`` entry point ``serve``).

    Example:
        >>> register_serve(typer.Typer())
    """
    app.command("serve")(serve)


def register_keys(app: typer.Typer) -> None:
    """Add the ``keys`` group to the main ``undolog`` CLI (the ``undolog.cli_plugins`` entry point ``keys``).

    Example:
        >>> register_keys(typer.Typer())
    """
    app.add_typer(keys_app, name="keys")


def register(app: typer.Typer) -> None:
    """Add ``serve`` and the ``keys`` group to a Typer application (``python -m undolog_server``).

    Args:
        app: The Typer application.
    """
    register_serve(app)
    register_keys(app)


def main() -> None:
    """Standalone entry point (``python -m undolog_server``)."""
    cli = typer.Typer(no_args_is_help=True)
    register(cli)
    cli()


def _slack_config() -> Any:
    """Slack approvals from ``UNDOLOG_SLACK_*`` (a token, a signing secret and a workspace id); None when off."""
    if not os.environ.get("UNDOLOG_SLACK_BOT_TOKEN"):
        return None
    from .slack import SlackConfig

    return SlackConfig.from_env()
