"""The server-rendered dashboard (Jinja2, no build step).

Login exchanges an API key for a server-side login session: the cookie (HttpOnly,
SameSite=Strict) holds a random token whose hash names the row, so logout, expiry or a
revoked key ends it for every copy of the cookie. Every form of a logged-in page carries a
CSRF token bound to that login (an HMAC of its id): a token minted in another browser, or
before login, is worthless. Only the login form itself, which has no login yet, is bound to
a per-browser nonce cookie.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from undolog_core import errors, limits
from undolog_core.integration import find_effect

from . import forms
from .auth import server_state
from .guard import body_problem
from .identity import ApiKey, key_id_of, owns
from .routers.approvals import approval_detail, event_dict
from .routers.effects import Visibility
from .routers.sessions import rollback_out, session_detail
from .state import ServerState
from .storage import utcnow
from .views import groups_for, may_see

SESSION_COOKIE = "undolog_session"
# The queue page shows at most this many requests; a longer queue is a job for the API's filters.
QUEUE_LIMIT = 500
CSRF_COOKIE = "undolog_csrf"

templates = Jinja2Templates(directory=str(Path(__file__).parent / "templates"))
templates.env.filters["pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)
# Every value a page prints goes out as UTF-8: a lone surrogate read back from an older row is shown as its escape
# instead of failing the whole page.
templates.env.finalize = lambda v: limits.escape_text(v) if isinstance(v, str) else v
templates.env.filters["iso"] = lambda d: d.isoformat() if d else ""
templates.env.filters["short"] = lambda s, n=8: (s or "")[:n]
# An id in a link or a form action is one path segment, whatever it holds: an embedded app's session id may carry
# ``#``, ``?``, ``%`` or a backslash (which a browser reads as ``/``), and written as it is it would lead elsewhere.
templates.env.filters["seg"] = lambda s: quote(str(s), safe="")

router = APIRouter(include_in_schema=False)


class _Redirect(Exception):
    def __init__(self, url: str) -> None:
        self.url = url


def _csrf_for(st: ServerState, bound_to: str, *, login: bool = False) -> str:
    """The CSRF token of a login session (``bound_to`` its id) or, for the login form only, of a nonce."""
    purpose = b"csrf-login:" if login else b"csrf:"
    return hmac.new(st.secret, purpose + bound_to.encode(), hashlib.sha256).hexdigest()


def _secure(st: ServerState, request: Request) -> bool:
    if st.settings.secure_cookies is not None:
        return st.settings.secure_cookies
    return request.url.scheme == "https"


def _current_user(request: Request) -> ApiKey | None:
    """The key of the request's live login session (remembered on the request for its CSRF check)."""
    st = server_state(request)
    raw = request.cookies.get(SESSION_COOKIE)
    if not raw:
        return None
    found = st.store.dashboard_session(raw)
    if found is None:
        return None
    key, session_id = found
    request.state.dashboard_session = session_id
    return key


def _user_or_redirect(request: Request) -> ApiKey:
    key = _current_user(request)
    if key is None:
        raise _Redirect("/ui/login")
    return key


def _nonce(request: Request) -> tuple[str, bool]:
    nonce = request.cookies.get(CSRF_COOKIE)
    if nonce and 16 <= len(nonce) <= 128:
        return nonce, False
    return secrets.token_urlsafe(24), True


def _render(request: Request, name: str, ctx: dict[str, Any], status: int = 200, *, rotate: bool = False) -> HTMLResponse:
    st = server_state(request)
    session_id: str | None = getattr(request.state, "dashboard_session", None)
    fresh = False
    if session_id is not None:
        token = _csrf_for(st, session_id)
    else:
        # No login yet (the login page, an error page): the login form's token fits this browser's nonce.
        nonce, fresh = _nonce(request)
        if rotate:
            nonce, fresh = secrets.token_urlsafe(24), True
        token = _csrf_for(st, nonce, login=True)
    ctx = {
        "request": request,
        "csrf_token": token,
        "user": ctx.pop("user", None),
        "poll_seconds": st.settings.poll_seconds,
        **ctx,
    }
    resp = templates.TemplateResponse(request, name, ctx, status_code=status)
    if fresh:
        resp.set_cookie(CSRF_COOKIE, nonce, httponly=True, samesite="strict", secure=_secure(st, request), path="/ui")
    return resp


