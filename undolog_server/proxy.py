"""The tool proxy: upstream HTTP tools declared in TOML, guarded by the engine.

A tool server that knows nothing of UndoLog sits behind ``POST
/v1/sessions/{session_id}/tools/{tool}:invoke``. Its declaration becomes a registered
contract (tier, argument schema, reason, risk tags), so it gets a fingerprint and revisions
like any decorated tool, and its compensation endpoint becomes a registered compensation
that rollback calls with ``Idempotency-Key: undo-{undo_id}``.

Example config::

    [tools.refund]
    tier = "compensable"
    url = "http://127.0.0.1:9000/refund"
    compensation_url = "http://127.0.0.1:9000/refund/cancel"
    risk_tags = ["billing"]
    timeout = 10
    [tools.refund.args_schema]
    type = "object"
    required = ["user_id", "amount"]
    properties = { user_id = { type = "string" }, amount = { type = "number" } }
"""

from __future__ import annotations

import functools
import json
import math
import ssl
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, Body, Depends, Header, Request
from fastapi import Path as PathParam
from fastapi.responses import Response

from undolog_core import errors, limits

from . import lanes
from .auth import AuthFirstRoute, require, server_state
from .problems import Problem, SafeJSONResponse, log_5xx, problem_response
from .storage import ApiKey

TIERS = ("safe", "compensable", "irreversible")

#: The most of an upstream answer read (bytes); the rest is never read and the stored body says so.
MAX_RESPONSE_BYTES = 1 << 20

#: Header names whose values are credentials: their values stay out of the contract (only their names go in).
_SECRET_HEADER_WORDS = ("authorization", "cookie", "token", "secret", "key", "password", "signature", "auth")

#: Errors after which the upstream may have acted: the request was sent and the answer lost. An approved
#: IRREVERSIBLE call that meets one is recorded ``unknown`` and its session halted, never failed and rolled back.
#: (A connect error or connect timeout means nothing was sent: that is a plain failure.)
OUTCOME_UNKNOWN_ERRORS: tuple[type[BaseException], ...] = (
    httpx.ReadTimeout, httpx.WriteTimeout, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError,
)


def is_secret_header(name: str) -> bool:
    """Whether a header's value is a credential (kept out of the contract fingerprint)."""
    lowered = name.lower()
    return any(word in lowered for word in _SECRET_HEADER_WORDS)


