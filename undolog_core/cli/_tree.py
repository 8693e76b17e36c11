"""The ``undolog`` app with every command registered: the core's resources and the plugins' (see the package).

Imported by :func:`undolog_core.cli.main` only when the command line needs the whole tree (every command but the
direct ones), and by ``undolog_core.cli.app``.
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


__all__ = ["PROGRESS_MIN_STEPS", "SERVER_EXTRA_HINT", "CliInputError", "app"]