def same_text(expected: str, sent: str) -> bool:
    """Whether ``sent`` is ``expected``, in constant time: a CSRF token or a code from a form.

    Compared as UTF-8 bytes: ``hmac.compare_digest`` raises ``TypeError`` on text outside ASCII, which whoever posts
    the form controls (such a post answered 500).

    Example:
        >>> same_text("abc", "\u00e9")
        False
    """
    return hmac.compare_digest(expected.encode(), sent.encode())


async def _form(request: Request, *, login: bool = False) -> dict[str, str]:
    """Read a POSTed form and check its CSRF token: bound to the login session, or for the login form to the
    browser's nonce cookie."""
    st = server_state(request)
    form = await request.form()
    data = {k: str(v) for k, v in form.items() if isinstance(v, str)}
    sent = data.get("csrf_token", "")
    if login:
        nonce = request.cookies.get(CSRF_COOKIE) or ""
        expected = _csrf_for(st, nonce, login=True) if nonce else ""
    else:
        session_id: str | None = getattr(request.state, "dashboard_session", None)
        if session_id is None:
            _current_user(request)
            session_id = getattr(request.state, "dashboard_session", None)
        expected = _csrf_for(st, session_id) if session_id else ""
    if not expected or not sent or not same_text(expected, sent):
        raise _CsrfFailed()
    return data


class _CsrfFailed(Exception):
    pass


def install(app: FastAPI) -> None:
    """Mount the dashboard routes and their error handlers on ``app``."""

    @app.exception_handler(_Redirect)
    async def _redirect(request: Request, exc: _Redirect) -> Response:
        return RedirectResponse(exc.url, status_code=303)

    @app.exception_handler(_CsrfFailed)
    async def _csrf(request: Request, exc: _CsrfFailed) -> Response:
        return _render(request, "error.html", {"title": "Form expired", "message":
                       "The form's security token did not match. Reload the page and try again."}, 403)

    app.include_router(router)


def _is_approver(key: ApiKey) -> bool:
    return bool(key.roles & {"approver", "admin"})


def _forbidden(request: Request, key: ApiKey, message: str) -> HTMLResponse:
    return _render(request, "error.html", {"user": key, "title": "Not allowed", "message": message}, 403)


# ---------------------------------------------------------------------------------------- login


@router.get("/")
def root() -> Response:
    return RedirectResponse("/ui/", status_code=303)


@router.get("/ui/login")
def login_page(request: Request) -> HTMLResponse:
    return _render(request, "login.html", {})


@router.post("/ui/login")
async def login(request: Request) -> Response:
    st = server_state(request)
    data = await _form(request, login=True)
    key = st.store.authenticate(data.get("api_key", "").strip())
    if key is None:
        return _render(request, "login.html", {"error": "That key is unknown or revoked."}, 401)
    if not _is_approver(key):
        return _render(request, "login.html", {"error": "The dashboard is for approvers and admins; agent keys use the API."}, 403)
    resp = RedirectResponse("/ui/", status_code=303)
    secure = _secure(st, request)
    # A new login session every time: a cookie planted before login (session fixation) is never promoted, and the
    # browser's previous login, if any, ends here rather than living on beside the new one.
    previous = st.store.dashboard_session(request.cookies.get(SESSION_COOKIE) or "")
    if previous is not None:
        st.store.end_dashboard_session(previous[1])
    token, _ = st.store.create_dashboard_session(key.key_id, st.settings.cookie_max_age)
    resp.set_cookie(SESSION_COOKIE, token, max_age=st.settings.cookie_max_age,
                    httponly=True, samesite="strict", secure=secure, path="/")
    # A new CSRF nonce at login: a token planted before login is worthless after it.
    resp.set_cookie(CSRF_COOKIE, secrets.token_urlsafe(24), httponly=True, samesite="strict", secure=secure, path="/ui")
    return resp


@router.post("/ui/logout")
async def logout(request: Request) -> Response:
    await _form(request)
    session_id: str | None = getattr(request.state, "dashboard_session", None)
    if session_id is not None:
        # Revoked server-side: a copy of the cookie (another tab, a stolen one) stops working too.
        server_state(request).store.end_dashboard_session(session_id)
    resp = RedirectResponse("/ui/login", status_code=303)
    resp.delete_cookie(SESSION_COOKIE, path="/")
    resp.delete_cookie(CSRF_COOKIE, path="/ui")
    return resp