class UpstreamError(Exception):
    """The upstream tool answered with an error or not at all."""

    def __init__(self, message: str, status_code: int | None = None, body: Any = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


@dataclass(frozen=True)
class ProxyTool:
    """One upstream tool as declared in the proxy config."""

    name: str
    tier: str
    url: str
    method: str = "POST"
    args_schema: dict[str, Any] | None = None
    reason: str | None = None
    risk_tags: tuple[str, ...] = ()
    compensation_url: str | None = None
    compensation_name: str | None = None
    probe_url: str | None = None
    timeout: float = 10.0
    headers: dict[str, str] = field(default_factory=dict)
    max_response_bytes: int = MAX_RESPONSE_BYTES

    def endpoint(self) -> dict[str, Any]:
        """Where the tool runs, as its contract records it: the URLs, the method and the non-secret headers.

        A change to any of them is a new revision of the tool, which cancels its pending approvals: a person
        approved a call to *this* upstream. Secret headers count by name only, so rotating a token is not a change.
        """
        return {
            "url": self.url,
            "method": self.method,
            "compensation_url": self.compensation_url,
            "probe_url": self.probe_url,
            "headers": {k.lower(): v for k, v in sorted(self.headers.items()) if not is_secret_header(k)},
            "secret_headers": sorted(k.lower() for k in self.headers if is_secret_header(k)),
        }


@dataclass
class Upstream:
    """An upstream answer, its body read up to a limit (``truncated`` when there was more)."""

    status_code: int
    headers: httpx.Headers
    content: bytes
    truncated: bool = False

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300


@functools.cache
def _tls() -> ssl.SSLContext:
    """The one TLS context of every upstream call (httpx's default: certifi's CAs, or ``SSL_CERT_FILE``).

    Building it parses the whole CA bundle: about 20 ms of CPU with the GIL held. Built per call (as a new
    ``httpx.Client`` does), that was most of the desk's CPU under the load test and stalled every other thread;
    an ``SSLContext`` is safe to share between threads. Each call still gets its own client and connection (no
    cookie jar or kept-alive connection shared between calls: a reused connection that the upstream closed at
    the wrong moment would make an approved IRREVERSIBLE call's outcome look unknown).
    """
    return httpx.create_ssl_context()


def _post(url: str, payload: Any, *, idempotency_key: str | None, timeout: float, headers: Mapping[str, str],
          method: str = "POST", max_bytes: int = MAX_RESPONSE_BYTES) -> Upstream:
    h = dict(headers)
    if idempotency_key:
        h["Idempotency-Key"] = idempotency_key
    with httpx.Client(timeout=timeout, follow_redirects=False, verify=_tls()) as client, \
            client.stream(method, url, json=payload, headers=h) as resp:
        chunks: list[bytes] = []
        size = 0
        truncated = False
        for chunk in resp.iter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                truncated = True  # the upstream did its work: keep what fits, note the rest, read no more
                break
        content = b"".join(chunks)[:max_bytes]
        return Upstream(resp.status_code, resp.headers, content, truncated)


def _body(resp: Upstream) -> Any:
    """The upstream's body as a value that can always be stored and served (see ``limits.safe_result``)."""
    if resp.truncated:
        return {limits.TRUNCATED: {"reason": f"the upstream answered more than {len(resp.content)} bytes",
                                   "preview": resp.content[: limits.PREVIEW_CHARS].decode("utf-8", "replace")}}
    try:
        value: Any = json.loads(resp.content)
    except RecursionError:
        return {limits.TRUNCATED: f"the upstream's JSON is nested deeper than {limits.MAX_JSON_DEPTH} levels"}
    except ValueError:
        value = resp.content.decode("utf-8", "replace")
    return limits.safe_result(value)


class ProxyTools:
    """The proxied tools of one server.

    Args:
        tools: Declarations by name.
    """

    def __init__(self, tools: Mapping[str, ProxyTool]) -> None:
        self.tools = dict(tools)

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any]) -> ProxyTools:
        """Parse a proxy config (a TOML file path or an already parsed mapping).

        Raises:
            errors.ConfigurationError: A tool lacks a URL, has an unknown tier, or a
                COMPENSABLE tool has no compensation endpoint.
        """
        if isinstance(source, Mapping):
            data = dict(source)
        else:
            with open(source, "rb") as fh:
                data = tomllib.load(fh)
        defaults = dict(data.get("defaults", {}))
        tools: dict[str, ProxyTool] = {}
        for name, raw in (data.get("tools") or {}).items():
            cfg = {**defaults, **raw}
            tier = str(cfg.get("tier", "")).lower()
            if tier not in TIERS:
                raise errors.ConfigurationError(f"proxy tool {name!r}: tier must be one of {', '.join(TIERS)}")
            if not cfg.get("url"):
                raise errors.ConfigurationError(f"proxy tool {name!r}: url is required")
            if tier == "compensable" and not cfg.get("compensation_url"):
                raise errors.ConfigurationError(
                    f"proxy tool {name!r} is compensable: it needs a compensation_url that undoes it"
                )
            tools[name] = ProxyTool(
                name=name,
                tier=tier,
                url=str(cfg["url"]),
                method=str(cfg.get("method", "POST")).upper(),
                args_schema=cfg.get("args_schema"),
                reason=cfg.get("reason"),
                risk_tags=tuple(cfg.get("risk_tags", ())),
                compensation_url=cfg.get("compensation_url"),
                compensation_name=cfg.get("compensation") or (f"{name}.compensate" if tier == "compensable" else None),
                probe_url=cfg.get("probe_url"),
                timeout=float(cfg.get("timeout", 10.0)),
                max_response_bytes=int(cfg.get("max_response_bytes", MAX_RESPONSE_BYTES)),
                headers={str(k): str(v) for k, v in (cfg.get("headers") or {}).items()},
            )
        return cls(tools)

    def register(self, undolog: Any) -> None:
        """Register every proxied tool and its compensation with ``undolog``."""
        for tool in self.tools.values():
            if tool.tier == "compensable":
                undolog.register_compensation(_compensator(tool), name=tool.compensation_name)
            kwargs: dict[str, Any] = {
                "name": tool.name,
                "tier": tool.tier,
                "reason": tool.reason,
                "risk_tags": list(tool.risk_tags),
                "args_schema": tool.args_schema or {"type": "object", "additionalProperties": True},
                # Part of the contract (the fingerprint): a changed upstream is a new revision.
                "binding": {"proxy": tool.endpoint()},
            }
            if tool.compensation_name:
                kwargs["compensation"] = tool.compensation_name
            if tool.probe_url:
                kwargs["probe"] = _prober(tool)
            undolog.register_tool(_forwarder(tool), **kwargs)

    def call(self, tool: ProxyTool, args: Mapping[str, Any], idempotency_key: str | None) -> Upstream:
        """Forward one call upstream; its answer is read up to ``tool.max_response_bytes``."""
        return _post(tool.url, dict(args), idempotency_key=idempotency_key, timeout=tool.timeout,
                     headers=tool.headers, method=tool.method, max_bytes=tool.max_response_bytes)


