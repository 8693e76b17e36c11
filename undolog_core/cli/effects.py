"""``undolog effects ...``: what a person does about one effect.

Example:
    $ undolog effects resolve 3f2a... --as committed --reason "the refund is in the ledger" --by ana
"""

from __future__ import annotations

import enum
from typing import Annotated

import typer

from ._output import _inert, _print_json
from ._root import JsonOpt, _actor, _open

effects_app = typer.Typer(help="Settle logged calls whose outcome is unknown.", no_args_is_help=True)


class ResolveAs(enum.StrEnum):
    """What a person found: the call happened and stands, it is undone, or it never happened."""

    committed = "committed"
    compensated = "compensated"
    not_happened = "not_happened"


@effects_app.command("resolve")
def effects_resolve(
    ctx: typer.Context,
    effect_id: Annotated[str, typer.Argument(metavar="EFFECT", help="The effect whose outcome is unknown.")],
    outcome: Annotated[ResolveAs, typer.Option(
        "--as", case_sensitive=False, show_choices=True,
        help="What the external system shows: committed (it happened and stands), compensated (it is undone), "
             "not_happened.")],
    reason: Annotated[str, typer.Option("--reason", help="What you checked (required; audited).")],
    actor: Annotated[str | None, typer.Option(
        "--by", envvar="UNDOLOG_ACTOR", metavar="NAME",
        help="Who takes this decision (recorded in the audit trail). Default: user@host.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Settle a call whose outcome is unknown (a late finish, an interrupted IRREVERSIBLE call), after checking the
    external system. Audited; the session stays halted: resume it or roll it back next.

    committed: the call happened and stands (a rollback still runs its compensation if it has not run);
    compensated: it is undone (no rollback runs its compensation again); not_happened: it never happened
    (recorded failed; nothing to undo).
    """
    u = _open(ctx)
    done = u.resolve_effect(effect_id, outcome=outcome.value, reason=reason, actor=_actor(actor))
    if as_json:
        _print_json(done.to_dict())
        return
    typer.echo(f"effect {effect_id} ({_inert(done.tool_name)}) resolved as {done.resolved_as} by {_inert(done.actor)}; "
               f"it is {done.state} now")
    if done.session_state == "halted":
        typer.echo(f"session {_inert(done.session_id)} is still halted: 'undolog sessions resume "
                   f"{_inert(done.session_id)}' lets it go on, 'undolog sessions rollback "
                   f"{_inert(done.session_id)}' undoes it")
