"""The confirmation page a mail's link opens (``/ui/email/<token>``): proof of who opened it, then one decision.

A GET decides nothing and sends nothing (mail scanners follow links). The request is shown only to the key the link
was sent for: logged in to the desk, or after a one-time code mailed to the same address (5 wrong codes void the
link). A POST from that page decides, once, through the core's :class:`~undolog_core.ApprovalService`
(self-decision and group checks as everywhere); an edit is reviewed (its diff) before it is approved.

Example:
    >>> from fastapi import FastAPI
    >>> FastAPI().include_router(ui)
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fastapi import APIRouter, Request, Response
from fastapi.responses import HTMLResponse, RedirectResponse

from undolog_core import errors

from .. import forms
from ..auth import server_state
from ..dashboard import CSRF_COOKIE, SESSION_COOKIE, same_text, templates
from ..guard import body_problem
from ..identity import ApiKey, owns
from ..storage import utcnow
from ..storage.email import EmailToken
from ..views import groups_for, may_see
from .sender import email_store
from .tokens import MAX_CODE_ATTEMPTS, code_for, read_token

if TYPE_CHECKING:
    from ..state import ServerState

__all__ = ["GRANT_COOKIE", "ui"]

#: Cookie (one per link) naming the browser a correct code was entered in.
GRANT_COOKIE = "undolog_email_grant_"


ui = APIRouter(include_in_schema=False)


@dataclass
class _Link:
    """A link whose signature held, with its row."""

    raw: str
    token: EmailToken


def _key_bytes(request: Request) -> bytes | None:
    return getattr(request.app.state, "email_token_key", None)


def _page(request: Request, ctx: dict[str, Any], status: int = 200) -> HTMLResponse:
    nonce = request.cookies.get(CSRF_COOKIE) or ""
    fresh = not (16 <= len(nonce) <= 128)
    if fresh:
        nonce = secrets.token_urlsafe(24)
    link: _Link | None = ctx.get("link")
    csrf = _csrf(request, link.token.token_id, nonce) if link else ""
    resp = templates.TemplateResponse(request, "email.html", {"request": request, "user": None, "csrf_token": csrf,
                                                              "poll_seconds": 0, **ctx}, status_code=status)
    # The page holds a request's arguments (and a code form): never cached, never sent on as a referrer.
    resp.headers["Cache-Control"] = "no-store"
    if fresh:
        st = server_state(request)
        resp.set_cookie(CSRF_COOKIE, nonce, httponly=True, samesite="strict", secure=_secure(request, st), path="/ui")
    return resp


def _secure(request: Request, st: ServerState) -> bool:
    if st.settings.secure_cookies is not None:
        return st.settings.secure_cookies
    return request.url.scheme == "https"


def _csrf(request: Request, token_id: str, nonce: str) -> str:
    st = server_state(request)
    return hmac.new(st.secret, f"csrf-email:{token_id}:{nonce}".encode(), hashlib.sha256).hexdigest()


def _refused(request: Request, title: str, message: str, status: int, *, audit: dict[str, Any] | None = None,
             link: _Link | None = None) -> HTMLResponse:
    if audit is not None:
        _record(request, "email_link_refused", link, audit)
    return _page(request, {"title": title, "message": message, "refused": True}, status)


def _record(request: Request, action: str, link: _Link | None, payload: dict[str, Any]) -> None:
    """A refusal on the audit trail; with the link's request, so it shows in that request's events."""
    st = server_state(request)
    if link is None:
        st.undolog.record_audit(subject="email:link", action=action, actor="email link", payload=payload)
        return
    tok = link.token
    st.undolog.record_audit(subject=f"approval:{tok.approval_request_id}", action=action,
                            actor="email link", approval_request_id=tok.approval_request_id,
                            payload=payload | {"token_id": tok.token_id, "key_id": tok.key_id})


def _open(request: Request, raw: str) -> _Link | HTMLResponse:
    """The link's row, if its signature holds and it is still live; else the refusal page."""
    key = _key_bytes(request)
    if key is None:
        return _refused(request, "Email approvals are off", "This desk does not send approval mail.", 404)
    data = read_token(key, raw)
    st = server_state(request)
    tok = email_store(st).token(data["t"]) if data else None
    if data is None or tok is None or (tok.approval_request_id, tok.key_id, tok.action_digest) != (
            data["r"], data["k"], data["d"]):
        return _refused(request, "Link not valid", "This link is not one this desk sent. Open the link from the mail "
                        "itself, or decide on the desk.", 404, audit={"why": "bad_signature"} if data is None else None)
    link = _Link(raw, tok)
    if tok.void_at is not None:
        return _refused(request, "Link void", f"This link no longer works ({tok.void_reason}). Decide on the desk, "
                        "logged in with your key.", 410, link=link)
    if tok.used_at is not None:
        return _refused(request, "Link already used", "This link has been used: a link decides once. The request's "
                        "outcome is on the desk.", 410, link=link)
    if tok.expires_at <= utcnow():
        return _refused(request, "Link expired", "This link expired with its request.", 410, link=link)
    try:
        # Read through the core, which applies a due timeout first: a link dies with its request, whoever opens it.
        state = st.undolog.approvals.get(tok.approval_request_id).state.value
    except errors.ApprovalNotFound:
        state = "gone"
    if state != "pending":
        return _refused(request, "Link expired", f"This link's request is {state.replace('_', ' ')}: there is "
                        "nothing left to decide. Its outcome is on the desk.", 410, link=link)
    return link