def _forwarder(tool: ProxyTool) -> Any:
    def forward(**kwargs: Any) -> Any:
        from undolog_core import current_call

        ctx = current_call()
        resp = _post(tool.url, kwargs, idempotency_key=ctx.idempotency_key if ctx else None,
                     timeout=tool.timeout, headers=tool.headers, method=tool.method, max_bytes=tool.max_response_bytes)
        if not resp.is_success:
            raise UpstreamError(f"{tool.name} upstream answered {resp.status_code}", resp.status_code, _body(resp))
        return {"status_code": resp.status_code, "body": _body(resp)}

    forward.__name__ = f"proxy_{tool.name}"
    forward.__doc__ = tool.reason or f"Proxied tool {tool.name} at {tool.url}"
    return forward


def _compensator(tool: ProxyTool) -> Any:
    def compensate(ctx: Any) -> None:
        result = ctx.result
        if isinstance(result, dict) and "body" in result and "status_code" in result:
            result = result["body"]
        resp = _post(
            tool.compensation_url or "",
            {"tool": tool.name, "args": ctx.args, "result": result},
            idempotency_key=ctx.idempotency_key,
            timeout=tool.timeout,
            headers=tool.headers,
        )
        if not resp.is_success:
            raise UpstreamError(
                f"compensation of {tool.name} answered {resp.status_code}", resp.status_code, _body(resp)
            )

    compensate.__name__ = f"compensate_{tool.name}"
    return compensate


def _prober(tool: ProxyTool) -> Any:
    """Recovery's question to the upstream: did this call happen?

    The probe endpoint gets ``{"tool", "args", "idempotency_key"}`` (the key the call was sent
    with) and answers 404 or ``{"happened": false}`` when it did not, ``{"happened": true,
    "result": ...}`` when it did.
    """

    def probe(ctx: Any) -> Any:
        resp = _post(tool.probe_url or "", {"tool": tool.name, "args": ctx.args, "idempotency_key": ctx.idempotency_key},
                     idempotency_key=None, timeout=tool.timeout, headers=tool.headers)
        if resp.status_code == 404:
            return False
        if not resp.is_success:
            raise UpstreamError(f"probe of {tool.name} answered {resp.status_code}", resp.status_code)
        body = _body(resp)
        if isinstance(body, dict) and "happened" in body:
            if not body["happened"]:
                return False
            result = body.get("result")
            return {"status_code": 200, "body": result, "media_type": "application/json"} if result is not None else True
        return bool(body)

    return probe