# ---------------------------------------------------------------------------------------- queue


def _queue(st: ServerState, key: ApiKey) -> list[dict[str, Any]]:
    groups = st.store.groups()
    out = []
    for a in st.views.pending_approvals(limit=QUEUE_LIMIT):
        g = groups_for(groups, a["tool_name"], a["risk_tags"])
        if may_see(key, g):
            a["groups"] = g
            out.append(a)
    return out


@router.get("/ui/")
def queue(request: Request) -> HTMLResponse:
    key = _user_or_redirect(request)
    st = server_state(request)
    return _render(request, "queue.html", {"user": key, "items": _queue(st, key), "now": utcnow()})


@router.get("/ui/queue/rows")
def queue_rows(request: Request) -> HTMLResponse:
    key = _current_user(request)
    if key is None:
        return HTMLResponse("", status_code=401)
    st = server_state(request)
    resp = templates.TemplateResponse(request, "_queue_rows.html", {"request": request, "items": _queue(st, key)})
    resp.headers["Cache-Control"] = "no-store"
    return resp


# ---------------------------------------------------------------------------------------- approvals


def _approval_page(request: Request, key: ApiKey, approval_request_id: str, *, error: str | None = None,
                   status: int = 200, notice: str | None = None, submitted: dict[str, str] | None = None,
                   review: list[forms.Change] | None = None, edited_json: str | None = None,
                   modify_reason: str | None = None) -> HTMLResponse:
    st = server_state(request)
    row = st.views.approval_row(approval_request_id)
    if row is None:
        return _render(request, "error.html", {"user": key, "title": "Not found",
                       "message": f"No approval request {approval_request_id}."}, 404)
    groups = groups_for(st.store.groups(), row["tool_name"], row["risk_tags"])
    if not may_see(key, groups):
        return _forbidden(request, key, f"This request is routed to {', '.join(groups)}; you are in none of them.")
    detail = approval_detail(st, row, key)
    session = st.views.session_row(row["session_id"]) or {}
    own = owns(key, session.get("created_by"))
    events = st.undolog.approvals.events(approval_request_id)
    # The edit form comes from the schema of the tool revision the request was raised under, filled with the
    # proposed arguments; an edit sent back (an error, a review) shows what was submitted.
    form = forms.build(forms.request_schema(st.undolog, row["tool_name"], row.get("tool_revision")),
                       detail.proposed_args)
    return _render(request, "approval.html", {
        "user": key, "a": detail, "session": session, "own_session": own,
        "events": [event_dict(e) for e in events], "form": form, "submitted": submitted or {}, "review": review,
        "edited_json": edited_json, "modify_reason": modify_reason, "error": error, "notice": notice,
    }, status)


@router.get("/ui/approvals/{approval_request_id}")
def approval_page(request: Request, approval_request_id: str) -> HTMLResponse:
    key = _user_or_redirect(request)
    return _approval_page(request, key, approval_request_id)


