"""``undolog recover``: reconcile the calls crashed processes left in flight."""

from __future__ import annotations

from typing import Annotated

import typer

from ._output import _inert, _print_json, _Progress, _show, _state, _Table, _txt
from ._root import JsonOpt, _open


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
