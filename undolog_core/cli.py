"""The ``undolog`` command line (Typer + Rich).

Everything here is a thin layer over the public Python API: the CLI never writes a table itself, so a
decision taken here is validated, audited and hash-chained exactly like one taken from code or the server.

Conventions every command follows:

* Global options go before or after the command: ``undolog --db URL approvals list`` and
  ``undolog approvals list --db URL`` are the same (``--db``, ``--schema``, ``--app``).
* ``--json`` prints machine-readable output with stable keys on stdout; tables are for people.
* An :class:`~undolog_core.errors.UndoLogError` prints ``error[<code>]: <message>`` on stderr and exits 2;
  never a traceback. Exit 1 means "ran, but something needs a person" (a tampered audit chain, a rollback
  that halted, effects that recovery could not reconcile).

Example:
    $ undolog --db sqlite:///undolog.db approvals list
    $ undolog approvals approve 3f2c... --as ana
    $ undolog --app myagent.app:undolog sessions rollback 9a1b...
"""

from __future__ import annotations

import datetime as dt
import decimal
import enum
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from ._app import gateway_database, is_gateway_config, load_app
from ._registry import default_actor
from ._saga import RollbackStep
from ._undolog import UndoLog
from .errors import ConfigurationError, UndoLogError
from .storage import DATABASE_ERRORS, database_error_detail, safe_url, sqlite_file
from .storage.base import resolve_url
from .storage.records import RequestState, SessionState

#: Below this many steps a rollback or recovery finishes too fast for a progress bar to help.
PROGRESS_MIN_STEPS = 5

#: How narrow a wrapping column may get before the table drops optional columns instead.
FLEX_WIDTH = 14

#: Width used when stdout is not a terminal (pipes, CI logs, tests): wide enough that 32-character ids
#: never wrap, because a wrapped id cannot be copied back into the next command.
PIPE_WIDTH = 200

#: What ``serve``, ``keys`` and ``db upgrade --server`` say when the approval desk is not installed.
SERVER_EXTRA_HINT = "the approval desk needs the server extra: pip install 'undolog[server]'"


class CliInputError(UndoLogError):
    """Bad input caught by the CLI itself (unparseable ``--args``, nothing to change...).

    Fix:
        Correct the option the message names (``undolog COMMAND --help`` shows its form). Nothing was changed.
    """

    code = "invalid_input"


# -- error handling -------------------------------------------------------------------------------


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
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
sessions_app = typer.Typer(help="List, inspect, roll back, resume and revalidate sessions.", no_args_is_help=True)
approvals_app = typer.Typer(help="Review and decide approval requests of IRREVERSIBLE calls.", no_args_is_help=True)
policy_app = typer.Typer(help="The organisation's approval policy.", no_args_is_help=True)
audit_app = typer.Typer(help="The hash-chained audit trail.", no_args_is_help=True)
effects_app = typer.Typer(help="Settle logged calls whose outcome is unknown.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(sessions_app, name="sessions")
app.add_typer(approvals_app, name="approvals")
app.add_typer(policy_app, name="policy")
app.add_typer(audit_app, name="audit")
app.add_typer(effects_app, name="effects")


# -- global state and opening the store -----------------------------------------------------------


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


# -- output helpers -------------------------------------------------------------------------------


def _console(stderr: bool = False) -> Console:
    """A Rich console bound to the current stdout/stderr (CliRunner swaps them per invocation)."""
    c = Console(stderr=stderr, highlight=False)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(stderr=stderr, highlight=False, width=PIPE_WIDTH)
    return c


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, set | frozenset | tuple):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def _print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=True, default=_jsonable, ensure_ascii=False))


def _when(value: dt.datetime | None) -> str:
    return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _compact(value: Any, limit: int | None = 60) -> str:
    text = json.dumps(value, sort_keys=True, default=_jsonable, ensure_ascii=False)
    return text if limit is None or len(text) <= limit else text[: limit - 1] + "…"


# What a terminal would act on rather than show: C0 controls but tab and newline (ESC starts ANSI and OSC sequences,
# CR overwrites a line), DEL, C1 controls (0x9b is a one-byte CSI), and the bidirectional overrides that reorder
# what a person reads.
_TERMINAL_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _inert(text: str) -> str:
    """``text`` with every terminal control shown as an escape (``\\x1b``), never sent to the terminal: agent- and
    model-supplied fields (arguments, reasons, errors) reach the operator's terminal through this."""
    return _TERMINAL_CONTROLS.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def _txt(value: Any) -> Text:
    """User data as literal text: arguments and reasons may contain ``[...]``, which Rich would take as markup, and
    terminal controls (ANSI escapes), which Rich passes through: both shown, neither acted on."""
    return Text("-" if value is None or value == "" else _inert(str(value)))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds <= 0:
        return "due"
    d, rem = divmod(seconds, 86400)
    h, rem = divmod(rem, 3600)
    m, s = divmod(rem, 60)
    parts = [f"{d}d" if d else "", f"{h}h" if h else "", f"{m}m" if m else "", f"{s}s" if s and not d else ""]
    return "in " + " ".join(p for p in parts if p)


_STATE_STYLES = {
    "active": "green", "completed": "green", "committed": "green", "compensated": "cyan", "approved": "green",
    "auto_approved": "yellow", "responded": "cyan", "awaiting_approval": "yellow", "pending": "yellow",
    "halted": "bold red",
    "rolling_back": "yellow",
    "rolled_back": "cyan", "rejected": "red", "timed_out": "red", "cancelled": "dim", "expired": "dim", "failed": "red",
    "unknown": "bold red", "dead_letter": "bold red", "compensation_failed": "bold red",
}


def _state(value: str | None) -> Text:
    return Text(value or "-", style=_STATE_STYLES.get(value or "", ""))


