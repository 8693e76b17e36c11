"""Approvals by email: a mail per approver through the desk's mail outbox, and a confirmation page its link opens.

The flow:

1. The core writes ``approval.requested`` to its outbox; the webhook fan-out hands it to :func:`queue_fanout`,
   which queues one *fan-out* row in the same transaction (at least once, never lost).
2. The mail loop (:class:`EmailSender`) expands a fan-out into one link token and one mail per approver address
   that may decide the request (admin-mapped addresses of keys in the request's approver groups, never the key
   that raised it), and sends the mails over SMTP with retries.
3. The link opens ``/ui/email/<token>``. A GET decides nothing and sends nothing (mail scanners follow links).
   The request is shown only to the key the link was sent for: logged in to the desk, or after a one-time code
   mailed to the same address (5 wrong codes void the link). A POST from that page decides, once, through the
   core's :class:`~undolog_core.ApprovalService` (self-decision and group checks as everywhere).

Link tokens are ``<payload>.<HMAC-SHA256>``, signed with a key kept outside the database
(``token_key_file`` or ``UNDOLOG_EMAIL_TOKEN_KEY``), bound to (request, key, action digest), expiring with the
request and spent by their one decision. Replies to the mail are not read.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
import os
import random
import re
import secrets
import smtplib
import ssl
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.message import EmailMessage
from email.utils import make_msgid
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from fastapi import APIRouter, Depends, FastAPI, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from undolog_core import errors
from undolog_core.records import OutboxEvent

from . import forms
from .auth import AuthFirstRoute, require, server_state
from .dashboard import CSRF_COOKIE, SESSION_COOKIE, templates
from .guard import body_problem
from .identity import ApiKey, owns
from .problems import Problem
from .storage import utcnow
from .storage.email import EmailStore, EmailToken
from .views import groups_for, may_see

if TYPE_CHECKING:
    from .state import EmailSettings, ServerState

__all__ = [
    "MAX_CODE_ATTEMPTS",
    "TOKEN_KEY_ENV",
    "EmailSender",
    "code_for",
    "install",
    "load_token_key",
    "queue_fanout",
    "read_token",
    "sign_token",
]

log = logging.getLogger("undolog.server.email")

#: The environment variable holding the link-signing key when no ``token_key_file`` is configured.
TOKEN_KEY_ENV = "UNDOLOG_EMAIL_TOKEN_KEY"
#: Wrong codes a link survives; the next makes it void for good.
MAX_CODE_ATTEMPTS = 5
#: The shortest signing key accepted (bytes).
MIN_KEY_BYTES = 32
#: Cookie (one per link) naming the browser a correct code was entered in.
GRANT_COOKIE = "undolog_email_grant_"
#: What the admin API takes for an address (deliberately plain: one mailbox, no display name, no list).
ADDRESS_PATTERN = r"^[^@\s<>\",;]{1,64}@[A-Za-z0-9.-]{1,253}\.[A-Za-z0-9-]{2,63}$"
_ADDRESS = re.compile(ADDRESS_PATTERN)


# ---------------------------------------------------------------------------------------- keys and tokens


def load_token_key(settings: EmailSettings) -> bytes:
    """Read the key that signs the links: ``token_key_file`` if set, else ``UNDOLOG_EMAIL_TOKEN_KEY``.

    Raises:
        ValueError: No key, or one shorter than 32 bytes; the message says where to put one.

    Example:
        >>> os.environ["UNDOLOG_EMAIL_TOKEN_KEY"] = secrets.token_hex(32)
        >>> len(load_token_key(EmailSettings(smtp_host="localhost", sender="desk@example.com"))) >= 32
        True
    """
    if settings.token_key_file:
        path = Path(settings.token_key_file)
        try:
            raw = path.read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the email token key file {path}: {exc.strerror}; create it with "
                             f"`python -c 'import secrets; print(secrets.token_hex(32))' > {path}`") from None
    else:
        raw = os.environ.get(TOKEN_KEY_ENV, "").strip().encode()
    if len(raw) < MIN_KEY_BYTES:
        raise ValueError(
            f"email approvals need a link-signing key of at least {MIN_KEY_BYTES} bytes, kept outside the database: "
            f"set {TOKEN_KEY_ENV} or --email-token-key-file (e.g. `python -c 'import secrets; "
            "print(secrets.token_hex(32))'`)")
    return raw


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _mac(key: bytes, purpose: str, data: str) -> bytes:
    return hmac.new(key, f"undolog-email:{purpose}:{data}".encode(), hashlib.sha256).digest()


def sign_token(key: bytes, *, token_id: str, approval_request_id: str, key_id: str, action_digest: str,
               expires_at: datetime) -> str:
    """The link token: the binding in clear (it is no secret) and its HMAC under the link-signing key.

    Example:
        >>> t = sign_token(b"k" * 32, token_id="t1", approval_request_id="r1", key_id="ab12", action_digest="d",
        ...                expires_at=utcnow())
        >>> read_token(b"k" * 32, t)["r"]
        'r1'
    """
    payload = _b64(json.dumps({"t": token_id, "r": approval_request_id, "k": key_id, "d": action_digest,
                               "e": int(expires_at.timestamp())}, separators=(",", ":")).encode())
    return f"{payload}.{_b64(_mac(key, 'link', payload))}"


def read_token(key: bytes, token: str) -> dict[str, Any] | None:
    """The binding of a token whose signature holds, else None (nothing of a forged token is believed).

    Example:
        >>> read_token(b"k" * 32, "forged.token") is None
        True
    """
    if not token or len(token) > 1000 or token.count(".") != 1:
        return None
    payload, sig = token.split(".")
    try:
        if not hmac.compare_digest(_unb64(sig), _mac(key, "link", payload)):
            return None
        data = json.loads(_unb64(payload))
    except (ValueError, TypeError):
        return None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), str) for k in "trkd"):
        return None
    if not isinstance(data.get("e"), int):
        return None
    return data


def code_for(key: bytes, token_id: str, nonce: str) -> str:
    """The six-digit one-time code of a link's current nonce: derived from the key outside the database, so the
    database never holds a usable code.

    Example:
        >>> len(code_for(b"k" * 32, "t1", "n1"))
        6
    """
    return f"{int.from_bytes(_mac(key, 'code', f'{token_id}:{nonce}')[:8], 'big') % 1_000_000:06d}"


# ---------------------------------------------------------------------------------------- outbox feed


def queue_fanout(state: ServerState, conn: Any, event: OutboxEvent) -> None:
    """Outbox consumer: queue a request's mails in the claiming transaction (so the event is never lost).

    Registered among the webhook dispatcher's ``consumers`` by :func:`install` when email is configured.
    """
    if event.event_type != "approval.requested":
        return
    rid = event.payload.get("approval_request_id")
    if isinstance(rid, str) and rid:
        _email_store(state).queue_in(conn, "fanout", f"fanout:{rid}", rid)


# ---------------------------------------------------------------------------------------- sending


def _header_text(value: Any, limit: int = 200) -> str:
    """A header-safe one-line text (no CR/LF: a tool name or reason cannot add headers)."""
    return re.sub(r"[\x00-\x1f\x7f]+", " ", str(value))[:limit]


def _email_store(state: Any) -> EmailStore:
    """The email tables, on the desk store's handle: they live on the core's store (one pool, one migration run)."""
    return EmailStore(state.store.core)


class EmailSender:
    """Sends due mail from the desk's mail outbox over SMTP, with retries and backoff; expands fan-outs first.

    Args:
        state: The server state (its settings carry :class:`~undolog_server.state.EmailSettings`).
        key: The link-signing key (:func:`load_token_key`).

    Example:
        >>> sender = EmailSender(state, load_token_key(state.settings.email))
        >>> sender.send_due()   # one pass: what the background loop does every ``email_interval``
        2
    """

    def __init__(self, state: ServerState, key: bytes) -> None:
        assert state.settings.email is not None and state.settings.public_url
        self.state = state
        self.settings: EmailSettings = state.settings.email
        self.key = key
        self.store = _email_store(state)

    def link(self, token: str) -> str:
        """The confirmation page's address for a token, built from ``public_url``."""
        return f"{(self.state.settings.public_url or '').rstrip('/')}/ui/email/{quote(token, safe='')}"

    def send_due(self, limit: int = 20) -> int:
        """Claim due messages and handle each (expand a fan-out, or send a mail); returns how many were handled."""
        lease = time.time() + self.settings.timeout * 6 + 10
        rows = self.store.claim_due(limit, lease)
        for row in rows:
            attempts = int(row["attempts"]) + 1
            try:
                if row["kind"] == "fanout":
                    self._expand(row)
                    continue
                msg = self._message(row)
                if msg is None:
                    self.store.record(row["message_id"], attempts=attempts - 1, status="dropped")
                    continue
                self._smtp(msg)
                self.store.record(row["message_id"], attempts=attempts, status="sent")
            except Exception as exc:  # noqa: BLE001 - one bad message must not stop the others
                self._retry(row["message_id"], attempts, exc)
        return len(rows)

    def _retry(self, message_id: str, attempts: int, exc: BaseException) -> None:
        s = self.settings
        # Generic text in the outbox (no SMTP conversation); the details go to the server log.
        error = f"{type(exc).__name__}"
        log.info("email message %s not sent (attempt %d): %s: %s", message_id, attempts, type(exc).__name__, exc)
        try:
            if attempts >= s.max_attempts:
                self.store.record(message_id, attempts=attempts, status="failed", error=error)
            else:
                delay = min(s.backoff_base * 2 ** (attempts - 1), s.backoff_max)
                self.store.record(message_id, attempts=attempts, error=error,
                                  next_attempt_at=time.time() + delay * random.uniform(0.8, 1.2))
        except Exception:
            # The lease runs out and the message is tried again: at least once, never lost.
            log.exception("could not record email message %s; it is retried after its lease", message_id)

    def _expand(self, row: dict[str, Any]) -> None:
        """One link token and one queued mail per address that may decide the request."""
        st = self.state
        rid = row["approval_request_id"]
        try:
            rec = st.undolog.approvals.get(rid)
        except errors.ApprovalNotFound:
            self.store.record(row["message_id"], attempts=1, status="dropped")
            return
        if rec.state.value != "pending":
            self.store.record(row["message_id"], attempts=1, status="dropped")
            return
        owner = (st.views.session_row(rec.session_id) or {}).get("created_by")
        groups = groups_for(st.store.groups(), rec.tool_name, rec.risk_tags)
        keys = [k for k in st.store.list_keys()
                if k.revoked_at is None and may_see(k, groups) and not owns(k, owner)]
        addresses = self.store.addresses_of([k.key_id for k in keys])
        tokens = [
            {"token_id": uuid.uuid4().hex, "approval_request_id": rid, "key_id": k.key_id, "address": address,
             "action_digest": rec.action_digest, "expires_at": rec.timeout_at}
            for k in keys for address in addresses.get(k.key_id, ())
        ]
        self.store.expand(row["message_id"], rid, tokens)

    def _message(self, row: dict[str, Any]) -> EmailMessage | None:
        """Build a mail at send time (the link is signed now, with the key outside the database); None: drop it."""
        tok = self.store.token(row["token_id"]) if row["token_id"] else None
        if tok is None or tok.used_at is not None or tok.void_at is not None:
            return None
        st = self.state
        try:
            rec = st.undolog.approvals.get(tok.approval_request_id)
        except errors.ApprovalNotFound:
            return None
        if rec.state.value != "pending":
            return None  # nothing left to decide: no mail about it
        token = sign_token(self.key, token_id=tok.token_id, approval_request_id=tok.approval_request_id,
                           key_id=tok.key_id, action_digest=tok.action_digest, expires_at=tok.expires_at)
        msg = EmailMessage()
        msg["From"] = self.settings.sender
        msg["To"] = tok.address
        msg["Message-ID"] = make_msgid(domain=self.settings.sender.rsplit("@", 1)[-1])
        # Auto-replies stay away; replies are not read anyway.
        msg["Auto-Submitted"] = "auto-generated"
        if row["kind"] == "code":
            nonce = str(row["dedupe"]).rsplit(":", 1)[-1]
            if tok.code_nonce != nonce:
                return None  # a newer code replaced this one
            msg["Subject"] = f"UndoLog code for approval request {_header_text(rec.approval_request_id)}"
            minutes = max(1, int(self.settings.code_ttl // 60))
            msg.set_content(
                f"Your one-time code: {code_for(self.key, tok.token_id, nonce)}\n\n"
                f"Enter it on the page that asked for it, within {minutes} minutes.\n"
                "If you did not ask for a code, someone else opened the link sent to you: do not pass the code on.\n"
            )
            return msg
        groups = groups_for(st.store.groups(), rec.tool_name, rec.risk_tags)
        include = self._include_arguments(groups)
        lines = [
            f"An agent asks to run {rec.tool_name}; it waits for a person's decision.",
            "",
            f"Request:  {rec.approval_request_id}",
            f"Reason:   {rec.reason or '-'}",
            f"Risk:     {', '.join(rec.risk_tags) or '-'}",
            f"Deadline: {rec.timeout_at.strftime('%Y-%m-%d %H:%M:%S')} UTC",
        ]
        if include:
            lines += ["", "Arguments:", json.dumps(rec.proposed_args, indent=2, sort_keys=True, ensure_ascii=False)]
        else:
            lines += ["", "The arguments are shown on the desk only (this approver group's mail carries none)."]
        lines += [
            "",
            "Review and decide:",
            self.link(token),
            "",
            "Opening the link decides nothing: the page shows the request after you log in to the desk or enter a "
            "code sent to this address, and only its Approve or Reject button decides. The link works once and "
            "expires with the request. Replies to this mail are not read.",
        ]
        msg["Subject"] = f"Approval needed: {_header_text(rec.tool_name, 100)} ({_header_text(rec.approval_request_id)})"
        msg.set_content("\n".join(lines) + "\n")
        return msg

    def _include_arguments(self, groups: Sequence[str]) -> bool:
        """Arguments go in the mail only when every group the request is routed to allows it ("*": no group)."""
        allowed = self.store.group_settings()
        return all(allowed.get(g, False) for g in groups) if groups else allowed.get("*", False)

    def _smtp(self, msg: EmailMessage) -> None:
        """One SMTP delivery, TLS as configured; the password is read from the environment now."""
        s = self.settings
        context = ssl.create_default_context(cafile=s.ca_file)
        client: smtplib.SMTP
        if s.security == "tls":
            client = smtplib.SMTP_SSL(s.smtp_host, s.smtp_port, timeout=s.timeout, context=context)
        else:
            client = smtplib.SMTP(s.smtp_host, s.smtp_port, timeout=s.timeout)
        with client:
            client.ehlo()
            if s.security == "starttls":
                client.starttls(context=context)  # raises when the server does not offer it: never plain text
                client.ehlo()
            if s.username:
                password = os.environ.get(s.password_env)
                if password is None:
                    raise smtplib.SMTPAuthenticationError(0, f"{s.password_env} is not set".encode())
                client.login(s.username, password)
            client.send_message(msg)

    async def loop(self, stop: asyncio.Event) -> None:
        """Send due mail every ``email_interval`` until ``stop`` is set (the desk's background loop)."""
        interval = self.state.settings.email_interval
        while not stop.is_set():
            handled = 0
            try:
                handled = await asyncio.to_thread(self.send_due)
            except Exception:
                log.exception("email pass failed; retrying")
            if not handled:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=interval)
                except TimeoutError:
                    pass


# ---------------------------------------------------------------------------------------- admin API


api = APIRouter(prefix="/v1/email", route_class=AuthFirstRoute, tags=["admin"])
ADMIN = require("admin")


class AddressIn(BaseModel):
    """Which key an approver address stands for."""

    model_config = ConfigDict(extra="forbid")
    key_id: str = Field(min_length=1, max_length=32, description="The approver's API key id.")


class AddressOut(BaseModel):
    """An approver address and its key."""

    address: str
    key_id: str
    created_at: datetime
    created_by: str | None


class GroupMailIn(BaseModel):
    """What the mails of an approver group's requests carry."""

    model_config = ConfigDict(extra="forbid")
    include_arguments: StrictBool = Field(description="Put the call's arguments in the mail (else a link only).")


class GroupMailOut(GroupMailIn):
    """An approver group's mail setting ('*': requests routed to no group)."""

    group: str


class MessageOut(BaseModel):
    """One row of the mail outbox (never its content)."""

    message_id: str
    kind: str
    approval_request_id: str
    status: str
    attempts: int
    last_error: str | None
    created_at: datetime
    sent_at: datetime | None


_ADDRESS_PARAM = PathParam(max_length=320, pattern=ADDRESS_PATTERN, description="The approver's address.")


def _estore(request: Request) -> EmailStore:
    return _email_store(server_state(request))


def _address(address: str) -> str:
    address = address.strip().lower()
    if not _ADDRESS.match(address):
        raise Problem(422, "invalid_email_address",
                      f"{address!r} is not an email address; send one like ana@example.com")
    return address


@api.get("/approvers", response_model=list[AddressOut], summary="List approver email addresses")
def list_addresses(request: Request, key: ApiKey = Depends(ADMIN)) -> list[AddressOut]:
    return [AddressOut.model_validate(r) for r in _estore(request).addresses()]


@api.put("/approvers/{address}", response_model=AddressOut, summary="Map an email address to an approver key")
def put_address(request: Request, body: AddressIn, address: str = _ADDRESS_PARAM,
                key: ApiKey = Depends(ADMIN)) -> AddressOut:
    address = _address(address)
    st = server_state(request)
    target = st.store.get_key(body.key_id)
    if target is None:
        raise Problem(409, "key_not_found", f"no active key {body.key_id!r}; create it first (POST /v1/keys)")
    if not target.roles & {"approver", "admin"}:
        raise Problem(409, "key_not_approver",
                      f"key {body.key_id!r} has neither the approver nor the admin role; only approvers get mail")
    store = _estore(request)
    before = store.map_address(address, body.key_id, actor=key.identity)
    st.undolog.record_audit(subject=f"email:{address}", action="email_address_mapped", actor=key.identity,
                            payload={"key_id": body.key_id, "previous_key_id": before})
    return next(AddressOut.model_validate(r) for r in store.addresses() if r["address"] == address)


@api.delete("/approvers/{address}", status_code=204, summary="Remove an approver email address")
def delete_address(request: Request, address: str = _ADDRESS_PARAM, key: ApiKey = Depends(ADMIN)) -> Response:
    address = address.strip().lower()
    before = _estore(request).unmap_address(address)
    if before is None:
        raise Problem(404, "email_address_not_found", f"no approver address {address!r}")
    server_state(request).undolog.record_audit(subject=f"email:{address}", action="email_address_unmapped",
                                               actor=key.identity, payload={"key_id": before})
    return Response(status_code=204)


@api.get("/groups", response_model=list[GroupMailOut], summary="List what each group's mails carry")
def list_group_settings(request: Request, key: ApiKey = Depends(ADMIN)) -> list[GroupMailOut]:
    return [GroupMailOut(group=g, include_arguments=v) for g, v in sorted(_estore(request).group_settings().items())]


@api.put("/groups/{group}", response_model=GroupMailOut, summary="Set whether a group's mails carry the arguments")
def put_group_setting(request: Request, body: GroupMailIn,
                      group: str = PathParam(min_length=1, max_length=100, description="A group's name; '*': no group."),
                      key: ApiKey = Depends(ADMIN)) -> GroupMailOut:
    _estore(request).put_group_setting(group, body.include_arguments)
    server_state(request).undolog.record_audit(subject=f"email-group:{group}", action="email_group_set",
                                               actor=key.identity, payload={"include_arguments": body.include_arguments})
    return GroupMailOut(group=group, include_arguments=body.include_arguments)


@api.get("/messages", response_model=list[MessageOut], summary="The mail outbox (status only)")
def list_messages(request: Request, approval_request_id: str | None = Query(None, max_length=64),
                  key: ApiKey = Depends(ADMIN)) -> list[MessageOut]:
    return [MessageOut.model_validate(r) for r in _estore(request).messages(approval_request_id)]


# ---------------------------------------------------------------------------------------- confirmation page


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
    tok = _email_store(st).token(data["t"]) if data else None
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
    if not expected or not hmac.compare_digest(expected, data.get("csrf_token", "")):
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
    ok = _email_store(st).start_code(link.token.token_id, nonce, utcnow() + timedelta(seconds=email.code_ttl),
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
    store = _email_store(st)
    tok = link.token
    code = re.sub(r"\s+", "", data.get("code", ""))
    attempt = store.count_attempt(tok.token_id, MAX_CODE_ATTEMPTS)  # None: the attempts were used up already
    current = tok.code_nonce is not None and tok.code_expires_at is not None and tok.code_expires_at > utcnow()
    right = bool(current and tok.code_nonce and hmac.compare_digest(
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
    store = _email_store(st)
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


# ---------------------------------------------------------------------------------------- wiring


def install(app: FastAPI) -> None:
    """Mount the admin API (always) and, when email is configured, the confirmation page, the outbox consumer and
    the mail loop."""
    app.include_router(api)
    app.include_router(ui)
    st: ServerState = app.state.undolog_server
    if st.settings.email is None:
        return
    try:
        key = load_token_key(st.settings.email)
    except ValueError as exc:
        raise errors.ConfigurationError(str(exc)) from None
    app.state.email_token_key = key
    sender = EmailSender(st, key)
    app.state.email_sender = sender
    # Runs inside the webhook fan-out's claiming transaction: the request's mail is queued with the claim.
    app.state.sweeper.webhooks.consumers.append(lambda: lambda conn, event: queue_fanout(st, conn, event))
    st.background_loops.append(sender.loop)
