"""``undolog sessions ...``: list, show, roll back, resume and revalidate sessions."""

from __future__ import annotations

from typing import Annotated

import typer

from ..storage.records import SessionState
from ._output import (
    _compact,
    _console,
    _inert,
    _kv,
    _print_json,
    _Progress,
    _show,
    _state,
    _Table,
    _txt,
    _when,
)
from ._root import ActorOpt, JsonOpt, _actor, _open
from .approvals import _approvals_table

sessions_app = typer.Typer(help="List, inspect, roll back, resume and revalidate sessions.", no_args_is_help=True)


@sessions_app.command("list")
def sessions_list(
    ctx: typer.Context,
    state: Annotated[SessionState | None, typer.Option("--state", help="Only sessions in this state.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many, newest first.")] = 50,
    as_json: JsonOpt = False,
) -> None:
    """List sessions, newest first."""
    u = _open(ctx)
    recs = u.sessions.list(state=state.value if state else None, limit=limit)
    if as_json:
        _print_json([r.to_dict() for r in recs])
        return
    if not recs:
        typer.echo("no sessions" + (f" in state {state.value}" if state else ""))
        return
    table = _Table(f"Sessions ({len(recs)}, newest first)")
    table.col("Session", no_wrap=True, min_width=32)
    table.col("Agent")
    table.col("State", no_wrap=True)
    table.col("Calls", justify="right")
    table.col("Created (UTC)", no_wrap=True, drop=2)
    table.col("Halted because", drop=1)
    for r in recs:
        table.row(r.session_id, _txt(r.agent_id), _state(r.state), str(r.tool_calls_total), _when(r.created_at),
                  _txt(r.halted_reason))
    _show(table)


@sessions_app.command("show")
def sessions_show(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(metavar="ID", help="The session id.")],
    as_json: JsonOpt = False,
) -> None:
    """Show one session: its state, its effects in order, its undo plan and its approval requests."""
    u = _open(ctx)
    rec = u.sessions.get(session_id)
    effects = u.sessions.effects(session_id)
    approvals = u.approvals.list(session_id=session_id)
    plan = u.saga.undo_plan(session_id)
    if as_json:
        _print_json({"session": rec.to_dict(), "effects": effects, "undo_plan": plan,
                     "approvals": [a.to_dict() for a in approvals]})
        return
    con = _console()
    con.print(_kv([
        ("Session", rec.session_id), ("Agent", rec.agent_id), ("State", _state(rec.state)),
        ("Halted because", rec.halted_reason), ("Tool calls", rec.tool_calls_total),
        ("On failure", rec.on_failure), ("Created by", rec.created_by),
        ("Created (UTC)", _when(rec.created_at)), ("Updated (UTC)", _when(rec.updated_at)),
        ("Pinned revisions", ", ".join(f"{k}@{v}" for k, v in sorted(rec.pinned_revisions.items())) or "-"),
    ]))
    if effects:
        table = _Table("Effects (oldest first; SAFE calls are counted, not logged)")
        table.col("#", justify="right", drop=3)
        table.col("Effect", no_wrap=True, min_width=32)
        table.col("Tool")
        table.col("Tier", drop=2)
        table.col("State", no_wrap=True)
        table.col("Arguments")
        table.col("Undo", drop=1)
        table.col("Error")
        for i, e in enumerate(effects, 1):
            undo = f"{e['compensation_name']} ({e['undo_state']})" if e.get("compensation_name") else "-"
            table.row(str(i), e["effect_id"], _txt(e["tool_name"]), e["tier"], _state(e["state"]),
                      _txt(_compact(e["args_snapshot"])), _txt(undo), _txt(e.get("error") or e.get("undo_error")))
        _show(table, con)
    else:
        con.print("no logged effects")
    if plan:
        counts: dict[str, int] = {}
        for p in plan:  # dicts keep first-seen order: newest first, like the walk
            counts[p["compensation_name"]] = counts.get(p["compensation_name"], 0) + 1
        con.print(f"A rollback would run {len(plan)} compensation(s): "
                  + ", ".join(f"{name} x{n}" if n > 1 else name for name, n in counts.items()), markup=False)
    if approvals:
        _show(_approvals_table(approvals, title="Approval requests"), con)