class _Table:
    """A Rich table that drops optional columns on a narrow terminal instead of squashing every column.

    Ids are never wrapped (a wrapped id cannot be copied into the next command), so on an 80-column
    terminal something has to give: columns with a ``drop`` rank go first, highest rank first.
    """

    def __init__(self, title: str) -> None:
        self.title = title
        self.cols: list[tuple[str, int, dict[str, Any]]] = []
        self.rows: list[tuple[Any, ...]] = []

    def col(self, header: str, *, drop: int = 0, **kw: Any) -> None:
        """Add a column.

        Args:
            header: The column header.
            drop: 0 keeps the column always; otherwise the column's rank for dropping (higher goes first).
            **kw: Passed to :meth:`rich.table.Table.add_column`; text wraps by default rather than being cut.
        """
        kw.setdefault("overflow", "fold")
        self.cols.append((header, drop, kw))

    def row(self, *cells: Any) -> None:
        self.rows.append(cells)

    def render(self, console: Console) -> Table:
        """The table with as many columns as fit the console, dropping ranked columns first."""
        droppable = sorted((i for i, c in enumerate(self.cols) if c[1]), key=lambda i: -self.cols[i][1])
        dropped: set[int] = set()
        while droppable and self._needed(console, dropped) > console.width:
            dropped.add(droppable.pop(0))
        table = Table(title=self.title)
        for i, (header, _, kw) in enumerate(self.cols):
            if i not in dropped:
                table.add_column(header, **kw)
        for cells in self.rows:
            table.add_row(*(c for i, c in enumerate(cells) if i not in dropped))
        return table

    def _needed(self, console: Console, dropped: set[int]) -> int:
        # A column that may wrap is content with FLEX_WIDTH characters a line; an unwrapped one (ids)
        # needs its full width. 3 characters of padding and border a column, plus the closing border.
        total = 1
        for i, (header, _, kw) in enumerate(self.cols):
            if i in dropped:
                continue
            natural = max([console.measure(header).maximum]
                          + [console.measure(cells[i]).maximum for cells in self.rows if i < len(cells)])
            total += 3 + (natural if kw.get("no_wrap") else min(natural, FLEX_WIDTH))
        return total


def _show(table: _Table, console: Console | None = None) -> None:
    con = console or _console()
    con.print(table.render(con))


def _kv(rows: list[tuple[str, Any]]) -> Table:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    for k, v in rows:
        grid.add_row(k, v if isinstance(v, Text) else _txt(v))
    return grid


class _Progress:
    """Progress of a rollback or recovery: a Rich bar on a terminal, one line per step otherwise.

    Used as the ``progress(done, total, step)`` callback of the saga and of recovery. Short runs show
    nothing; on a pipe (CI logs) a line per step is more useful than a bar that cannot redraw.
    """

    def __init__(self, what: str, *, enabled: bool = True) -> None:
        self._what = what
        self._enabled = enabled
        self._console = _console(stderr=True)
        self._bar: Progress | None = None
        self._task: Any = None

    def start(self, total: int) -> None:
        """Show the bar before the first step, when the number of steps is known up front.

        Args:
            total: How many steps the run will take.
        """
        if not self._enabled or total < PROGRESS_MIN_STEPS or not self._console.is_terminal or self._bar:
            return
        # The current step goes last, where Rich may cut it; the bar and the count always stay visible.
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=30), MofNCompleteColumn(),
                             TimeElapsedColumn(), TextColumn("{task.fields[step]}"), console=self._console)
        self._bar.start()
        self._task = self._bar.add_task(escape(self._what), total=total, step="")

    def __call__(self, done: int, total: int, step: Any) -> None:
        if not self._enabled or total < PROGRESS_MIN_STEPS:
            return
        text = _describe_step(step)
        if self._console.is_terminal:
            self.start(total)
            assert self._bar is not None
            self._bar.update(self._task, completed=done, total=total, step=escape(_short_step(step)))
        else:
            self._console.print(f"[{done}/{total}] {text}", markup=False, highlight=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def __enter__(self) -> _Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _short_step(step: Any) -> str:
    if isinstance(step, RollbackStep):
        return f"{step.tool_name}: {step.outcome}"
    return str(step)


def _describe_step(step: Any) -> str:
    if isinstance(step, RollbackStep):
        text = f"{step.compensation_name} of {step.tool_name} ({step.effect_id}): {step.outcome}"
        return text + (f" - {step.error}" if step.error else "")
    return str(step)


# -- db -------------------------------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade(
    ctx: typer.Context,
    server: Annotated[
        bool, typer.Option("--server", help="Also create or upgrade the approval desk's tables (its own branch).")
    ] = False,
) -> None:
    """Create the UndoLog tables, or bring them to the latest schema revision.

    \f
    Safe to run from several processes at once: on PostgreSQL an advisory lock serialises migrations.
    The approval desk's tables are a migration branch of the server's own; ``undolog serve`` applies it when
    it starts, ``--server`` applies it now (the server package must be installed).
    """
    u = _open(ctx, migrate=True)
    before = u.store.schema_revision()
    u.store.migrate()
    after = u.store.schema_revision()
    where = u.store.where()
    if before == after:
        typer.echo(f"{where} is already at the latest schema revision ({after})")
    else:
        typer.echo(f"upgraded {where} from {before or 'an empty database'} to {after}")
    if server:
        try:
            from undolog_server import storage as server_store
        except ImportError:
            raise ConfigurationError(SERVER_EXTRA_HINT) from None
        s_before = server_store.migration_current(u.store)
        server_store.migrate(u.store)
        s_after = server_store.migration_current(u.store)
        if s_before == s_after:
            typer.echo(f"the server's tables are already at their latest revision ({s_after})")
        else:
            typer.echo(f"upgraded the server's tables from {s_before or 'none'} to {s_after}")


# -- tools ----------------------------------------------------------------------------------------


