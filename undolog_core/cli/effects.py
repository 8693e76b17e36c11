"""``undolog effects ...``: what a person does about one effect (the group is listed once it has a command).

The group is ready for the commands that act on a single effect (``undolog effects resolve``); until one is added
here, ``undolog --help`` does not list it, so the command tree stays what it was.

Example:
    >>> @effects_app.command("resolve")                                   # doctest: +SKIP
    ... def effects_resolve(ctx: typer.Context, effect_id: str, as_json: JsonOpt = False) -> None: ...
"""

from __future__ import annotations

import typer

effects_app = typer.Typer(help="Inspect and settle single effects.", no_args_is_help=True)