router = APIRouter(prefix="/v1", tags=["proxy"], route_class=AuthFirstRoute)


@router.post(
    "/sessions/{session_id}/tools/{tool}:invoke",
    summary="Invoke a proxied tool in a session",
    responses={
        200: {"description": "The upstream's response (or the stored one for a replayed call)"},
        202: {"description": "IRREVERSIBLE call awaiting approval; retry with the same Idempotency-Key"},
        403: {"description": "Approval rejected or timed out"},
        504: {"description": "An approved IRREVERSIBLE call lost the upstream's answer: outcome unknown (session "
                    "halted), or the probe says it did not happen (retry)"},
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

    from undolog_core import AwaitingApproval, Completed

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

    def upstream(call_args: dict[str, Any]) -> dict[str, Any]:
        # The wait for the upstream needs no slot of the desk's lane (a blocked socket: no database, no CPU), so
        # it gives its slot back meanwhile: slow upstreams do not keep other agents' requests waiting. Reading
        # the answer and recording the outcome (the commit mark; a failure and its rollback) take one again,
        # waiting without a time limit: the upstream has acted, its outcome is never refused with a 503.
        with lanes.given_back(request.scope):
            resp = proxy.call(ptool, call_args, key_for_upstream)
        if not resp.is_success:
            raise UpstreamError(f"{tool} upstream answered {resp.status_code}", resp.status_code, _body(resp))
        return {"status_code": resp.status_code, "body": _body(resp), "media_type": resp.headers.get("content-type")}

    # The call driver runs it, as it runs every caller's: the upstream's failure is recorded and the session
    # rolled back per its policy; the rollback is told in the problem's body.
    # An approved IRREVERSIBLE call that was sent and then lost its answer may have happened: it is settled as
    # recovery would (the tool's probe decides; without one it is `unknown` and the session halted for a person),
    # never marked failed and rolled back.
    unknown_on = OUTCOME_UNKNOWN_ERRORS if ptool.tier == "irreversible" else ()
    outcome = st.undolog.driver.run_sync(decision, upstream, note=False, unknown_on=unknown_on)
    exc = outcome.error
    if exc is None:
        return _stored(outcome.value, replayed=False)
    if unknown_on and isinstance(exc, unknown_on):
        return _in_doubt(request, st, session_id, tool, args, call_id, decision, exc, outcome.in_doubt)
    if not isinstance(exc, (UpstreamError, httpx.HTTPError)):
        raise exc
    from .api import rollback_out

    extra: dict[str, Any] = {"upstream_status": getattr(exc, "status_code", None)}
    if outcome.rollback is not None:
        extra["rollback"] = rollback_out(session_id, outcome.rollback).model_dump(mode="json")
    log_5xx(request, exc)
    return problem_response(request, 502, "upstream_error", str(exc), **extra)


def _in_doubt(request: Request, st: Any, session_id: str, tool: str, args: dict[str, Any], call_id: str | None,
              decision: Any, exc: BaseException, settled: str | None) -> Response:
    """The answer to a call whose upstream answer was lost, by how it was settled (``Outcome.in_doubt``)."""
    from undolog_core import Completed

    if settled == "committed":
        # The probe says it happened: answer with what it reported, as a replay would.
        done = st.undolog.driver.decide(session_id, tool, args, call_id=call_id or decision.call_id)
        if isinstance(done, Completed):
            return _stored(done.result, replayed=True)
    if settled == "not_run":
        return problem_response(
            request, 504, "upstream_timeout",
            f"{tool}: the upstream did not answer ({type(exc).__name__}) and its probe says the call did not "
            "happen; the approval still stands: retry the same call",
            effect_id=decision.effect_id, headers={"Retry-After": "1"},
        )
    return problem_response(
        request, 504, "outcome_unknown",
        f"{tool}: the upstream did not answer ({type(exc).__name__}); the call may have happened. It is recorded "
        "'unknown' and the session is halted until a person checks the upstream and resumes it",
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
