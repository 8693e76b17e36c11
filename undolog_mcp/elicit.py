"""Deciding an IRREVERSIBLE call at the MCP client, through its elicitation form (opt-in per tool).

The person at the client is not a verified approver: the audit records them as an unverified MCP client with the
name it reports, and a tool (or a risk tag) that has an approver group is never decided here, only at the desk.
Elicitation forms carry flat fields only, so edits are offered only for tools whose arguments are flat.

The gateway calls in with the request's context and the tool; this module does not import the gateway.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from mcp import types

from undolog_core import UndoLog
from undolog_core.integration import AwaitingApproval, shared_store

from .results import META_KEY, awaiting_result, error_result

if TYPE_CHECKING:
    from mcp.server.session import ServerSession
    from mcp.shared.context import RequestContext

_FLAT = {"string", "number", "integer", "boolean"}


def approver_groups_cover(undolog: UndoLog, tool: str, risk_tags: tuple[str, ...]) -> list[str]:
    """The approver groups (the desk's) that cover this tool or one of its risk tags; none without the desk."""
    try:
        from undolog_server.storage import ServerStore, migration_current
    except ImportError:
        return []
    store = shared_store(undolog)
    if migration_current(store) is None:
        return []  # the desk never ran on this database: no groups
    return [g.name for g in ServerStore(store).groups()
            if tool in g.tools or any(t in g.risk_tags for t in risk_tags)]


def form_for(arguments: dict[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The elicitation schema: approve, a reason, and (flat schemas only) each argument as an editable field."""
    props: dict[str, Any] = {
        "approve": {"type": "boolean", "title": "Run it?", "default": False},
        "reason": {"type": "string", "title": "Reason (required to decline)"},
    }
    editable: list[str] = []
    given = schema.get("properties") or {}
    if all(isinstance(p, dict) and p.get("type") in _FLAT for p in given.values()):
        for name, p in given.items():
            if name in props:
                continue
            field = {k: v for k, v in p.items() if k in ("type", "title", "description", "enum", "minimum",
                                                          "maximum", "minLength", "maxLength")}
            if name in arguments:
                field["default"] = arguments[name]
            props[name] = field
            editable.append(name)
    return {"type": "object", "properties": props, "required": ["approve"]}, editable


async def elicit_decision(ctx: RequestContext[ServerSession, Any, Any], undolog: UndoLog, exposed_name: str,
                          listed: types.Tool, d: AwaitingApproval, *,
                          decline_rejects: bool = False) -> types.CallToolResult | None:
    """Ask the client's person about the call ``d`` of the tool ``listed`` (exposed as ``exposed_name``), in the
    MCP request ``ctx``; None when the call was approved (the caller then runs it), else the answer.

    A "no" is a ``respond`` decision (the tool did not run, the person's reason is its result, the session goes
    on); with ``decline_rejects`` (the tool's ``decline = "reject"``) a reject, which halts the session."""
    params = ctx.session.client_params
    caps = params.capabilities if params else None
    if caps is None or caps.elicitation is None:
        return awaiting_result(exposed_name, d)  # the client cannot show a form: the desk decides
    groups = await asyncio.to_thread(approver_groups_cover, undolog, d.tool_name, d.risk_tags)
    if groups:
        note = (f" It is covered by approver group(s) {', '.join(groups)}: only a verified approver at the desk "
                "can decide it.")
        return awaiting_result(exposed_name, d, note=note)
    info = params.clientInfo if params else None
    approver = f"mcp-client:{info.name}/{info.version} (unverified)" if info else "mcp-client (unverified)"
    schema, editable = form_for(d.args, dict(listed.inputSchema or {}))
    message = (f"{exposed_name} is irreversible{': ' + d.reason if d.reason else ''}. "
               f"Arguments: {d.args}. Approve to run it once.")
    answer = await ctx.session.elicit_form(message, schema, related_request_id=ctx.request_id)
    approvals = undolog.approvals
    if answer.action == "cancel":
        return awaiting_result(exposed_name, d)  # no decision: the request stays pending at the desk
    content = answer.content or {}
    reason = str(content.get("reason") or "").strip() or None
    approve = content.get("approve")
    if answer.action == "accept" and approve is not None and not isinstance(approve, bool):
        # Not a yes or a no ("false" as a string, a number): no decision; only a real true runs the call.
        return awaiting_result(exposed_name, d, note=f" The form's answer {approve!r} was not a yes or a no: "
                                                     "nothing was decided.")
    if answer.action == "decline" or approve is not True:
        why = reason or "declined at the MCP client"
        if decline_rejects:
            await asyncio.to_thread(approvals.reject, d.approval_request_id, approver=approver, reason=why)
            return error_result(f"{exposed_name} was rejected: {why}. It did not run, and the session is halted "
                                "until a person resumes it.", code="approval_rejected")
        response = f"{exposed_name} did not run: the person at the client declined it: {why}"
        await asyncio.to_thread(approvals.respond, d.approval_request_id, approver=approver, response=response,
                                reason=why)
        return types.CallToolResult(content=[types.TextContent(type="text", text=response)], isError=False,
                                    _meta={META_KEY: {"responded": True}})
    edits = {k: content[k] for k in editable if k in content and content[k] != d.args.get(k)}
    if edits:
        await asyncio.to_thread(approvals.modify, d.approval_request_id, approver=approver,
                                args={**d.args, **edits}, reason=reason)
    else:
        await asyncio.to_thread(approvals.approve, d.approval_request_id, approver=approver, reason=reason)
    return None
