"""``undolog approvals ...``: review and decide the approval requests of IRREVERSIBLE calls."""

from __future__ import annotations

import decimal
import enum
import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer

from ..storage.records import RequestState
from ._output import (
    _compact,
    _console,
    _duration,
    _inert,
    _jsonable,
    _kv,
    _print_json,
    _show,
    _state,
    _Table,
    _txt,
    _when,
)
from ._root import ActorOpt, CliInputError, JsonOpt, _actor, _open

approvals_app = typer.Typer(help="Review and decide approval requests of IRREVERSIBLE calls.", no_args_is_help=True)


#: ``--state`` of ``approvals list``: a request state, or every state.
ApprovalState = enum.Enum(  # type: ignore[misc]
    "ApprovalState", {**{s.value: s.value for s in RequestState}, "all": "all"}, type=str
)


def _approvals_table(recs: list[Any], *, title: str) -> _Table:
    table = _Table(title)
    table.col("Request", no_wrap=True, min_width=32)
    table.col("Tool")
    table.col("State", no_wrap=True)
    table.col("Session", no_wrap=True, min_width=32, drop=4)
    table.col("Proposed arguments")
    table.col("Risk tags", drop=3)
    table.col("Times out", no_wrap=True, drop=2)
    for r in recs:
        due = _duration(r.seconds_left) if r.state is RequestState.PENDING else "-"
        table.row(r.approval_request_id, _txt(r.tool_name), _state(r.state), r.session_id,
                  _txt(_compact(r.proposed_args)), _txt(", ".join(r.risk_tags)), due)
    return table