def _who(request: Request, link: _Link) -> tuple[str, ApiKey | None]:
    """Who opened the page: ``login`` (the link's key, logged in), ``code`` (a correct code in this browser),
    ``other`` (logged in as another key) or ``none``."""
    st = server_state(request)
    raw = request.cookies.get(SESSION_COOKIE)
    found = st.store.dashboard_session(raw) if raw else None
    if found is not None:
        key, session_id = found
        request.state.dashboard_session = session_id
        if key.key_id == link.token.key_id:
            return "login", key
        return "other", key
    grant = request.cookies.get(GRANT_COOKIE + link.token.token_id)
    if grant and link.token.grant_hash and hmac.compare_digest(
            hashlib.sha256(grant.encode()).hexdigest(), link.token.grant_hash):
        holder = st.store.get_key(link.token.key_id)
        if holder is not None:
            return "code", holder
    return "none", None


async def _form(request: Request, link: _Link) -> dict[str, str] | None:
    form = await request.form()
    data = {k: str(v) for k, v in form.items() if isinstance(v, str)}
    nonce = request.cookies.get(CSRF_COOKIE) or ""
    expected = _csrf(request, link.token.token_id, nonce) if nonce else ""
    if not expected or not same_text(expected, data.get("csrf_token", "")):
        return None
    return data


async def _posted(request: Request, token: str) -> tuple[_Link, dict[str, str]] | HTMLResponse:
    """The link and the form posted to it, or the page refusing them (a bad link, a stale security token)."""
    link = _open(request, token)
    if isinstance(link, HTMLResponse):
        return link
    data = await _form(request, link)
    if data is None:
        return _refused(request, "Form expired", "The page's security token did not match. Open the link again.", 403)
    return link, data


def _request_state(request: Request, link: _Link, key: ApiKey) -> tuple[Any, str | None, int]:
    """The request if this key may still decide it through this link: (record, refusal, status)."""
    st = server_state(request)
    try:
        rec = st.undolog.approvals.get(link.token.approval_request_id)
    except errors.ApprovalNotFound:
        return None, "The request no longer exists.", 404
    if rec.state.value != "pending":
        return rec, f"The request is {rec.state.value.replace('_', ' ')}: there is nothing left to decide.", 409
    if rec.action_digest != link.token.action_digest:
        return rec, "The request changed since this mail was sent; decide it on the desk.", 409
    if not key.roles & {"approver", "admin"} or not may_see(key, groups_for(st.store.groups(), rec.tool_name,
                                                                           rec.risk_tags)):
        return rec, "Your key is no longer an approver of this request's group.", 403
    return rec, None, 200


@ui.get("/ui/email/{token}")
def confirm_page(request: Request, token: str, sent: int = 0, e: str | None = None) -> HTMLResponse:
    """Show the request to the link's approver; to anyone else, only how to prove it is them. Decides nothing."""
    link = _open(request, token)
    if isinstance(link, HTMLResponse):
        return link
    # Only fixed texts, by code: a crafted link cannot put words of its own on the desk's page.
    left = MAX_CODE_ATTEMPTS - link.token.code_attempts
    error = _ERRORS[e].format(left=left, s="s" if left != 1 else "", max_codes=_max_codes(request)) if e in _ERRORS \
        else None
    who, key = _who(request, link)
    if who == "other":
        return _refused(request, "Not your link", "This link was sent to another approver. Log out of the desk and "
                        "ask for your own, or decide on the desk.", 403, link=link,
                        audit={"why": "other_key", "key_id": key.key_id if key else None})
    if key is None:
        return _page(request, {"link": link, "title": "Confirm it is you", "challenge": True,
                               "code_sent": bool(sent) and link.token.code_nonce is not None, "error": error,
                               "attempts_left": MAX_CODE_ATTEMPTS - link.token.code_attempts,
                               "address": _masked(link.token.address)})
    rec, refusal, status = _request_state(request, link, key)
    if refusal:
        return _refused(request, "Nothing to decide", refusal, status, link=link)
    st = server_state(request)
    session = st.views.session_row(rec.session_id) or {}
    if owns(key, session.get("created_by")):
        return _refused(request, "Not allowed", "Your key created the session that raised this request; someone "
                        "else must decide it.", 403, link=link)
    return _decision_page(request, link, rec, key, error=error)