@app.command("tools")
def tools(
    ctx: typer.Context,
    tool: Annotated[str | None, typer.Option("--tool", help="Only this tool's revisions.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the tool registry: every contract revision with its fingerprint and tier.

    \f
    Reads ``undolog_tool_registry``, the immutable contract audit trail; the newest revision of each tool
    is the one new sessions are pinned to.
    """
    u = _open(ctx)
    rows = u.registry.history(tool)
    if tool and not rows:
        raise CliInputError(f"tool {tool!r} has never been registered in this database")
    if as_json:
        _print_json([_registry_row(r) for r in rows])
        return
    if not rows:
        typer.echo("no tools registered yet")
        return
    latest = {r["tool_name"]: r["revision"] for r in rows}  # rows are ordered by (tool, revision)
    table = _Table("Tool registry (fingerprints shortened; --json for full values)")
    table.col("Tool", no_wrap=True)
    table.col("Rev", justify="right")
    table.col("Tier")
    table.col("Fingerprint", no_wrap=True)
    table.col("Previous", no_wrap=True, drop=3)
    table.col("Compensation")
    table.col("Registered by", drop=1)
    table.col("Registered at (UTC)", no_wrap=True, drop=2)
    for r in rows:
        comp = f"{r['compensation_name']} v{r['compensation_version']}" if r["compensation_name"] else "-"
        rev = Text(str(r["revision"]) + ("" if latest[r["tool_name"]] == r["revision"] else " (old)"),
                   style="" if latest[r["tool_name"]] == r["revision"] else "dim")
        table.row(_txt(r["tool_name"]), rev, _state(r["tier"]), r["fingerprint"][:16],
                  (r["previous_fingerprint"] or "-")[:16], _txt(comp), _txt(r["registered_by"]),
                  _when(r["registered_at"]))
    _show(table)


def _registry_row(r: Mapping[str, Any]) -> dict[str, Any]:
    keys = ("tool_name", "revision", "tier", "fingerprint", "previous_fingerprint", "compensation_name",
            "compensation_version", "registered_by", "registered_at", "contract")
    return {k: r.get(k) for k in keys}


# -- sessions -------------------------------------------------------------------------------------


@sessions_app.command("list")
def sessions_list(
    ctx: typer.Context,
    state: Annotated[SessionState | None, typer.Option("--state", help="Only sessions in this state.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many, newest first.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List sessions, newest first."""
    u = _open(ctx)
    recs = u.sessions.list(state=state.value if state else None, limit=limit)
    if as_json:
        _print_json([r.to_dict() for r in recs])
        return
    if not recs:
        typer.echo("no sessions" + (f" in state {state.value}" if state else ""))
        return
    table = _Table(f"Sessions ({len(recs)}, newest first)")
    table.col("Session", no_wrap=True, min_width=32)
    table.col("Agent")
    table.col("State", no_wrap=True)
    table.col("Calls", justify="right")
    table.col("Created (UTC)", no_wrap=True, drop=2)
    table.col("Halted because", drop=1)
    for r in recs:
        table.row(r.session_id, _txt(r.agent_id), _state(r.state), str(r.tool_calls_total), _when(r.created_at),
                  _txt(r.halted_reason))
    _show(table)


@sessions_app.command("show")
def sessions_show(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(metavar="ID", help="The session id.")],
    as_json: JsonOpt = False,
) -> None:
    """Show one session: its state, its effects in order, its undo plan and its approval requests."""
    u = _open(ctx)
    rec = u.sessions.get(session_id)
    effects = u.sessions.effects(session_id)
    approvals = u.approvals.list(session_id=session_id)
    plan = u.saga.undo_plan(session_id)
    if as_json:
        _print_json({"session": rec.to_dict(), "effects": effects, "undo_plan": plan,
                     "approvals": [a.to_dict() for a in approvals]})
        return
    con = _console()
    con.print(_kv([
        ("Session", rec.session_id), ("Agent", rec.agent_id), ("State", _state(rec.state)),
        ("Halted because", rec.halted_reason), ("Tool calls", rec.tool_calls_total),
        ("On failure", rec.on_failure), ("Created by", rec.created_by),
        ("Created (UTC)", _when(rec.created_at)), ("Updated (UTC)", _when(rec.updated_at)),
        ("Pinned revisions", ", ".join(f"{k}@{v}" for k, v in sorted(rec.pinned_revisions.items())) or "-"),
    ]))
    if effects:
        table = _Table("Effects (oldest first; SAFE calls are counted, not logged)")
        table.col("#", justify="right", drop=3)
        table.col("Effect", no_wrap=True, min_width=32)
        table.col("Tool")
        table.col("Tier", drop=2)
        table.col("State", no_wrap=True)
        table.col("Arguments")
        table.col("Undo", drop=1)
        table.col("Error")
        for i, e in enumerate(effects, 1):
            undo = f"{e['compensation_name']} ({e['undo_state']})" if e.get("compensation_name") else "-"
            table.row(str(i), e["effect_id"], _txt(e["tool_name"]), e["tier"], _state(e["state"]),
                      _txt(_compact(e["args_snapshot"])), _txt(undo), _txt(e.get("error") or e.get("undo_error")))
        _show(table, con)
    else:
        con.print("no logged effects")
    if plan:
        counts: dict[str, int] = {}
        for p in plan:  # dicts keep first-seen order: newest first, like the walk
            counts[p["compensation_name"]] = counts.get(p["compensation_name"], 0) + 1
        con.print(f"A rollback would run {len(plan)} compensation(s): "
                  + ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.items()), markup=False)
    if approvals:
        _show(_approvals_table(approvals, title="Approval requests"), con)


@sessions_app.command("rollback")
def sessions_rollback(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(metavar="ID", help="The session to roll back.")],
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
    wait: Annotated[float, typer.Option(
        "--wait", help="Seconds to wait for the live process serving the session (an MCP gateway) to run it.")] = 30.0,
) -> None:
    """Undo every compensable effect of a session, newest first (needs --app for the compensations).

    A session served by a live MCP gateway is rolled back by that gateway, over the upstream connections that did
    the work; this waits for it (``--wait``). Only when that gateway is gone does this run it, and says so.

    \f
    Committed IRREVERSIBLE effects cannot be undone; they are listed. A compensation that keeps failing
    stops the walk and halts the session (exit code 1); running the command again resumes where it stopped.
    """
    u = _open(ctx)
    u.sessions.get(session_id)  # an unknown id is a clear error before anything else
    total = len(u.saga.undo_plan(session_id))
    with _Progress("rolling back", enabled=not as_json) as progress:
        progress.start(total)
        report = u.rollback(session_id, actor=_actor(actor), progress=progress, wait=wait)
    if as_json:
        _print_json(report.to_dict())
    elif report.already_rolled_back:
        typer.echo(f"session {session_id} was already rolled back; nothing to do")
    else:
        if report.steps:
            table = _Table(f"Rollback of session {session_id} (newest first)")
            table.col("Effect", no_wrap=True, min_width=32)
            table.col("Tool")
            table.col("Compensation", drop=1)
            table.col("Outcome", no_wrap=True)
            table.col("Attempts", justify="right", drop=2)
            table.col("Error")
            for s in report.steps:
                table.row(s.effect_id, _txt(s.tool_name), _txt(s.compensation_name), _state(s.outcome),
                          str(s.attempts), _txt(s.error))
            _show(table)
        if report.complete:
            typer.echo(f"session {session_id} rolled back ({len(report.steps)} compensation(s) run)")
        if report.ran_by is not None:
            typer.echo(f"run by the live process serving the session: {report.ran_by}")
        if report.ran_without_live_upstream:
            typer.echo("ran here: the process that served the session is gone, so its compensations reached "
                       "upstreams started for this rollback (ran_without_live_upstream)", err=True)
        for kept in report.kept_irreversible:
            typer.echo(f"kept (irreversible, cannot be undone): {kept}")
    if not report.complete:
        typer.echo(f"rollback stopped; session {session_id} is halted: {_inert(report.halted_reason or '')}",
                   err=True)
        raise typer.Exit(1)


