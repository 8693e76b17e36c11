"""RFC 9457 problem details with stable codes.

Every error the server returns is ``application/problem+json`` with a ``code``
that clients may branch on; the ``type`` URI is derived from the code so the two
never disagree.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from undolog_core.errors import UndoLogError

PROBLEM_MEDIA_TYPE = "application/problem+json"
PROBLEM_BASE = "https://undolog.dev/problems/"

#: The HTTP status of each core error code. It lives here, not on the core's errors, because a status is
#: how this server speaks HTTP; the core, the CLI and the adapters only know the codes. A code missing
#: here (a new core error) answers 400 until it is added.
ERROR_STATUS: dict[str, int] = {
    "undolog_error": 400,
    "configuration_error": 400,
    "checkpoint_invalid": 422,
    "audit_chain_broken": 409,
    "invalid_declaration": 400,
    "tool_not_classified": 400,
    "invalid_input": 422,
    "undo_check_scenario": 422,  # undolog_core.testing: a scenario check_undo cannot check
    "tool_not_registered": 404,
    "arguments_invalid": 422,
    "session_not_found": 404,
    "session_halted": 409,
    "session_closed": 409,
    "invalid_session_state": 409,
    "invalid_id": 422,
    "call_id_conflict": 409,
    "contract_changed": 409,
    "approval_pending": 202,
    "approval_rejected": 403,
    "approval_timed_out": 403,
    "approval_cancelled": 409,
    "approval_not_found": 404,
    "approval_already_decided": 409,
    "self_approval_forbidden": 403,
    "outcome_unknown": 409,
    "database_unavailable": 503,
    "effect_not_found": 404,
    "invalid_effect_state": 409,
    "compensation_not_found": 409,
    "compensation_version_mismatch": 409,
    "compensation_failed": 409,
    "audit_tampered": 409,
    "policy_invalid": 422,
    "database_open_failed": 503,  # the store could not be opened (a wrong URL, the server down)
    "idempotency_key_invalid": 422,  # a client's own idempotency key is malformed
    "idempotency_key_reused": 409,  # the same client key with other arguments
    "outcome_conflict": 409,  # a call finished after it was taken over: a person decides
    "rollback_still_running": 202,  # filed for the owning process, not finished within the wait
    "session_not_yours": 403,  # a session named by a client that did not create it
    "form_invalid": 422,  # undolog_server.forms: an edit form's values do not fit the tool's schema
}


def status_for(code: str) -> int:
    """The HTTP status the server answers for a core error code.

    Example:
        >>> status_for("approval_not_found")
        404
    """
    return ERROR_STATUS.get(code, 400)

_HTTP_CODES = {
    400: "bad_request",
    401: "unauthenticated",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "payload_too_large",
    415: "unsupported_media_type",
    422: "validation_failed",
    429: "too_many_requests",
    500: "internal_error",
    502: "upstream_error",
    503: "unavailable",
    504: "upstream_timeout",
}

_TITLES = {
    400: "Bad request",
    401: "Authentication required",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    422: "Unprocessable content",
    500: "Internal server error",
    502: "Bad gateway",
    503: "Service unavailable",
    504: "Gateway timeout",
}


class SafeJSONResponse(JSONResponse):
    """``JSONResponse`` that never fails on a lone surrogate (an old row, a stored upstream body): it is written as
    its JSON escape (``\\ud800``), so the answer is still valid JSON instead of a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode(
            "utf-8", "backslashreplace")


class Problem(Exception):
    """An error to be rendered as problem+json.

    Args:
        status: HTTP status code.
        code: Stable machine-readable code (snake_case).
        detail: Human-readable explanation of this occurrence.
        headers: Extra response headers (e.g. ``WWW-Authenticate``).
        **extra: Extension members added to the body.
    """

    def __init__(
        self, status: int, code: str, detail: str, *, headers: dict[str, str] | None = None, **extra: Any
    ) -> None:
        super().__init__(detail)
        self.status = status
        self.code = code
        self.detail = detail
        self.headers = headers or {}
        self.extra = extra


def problem_body(status: int, code: str, detail: str, instance: str | None = None, **extra: Any) -> dict[str, Any]:
    """Build a problem+json body.

    Args:
        status: HTTP status.
        code: Stable code.
        detail: Human-readable detail.
        instance: The request path the problem occurred on.
        **extra: Extension members.

    Returns:
        The JSON-able body.
    """
    body: dict[str, Any] = {
        "type": PROBLEM_BASE + code,
        "title": _TITLES.get(status, "Error"),
        "status": status,
        "code": code,
        "detail": detail,
    }
    if instance:
        body["instance"] = instance
    body.update({k: v for k, v in extra.items() if k not in body})
    return body


