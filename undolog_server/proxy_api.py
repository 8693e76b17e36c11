"""The tool proxy's route: ``POST /v1/sessions/{session_id}/tools/{tool}:invoke``, through the call driver.

The tools it serves (``ProxyTools``: declarations, the upstream client, registration) are in ``proxy``.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
from fastapi import APIRouter, Body, Depends, Header, Request
from fastapi import Path as PathParam
from fastapi.responses import Response

from . import lanes
from .auth import AuthFirstRoute, require, server_state
from .problems import Problem, SafeJSONResponse, log_5xx, problem_response
from .proxy import OUTCOME_UNKNOWN_ERRORS, AnswerLost, UpstreamError, _body
from .routers.sessions import rollback_out
from .storage import ApiKey

router = APIRouter(prefix="/v1", tags=["proxy"], route_class=AuthFirstRoute)


@router.post(
    "/sessions/{session_id}/tools/{tool}:invoke",
    summary="Invoke a proxied tool in a session",
    responses={
        200: {"description": "The upstream's response (or the stored one for a replayed call)"},
        202: {"description": "IRREVERSIBLE call awaiting approval; retry with the same Idempotency-Key"},
        403: {"description": "Approval rejected or timed out"},
        504: {"description": "A call lost the upstream's answer: outcome unknown (session halted; a COMPENSABLE "
                    "call whose probe says 'not yet' is held in flight), unless the probe says it happened (then "
                    "200, as a replay)"},
        409: {"description": "Session halted or closed"},
        422: {"description": "Arguments invalid for the tool's schema"},
        502: {"description": "The upstream failed"},
    },
)
def invoke(
    request: Request,
    session_id: str = PathParam(min_length=1, max_length=200),
    tool: str = PathParam(min_length=1, max_length=200),
    args: dict[str, Any] = Body(default_factory=dict),
    idempotency_key: str | None = Header(None, alias="Idempotency-Key", max_length=200),
    key: ApiKey = Depends(require("agent")),
) -> Response:
    st = server_state(request)
    row = st.views.session_row(session_id)
    if row is None or row.get("created_by") != key.principal_ref:
        raise Problem(404, "session_not_found", f"session {session_id!r} does not exist")
    if st.proxy is None or tool not in st.proxy.tools:
        raise Problem(404, "tool_not_proxied", f"tool {tool!r} is not served by this proxy")
    ptool = st.proxy.tools[tool]
    call_id = idempotency_key
    if call_id is None and ptool.tier == "irreversible":
        # Agents that do not send Idempotency-Key still find their pending request by its arguments.
        found = st.undolog.approvals.find_for_call(session_id, tool, args)
        call_id = found.call_id if found is not None else None

    from undolog_core.integration import AwaitingApproval, Completed

    decision = st.undolog.driver.decide(session_id, tool, args, call_id=call_id)
    if isinstance(decision, AwaitingApproval):
        retry = max(1, math.ceil(decision.retry_after))
        return SafeJSONResponse(
            {
                "status": "awaiting_approval",
                "approval_request_id": decision.approval_request_id,
                "effect_id": decision.effect_id,
                "call_id": decision.call_id,
                "retry_after": retry,
                "timeout_at": decision.timeout_at.isoformat(),
                "reason": decision.reason,
                "risk_tags": list(decision.risk_tags),
            },
            status_code=202,
            headers={"Retry-After": str(retry), "Location": f"/v1/approvals/{decision.approval_request_id}"},
        )
    if isinstance(decision, Completed):
        return _stored(decision.result, replayed=True)
    proxy = st.proxy
    key_for_upstream = decision.idempotency_key or idempotency_key

    # Which calls that lost their answer are settled in doubt (AnswerLost) rather than failed: every call that wrote
    # something. Failed, a COMPENSABLE call was compensated at once (the session's rollback policy) while the
    # request could still land upstream: the undo went out first, a no-op, and then the call landed and stood. Its
    # probe, if it has one, says it happened, or holds it while it may still land; without one it is unknown and
    # the session halted for a person (undolog effects resolve).
    in_doubt_settled = ptool.tier in ("irreversible", "compensable")

    def upstream(call_args: dict[str, Any]) -> dict[str, Any]:
        # The wait for the upstream needs no slot of the desk's lane (a blocked socket: no database, no CPU), so
        # it gives its slot back meanwhile: slow upstreams do not keep other agents' requests waiting. Reading
        # the answer and recording the outcome (the commit mark; a failure and its rollback) take one again,
        # waiting without a time limit: the upstream has acted, its outcome is never refused with a 503.
        with lanes.given_back(request.scope):
            # The ownership epoch rides beside the key (a SAFE call has none): see proxy.EPOCH_HEADER.
            try:
                resp = proxy.call(ptool, call_args, key_for_upstream,
                                  epoch=decision.epoch if decision.idempotency_key else None)
            except OUTCOME_UNKNOWN_ERRORS as exc:
                if not in_doubt_settled:
                    raise  # (a SAFE call: nothing written, nothing to settle)
                # Sent, answer lost: the upstream may still finish it (see AnswerLost).
                raise AnswerLost(f"{tool}: {type(exc).__name__}") from exc
        if not resp.is_success:
            raise UpstreamError(f"{tool} upstream answered {resp.status_code}", resp.status_code, _body(resp))
        return {"status_code": resp.status_code, "body": _body(resp), "media_type": resp.headers.get("content-type")}

    # The call driver runs it, as it runs every caller's: the upstream's failure is recorded and the session
    # rolled back per its policy; the rollback is told in the problem's body.
    # An approved IRREVERSIBLE call that was sent and then lost its answer may have happened, or may still happen:
    # it is settled as recovery would, except that the request may still land (see AnswerLost): the probe's "it
    # happened" commits it; anything else is `unknown` and the session halted for a person. Never marked failed
    # and rolled back, never approved again to be re-sent.
    outcome = st.undolog.driver.run_sync(decision, upstream, note=False, unknown_on=(AnswerLost,))
    exc = outcome.error
    if exc is None:
        return _stored(outcome.value, replayed=False)
    if isinstance(exc, AnswerLost):
        return _in_doubt(request, st, session_id, tool, args, call_id, decision, exc, outcome.in_doubt)
    if not isinstance(exc, (UpstreamError, httpx.HTTPError)):
        raise exc
    extra: dict[str, Any] = {"upstream_status": getattr(exc, "status_code", None)}
    if outcome.rollback is not None:
        extra["rollback"] = rollback_out(session_id, outcome.rollback).model_dump(mode="json")
    log_5xx(request, exc)
    return problem_response(request, 502, "upstream_error", str(exc), **extra)


def _in_doubt(request: Request, st: Any, session_id: str, tool: str, args: dict[str, Any], call_id: str | None,
              decision: Any, exc: BaseException, settled: str | None) -> Response:
    """The answer to a call whose upstream answer was lost, by how it was settled (``Outcome.in_doubt``)."""
    from undolog_core.integration import Completed

    if settled == "committed":
        # The probe says it happened: answer with what it reported, as a replay would.
        done = st.undolog.driver.decide(session_id, tool, args, call_id=call_id or decision.call_id)
        if isinstance(done, Completed):
            return _stored(done.result, replayed=True)
    # (Never "not_run" here: the proxy never says the request can no longer land, see AnswerLost.)
    cause = type(exc.__cause__ or exc).__name__
    if settled == "settling":
        # COMPENSABLE, its probe says "not yet": as the MCP gateway, held in flight while it may still land.
        return problem_response(
            request, 504, "outcome_unknown",
            f"{tool}: the upstream did not answer ({cause}) and its probe says the call has not happened yet, but "
            "the upstream may still be running it: it is held in flight (neither undone nor run again) until "
            "recovery settles it once this desk restarts, or a person takes it over (undolog recover --take-over)",
            effect_id=decision.effect_id,
        )
    if settled == "compensated":
        return problem_response(
            request, 504, "outcome_unknown",
            f"{tool}: the upstream did not answer ({cause}) and its probe could not tell whether the call "
            "happened: it was compensated and the session is halted until a person checks the upstream",
            effect_id=decision.effect_id, session_state="halted",
        )
    return problem_response(
        request, 504, "outcome_unknown",
        f"{tool}: the upstream did not answer ({cause}); the call may have happened, or may still happen. It is "
        "recorded 'unknown' (neither undone nor sent again) and the session is halted until a person checks the "
        f"upstream, settles it (undolog effects resolve {decision.effect_id}, or the desk) and resumes or rolls "
        "back the session",
        effect_id=decision.effect_id, session_state="halted",
    )


def _stored(result: Any, *, replayed: bool) -> Response:
    headers = {"UndoLog-Replayed": "true" if replayed else "false"}
    if isinstance(result, dict) and "status_code" in result and "body" in result:
        body = result["body"]
        if isinstance(body, str) and not str(result.get("media_type") or "").startswith("application/json"):
            return Response(body, status_code=int(result["status_code"]), headers=headers,
                            media_type=result.get("media_type") or "text/plain")
        return SafeJSONResponse(body, status_code=int(result["status_code"]), headers=headers)
    return SafeJSONResponse(result, headers=headers)