@router.post("/ui/approvals/{approval_request_id}/{action}")
async def decide(request: Request, approval_request_id: str, action: str) -> Response:
    key = _user_or_redirect(request)
    data = await _form(request)
    st = server_state(request)
    if action not in ("approve", "reject", "modify"):
        return _render(request, "error.html", {"user": key, "title": "Not found", "message": "Unknown action."}, 404)
    if not _is_approver(key):
        return _forbidden(request, key, "Only approvers and admins decide requests.")
    row = st.views.approval_row(approval_request_id)
    if row is None:
        return _approval_page(request, key, approval_request_id)
    if not may_see(key, groups_for(st.store.groups(), row["tool_name"], row["risk_tags"])):
        return _forbidden(request, key, "This request is routed to an approver group you are not in.")
    session = st.views.session_row(row["session_id"]) or {}
    if owns(key, session.get("created_by")):
        try:  # the core's check, which audits the refusal before it raises
            st.undolog.approvals.refuse_own(approval_request_id, key.identity, action, key.principal_ref)
        except errors.SelfDecisionForbidden:
            pass
        return _forbidden(request, key, "Your key created the session that raised this request; someone else must decide it.")
    reason = data.get("reason", "").strip() or None
    try:
        if action == "approve":
            st.undolog.approvals.approve(approval_request_id, approver=key.identity, principal=key.principal_ref, reason=reason)
        elif action == "reject":
            if not reason:
                return _approval_page(request, key, approval_request_id, error="A rejection needs a reason.", status=422)
            st.undolog.approvals.reject(approval_request_id, approver=key.identity, principal=key.principal_ref, reason=reason)
        elif data.get("step") == "confirm":
            edited = data.get("args_json", "")
            # The reviewed edit comes back as JSON: the same door as the API's body (NUL, nesting, lone surrogates,
            # NaN and infinities refused) before it is parsed, then the core validates it against the schema again.
            refused = body_problem(edited.encode("utf-8", "surrogatepass"), "application/json")
            if refused is not None:
                return _approval_page(request, key, approval_request_id, status=422,
                                      error=refused[1].replace("the JSON body", "the arguments"))
            try:
                args = json.loads(edited)
            except ValueError as exc:
                return _approval_page(request, key, approval_request_id, status=422,
                                      error=f"The arguments are not valid JSON: {exc}")
            if not isinstance(args, dict):
                return _approval_page(request, key, approval_request_id, status=422,
                                      error="The arguments must be a JSON object.")
            st.undolog.approvals.modify(approval_request_id, approver=key.identity, principal=key.principal_ref, args=args,
                                        reason=reason)
        else:
            # The review step: the submitted fields become arguments (checked against the tool's schema, every
            # error naming its field) and the page shows what the edit changes before anything is decided.
            submitted = {k: v for k, v in data.items() if k not in ("csrf_token", "step", "reason")}
            for text in submitted.values():
                refused = body_problem(json.dumps(text).encode("utf-8", "surrogatepass"), "application/json")
                if refused is not None:
                    return _approval_page(request, key, approval_request_id, status=422, submitted=submitted,
                                          modify_reason=reason,
                                          error=refused[1].replace("the JSON body", "the arguments"))
            schema = forms.request_schema(st.undolog, row["tool_name"], row.get("tool_revision"))
            proposed = row.get("proposed_args") or {}
            try:
                parsed = forms.parse(schema, submitted, original=proposed)
            except forms.FormInvalid as exc:
                return _approval_page(request, key, approval_request_id, error=exc.message, status=422,
                                      submitted=submitted, modify_reason=reason)
            return _approval_page(request, key, approval_request_id, submitted=submitted, modify_reason=reason,
                                  review=forms.diff(proposed, parsed),
                                  edited_json=json.dumps(parsed, sort_keys=True, ensure_ascii=False))
    except errors.ArgumentsInvalid as exc:
        return _approval_page(request, key, approval_request_id, error=exc.message, status=422)
    except errors.ApprovalAlreadyDecided as exc:
        return _approval_page(request, key, approval_request_id, error=exc.message, status=409)
    except errors.UndoLogError as exc:
        return _approval_page(request, key, approval_request_id, error=exc.message, status=409)
    return RedirectResponse(f"/ui/approvals/{quote(approval_request_id, safe='')}?done={action}", status_code=303)


# ---------------------------------------------------------------------------------------- sessions


@router.get("/ui/sessions")
def sessions_page(request: Request, state: str | None = None) -> HTMLResponse:
    key = _user_or_redirect(request)
    st = server_state(request)
    valid = {"active", "awaiting_approval", "halted", "rolled_back", "completed"}
    rows = st.views.sessions(state=state if state in valid else None, limit=200)
    return _render(request, "sessions.html", {"user": key, "sessions": rows, "state": state})


@router.get("/ui/sessions/{session_id}")
def session_page(request: Request, session_id: str) -> HTMLResponse:
    key = _user_or_redirect(request)
    return _session_page(request, key, session_id)


def _session_page(request: Request, key: ApiKey, session_id: str, *, report: Any = None, error: str | None = None,
                  status: int = 200) -> HTMLResponse:
    st = server_state(request)
    row = st.views.session_row(session_id)
    if row is None:
        return _render(request, "error.html", {"user": key, "title": "Not found", "message": f"No session {session_id}."}, 404)
    return _render(request, "session.html", {
        "user": key, "s": session_detail(st, row, key), "report": report, "error": error,
        "can_admin": "admin" in key.roles, "creator": _creator(st, row.get("created_by")),
        # Approvers and admins settle unknown effects, but not those of a session their own key created.
        "can_resolve": _is_approver(key) and not owns(key, row.get("created_by")),
    }, status)