@sessions_app.command("rollback")
def sessions_rollback(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(metavar="ID", help="The session to roll back.")],
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
    wait: Annotated[float, typer.Option(
        "--wait", help="Seconds to wait for the live process serving the session (an MCP gateway) to run it.")] = 30.0,
) -> None:
    """Undo every compensable effect of a session, newest first (needs --app for the compensations).

    A session served by a live MCP gateway is rolled back by that gateway, over the upstream connections that did
    the work; this waits for it (``--wait``). Only when that gateway is gone does this run it, and says so.

    \f
    Committed IRREVERSIBLE effects cannot be undone; they are listed. A compensation that keeps failing
    stops the walk and halts the session (exit code 1); running the command again resumes where it stopped.
    """
    u = _open(ctx)
    u.sessions.get(session_id)  # an unknown id is a clear error before anything else
    total = len(u.saga.undo_plan(session_id))
    with _Progress("rolling back", enabled=not as_json) as progress:
        progress.start(total)
        report = u.rollback(session_id, actor=_actor(actor), progress=progress, wait=wait)
    if as_json:
        _print_json(report.to_dict())
    elif report.already_rolled_back:
        typer.echo(f"session {session_id} was already rolled back; nothing to do")
    else:
        if report.steps:
            table = _Table(f"Rollback of session {session_id} (newest first)")
            table.col("Effect", no_wrap=True, min_width=32)
            table.col("Tool")
            table.col("Compensation", drop=1)
            table.col("Outcome", no_wrap=True)
            table.col("Attempts", justify="right", drop=2)
            table.col("Error")
            for s in report.steps:
                table.row(s.effect_id, _txt(s.tool_name), _txt(s.compensation_name), _state(s.outcome),
                          str(s.attempts), _txt(s.error))
            _show(table)
        if report.complete:
            typer.echo(f"session {session_id} rolled back ({len(report.steps)} compensation(s) run)")
        if report.ran_by is not None:
            typer.echo(f"run by the live process serving the session: {report.ran_by}")
        if report.ran_without_live_upstream:
            typer.echo("ran here: the process that served the session is gone, so its compensations reached "
                       "upstreams started for this rollback (ran_without_live_upstream)", err=True)
        for kept in report.kept_irreversible:
            typer.echo(f"kept (irreversible, cannot be undone): {kept}")
    if not report.complete:
        typer.echo(f"rollback stopped; session {session_id} is halted: {_inert(report.halted_reason or '')}",
                   err=True)
        raise typer.Exit(1)


@sessions_app.command("resume")
def sessions_resume(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(metavar="ID", help="The halted session.")],
    actor: ActorOpt = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Why it may go on (audited).")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Let a halted session go on, after a person has looked at it (audited)."""
    u = _open(ctx)
    rec = u.sessions.resume(session_id, actor=_actor(actor), reason=reason)
    if as_json:
        _print_json(rec.to_dict())
        return
    typer.echo(f"session {session_id} resumed by {_actor(actor)}; it is {rec.state} again")


@sessions_app.command("revalidate")
def sessions_revalidate(
    ctx: typer.Context,
    session_id: Annotated[str, typer.Argument(metavar="ID", help="The session to re-pin.")],
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Pin a session to the current tool contracts, so calls to changed tools are accepted again (audited).

    \f
    With ``--app`` the session is pinned to the revisions that app registers; without it, to the newest
    revision of each tool in the registry.
    """
    u = _open(ctx)
    changed = u.sessions.revalidate(session_id, actor=_actor(actor))
    if as_json:
        _print_json({"session_id": session_id, "changed": changed})
        return
    if not changed:
        typer.echo(f"session {session_id} was already pinned to the current contracts; nothing changed")
        return
    table = _Table(f"Session {session_id} re-pinned by {_actor(actor)}")
    table.col("Tool")
    table.col("From", justify="right")
    table.col("To", justify="right")
    for name, ch in sorted(changed.items()):
        table.row(_txt(name), _txt(ch["from"]), _txt(ch["to"]))
    _show(table)
