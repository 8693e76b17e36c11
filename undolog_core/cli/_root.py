"""The root of the ``undolog`` command line: the app, its global options, error handling and opening the store.

Every resource module (``sessions``, ``approvals``...) adds its commands to :data:`app` or to a group of its own
that the package registers; this module knows none of them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from .._app import gateway_database, is_gateway_config, load_app
from .._registry import default_actor
from .._undolog import UndoLog
from ..errors import ConfigurationError, UndoLogError
from ..storage import DATABASE_ERRORS, database_error_detail, safe_url, sqlite_file
from ..storage.base import resolve_url
from ._output import _inert


class CliInputError(UndoLogError):
    """Bad input caught by the CLI itself (unparseable ``--args``, nothing to change...).

    Fix:
        Correct the option the message names (``undolog COMMAND --help`` shows its form). Nothing was changed.
    """

    code = "invalid_input"


class _RootGroup(TyperGroup):
    """The root command group; turns expected errors into one line on stderr and exit code 2.

    Catching here, around the whole invocation, covers every sub-command (including the server's
    ``serve`` and ``keys``) without decorating each function, and keeps working under CliRunner,
    which calls the group directly rather than :func:`main`.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        return super().parse_args(ctx, _hoist_globals(self, ctx, list(args)))

    def invoke(self, ctx: Any) -> Any:  # typer.Context is a subclass of the vendored click Context
        try:
            return super().invoke(ctx)
        except UndoLogError as exc:
            _fail(exc.code, exc.message)
        except DATABASE_ERRORS as exc:
            # Unreachable server, missing schema, locked file: an environment problem, not a bug in UndoLog.
            _fail("database_error", database_error_detail(exc))


#: The root's options, which users also type after the command (``undolog approvals list --db URL``).
GLOBAL_OPTIONS = frozenset({"--db", "--schema", "--app"})


def _hoist_globals(group: Any, ctx: Any, args: list[str]) -> list[str]:
    """Move global options given after the command in front of it, where the root group parses them.

    Click parses a group's options only before its sub-command. A command that has an option of the same name
    itself (``serve --db``) keeps it; so does anything after ``--``.

    Example:
        >>> _hoist_globals(app_group, ctx, ["approvals", "list", "--db", "sqlite:///x.db"])   # doctest: +SKIP
        ['--db', 'sqlite:///x.db', 'approvals', 'list']
    """
    i = 0  # the root's own options, before the command
    while i < len(args) and args[i].startswith("-") and args[i] != "--":
        i += 1 if "=" in args[i] or args[i] not in GLOBAL_OPTIONS else 2
    head, tail = args[:i], args[i:]
    cmd, k = group, 0
    while k < len(tail) and not tail[k].startswith("-") and hasattr(cmd, "get_command"):
        sub = cmd.get_command(ctx, tail[k])
        if sub is None:
            break
        cmd, k = sub, k + 1
    own = set() if cmd is group else {o for p in cmd.params for o in getattr(p, "opts", ())}
    moved: list[str] = []
    kept: list[str] = []
    j = 0
    while j < len(tail):
        tok = tail[j]
        if tok == "--":
            kept += tail[j:]
            break
        name = tok.split("=", 1)[0]
        if name in GLOBAL_OPTIONS and name not in own and j >= k:
            if "=" in tok:
                moved.append(tok)
                j += 1
                continue
            if j + 1 < len(tail):
                moved += tail[j:j + 2]
                j += 2
                continue
        kept.append(tok)
        j += 1
    return head + moved + kept


def _fail(code: str, message: str, exit_code: int = 2) -> None:
    """Print ``error[<code>]: <message>`` on stderr and exit.

    Args:
        code: The stable error code (an UndoLogError's ``code``).
        message: What went wrong, for a person.
        exit_code: 2 for bad input or a refused operation.

    Raises:
        typer.Exit: Always.
    """
    typer.echo(f"error[{code}]: {_inert(message)}", err=True)
    raise typer.Exit(exit_code)