@sessions_app.command("resume")
def sessions_resume(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(metavar="ID", help="The halted session.")],
    actor: ActorOpt = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Why it may go on (audited).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Let a halted session go on, after a person has looked at it (audited)."""
    u = _open(ctx)
    rec = u.sessions.resume(session_id, actor=_actor(actor), reason=reason)
    if as_json:
        _print_json(rec.to_dict())
        return
    typer.echo(f"session {session_id} resumed by {_actor(actor)}; it is {rec.state} again")


class ResolveAs(enum.StrEnum):
    """What a person found: the call happened and stands, it is undone, or it never happened."""

    committed = "committed"
    compensated = "compensated"
    not_happened = "not_happened"


@effects_app.command("resolve")
def effects_resolve(
    ctx: typer.Context,
    effect_id: Annotated[str, typer.Argument(metavar="EFFECT", help="The effect whose outcome is unknown.")],
    outcome: Annotated[ResolveAs, typer.Option(
        "--as", case_sensitive=False, show_choices=True,
        help="What the external system shows: committed (it happened and stands), compensated (it is undone), "
             "not_happened.")],
    reason: Annotated[str, typer.Option("--reason", help="What you checked (required; audited).")],
    actor: Annotated[str | None, typer.Option(
        "--by", envvar="UNDOLOG_ACTOR", metavar="NAME",
        help="Who takes this decision (recorded in the audit trail). Default: user@host.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Settle a call whose outcome is unknown (a late finish, an interrupted IRREVERSIBLE call), after checking the
    external system. Audited; the session stays halted: resume it or roll it back next.

    committed: the call happened and stands (a rollback still runs its compensation if it has not run);
    compensated: it is undone (no rollback runs its compensation again); not_happened: it never happened
    (recorded failed; nothing to undo).
    """
    u = _open(ctx)
    done = u.resolve_effect(effect_id, outcome=outcome.value, reason=reason, actor=_actor(actor))
    if as_json:
        _print_json(done.to_dict())
        return
    typer.echo(f"effect {effect_id} ({_inert(done.tool_name)}) resolved as {done.resolved_as} by {_inert(done.actor)}; "
               f"it is {done.state} now")
    if done.session_state == "halted":
        typer.echo(f"session {_inert(done.session_id)} is still halted: 'undolog sessions resume "
                   f"{_inert(done.session_id)}' lets it go on, 'undolog sessions rollback "
                   f"{_inert(done.session_id)}' undoes it")


