"""``undolog gc``: archive settled sessions' effects and undo entries."""

from __future__ import annotations

from typing import Annotated

import typer

from ._output import _print_json
from ._root import ActorOpt, JsonOpt, _actor, _open


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
    from .._gc import collect, parse_age

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