def _creator(st: ServerState, created_by: str | None) -> str | None:
    """Show a key-created session's creator by the key's name."""
    key_id = key_id_of(created_by)
    if key_id is not None:
        key = st.store.get_key(key_id)
        if key is not None:
            return key.identity
    return created_by


@router.post("/ui/sessions/{session_id}/rollback")
async def rollback(request: Request, session_id: str) -> Response:
    key = _user_or_redirect(request)
    await _form(request)
    st = server_state(request)
    if "admin" not in key.roles:
        return _forbidden(request, key, "Only admins roll sessions back from the dashboard.")
    if st.views.session_row(session_id) is None:
        return _session_page(request, key, session_id)
    try:
        report = st.undolog.rollback(session_id, actor=key.identity)
    except errors.UndoLogError as exc:
        return _session_page(request, key, session_id, error=exc.message, status=409)
    return _session_page(request, key, session_id, report=rollback_out(session_id, report))


@router.post("/ui/sessions/{session_id}/revalidate")
async def revalidate(request: Request, session_id: str) -> Response:
    """Pin the session to the tools' current contracts, once a person has reviewed a change: what an MCP client
    refused with ``contract_changed`` is told to ask for (it cannot revalidate a session itself)."""
    key = _user_or_redirect(request)
    await _form(request)
    st = server_state(request)
    if "admin" not in key.roles:
        return _forbidden(request, key, "Only admins revalidate sessions.")
    if st.views.session_row(session_id) is None:
        return _session_page(request, key, session_id)
    from .coreops import revalidate as _revalidate

    try:
        _revalidate(st.undolog, session_id, actor=key.identity)
    except errors.UndoLogError as exc:
        return _session_page(request, key, session_id, error=exc.message, status=409)
    return RedirectResponse(f"/ui/sessions/{quote(session_id, safe='')}", status_code=303)


@router.post("/ui/sessions/{session_id}/resume")
async def resume(request: Request, session_id: str) -> Response:
    key = _user_or_redirect(request)
    data = await _form(request)
    st = server_state(request)
    if "admin" not in key.roles:
        return _forbidden(request, key, "Only admins resume sessions.")
    if st.views.session_row(session_id) is None:
        return _session_page(request, key, session_id)
    from .coreops import resume as _resume

    try:
        _resume(st.undolog, session_id, actor=key.identity, reason=data.get("reason") or None)
    except errors.UndoLogError as exc:
        return _session_page(request, key, session_id, error=exc.message, status=409)
    return RedirectResponse(f"/ui/sessions/{quote(session_id, safe='')}", status_code=303)


# ---------------------------------------------------------------------------------------- effects


@router.post("/ui/effects/{effect_id}/resolve")
async def resolve(request: Request, effect_id: str) -> Response:
    """Settle an ``unknown`` effect from its session's timeline (the API's ``/v1/effects/{id}:resolve``)."""
    key = _user_or_redirect(request)
    data = await _form(request)
    st = server_state(request)
    if not _is_approver(key):
        return _forbidden(request, key, "Only approvers and admins resolve calls whose outcome is unknown.")
    found = find_effect(st.undolog, effect_id)
    session = st.views.session_row(found.session_id) if found is not None else None
    if found is None or session is None:
        return _render(request, "error.html", {"user": key, "title": "Not found", "message": f"No effect {effect_id}."},
                       404)
    session_id = found.session_id
    if not Visibility(st, key, session).sees(found.tool_name, found.tool_revision):
        return _forbidden(request, key, "This call's tool is routed to an approver group you are not in.")
    outcome, reason = data.get("outcome", ""), data.get("reason", "").strip()
    if outcome not in ("committed", "compensated", "not_happened"):
        return _session_page(request, key, session_id, error="Pick what the external system shows.", status=422)
    if not reason:
        return _session_page(request, key, session_id, error="Say what you checked (a reason is required).",
                             status=422)
    try:
        st.undolog.resolve_effect(effect_id, outcome=outcome, reason=reason, actor=key.identity,
                                  principal=key.principal_ref)
    except errors.SelfDecisionForbidden:
        return _forbidden(request, key, "Your key created the session that made this call; someone else must resolve it.")
    except errors.UndoLogError as exc:
        return _session_page(request, key, session_id, error=exc.message, status=409)
    return RedirectResponse(f"/ui/sessions/{quote(session_id, safe='')}", status_code=303)
