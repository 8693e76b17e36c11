"""``undolog db upgrade``: create or migrate the tables (and, with ``--server``, a plugin's own tables)."""

from __future__ import annotations

from typing import Annotated

import typer

from .._plugins import TABLE_BRANCHES, plugin
from ..errors import ConfigurationError
from ._root import _open

#: What ``db upgrade --server`` says when the approval desk is not installed.
SERVER_EXTRA_HINT = "the approval desk needs the server extra: pip install 'undolog[server]'"


db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)


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
        # The desk declares its tables' migration in the undolog.table_branches entry-point group: the core
        # imports no package built on it.
        try:
            upgrade = plugin(TABLE_BRANCHES, "server")
        except ImportError:
            raise ConfigurationError(SERVER_EXTRA_HINT) from None
        if upgrade is None:
            raise ConfigurationError(SERVER_EXTRA_HINT)
        s_before, s_after = upgrade(u.store)
        if s_before == s_after:
            typer.echo(f"the server's tables are already at their latest revision ({s_after})")
        else:
            typer.echo(f"upgraded the server's tables from {s_before or 'none'} to {s_after}")