def _decision_page(request: Request, link: _Link, rec: Any, key: ApiKey, *, error: str | None = None,
                   status: int = 200, submitted: dict[str, str] | None = None,
                   review: list[forms.Change] | None = None, edited_json: str | None = None,
                   modify_reason: str | None = None) -> HTMLResponse:
    """The request, Approve, Reject, and the edit form generated from the tool's schema (with its diff under review)."""
    st = server_state(request)
    form = forms.build(forms.request_schema(st.undolog, rec.tool_name, rec.tool_revision), rec.proposed_args)
    return _page(request, {"link": link, "title": f"Decide: {rec.tool_name}", "a": rec, "key": key, "error": error,
                           "groups": groups_for(st.store.groups(), rec.tool_name, rec.risk_tags), "form": form,
                           "submitted": submitted or {}, "review": review, "edited_json": edited_json,
                           "modify_reason": modify_reason}, status)


def _masked(address: str) -> str:
    local, _, domain = address.partition("@")
    return f"{local[:1]}…@{domain}"


@ui.post("/ui/email/{token}/code")
async def send_code(request: Request, token: str) -> Response:
    """Mail a one-time code to the link's own address (never to one the visitor chooses)."""
    posted = await _posted(request, token)
    if isinstance(posted, HTMLResponse):
        return posted
    link = posted[0]
    st = server_state(request)
    email = st.settings.email
    assert email is not None
    nonce = secrets.token_hex(8)
    ok = email_store(st).start_code(link.token.token_id, nonce, utcnow() + timedelta(seconds=email.code_ttl),
                                                 email.max_codes)
    if not ok:
        return _to_page(token, error="codes")
    return _to_page(token, sent=True)


_ERRORS = {
    "wrong": "That code is wrong or expired ({left} attempt{s} left).",
    "nocode": "No code is waiting: ask for one first ({left} attempt{s} left).",
    "codes": "No more codes for this link (at most {max_codes}). Decide on the desk.",
    "choose": "Choose Approve or Reject.",
    "reason": "A rejection needs a reason.",
}


def _max_codes(request: Request) -> int:
    email = server_state(request).settings.email
    return email.max_codes if email else 0


def _to_page(token: str, *, sent: bool = False, error: str | None = None) -> RedirectResponse:
    query = "?sent=1" if sent else ""
    if error:
        query += ("&" if query else "?") + "e=" + error
    return RedirectResponse(f"/ui/email/{quote(token, safe='')}{query}", status_code=303)


@ui.post("/ui/email/{token}/verify")
async def verify_code(request: Request, token: str) -> Response:
    """Check a code: right, and this browser may see the request; wrong five times, and the link is void."""
    posted = await _posted(request, token)
    if isinstance(posted, HTMLResponse):
        return posted
    link, data = posted
    st = server_state(request)
    store = email_store(st)
    tok = link.token
    code = re.sub(r"\s+", "", data.get("code", ""))
    attempt = store.count_attempt(tok.token_id, MAX_CODE_ATTEMPTS)  # None: the attempts were used up already
    current = tok.code_nonce is not None and tok.code_expires_at is not None and tok.code_expires_at > utcnow()
    right = bool(current and tok.code_nonce and same_text(
        code, code_for(_key_bytes(request) or b"", tok.token_id, tok.code_nonce)))
    if attempt is not None and right:
        grant = secrets.token_urlsafe(32)
        if not store.grant(tok.token_id, hashlib.sha256(grant.encode()).hexdigest()):
            return _refused(request, "Link no longer works", "This link was used or voided meanwhile.", 410, link=link)
        resp = _to_page(token)
        max_age = max(1, int((tok.expires_at - utcnow()).total_seconds()))
        resp.set_cookie(GRANT_COOKIE + tok.token_id, grant, max_age=max_age, httponly=True, samesite="strict",
                        secure=_secure(request, st), path="/ui/email")
        return resp
    left = 0 if attempt is None else MAX_CODE_ATTEMPTS - attempt
    if left <= 0:
        store.void(tok.token_id, "too many wrong codes")
        return _refused(request, "Link void", "Too many wrong codes: this link no longer works. Decide on the desk.",
                        410, link=link, audit={"why": "code_attempts"})
    _record(request, "email_code_wrong", link, {"attempts_left": left})
    return _to_page(token, sent=current, error="wrong" if current else "nocode")