@sessions_app.command("revalidate")
def sessions_revalidate(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(metavar="ID", help="The session to re-pin.")],
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Pin a session to the current tool contracts, so calls to changed tools are accepted again (audited).

    \f
    With ``--app`` the session is pinned to the revisions that app registers; without it, to the newest
    revision of each tool in the registry.
    """
    u = _open(ctx)
    changed = u.sessions.revalidate(session_id, actor=_actor(actor))
    if as_json:
        _print_json({"session_id": session_id, "changed": changed})
        return
    if not changed:
        typer.echo(f"session {session_id} was already pinned to the current contracts; nothing changed")
        return
    table = _Table(f"Session {session_id} re-pinned by {_actor(actor)}")
    table.col("Tool")
    table.col("From", justify="right")
    table.col("To", justify="right")
    for name, ch in sorted(changed.items()):
        table.row(_txt(name), _txt(ch["from"]), _txt(ch["to"]))
    _show(table)


# -- approvals ------------------------------------------------------------------------------------


#: ``--state`` of ``approvals list``: a request state, or every state.
ApprovalState = enum.Enum(  # type: ignore[misc]
    "ApprovalState", {**{s.value: s.value for s in RequestState}, "all": "all"}, type=str
)


def _approvals_table(recs: list[Any], *, title: str) -> _Table:
    table = _Table(title)
    table.col("Request", no_wrap=True, min_width=32)
    table.col("Tool")
    table.col("State", no_wrap=True)
    table.col("Session", no_wrap=True, min_width=32, drop=4)
    table.col("Proposed arguments")
    table.col("Risk tags", drop=3)
    table.col("Times out", no_wrap=True, drop=2)
    for r in recs:
        due = _duration(r.seconds_left) if r.state is RequestState.PENDING else "-"
        table.row(r.approval_request_id, _txt(r.tool_name), _state(r.state), r.session_id,
                  _txt(_compact(r.proposed_args)), _txt(", ".join(r.risk_tags)), due)
    return table


@approvals_app.command("list")
def approvals_list(
    ctx: typer.Context,
    state: Annotated[ApprovalState, typer.Option("--state", help="Requests in this state ('all' for every state).")]
    = ApprovalState.pending,  # type: ignore[attr-defined]
    session_id: Annotated[str | None, typer.Option("--session", help="Only this session's requests.")] = None,
    tool: Annotated[str | None, typer.Option("--tool", help="Only requests for this tool.")] = None,
    risk_tag: Annotated[str | None, typer.Option("--risk-tag", help="Only requests carrying this risk tag.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many, newest first.")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """List approval requests (pending ones by default), newest first."""
    u = _open(ctx)
    # Reading applies due timeouts first, so nothing past its deadline is shown (or decided) as pending.
    u.approvals.expire_due()
    recs = u.approvals.list(state=None if state.value == "all" else state.value, session_id=session_id,
                            tool_name=tool, risk_tag=risk_tag, limit=limit)
    if as_json:
        _print_json([r.to_dict() for r in recs])
        return
    if not recs:
        typer.echo("no approval requests" + ("" if state.value == "all" else f" in state {state.value}"))
        return
    _show(_approvals_table(recs, title=f"Approval requests ({len(recs)}, newest first)"))


@approvals_app.command("show")
def approvals_show(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(metavar="ID", help="The approval request id.")],
    as_json: JsonOpt = False,
) -> None:
    """Show one approval request: the proposed call, why it needs a person, the agent's recent calls, its history."""
    u = _open(ctx)
    rec = u.approvals.get(request_id)
    events = u.approvals.events(request_id)
    if as_json:
        _print_json({**rec.to_dict(), "events": [asdict(e) for e in events]})
        return
    con = _console()
    due = _duration(rec.seconds_left) if rec.state is RequestState.PENDING else "-"
    con.print(_kv([
        ("Request", rec.approval_request_id), ("State", _state(rec.state)),
        ("Tool", f"{rec.tool_name} (revision {rec.tool_revision})"),
        ("Session", rec.session_id), ("Call id", rec.call_id), ("Effect", rec.effect_id),
        ("Why a person", rec.reason), ("Risk tags", ", ".join(rec.risk_tags)),
        ("Proposed arguments", json.dumps(rec.proposed_args, indent=2, sort_keys=True, default=_jsonable)),
        ("Approved arguments",
         None if rec.approved_args is None else json.dumps(rec.approved_args, indent=2, sort_keys=True,
                                                            default=_jsonable)),
        ("Created (UTC)", _when(rec.created_at)), ("Times out (UTC)", f"{_when(rec.timeout_at)} {due}"),
        ("Decided by", rec.decided_by), ("Decided (UTC)", _when(rec.decided_at)),
        ("Decision reason", rec.decision_reason),
    ]))
    if rec.agent_context:
        table = _Table("The agent's recent calls (oldest first)")
        table.col("Tool")
        table.col("Tier")
        table.col("State")
        table.col("Arguments")
        for c in rec.agent_context:
            table.row(_txt(c.get("tool_name")), _txt(c.get("tier")), _state(c.get("state")),
                      _txt(_compact(c.get("args"), 100)))
        _show(table, con)
    if events:
        table = _Table("History (audit events)")
        table.col("Event", justify="right")
        table.col("When (UTC)", no_wrap=True, drop=1)
        table.col("Action")
        table.col("Actor")
        table.col("Details")
        for e in events:
            table.row(str(e.event_id), _when(e.created_at), _txt(e.action), _txt(e.actor),
                      _txt(_compact(e.payload, 120)))
        _show(table, con)


def _decided(rec: Any, verb: str, as_json: bool) -> None:
    if as_json:
        _print_json(rec.to_dict())
        return
    typer.echo(f"{verb} request {rec.approval_request_id}: {rec.tool_name} in session {rec.session_id}")


@approvals_app.command("approve")
def approvals_approve(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(metavar="ID", help="The approval request id.")],
    actor: ActorOpt = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Optional note, kept in the audit trail.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve the call as proposed; it runs once, when the agent re-issues it (same call_id)."""
    u = _open(ctx)
    rec = u.approvals.approve(request_id, approver=_actor(actor), reason=reason)
    _decided(rec, "approved", as_json)
    if not as_json:
        typer.echo(f"the call runs when the agent re-issues it (call_id {rec.call_id})")


@approvals_app.command("reject")
def approvals_reject(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(metavar="ID", help="The approval request id.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (required; the agent and the audit trail see it).")],
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reject the call: it never runs, the session halts and its other pending requests are cancelled."""
    u = _open(ctx)
    rec = u.approvals.reject(request_id, approver=_actor(actor), reason=reason)
    _decided(rec, "rejected", as_json)
    if not as_json:
        typer.echo(f"session {rec.session_id} is halted: roll it back or resume it once you have looked")


@approvals_app.command("modify")
def approvals_modify(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(metavar="ID", help="The approval request id.")],
    args_text: Annotated[
        str,
        typer.Option("--args", metavar="JSON",
                     help="The edited arguments as a JSON object (or @file.json); validated against the tool's schema."),
    ],
    merge: Annotated[
        bool, typer.Option("--merge", help="Apply the given fields on top of the proposed arguments.")
    ] = False,
    actor: ActorOpt = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Optional note, kept in the audit trail.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve with edited arguments; a bad edit is refused and names the field."""
    edited = _parse_args(args_text)
    u = _open(ctx)
    if merge:
        edited = {**u.approvals.get(request_id).proposed_args, **edited}
    rec = u.approvals.modify(request_id, approver=_actor(actor), args=edited, reason=reason)
    _decided(rec, "approved with edits", as_json)
    if not as_json:
        typer.echo(f"approved arguments: {_inert(_compact(rec.approved_args, None))}")
        typer.echo(f"the call runs with them when the agent re-issues it (call_id {rec.call_id})")


def _parse_args(text: str) -> dict[str, Any]:
    """Parse ``--args``: a JSON object, given inline or as ``@path``.

    Args:
        text: The option's value.

    Returns:
        The arguments as a dict.

    Raises:
        CliInputError: Unreadable file, invalid JSON (with its position) or not a JSON object.
    """
    source = "--args"
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CliInputError(f"cannot read --args file {path}: {exc.strerror or exc}") from None
        source = f"--args file {path}"
    try:
        value = json.loads(text, parse_float=decimal.Decimal)
    except json.JSONDecodeError as exc:
        raise CliInputError(
            f"{source} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(value, dict):
        raise CliInputError(
            f"{source} must be a JSON object of argument names to values, e.g. '{{\"amount\": 10}}'; "
            f"got a JSON {type(value).__name__}"
        )
    return value


# -- policy ---------------------------------------------------------------------------------------


@policy_app.command("show")
def policy_show(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Show the organisation's approval policy."""
    u = _open(ctx)
    pol = u.policy.get()
    if as_json:
        _print_json(pol.to_dict())
        return
    _console().print(_kv([
        ("approval_timeout_seconds", f"{pol.approval_timeout_seconds} ({_duration(pol.approval_timeout_seconds)[3:]})"),
        ("auto_approve_on_timeout", str(pol.auto_approve_on_timeout).lower()),
        ("context_calls", pol.context_calls),
        ("approved_ttl_seconds", f"{pol.approved_ttl_seconds} ({_duration(pol.approved_ttl_seconds)[3:]})"),
    ]))