def problem_response(
    request: Request | None, status: int, code: str, detail: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    """Render a problem as a JSON response with the problem media type."""
    instance = request.url.path if request is not None else None
    return SafeJSONResponse(
        problem_body(status, code, detail, instance, **extra),
        status_code=status,
        media_type=PROBLEM_MEDIA_TYPE,
        headers=headers,
    )


def from_undolog_error(request: Request, exc: UndoLogError) -> JSONResponse:
    """Map a core error onto its problem: the core owns the code, :data:`ERROR_STATUS` the status."""
    status = status_for(exc.code)
    # 202 is not an error status; ApprovalPending only reaches here if a handler forgot it.
    if status < 400:
        status = 409
    extra = {k: _jsonable(v) for k, v in exc.details.items()}
    if isinstance(extra.get("errors"), list):
        extra["errors"] = [_field_error(e) for e in extra["errors"]]
    # A database that does not answer (down, or no connection free in time) is worth retrying: say when.
    headers = {"Retry-After": "1"} if status == 503 else None
    return problem_response(request, status, exc.code, exc.message, headers, **extra)


def _allowed_methods(request: Request) -> str:
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def _field_error(e: Any) -> Any:
    if not isinstance(e, dict):
        return _jsonable(e)
    loc = e.get("loc", ())
    return {
        "field": ".".join(str(p) for p in loc) if isinstance(loc, (list, tuple)) else str(loc),
        "message": str(e.get("msg", "invalid")),
        "type": str(e.get("type", "invalid")),
    }


def _jsonable(v: Any) -> Any:
    from pydantic_core import to_jsonable_python

    try:
        return to_jsonable_python(v)
    except Exception:
        return str(v)


def log_5xx(request: Request | None, exc: BaseException) -> None:
    """Every 5xx answer is logged under ``undolog.server`` with the traceback of what caused it."""
    where = f"{request.method} {request.url.path}" if request is not None else "a request"
    logging.getLogger("undolog.server").error("%s answered %s: %s", where, type(exc).__name__, exc, exc_info=exc)


def install_handlers(app: FastAPI) -> None:
    """Register exception handlers so no error escapes as HTML or a bare 500 body."""

    @app.exception_handler(Problem)
    async def _problem(request: Request, exc: Problem) -> JSONResponse:
        if exc.status >= 500:
            log_5xx(request, exc)
        return problem_response(request, exc.status, exc.code, exc.detail, exc.headers or None, **exc.extra)

    @app.exception_handler(UndoLogError)
    async def _core(request: Request, exc: UndoLogError) -> JSONResponse:
        response = from_undolog_error(request, exc)
        if response.status_code >= 500:
            log_5xx(request, exc)
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = []
        for e in exc.errors():
            loc = [str(p) for p in e.get("loc", ())]
            errors.append({"field": ".".join(loc), "message": str(e.get("msg", "invalid")), "type": str(e.get("type"))})
        fields = ", ".join(f"{e['field']}: {e['message']}" for e in errors)
        return problem_response(request, 422, "validation_failed", f"request is invalid: {fields}", errors=errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        detail = exc.detail if isinstance(exc.detail, str) else code
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route whose path matched; with ``{id}`` and
            # ``{id}:approve`` both matching one URL that is wrong. Allow lists every route's methods for this path.
            headers["Allow"] = _allowed_methods(request)
        return problem_response(request, exc.status_code, code, detail, headers or None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log_5xx(request, exc)
        return problem_response(request, 500, "internal_error", "the server failed to handle this request")


#: The problem+json body every error response carries (RFC 9457), as documented in the OpenAPI schema.
PROBLEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "An RFC 9457 problem. Branch on `code`, which is stable; extension members depend on it.",
    "required": ["type", "title", "status", "code", "detail"],
    "properties": {
        "type": {"type": "string"},
        "title": {"type": "string"},
        "status": {"type": "integer"},
        "code": {"type": "string"},
        "detail": {"type": "string"},
        "instance": {"type": "string"},
    },
    "additionalProperties": True,
}

_ERROR_DESCRIPTIONS = {
    400: "The body is not parseable (malformed JSON or form)",
    401: "No API key, or an unknown or revoked one",
    403: "The key lacks the role, the approver group, or decides its own session's request",
    404: "The addressed object does not exist (or is not the caller's to see)",
    409: "The object's state forbids this (already decided, session halted, exists)",
    413: "The body is larger than the server accepts",
    415: "The body's media type is not accepted",
    422: "The request does not validate (the failing field is named)",
    503: "The database does not answer, or the server is busy (`server_busy`); retry after `Retry-After` seconds",
}


def document_problems(schema: dict[str, Any]) -> dict[str, Any]:
    """Document every error an operation can answer, as problem+json, in a generated OpenAPI schema.

    FastAPI documents only the success response and a JSON 422; the desk answers every error as
    ``application/problem+json`` (see :func:`install_handlers`), so a client generator or a schema checker
    (schemathesis runs with all its checks in the test suite) would otherwise meet statuses and a media type the
    schema never mentions. Which statuses: 401/403 on every authenticated operation, 404 where a path names an
    object, 400/413/415 where there is a body, 422 and 503 everywhere, plus what a route declared itself.
    """
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["Problem"] = PROBLEM_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    ref = {"$ref": "#/components/schemas/Problem"}
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            if not isinstance(op, dict) or "responses" not in op:
                continue
            statuses = {422, 503}
            if op.get("security"):
                statuses |= {401, 403}
            if "{" in path:
                statuses.add(404)
            if "requestBody" in op:
                statuses |= {400, 413, 415}
            if method != "get":
                statuses.add(409)
            responses = op["responses"]
            for status in sorted(statuses | {int(s) for s in responses if s.isdigit() and int(s) >= 400}):
                entry = responses.setdefault(str(status), {"description": _ERROR_DESCRIPTIONS.get(status, "Error")})
                entry["content"] = {PROBLEM_MEDIA_TYPE: {"schema": ref}}
    return schema