@ui.post("/ui/email/{token}/decide")
async def decide(request: Request, token: str) -> Response:
    """Approve or reject through the link: its approver only, once, while the request is as it was mailed."""
    posted = await _posted(request, token)
    if isinstance(posted, HTMLResponse):
        return posted
    link, data = posted
    who, key = _who(request, link)
    if key is None or who == "other":
        return _refused(request, "Not allowed", "Log in to the desk with the key this link was sent for, or confirm "
                        "with the code sent to its address, first.", 403, link=link, audit={"why": "no_proof"})
    action = data.get("action", "")
    reason = data.get("reason", "").strip() or None
    if action not in ("approve", "reject", "modify"):
        return _to_page(token, error="choose")
    if action == "reject" and not reason:
        return _to_page(token, error="reason")
    rec, refusal, status = _request_state(request, link, key)
    if refusal:
        return _refused(request, "Nothing to decide", refusal, status, link=link, audit={"why": "request_state",
                                                                                           "detail": refusal})
    st = server_state(request)
    session = st.views.session_row(rec.session_id) or {}
    if owns(key, session.get("created_by")):
        try:  # the core's check, which audits the refusal before it raises
            st.undolog.approvals.refuse_own(rec.approval_request_id, key.identity, action, key.principal_ref)
        except errors.SelfDecisionForbidden:
            pass
        return _refused(request, "Not allowed", "Your key created the session that raised this request; someone "
                        "else must decide it.", 403, link=link)
    edited: dict[str, Any] | None = None
    if action == "modify":
        got = _edit(request, link, rec, key, data, reason)
        if isinstance(got, HTMLResponse):
            return got  # the review of the edit, or the edit sent back with its error: nothing decided yet
        edited = got
    store = email_store(st)
    # Spent before deciding: two tabs racing on one link decide once; a crash in between leaves the request pending
    # for the desk (a decision is never replayed from a link).
    if not store.use(link.token.token_id):
        return _refused(request, "Link already used", "This link has been used: a link decides once.", 410, link=link)
    try:
        if action == "approve":
            done = st.undolog.approvals.approve(rec.approval_request_id, approver=key.identity,
                                                principal=key.principal_ref, reason=reason)
        elif action == "modify":
            assert edited is not None
            done = st.undolog.approvals.modify(rec.approval_request_id, approver=key.identity,
                                               principal=key.principal_ref, args=edited, reason=reason)
        else:
            done = st.undolog.approvals.reject(rec.approval_request_id, approver=key.identity,
                                               principal=key.principal_ref, reason=reason or "")
    except errors.ArgumentsInvalid as exc:
        # The core refused the edit and the request is still pending: the link is given back for a corrected edit.
        store.unuse(link.token.token_id)
        return _decision_page(request, link, rec, key, error=exc.message, status=422)
    except errors.UndoLogError as exc:
        return _refused(request, "Not decided", exc.message, 409, link=link)
    return _page(request, {"title": "Decision recorded", "done": done, "action": action})


def _edit(request: Request, link: _Link, rec: Any, key: ApiKey, data: dict[str, str],
          reason: str | None) -> dict[str, Any] | HTMLResponse:
    """The edit's two steps, as on the dashboard: ``review`` turns the form's fields into arguments (checked against
    the tool's schema) and shows their diff; ``confirm`` returns the reviewed arguments to decide with."""
    st = server_state(request)
    if data.get("step") == "confirm":
        text = data.get("args_json", "")
        # The same door as the API's body (NUL, nesting, lone surrogates, NaN) before it is parsed.
        refused = body_problem(text.encode("utf-8", "surrogatepass"), "application/json")
        try:
            args = json.loads(text) if refused is None else None
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return _decision_page(request, link, rec, key, status=422,
                                  error="The reviewed arguments did not come back as a JSON object; edit again.")
        return args
    submitted = {k: v for k, v in data.items() if k not in ("csrf_token", "step", "reason", "action")}
    for value in submitted.values():
        refused = body_problem(json.dumps(value).encode("utf-8", "surrogatepass"), "application/json")
        if refused is not None:
            return _decision_page(request, link, rec, key, status=422, submitted=submitted, modify_reason=reason,
                                  error=refused[1].replace("the JSON body", "the arguments"))
    schema = forms.request_schema(st.undolog, rec.tool_name, rec.tool_revision)
    try:
        parsed = forms.parse(schema, submitted, original=rec.proposed_args)
    except forms.FormInvalid as exc:
        return _decision_page(request, link, rec, key, status=422, submitted=submitted, modify_reason=reason,
                              error=exc.message)
    return _decision_page(request, link, rec, key, submitted=submitted, modify_reason=reason,
                          review=forms.diff(rec.proposed_args, parsed),
                          edited_json=json.dumps(parsed, sort_keys=True, ensure_ascii=False))
