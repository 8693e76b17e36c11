"""``undolog policy show|set``: the organisation's approval policy."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ._output import _console, _duration, _kv, _print_json, _show, _Table, _txt
from ._root import ActorOpt, CliInputError, JsonOpt, _actor, _open

policy_app = typer.Typer(help="The organisation's approval policy.", no_args_is_help=True)


@policy_app.command("show")
def policy_show(ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """Show the organisation's approval policy."""
    u = _open(ctx)
    pol = u.policy.get()
    if as_json:
        _print_json(pol.to_dict())
        return
    _console().print(_kv([
        ("approval_timeout_seconds", f"{pol.approval_timeout_seconds} ({_duration(pol.approval_timeout_seconds)[3:]})"),
        ("auto_approve_on_timeout", str(pol.auto_approve_on_timeout).lower()),
        ("context_calls", pol.context_calls),
        ("approved_ttl_seconds", f"{pol.approved_ttl_seconds} ({_duration(pol.approved_ttl_seconds)[3:]})"),
    ]))


@policy_app.command("set")
def policy_set(
    ctx: typer.Context,
    approval_timeout_seconds: Annotated[
        int | None, typer.Option("--approval-timeout-seconds", metavar="N",
                                 help="How long a new approval request waits for a person.")
    ] = None,
    auto_approve_on_timeout: Annotated[
        str | None, typer.Option("--auto-approve-on-timeout", metavar="true|false",
                                 help="On timeout: auto-approve (true) or fail closed (false, the default).")
    ] = None,
    context_calls: Annotated[
        int | None, typer.Option("--context-calls", metavar="N",
                                 help="How many recent calls go into an approval request's context.")
    ] = None,
    approved_ttl_seconds: Annotated[
        int | None, typer.Option("--approved-ttl-seconds", metavar="N",
                                 help="How long an approved call may wait to be re-issued before it expires.")
    ] = None,
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Change the organisation's approval policy (audited)."""
    from rich.text import Text  # the command's own: importing the CLI loads no Rich

    changes = {"approval_timeout_seconds": approval_timeout_seconds,
               "auto_approve_on_timeout": auto_approve_on_timeout, "context_calls": context_calls,
               "approved_ttl_seconds": approved_ttl_seconds}
    changes = {k: v for k, v in changes.items() if v is not None}
    if not changes:
        raise CliInputError(
            "nothing to change: give --approval-timeout-seconds, --auto-approve-on-timeout, --context-calls and/or "
            "--approved-ttl-seconds"
        )
    u = _open(ctx)
    before = u.policy.get()
    after = u.policy.set(actor=_actor(actor), **changes)
    if as_json:
        _print_json({"before": before.to_dict(), "after": after.to_dict()})
        return
    table = _Table(f"Policy changed by {_actor(actor)}")
    table.col("Setting")
    table.col("Before")
    table.col("After")
    for k, old in before.to_dict().items():
        new = after.to_dict()[k]
        style = "bold" if new != old else "dim"
        table.row(Text(k, style=style), _txt(json.dumps(old)), Text(json.dumps(new), style=style))
    _show(table)
