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

from . import approvals, audit, check_undo, db, demo, effects, gc, policy, recover, sessions, tools
from ._output import PROGRESS_MIN_STEPS
from ._root import CliInputError, app
from .db import SERVER_EXTRA_HINT
from .plugins import register_plugins

# Typer lists the root's commands in the order they are added, then its groups: the order `undolog --help` has
# always shown (tests/test_cli_tree.py pins it).
app.command("tools")(tools.tools)
app.command("recover")(recover.recover)
app.command("gc")(gc.gc)
app.command("demo")(demo.demo)
app.command("check-undo")(check_undo.check_undo_command)
app.add_typer(db.db_app, name="db")
app.add_typer(sessions.sessions_app, name="sessions")
app.add_typer(approvals.approvals_app, name="approvals")
app.add_typer(policy.policy_app, name="policy")
app.add_typer(audit.audit_app, name="audit")
if effects.effects_app.registered_commands:  # listed once it has a command (see effects)
    app.add_typer(effects.effects_app, name="effects")
register_plugins(app)


def main() -> None:
    """Entry point of the ``undolog`` console script.

    Example:
        $ undolog --db sqlite:///undolog.db sessions list
    """
    app(prog_name="undolog")


__all__ = ["PROGRESS_MIN_STEPS", "SERVER_EXTRA_HINT", "CliInputError", "app", "main"]
