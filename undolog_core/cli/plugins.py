"""The commands other packages add to ``undolog`` (the desk's ``serve`` and ``keys``, the gateway's ``mcp``).

Each is a ``register(app)`` in the ``undolog.cli_plugins`` entry-point group (see ``undolog_core._plugins``), named as
the command it adds, with the extra it needs (``serve = "undolog_server.cli:register_serve [server]"``): the core's
CLI imports none of them by name. A plugin that is declared but cannot be imported (an extra missing, its package
broken) still shows as its command, which says what to install instead of taking the whole CLI down.

Example:
    >>> register_plugins(app)                                             # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import typer

from .._plugins import CLI_PLUGINS, plugins
from ..errors import ConfigurationError


def register_plugins(app: typer.Typer) -> None:
    """Call every ``undolog.cli_plugins`` entry point's ``register(app)``, in the order of their names."""
    for ep in plugins(CLI_PLUGINS):
        try:
            register = ep.load()
        except ImportError as exc:
            _unavailable(app, ep.name, ep.extras, exc)
        else:
            register(app)


def _unavailable(app: typer.Typer, name: str, extras: list[str], exc: ImportError) -> None:
    install = f"pip install 'undolog[{','.join(extras)}]'" if extras else "reinstall undolog"

    def missing() -> None:
        raise ConfigurationError(f"`undolog {name}` cannot be loaded ({exc}): {install}")

    needs = f" (needs the {', '.join(extras)} extra)" if extras else " (cannot be loaded)"
    ctx: dict[str, Any] = {"allow_extra_args": True, "ignore_unknown_options": True}
    app.command(name, help=f"`undolog {name}`{needs}: run it to see what to install.", context_settings=ctx)(missing)