app = typer.Typer(
    cls=_RootGroup,
    name="undolog",
    help="UndoLog: inspect and resolve sessions, approvals, the tool registry, policy and the audit trail.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@dataclass
class _Settings:
    """The global options, kept on the root context for the commands."""

    db: str | None
    schema: str | None
    app_spec: str | None
    db_given: bool
    undolog: UndoLog | None = None


@app.callback()
def _root(
    ctx: typer.Context,
    db: Annotated[
        str | None,
        typer.Option("--db", envvar="UNDOLOG_DATABASE_URL", metavar="URL",
                     help="Database URL (sqlite:///file.db or postgresql+psycopg://...). Default: ./undolog.db."),
    ] = None,
    schema: Annotated[
        str | None, typer.Option("--schema", envvar="UNDOLOG_SCHEMA", help="PostgreSQL schema to use.")
    ] = None,
    app_spec: Annotated[
        str | None,
        typer.Option("--app", envvar="UNDOLOG_APP", metavar="MODULE:ATTR",
                     help="The app's UndoLog (or a factory returning one), so its compensations and probes can run."),
    ] = None,
) -> None:
    """UndoLog: a safety layer for LLM-agent tool calls."""
    source = ctx.get_parameter_source("db")
    ctx.obj = _Settings(db=db, schema=schema, app_spec=app_spec,
                        db_given=source is not None and source.name == "COMMANDLINE")
    # Commands registered by other modules (``serve``, ``keys``) read their own --db/--schema/--app
    # options from the environment; exporting what was given here means `undolog --db X serve` serves X.
    # The group callback runs before the sub-command parses its options, so they see these values.
    for var, value in (("UNDOLOG_DATABASE_URL", db), ("UNDOLOG_SCHEMA", schema), ("UNDOLOG_APP", app_spec)):
        if value is not None and os.environ.get(var) != value:
            old = os.environ.get(var)
            os.environ[var] = value
            ctx.call_on_close(_restore_env(var, old))


def _restore_env(var: str, old: str | None) -> Callable[[], None]:
    def restore() -> None:
        if old is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = old

    return restore


def _settings(ctx: typer.Context) -> _Settings:
    obj = ctx.find_root().obj
    assert isinstance(obj, _Settings)
    return obj


def _open(ctx: typer.Context, *, migrate: bool = False) -> UndoLog:
    """The UndoLog a command works on: the app's when ``--app`` is given, else one on ``--db``.

    Args:
        ctx: The command's context; the UndoLog is closed when the root context closes.
        migrate: Only ``db upgrade`` migrates; every other command refuses a database that is missing
            or behind, rather than silently creating tables in a mistyped location.

    Returns:
        The opened UndoLog (one per invocation).

    Raises:
        ConfigurationError: No database there, a database behind the code, or ``--app`` on another database.
    """
    st = _settings(ctx)
    if st.undolog is not None:
        return st.undolog
    gateway = bool(st.app_spec and is_gateway_config(st.app_spec))
    if st.app_spec and not gateway:
        u = load_app(st.app_spec)
        ctx.find_root().call_on_close(u.close)
        if st.db_given:
            # Compensations run against the app's database; acting on another one than the user named
            # would roll back the wrong sessions.
            wanted = resolve_url(st.db)
            if wanted != u.store.url or (st.schema or None) != (u.store.schema or None):
                raise ConfigurationError(
                    f"--app {st.app_spec} uses {safe_url(u.store.url)}"
                    f"{' schema ' + u.store.schema if u.store.schema else ''}, not the --db given "
                    f"({safe_url(wanted)}{' schema ' + st.schema if st.schema else ''}); drop --db or point "
                    "both at the same database"
                )
    else:
        # A gateway config may name its database (the MCP client's config starts the gateway with it): used when
        # neither --db nor UNDOLOG_DATABASE_URL says otherwise.
        named = gateway_database(st.app_spec) if gateway and st.db is None and st.app_spec else None
        url = resolve_url(st.db if st.db is not None else named)
        if not migrate and url.startswith("sqlite"):
            path = sqlite_file(url) or ""
            if not Path(path).expanduser().exists():
                # Connecting would create an empty file; say where we looked instead.
                raise ConfigurationError(
                    f"no UndoLog database at {path} (looked for {safe_url(url)}): pass --db URL (or set "
                    "UNDOLOG_DATABASE_URL), --app MODULE:ATTR for an app that opens its own, or create it with "
                    f"`undolog db upgrade --db {safe_url(url)}`"
                )
        u = UndoLog.open(url, schema=st.schema, migrate=False)
        ctx.find_root().call_on_close(u.close)
    st.undolog = u
    if not migrate:
        current, head = u.store.schema_revision(), u.store.head_revision()
        if current != head:
            where = u.store.where()
            state = "has no UndoLog tables" if current is None else f"is at schema revision {current}, not {head}"
            raise ConfigurationError(f"the database {where} {state}: run `undolog db upgrade`")
    if gateway:
        # An MCP gateway's config names no database of its own: its upstreams' tools and compensations are
        # loaded into the one --db names.
        load_app(st.app_spec, into=u)
    return u


def _actor(value: str | None) -> str:
    return value or default_actor()


ActorOpt = Annotated[
    str | None,
    typer.Option("--as", envvar="UNDOLOG_ACTOR", metavar="NAME",
                 help="Who takes this decision (recorded in the audit trail). Default: user@host."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]
