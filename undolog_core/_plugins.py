"""What other packages add to the core, found through entry points instead of imported by name.

The core imports none of the packages built on it (the desk in ``undolog_server``, the MCP gateway in
``undolog_mcp``; ``tests/test_import_graph.py`` checks it): they declare what they add in their distribution's
metadata, and the core looks it up when a command or an ``--app`` needs it. A package outside this distribution adds
``undolog`` commands the same way.

The entry-point groups:

- ``undolog.cli_plugins``: ``register(app)`` adds the command named as the entry point to the ``undolog`` Typer app
  (``serve`` and ``keys`` from the desk, ``mcp`` from the gateway), registered in the order of their names; the
  entry point's extra (``[server]``) is what to install when it cannot be imported.
- ``undolog.cli_direct``: ``run(args)`` runs the command ``GROUP COMMAND`` named by the entry point
  (``mcp.connect``) without building the ``undolog`` app, given the arguments after it; it returns the exit status,
  or None to leave them to the app (``--help``, anything it does not parse itself). For commands a client starts
  per session, where the app's imports were most of their start-up.
- ``undolog.table_branches``: ``upgrade(store) -> (before, after)`` creates or migrates a package's own tables on
  the core's store (``undolog db upgrade --server`` runs the one named ``server``).
- ``undolog.gateway``: ``register`` (``register_gateway(path, into)``) and ``database`` (``database_of(path)``), what
  ``--app gateway.toml`` needs of the MCP gateway.

Example:
    >>> from undolog_core._plugins import plugin
    >>> plugin("undolog.table_branches", "server")                     # doctest: +SKIP
    <function upgrade_tables at 0x...>
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

CLI_PLUGINS = "undolog.cli_plugins"
CLI_DIRECT = "undolog.cli_direct"
TABLE_BRANCHES = "undolog.table_branches"
GATEWAY = "undolog.gateway"


def plugins(group: str) -> list[EntryPoint]:
    """The entry points of ``group`` in every installed distribution, ordered by name (duplicates once).

    Example:
        >>> [ep.name for ep in plugins("undolog.cli_plugins")]           # doctest: +SKIP
        ['keys', 'mcp', 'serve']
    """
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=group):
        # An editable install and a built one of the same distribution both list their entry points: once each.
        found.setdefault(ep.name, ep)
    return [found[name] for name in sorted(found)]


def plugin(group: str, name: str) -> Callable[..., Any] | None:
    """The object the entry point ``name`` of ``group`` names, loaded; None when no installed package declares it.

    Raises:
        ImportError: the package that declares it is installed but cannot be imported (a missing extra).

    Example:
        >>> plugin("undolog.gateway", "database")                        # doctest: +SKIP
        <function database_of at 0x...>
    """
    for ep in plugins(group):
        if ep.name == name:
            loaded: Callable[..., Any] = ep.load()
            return loaded
    return None