@policy_app.command("set")
def policy_set(
    ctx: typer.Context,
    approval_timeout_seconds: Annotated[
        int | None, typer.Option("--approval-timeout-seconds", metavar="N",
                                 help="How long a new approval request waits for a person.")
    ] = None,
    auto_approve_on_timeout: Annotated[
        str | None, typer.Option("--auto-approve-on-timeout", metavar="true|false",
                                 help="On timeout: auto-approve (true) or fail closed (false, the default).")
    ] = None,
    context_calls: Annotated[
        int | None, typer.Option("--context-calls", metavar="N",
                                 help="How many recent calls go into an approval request's context.")
    ] = None,
    approved_ttl_seconds: Annotated[
        int | None, typer.Option("--approved-ttl-seconds", metavar="N",
                                 help="How long an approved call may wait to be re-issued before it expires.")
    ] = None,
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change the organisation's approval policy (audited)."""
    changes = {"approval_timeout_seconds": approval_timeout_seconds,
               "auto_approve_on_timeout": auto_approve_on_timeout, "context_calls": context_calls,
               "approved_ttl_seconds": approved_ttl_seconds}
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        raise CliInputError(
            "nothing to change: give --approval-timeout-seconds, --auto-approve-on-timeout, --context-calls and/or "
            "--approved-ttl-seconds"
        )
    u = _open(ctx)
    before = u.policy.get()
    after = u.policy.set(actor=_actor(actor), **changes)
    if as_json:
        _print_json({"before": before.to_dict(), "after": after.to_dict()})
        return
    table = _Table(f"Policy changed by {_actor(actor)}")
    table.col("Setting")
    table.col("Before")
    table.col("After")
    for k, old in before.to_dict().items():
        new = after.to_dict()[k]
        style = "bold" if new != old else "dim"
        table.row(Text(k, style=style), _txt(json.dumps(old)), Text(json.dumps(new), style=style))
    _show(table)


# -- recovery -------------------------------------------------------------------------------------


@app.command("recover")
def recover(
    ctx: typer.Context,
    as_json: JsonOpt = False,
    take_over: Annotated[
        list[str] | None,
        typer.Option("--take-over", metavar="EFFECT",
                     help="Take over this in-flight effect although its owner still runs on this host (a process "
                          "stopped for good). Repeatable."),
    ] = None,
) -> None:
    """Reconcile calls left in flight by crashed processes (needs --app for probes and compensations).

    \f
    Only effects whose owner is gone are touched, so running it next to live agents is safe, and several
    ``recover`` runs at once handle each effect once. A process on this host that still runs (stopped, paused)
    keeps its calls whatever its lease says; ``--take-over EFFECT`` is a person's decision to take one over (if
    the process finishes the call after all, the effect becomes ``unknown`` and the finish is recorded). Exit
    code 1 when some effects could not be reconciled (e.g. their tool is not in the loaded app) or went to the
    dead letter.
    """
    u = _open(ctx)
    with _Progress("recovering", enabled=not as_json) as progress:
        report = u.recover(progress=progress, take_over=take_over or ())
    if as_json:
        _print_json(report.to_dict())
    else:
        if report.reconciled:
            table = _Table("Reconciled effects")
            table.col("Effect", no_wrap=True, min_width=32)
            table.col("Tool")
            table.col("Outcome", no_wrap=True)
            for r in report.reconciled:
                table.row(r["effect_id"], _txt(r["tool_name"]), _state(r["outcome"]))
            _show(table)
        for sid in report.rollbacks_resumed:
            typer.echo(f"resumed the interrupted rollback of session {sid}")
        for eid in report.dead_lettered:
            typer.echo(f"dead letter (needs a person): effect {eid}")
        if report.left_alive:
            typer.echo(f"left alone: {report.left_alive} call(s) still running in live processes")
        if not (report.reconciled or report.rollbacks_resumed or report.errors or report.dead_lettered):
            typer.echo("nothing to recover")
    for err in report.errors:
        typer.echo(f"not recovered: {_inert(err)}", err=True)
    if report.errors or report.dead_lettered:
        raise typer.Exit(1)


# -- growth ---------------------------------------------------------------------------------------


@app.command("gc")
def gc(
    ctx: typer.Context,
    older_than: Annotated[str, typer.Option("--older-than", metavar="AGE",
                                            help="Idle for at least this long: 30d, 12h, 2w...")],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Count the settled sessions; change nothing.")] = False,
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Archive the effects and undo entries of settled sessions idle for --older-than into undolog_archive.

    \f
    Settled: completed or rolled back, or active with nothing in flight or awaiting approval (closed as it is
    archived). Recorded in the audit trail (``gc.archive``); audit events are never deleted.
    """
    from ._gc import collect, parse_age

    age = parse_age(older_than)
    u = _open(ctx)
    report = collect(u.store, age, actor=_actor(actor), dry_run=dry_run)
    if as_json:
        _print_json(report.to_dict())
        return
    if dry_run:
        typer.echo(f"{report.sessions} settled session(s) idle since before {report.idle_before} (dry run)")
        return
    typer.echo(f"archived {report.effects} effect(s) and {report.undo_entries} undo entr(y/ies) of "
               f"{report.sessions} session(s) idle since before {report.idle_before} (run {report.run_id})")
    if report.closed:
        typer.echo(f"closed {len(report.closed)} idle active session(s)")


# -- audit ----------------------------------------------------------------------------------------


@audit_app.command("verify")
def audit_verify(
    ctx: typer.Context,
    checkpoints: Annotated[
        Path | None,
        typer.Option("--checkpoints", help="Directory of signed checkpoints the chain must match (see 'checkpoint')."),
    ] = None,
    public_key: Annotated[
        Path | None,
        typer.Option("--public-key", envvar="UNDOLOG_AUDIT_PUBLIC_KEY",
                     help="Ed25519 public key (PEM) that signed the checkpoints ('audit keygen' wrote <key>.pub)."),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Recompute the audit hash chain (and match it against signed checkpoints); exit 1 when tampered with."""
    if checkpoints is not None and public_key is None:
        # Never taken from the checkpoint directory: whoever can write there could swap both.
        _fail("invalid_input", "--checkpoints needs the public key that signed them: --public-key FILE")
    u = _open(ctx)
    report = u.verify_audit(checkpoints=checkpoints, public_key=public_key)
    if as_json:
        _print_json(asdict(report))
    elif report.ok:
        signed = f", matching {report.checkpoints_checked} signed checkpoint(s)" if checkpoints is not None else ""
        typer.echo(f"audit chain intact: {report.events_checked} event(s) checked{signed}")
    if not report.ok:
        typer.echo(
            f"audit chain BROKEN at event {report.first_bad_event_id}: {report.problem} "
            f"({report.events_checked} event(s) checked)",
            err=True,
        )
        raise typer.Exit(1)


@audit_app.command("keygen")
def audit_keygen(
    key: Annotated[Path, typer.Option("--key", help="Where to write the private key; the public key goes to <key>.pub.")],
    force: Annotated[bool, typer.Option("--force", help="Replace existing key files.")] = False,
) -> None:
    """Write a new Ed25519 key pair for signed audit checkpoints (keep the private key off the database host)."""
    from ._checkpoints import generate_keypair

    private, public = generate_keypair(key, overwrite=force)
    typer.echo(f"private key: {private} (mode 0600; only the checkpointing process may read it)")
    typer.echo(f"public key:  {public} (give it to whoever runs 'undolog audit verify --checkpoints')")


@audit_app.command("checkpoint")
def audit_checkpoint(
    ctx: typer.Context,
    key: Annotated[Path, typer.Option("--key", envvar="UNDOLOG_AUDIT_KEY", help="Ed25519 private key (PEM).")],
    out: Annotated[Path, typer.Option("--out", help="Directory (outside the database) to write the checkpoint into.")],
    as_json: JsonOpt = False,
) -> None:
    """Verify the chain, then sign its head and write the signed checkpoint into --out (run it on a schedule)."""
    from ._checkpoints import load_private_key, write_checkpoint

    private = load_private_key(key)  # before opening the database: a bad key is the first thing to report
    u = _open(ctx)
    path = write_checkpoint(u.store, private, out)
    doc = json.loads(path.read_text(encoding="utf-8"))["checkpoint"]
    if as_json:
        _print_json({"file": str(path), **doc})
    else:
        typer.echo(f"signed the chain head at event {doc['position']} ({doc['hash'][:16]}…) into {path}")


# -- demo -----------------------------------------------------------------------------------------


class Framework(enum.StrEnum):
    langgraph = "langgraph"
    crewai = "crewai"
    semantic_kernel = "semantic-kernel"


_DEMOS = {
    Framework.langgraph: ("examples.support_agent.demo", "langgraph"),
    Framework.crewai: ("examples.crewai_support_crew.demo", "crewai"),
    Framework.semantic_kernel: ("examples.semantic_kernel_support.demo", "semantic-kernel"),
}


def _examples_root() -> Path | None:
    """The folder that holds ``examples/`` (the demos are not an installed package).

    ``$UNDOLOG_EXAMPLES`` (the ``examples`` folder itself) wins; then the current directory; then the
    checkout this CLI runs from (an editable install: ``undolog_core`` sits next to ``examples``).
    """
    candidates = []
    if env := os.environ.get("UNDOLOG_EXAMPLES"):
        candidates.append(Path(env).expanduser().resolve().parent)
    candidates += [Path.cwd(), Path(__file__).resolve().parent.parent]
    for root in candidates:
        if (root / "examples" / "__init__.py").is_file():
            return root
    return None


def _import_demo(module_name: str) -> Any:
    import importlib
    import sys

    root = _examples_root()
    if root is not None and str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(module_name)


@app.command("demo")
def demo(
    framework: Annotated[Framework, typer.Option("--framework", help="Which agent framework runs the demo.")]
    = Framework.langgraph,
    reject: Annotated[bool, typer.Option("--reject", help="Reject the account deletion instead of approving it.")]
    = False,
    interactive: Annotated[
        bool, typer.Option("--interactive", help="Ask you to decide the approval (langgraph only).")
    ] = False,
    model: Annotated[
        str | None, typer.Option("--model", help="A real chat model instead of the scripted one (langgraph only).")
    ] = None,
    demo_db: Annotated[
        str | None, typer.Option("--demo-db", metavar="PATH", help="Keep the demo's SQLite database at PATH.")
    ] = None,
    old_demo_db: Annotated[
        str | None, typer.Option("--db", metavar="PATH", hidden=True, help="Deprecated spelling of --demo-db.")
    ] = None,
) -> None:
    """Run the support-agent demo: a refund, a deletion that waits for approval, and a rollback.

    \f
    The demo modules live in ``examples/`` (found by :func:`_examples_root`, not installed) and pull in
    their framework; they are imported only here so the rest of the CLI works without those extras.
    """
    module_name, extra = _DEMOS[framework]
    if old_demo_db is not None:
        # `demo --db PATH` predates the global `--db URL` that may now follow any command; it keeps working.
        typer.echo("note: `undolog demo --db PATH` is deprecated, use `--demo-db PATH`", err=True)
        if demo_db is not None and demo_db != old_demo_db:
            raise CliInputError("give the demo's database once: --demo-db PATH (--db is its deprecated spelling)")
        demo_db = old_demo_db
    if framework is not Framework.langgraph and (interactive or model):
        raise CliInputError(f"--interactive and --model apply to the langgraph demo only, not {framework.value}")
    try:
        module = _import_demo(module_name)
    except ImportError as exc:
        where = "" if _examples_root() else (
            "; the demos live in the repository's examples/ folder: run from the checkout or set "
            "UNDOLOG_EXAMPLES=/path/to/examples"
        )
        raise ConfigurationError(
            f"the {framework.value} demo cannot be loaded ({exc}); install it with: pip install "
            f"'undolog[{extra}]'{where}"
        ) from None
    run = module.main
    if framework is Framework.langgraph:
        code = run(reject=reject, interactive=interactive, model=model, db_path=demo_db)
    else:
        kwargs: dict[str, Any] = {"reject": reject}
        if demo_db is not None:
            if "database_url" not in inspect.signature(run).parameters:
                raise CliInputError(f"the {framework.value} demo does not take --demo-db")
            kwargs["database_url"] = demo_db if "://" in demo_db else f"sqlite:///{Path(demo_db).resolve()}"
        code = run(**kwargs)
    raise typer.Exit(int(code or 0))


# -- check-undo -----------------------------------------------------------------------------------


def _load_callable(spec: str, what: str) -> Any:
    """``module:attribute`` (the attribute may be dotted) imported from the current directory or the path."""
    import importlib

    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise CliInputError(f"{what} must look like module:function, got {spec!r}")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as exc:
        raise CliInputError(f"cannot import {mod_name!r} for {what}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: say so, no traceback
        raise CliInputError(f"importing {mod_name!r} for {what} raised {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CliInputError(f"{mod_name!r} has no {attr!r} for {what}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CliInputError(f"{what} {spec!r} is not callable")
    return obj


@app.command("check-undo")
def check_undo_command(
    ctx: typer.Context,
    scenario: Annotated[str, typer.Argument(metavar="MODULE:SCENARIO",
                                            help="scenario(undolog) or scenario(undolog, run), sync or async.")],
    snapshot: Annotated[str, typer.Option("--snapshot", metavar="MODULE:FN",
                                          help="Returns a JSON-able picture of the world a compensation restores.")],
    reset: Annotated[str, typer.Option("--reset", metavar="MODULE:FN",
                                       help="Puts the world back to the scenario's starting point.")],
    idempotency: Annotated[bool, typer.Option("--idempotency/--no-idempotency",
                                              help="Run each compensation a second time with the same key.")] = True,
    never_happened: Annotated[bool, typer.Option(
        "--never-happened/--no-never-happened",
        help="Crash each step after its pre-write, before the tool ran, and let recovery compensate it.")] = True,
    crash: Annotated[bool, typer.Option("--crash", help="Also with real SIGKILLs in a child process.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Break a scenario after every COMPENSABLE step and check that its compensations restore the world.

    Prints the table (step, tool, compensation, restored, idempotent, never-happened) and the diffs; exit 1 when
    a step is not restored, not idempotent or not tolerant of "never happened", or when the check proved nothing
    (the scenario raised an error of its own, or made no COMPENSABLE call).
    \f
    The scenario runs against the UndoLog of ``--app`` (or one on ``--db``); its runs are sessions of their own.
    """
    from .testing import check_undo

    fns = {name: _load_callable(spec, name) for name, spec in
           (("scenario", scenario), ("--snapshot", snapshot), ("--reset", reset))}
    u = _open(ctx)
    paths = {"scenario": scenario, "snapshot": snapshot, "reset": reset}
    if _settings(ctx).app_spec:
        paths["app"] = _settings(ctx).app_spec or ""
    report = check_undo(fns["scenario"], snapshot=fns["--snapshot"], reset=fns["--reset"], undolog=u,
                        idempotency=idempotency, never_happened=never_happened, crash=crash,
                        crash_paths=paths if crash else None)
    if as_json:
        _print_json(report.to_dict())
    else:
        typer.echo(report.explain(color=sys.stdout.isatty(), width=_console().width), nl=False)
    raise typer.Exit(0 if report.ok else 1)


# -- the server's commands ------------------------------------------------------------------------


def _register_mcp_commands() -> None:
    # The MCP gateway is its own package (undolog_mcp, the mcp extra); its CLI module imports the SDK only when
    # a command runs. Without it, ``undolog mcp`` still exists and says what to install.
    try:
        from undolog_mcp import cli as mcp_cli
    except ImportError:
        def _missing() -> None:
            raise ConfigurationError("the MCP gateway needs the mcp extra: pip install 'undolog[mcp]'")

        ctx = {"allow_extra_args": True, "ignore_unknown_options": True}
        app.command("mcp", help="The MCP gateway (needs the mcp extra).", context_settings=ctx)(_missing)
    else:
        mcp_cli.register(app)


def _register_server_commands() -> None:
    # The desk is its own package (undolog_server) and its dependencies (FastAPI, uvicorn, httpx) are the
    # optional [server] extra. Only its small CLI module is imported here, and it imports those dependencies
    # when a command runs; without the package, ``serve`` and ``keys`` still exist and say what to install,
    # and a missing or broken server never takes the core CLI down with it.
    try:
        from undolog_server import cli as server_cli
    except ImportError:
        pass
    else:
        server_cli.register(app)
        return

    def _missing() -> None:
        raise ConfigurationError(SERVER_EXTRA_HINT)

    ctx = {"allow_extra_args": True, "ignore_unknown_options": True}
    app.command("serve", help="Run the approval desk (needs the server extra).", context_settings=ctx)(_missing)
    app.command("keys", help="Manage API keys (needs the server extra).", context_settings=ctx)(_missing)


_register_server_commands()
_register_mcp_commands()


def main() -> None:
    """Entry point of the ``undolog`` console script."""
    app(prog_name="undolog")


if __name__ == "__main__":  # pragma: no cover
    main()
