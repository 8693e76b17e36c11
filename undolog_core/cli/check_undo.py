"""``undolog check-undo``: run the undo check of a tool's scenario from the command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ._output import _console, _print_json
from ._root import CliInputError, JsonOpt, _open, _settings


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
    from ..testing import check_undo

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