@approvals_app.command("list")
def approvals_list(
    ctx: typer.Context,
    state: Annotated[ApprovalState, typer.Option("--state", help="Requests in this state ('all' for every state).")]
    = ApprovalState.pending,  # type: ignore[attr-defined]
    session_id: Annotated[str | None, typer.Option("--session", help="Only this session's requests.")] = None,
    tool: Annotated[str | None, typer.Option("--tool", help="Only requests for this tool.")] = None,
    risk_tag: Annotated[str | None, typer.Option("--risk-tag", help="Only requests carrying this risk tag.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="At most this many, newest first.")] = 100,
    as_json: JsonOpt = False,
) -> None:
    """List approval requests (pending ones by default), newest first."""
    u = _open(ctx)
    # Reading applies due timeouts first, so nothing past its deadline is shown (or decided) as pending.
    u.approvals.expire_due()
    recs = u.approvals.list(state=None if state.value == "all" else state.value, session_id=session_id,
                            tool_name=tool, risk_tag=risk_tag, limit=limit)
    if as_json:
        _print_json([r.to_dict() for r in recs])
        return
    if not recs:
        typer.echo("no approval requests" + ("" if state.value == "all" else f" in state {state.value}"))
        return
    _show(_approvals_table(recs, title=f"Approval requests ({len(recs)}, newest first)"))


@approvals_app.command("show")
def approvals_show(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(metavar="ID", help="The approval request id.")],
    as_json: JsonOpt = False,
) -> None:
    """Show one approval request: the proposed call, why it needs a person, the agent's recent calls, its history."""
    u = _open(ctx)
    rec = u.approvals.get(request_id)
    events = u.approvals.events(request_id)
    if as_json:
        _print_json({**rec.to_dict(), "events": [asdict(e) for e in events]})
        return
    con = _console()
    due = _duration(rec.seconds_left) if rec.state is RequestState.PENDING else "-"
    con.print(_kv([
        ("Request", rec.approval_request_id), ("State", _state(rec.state)),
        ("Tool", f"{rec.tool_name} (revision {rec.tool_revision})"),
        ("Session", rec.session_id), ("Call id", rec.call_id), ("Effect", rec.effect_id),
        ("Why a person", rec.reason), ("Risk tags", ", ".join(rec.risk_tags)),
        ("Proposed arguments", json.dumps(rec.proposed_args, indent=2, sort_keys=True, default=_jsonable)),
        ("Approved arguments",
         None if rec.approved_args is None else json.dumps(rec.approved_args, indent=2, sort_keys=True,
                                                            default=_jsonable)),
        ("Created (UTC)", _when(rec.created_at)), ("Times out (UTC)", f"{_when(rec.timeout_at)} {due}"),
        ("Decided by", rec.decided_by), ("Decided (UTC)", _when(rec.decided_at)),
        ("Decision reason", rec.decision_reason),
    ]))
    if rec.agent_context:
        table = _Table("The agent's recent calls (oldest first)")
        table.col("Tool")
        table.col("Tier")
        table.col("State")
        table.col("Arguments")
        for c in rec.agent_context:
            table.row(_txt(c.get("tool_name")), _txt(c.get("tier")), _state(c.get("state")),
                      _txt(_compact(c.get("args"), 100)))
        _show(table, con)
    if events:
        table = _Table("History (audit events)")
        table.col("Event", justify="right")
        table.col("When (UTC)", no_wrap=True, drop=1)
        table.col("Action")
        table.col("Actor")
        table.col("Details")
        for e in events:
            table.row(str(e.event_id), _when(e.created_at), _txt(e.action), _txt(e.actor),
                      _txt(_compact(e.payload, 120)))
        _show(table, con)


def _decided(rec: Any, verb: str, as_json: bool) -> None:
    if as_json:
        _print_json(rec.to_dict())
        return
    typer.echo(f"{verb} request {rec.approval_request_id}: {rec.tool_name} in session {rec.session_id}")


@approvals_app.command("approve")
def approvals_approve(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(metavar="ID", help="The approval request id.")],
    actor: ActorOpt = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Optional note, kept in the audit trail.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve the call as proposed; it runs once, when the agent re-issues it (same call_id)."""
    u = _open(ctx)
    rec = u.approvals.approve(request_id, approver=_actor(actor), reason=reason)
    _decided(rec, "approved", as_json)
    if not as_json:
        typer.echo(f"the call runs when the agent re-issues it (call_id {rec.call_id})")


@approvals_app.command("reject")
def approvals_reject(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(metavar="ID", help="The approval request id.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (required; the agent and the audit trail see it).")],
    actor: ActorOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Reject the call: it never runs, the session halts and its other pending requests are cancelled."""
    u = _open(ctx)
    rec = u.approvals.reject(request_id, approver=_actor(actor), reason=reason)
    _decided(rec, "rejected", as_json)
    if not as_json:
        typer.echo(f"session {rec.session_id} is halted: roll it back or resume it once you have looked")


@approvals_app.command("modify")
def approvals_modify(
    ctx: typer.Context,
    request_id: Annotated[str, typer.Argument(metavar="ID", help="The approval request id.")],
    args_text: Annotated[
        str,
        typer.Option("--args", metavar="JSON",
                     help="The edited arguments as a JSON object (or @file.json); validated against the tool's schema."),
    ],
    merge: Annotated[
        bool, typer.Option("--merge", help="Apply the given fields on top of the proposed arguments.")
    ] = False,
    actor: ActorOpt = None,
    reason: Annotated[str | None, typer.Option("--reason", help="Optional note, kept in the audit trail.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Approve with edited arguments; a bad edit is refused and names the field."""
    edited = _parse_args(args_text)
    u = _open(ctx)
    if merge:
        edited = {**u.approvals.get(request_id).proposed_args, **edited}
    rec = u.approvals.modify(request_id, approver=_actor(actor), args=edited, reason=reason)
    _decided(rec, "approved with edits", as_json)
    if not as_json:
        typer.echo(f"approved arguments: {_inert(_compact(rec.approved_args, None))}")
        typer.echo(f"the call runs with them when the agent re-issues it (call_id {rec.call_id})")


def _parse_args(text: str) -> dict[str, Any]:
    """Parse ``--args``: a JSON object, given inline or as ``@path``.

    Args:
        text: The option's value.

    Returns:
        The arguments as a dict.

    Raises:
        CliInputError: Unreadable file, invalid JSON (with its position) or not a JSON object.
    """
    source = "--args"
    if text.startswith("@"):
        path = Path(text[1:]).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise CliInputError(f"cannot read --args file {path}: {exc.strerror or exc}") from None
        source = f"--args file {path}"
    try:
        value = json.loads(text, parse_float=decimal.Decimal)
    except json.JSONDecodeError as exc:
        raise CliInputError(
            f"{source} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    if not isinstance(value, dict):
        raise CliInputError(
            f"{source} must be a JSON object of argument names to values, e.g. '{{\"amount\": 10}}'; "
            f"got a JSON {type(value).__name__}"
        )
    return value
