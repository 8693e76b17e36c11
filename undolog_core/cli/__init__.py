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

One module per resource (``sessions``, ``approvals``, ``effects``, ``policy``, ``audit``, ``tools``, ``recover``,
``gc``, ``db``, ``demo``, ``check_undo``) over ``_root`` (the app, the global options, opening the store) and
``_output`` (tables, JSON, progress). The desk's and the gateway's commands come in through the
``undolog.cli_plugins`` entry-point group (``plugins``): the core imports neither.

Example:
    $ undolog --db sqlite:///undolog.db approvals list
    $ undolog approvals approve 3f2c... --as ana
    $ undolog --app myagent.app:undolog sessions rollback 9a1b...
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._output import PROGRESS_MIN_STEPS as PROGRESS_MIN_STEPS
    from ._root import CliInputError as CliInputError
    from ._root import app as app
    from .db import SERVER_EXTRA_HINT as SERVER_EXTRA_HINT


def main() -> None:
    """Entry point of the ``undolog`` console script.

    Example:
        $ undolog --db sqlite:///undolog.db sessions list
    """
    # A command declared in ``undolog.cli_direct`` (see ``undolog_core._plugins``) runs without the app when it parses
    # its arguments itself: ``undolog mcp connect``, which an MCP client that opens a session per call starts for
    # every call, forwarded its first byte after 0.4-0.9 CPU s of imports (every command's, the store's stack among
    # them), and after about 0.05 s this way.
    args = sys.argv[1:]
    if len(args) >= 2 and not args[0].startswith("-") and not args[1].startswith("-"):
        run = _direct(f"{args[0]}.{args[1]}")
        status = run(args[2:]) if run is not None else None
        if status is not None:
            raise SystemExit(status)
    from ._tree import app

    app(prog_name="undolog")


def _direct(name: str) -> Any:
    """The ``undolog.cli_direct`` entry point ``name``, loaded; None when there is none or it cannot be imported
    (the app then runs the command, and says what to install)."""
    from .._plugins import CLI_DIRECT, plugin

    try:
        return plugin(CLI_DIRECT, name)
    except ImportError:
        return None


def __getattr__(name: str) -> Any:
    """The app and the names below it, built on first use (``from undolog_core.cli import app``)."""
    if name in __all__ and name != "main":
        from . import _tree

        value = getattr(_tree, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["PROGRESS_MIN_STEPS", "SERVER_EXTRA_HINT", "CliInputError", "app", "main"]
