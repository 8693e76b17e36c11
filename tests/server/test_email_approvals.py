"""Approvals by email (issue 37): a real SMTP server on loopback (aiosmtpd), the delivered mail read and its link
followed, by HTTP and in a real browser (Chromium via Playwright).

What must hold: a GET decides nothing (mail scanners follow links); the confirmation decides once; a reused link,
an expired one, and a forwarded one opened by someone without the login or the code are refused; five wrong codes
void the link; a mail queued while the SMTP server is down is sent once it is back.
"""

from __future__ import annotations

import email
import email.policy
import re
import secrets
import socket
import ssl
import string
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from email.message import EmailMessage
from typing import Any

import httpx
import pytest
from aiosmtpd.controller import Controller

from undolog_core import ApprovalPending
from undolog_server import create_app
from undolog_server.email_approvals import MAX_CODE_ATTEMPTS, TOKEN_KEY_ENV, sign_token
from undolog_server.state import EmailSettings, ServerSettings
from undolog_server.storage import ApiKey, ServerStore
from undolog_server.storage.email import EmailStore

from ..support import demo_app
from .conftest import LiveServer

# Both databases: the links, codes and the mail outbox are rows.
# SQLite run only (reads_store), but for the tests marked storage: those run the desk's mail outbox SQL that
# differs by database (the claim's SKIP LOCKED, the link's use-once update).
pytestmark = pytest.mark.reads_store

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
SECRET_ARG = "u-secret-4242"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Inbox:
    """An aiosmtpd handler keeping every delivered message, parsed."""

    def __init__(self) -> None:
        self.messages: list[EmailMessage] = []
        self.lock = threading.Lock()

    async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:  # noqa: N802 - aiosmtpd's name
        msg = email.message_from_bytes(envelope.content, policy=email.policy.default)
        with self.lock:
            self.messages.append(msg)  # type: ignore[arg-type]
        return "250 OK"

    def to(self, address: str) -> list[EmailMessage]:
        with self.lock:
            return [m for m in self.messages if m["To"] == address]


class Smtp:
    """A real SMTP server on a loopback port, which can be started late (the server-down test)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.inbox = Inbox()
        self.controller: Controller | None = None

    def start(self) -> Smtp:
        self.controller = Controller(self.inbox, hostname="127.0.0.1", port=self.port)
        self.controller.start()
        return self

    def stop(self) -> None:
        if self.controller is not None:
            self.controller.stop()
            self.controller = None


@dataclass
class MailDesk:
    """A running desk sending approval mail to :attr:`smtp`."""

    undolog: Any
    app: Any
    server: LiveServer
    smtp: Smtp
    keys: dict[str, tuple[ApiKey, str]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def estore(self) -> EmailStore:
        return EmailStore(self.undolog.store)

    def key(self, name: str) -> ApiKey:
        return self.keys[name][0]

    def admin(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.keys['admin'][1]}"}, timeout=30)

    def pump(self) -> None:
        """What the background loops do: fan the core's outbox out, then send every due mail."""
        self.app.state.sweeper.tick()
        sender = self.app.state.email_sender
        for _ in range(10):
            if not sender.send_due():
                return

    def pending(self, owner: str = "agent", tool: str = "delete_user_account", **args: Any) -> str:
        s = self.undolog.session(agent_id="bot", created_by=self.key(owner).principal_ref)
        with s:
            try:
                s.call_sync(tool, call_id="c-1", **(args or {"user_id": SECRET_ARG}))
            except ApprovalPending as p:
                return p.approval_request_id
        raise AssertionError("expected an approval request")

    def link(self, address: str, n: int = -1) -> str:
        mails = [m for m in self.smtp.inbox.to(address) if m["Subject"].strip().startswith("Approval needed")]
        assert mails, f"no approval mail to {address}: {[(m['To'], m['Subject']) for m in self.smtp.inbox.messages]}"
        body = mails[n].get_content()
        m = re.search(re.escape(self.url) + r"/ui/email/[A-Za-z0-9_.%-]+", body)
        assert m, body
        return m.group(0)

    def code(self, address: str) -> str:
        mails = [m for m in self.smtp.inbox.to(address) if m["Subject"].strip().startswith("UndoLog code")]
        assert mails, f"no code mail to {address}"
        m = re.search(r"code: (\d{6})", mails[-1].get_content())
        assert m
        return m.group(1)


def _make(db: Any, smtp: Smtp, monkeypatch: pytest.MonkeyPatch, **email_kw: Any) -> MailDesk:
    monkeypatch.setenv(TOKEN_KEY_ENV, secrets.token_hex(32))
    undolog = db.open()
    demo_app.register(undolog)
    settings = ServerSettings(
        background=False, public_url="http://placeholder.invalid",
        email=EmailSettings(**{"smtp_host": "127.0.0.1", "smtp_port": smtp.port, "security": "none",
                               "sender": "desk@example.com", "timeout": 5.0, **email_kw}),
    )
    app = create_app(undolog, settings=settings)
    server = LiveServer(app)
    # The link must name the address the desk really listens on, known once its socket is bound.
    app.state.undolog_server.settings.public_url = server.url
    server.start()
    desk = MailDesk(undolog, app, server, smtp)
    store = ServerStore(undolog.store)
    desk.keys["admin"] = store.create_key("admin", ["admin"])
    desk.keys["ana"] = store.create_key("ana", ["approver"])
    desk.keys["bob"] = store.create_key("bob", ["approver"])
    desk.keys["agent"] = store.create_key("agent", ["agent"])
    # A key that raises requests and approves others': never mailed a link to its own request.
    desk.keys["both"] = store.create_key("both", ["agent", "approver"])
    with desk.admin() as c:
        for who in ("ana", "bob", "both"):
            r = c.put(f"/v1/email/approvers/{who}@example.com", json={"key_id": desk.key(who).key_id})
            assert r.status_code == 200, r.text
    return desk


@pytest.fixture
def smtp() -> Iterator[Smtp]:
    s = Smtp(_free_port()).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def mdesk(db: Any, smtp: Smtp, monkeypatch: pytest.MonkeyPatch) -> Iterator[MailDesk]:
    d = _make(db, smtp, monkeypatch)
    try:
        yield d
    finally:
        d.server.stop()
        d.undolog.close()


def _audit(desk: MailDesk) -> list[dict[str, Any]]:
    """The audit trail's events (the hash chain every decision is on), oldest first."""
    import json

    import sqlalchemy as sa

    with desk.undolog.store.engine.connect() as conn:
        table = sa.Table("undolog_approval_events", sa.MetaData(), autoload_with=conn, schema=desk.undolog.store.schema)
        rows = conn.execute(sa.select(table).order_by(table.c.event_id)).mappings().all()
    return [dict(r) | {"payload": json.loads(r["payload"]) if isinstance(r["payload"], str) else r["payload"]}
            for r in rows]


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert m, html[:800]
    return m.group(1)


def _browser_like(desk: MailDesk) -> httpx.Client:
    return httpx.Client(base_url=desk.url, follow_redirects=False, timeout=30)


def _confirm_by_code(desk: MailDesk, c: httpx.Client, link: str, address: str) -> None:
    page = c.get(link)
    r = c.post(link + "/code", data={"csrf_token": _csrf(page.text)})
    assert r.status_code == 303, r.text
    desk.pump()
    page = c.get(link)
    r = c.post(link + "/verify", data={"csrf_token": _csrf(page.text), "code": desk.code(address)})
    assert r.status_code == 303 and "e=" not in r.headers["location"], r.headers


def test_email_without_a_signing_key_refuses_to_start_and_says_where_to_put_one(
        db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from undolog_core import errors

    monkeypatch.delenv(TOKEN_KEY_ENV, raising=False)
    undolog = db.open()
    settings = ServerSettings(background=False, public_url="https://desk.example.com",
                              email=EmailSettings(smtp_host="127.0.0.1", sender="desk@example.com"))
    with pytest.raises(errors.ConfigurationError, match=TOKEN_KEY_ENV):
        create_app(undolog, settings=settings)
    with pytest.raises(ValueError, match="--public-url"):
        ServerSettings(email=EmailSettings(smtp_host="127.0.0.1", sender="desk@example.com"))


def test_a_decision_through_the_link_has_the_decisions_lane() -> None:
    from undolog_server.lanes import is_decision

    assert is_decision("POST", "/ui/email/abc.def/decide")
    assert not is_decision("GET", "/ui/email/abc.def") and not is_decision("POST", "/ui/email/abc.def/code")


# ---------------------------------------------------------------------------------------- the mail


@pytest.mark.storage
def test_a_request_mails_each_approver_who_may_decide_it_a_link_and_no_arguments_by_default(mdesk: MailDesk) -> None:
    rid = mdesk.pending(owner="both")
    mdesk.pump()
    ana = mdesk.smtp.inbox.to("ana@example.com")
    assert len(ana) == 1 and ana[0]["From"] == "desk@example.com" and rid in ana[0]["Subject"]
    body = ana[0].get_content()
    assert SECRET_ARG not in body and "Arguments:" not in body, body
    assert "Replies to this mail are not read" in body
    assert mdesk.link("ana@example.com").startswith(mdesk.url + "/ui/email/")
    assert mdesk.link("bob@example.com") != mdesk.link("ana@example.com")  # one link per approver
    # The key that raised the request gets no link to it (it could not decide it anyway).
    assert mdesk.smtp.inbox.to("both@example.com") == []
    # A fan-out run again (another server, a retry) sends nothing twice.
    mdesk.pump()
    assert len(mdesk.smtp.inbox.to("ana@example.com")) == 1

    # The group setting lets the arguments into the mail; every change is audited with who made it.
    with mdesk.admin() as c:
        assert c.put("/v1/email/groups/*", json={"include_arguments": True}).status_code == 200
        rid2 = mdesk.pending()
        mdesk.pump()
        assert SECRET_ARG in mdesk.smtp.inbox.to("ana@example.com")[-1].get_content()
        actions = [(a["action"], a["subject"], a["actor"]) for a in _audit(mdesk)]
        assert ("email_group_set", "email-group:*", mdesk.key("admin").identity) in actions
        assert ("email_address_mapped", "email:ana@example.com", mdesk.key("admin").identity) in actions
        assert mdesk.undolog.verify_audit().ok  # on the chain, not beside it
        assert {m["status"] for m in c.get("/v1/email/messages", params={"approval_request_id": rid2}).json()} == {"sent"}


def test_approver_groups_decide_who_is_mailed(mdesk: MailDesk) -> None:
    with mdesk.admin() as c:
        assert c.put("/v1/approver-groups/finance", json={"tools": ["wire_money"], "risk_tags": []}).status_code == 200
        keys = ServerStore(mdesk.undolog.store)
        fin, _ = keys.create_key("fin", ["approver"], ["finance"])
        assert c.put("/v1/email/approvers/Fin@Example.com", json={"key_id": fin.key_id}).status_code == 200
    mdesk.pending(tool="wire_money", to="acme", amount=10.0)
    mdesk.pump()
    assert len(mdesk.smtp.inbox.to("fin@example.com")) == 1
    assert mdesk.smtp.inbox.to("ana@example.com") == []


def test_the_admin_api_checks_roles_and_input(mdesk: MailDesk) -> None:
    ana_token = mdesk.keys["ana"][1]
    with httpx.Client(base_url=mdesk.url, headers={"Authorization": f"Bearer {ana_token}"}, timeout=30) as c:
        assert c.get("/v1/email/approvers").status_code == 403
        r = c.put("/v1/email/approvers/x@example.com", json={"key_id": mdesk.key("ana").key_id})
        assert r.status_code == 403
    with mdesk.admin() as c:
        r = c.put("/v1/email/approvers/not-an-address", json={"key_id": mdesk.key("ana").key_id})
        assert r.status_code == 422 and "address" in r.text
        r = c.put("/v1/email/approvers/x@example.com", json={"key_id": mdesk.key("agent").key_id})
        assert r.status_code == 409 and r.json()["code"] == "key_not_approver"
        assert c.delete("/v1/email/approvers/nobody@example.com").status_code == 404
        assert c.delete("/v1/email/approvers/bob@example.com").status_code == 204
        assert "bob@example.com" not in [a["address"] for a in c.get("/v1/email/approvers").json()]
        assert any(a["action"] == "email_address_unmapped" for a in _audit(mdesk))


# ---------------------------------------------------------------------------------------- the link, by HTTP


def test_a_get_decides_nothing_and_sends_nothing(mdesk: MailDesk) -> None:
    rid = mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    # What a mail scanner does: fetch the link (and again, and HEAD it), with no cookie.
    with _browser_like(mdesk) as scanner:
        for _ in range(3):
            r = scanner.get(link)
            assert r.status_code == 200 and SECRET_ARG not in r.text
            assert "Email me a code" in r.text
        scanner.head(link)
    mdesk.pump()
    assert mdesk.undolog.approvals.get(rid).state == "pending"
    assert [m["kind"] for m in mdesk.estore.messages(rid) if m["kind"] == "code"] == []


def test_a_forwarded_link_without_login_or_code_is_refused(mdesk: MailDesk) -> None:
    rid = mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    with _browser_like(mdesk) as stranger:
        page = stranger.get(link)
        assert SECRET_ARG not in page.text
        # The form's CSRF token is the stranger's own: the refusal is for want of proof, not of a token.
        r = stranger.post(link + "/decide", data={"csrf_token": _csrf(page.text), "action": "approve"})
        assert r.status_code == 403 and SECRET_ARG not in r.text
        # Asking for a code sends it to ana's address, never one the stranger names.
        stranger.post(link + "/code", data={"csrf_token": _csrf(page.text), "to": "evil@example.net"})
        mdesk.pump()
        assert mdesk.smtp.inbox.to("evil@example.net") == [] and mdesk.code("ana@example.com")
    # Another approver logged in to the desk is not ana either.
    bob = _browser_like(mdesk)
    login = bob.get("/ui/login")
    bob.post("/ui/login", data={"api_key": mdesk.keys["bob"][1], "csrf_token": _csrf(login.text)})
    r = bob.get(link)
    assert r.status_code == 403 and "another approver" in r.text and SECRET_ARG not in r.text
    assert mdesk.undolog.approvals.get(rid).state == "pending"
    # Refusals are on the request's own events, where the desk shows its history.
    refused = [e.payload.get("why") for e in mdesk.undolog.approvals.events(rid) if e.action == "email_link_refused"]
    assert "no_proof" in refused and "other_key" in refused


def test_the_desk_login_of_the_links_key_shows_the_request_and_the_link_decides_once(mdesk: MailDesk) -> None:
    rid = mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    ana = _browser_like(mdesk)
    login = ana.get("/ui/login")
    ana.post("/ui/login", data={"api_key": mdesk.keys["ana"][1], "csrf_token": _csrf(login.text)})
    page = ana.get(link)
    assert page.status_code == 200 and SECRET_ARG in page.text
    r = ana.post(link + "/decide", data={"csrf_token": _csrf(page.text), "action": "reject", "reason": "not this user"})
    assert r.status_code == 200 and "Decision recorded" in r.text
    rec = mdesk.undolog.approvals.get(rid)
    assert rec.state == "rejected" and rec.decided_by == mdesk.key("ana").identity
    # A reject halts the session, as from every door.
    assert mdesk.undolog.store.sessions.get_session(rec.session_id).state == "halted"
    # The same link again: refused, and nothing is decided twice.
    again = ana.post(link + "/decide", data={"csrf_token": _csrf(page.text), "action": "approve"})
    assert again.status_code == 410
    assert ana.get(link).status_code == 410


@pytest.mark.storage
def test_a_reused_link_is_refused(mdesk: MailDesk) -> None:
    rid = mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    with _browser_like(mdesk) as c:
        _confirm_by_code(mdesk, c, link, "ana@example.com")
        page = c.get(link)
        assert SECRET_ARG in page.text
        token = _csrf(page.text)
        assert c.post(link + "/decide", data={"csrf_token": token, "action": "approve"}).status_code == 200
        r = c.post(link + "/decide", data={"csrf_token": token, "action": "approve"})
        assert r.status_code == 410 and "used" in r.text
    assert mdesk.undolog.approvals.get(rid).state == "approved"
    events = [e.action for e in mdesk.undolog.approvals.events(rid)]
    assert events.count("approve") == 1, events


def test_an_edit_through_the_schema_form_is_reviewed_then_decided_once(mdesk: MailDesk) -> None:
    rid = mdesk.pending(tool="wire_money", to="acme", amount=10.0)
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    with _browser_like(mdesk) as c:
        _confirm_by_code(mdesk, c, link, "ana@example.com")
        page = c.get(link)
        assert 'name="/amount"' in page.text and 'type="number"' in page.text
        token = _csrf(page.text)
        bad = c.post(link + "/decide", data={"csrf_token": token, "action": "modify", "step": "review",
                                             "/to": "acme", "/amount": "a lot"})
        assert bad.status_code == 422 and "amount" in bad.text
        review = c.post(link + "/decide", data={"csrf_token": token, "action": "modify", "step": "review",
                                                "/to": "acme", "/amount": "90", "reason": "cap at 90"})
        assert review.status_code == 200 and 'id="diff"' in review.text
        assert mdesk.undolog.approvals.get(rid).state == "pending"  # a review decides nothing
        m = re.search(r'name="args_json" value="([^"]*)"', review.text)
        assert m
        import html

        done = c.post(link + "/decide", data={"csrf_token": token, "action": "modify", "step": "confirm",
                                              "args_json": html.unescape(m.group(1)), "reason": "cap at 90"})
        assert done.status_code == 200 and "Decision recorded" in done.text
    rec = mdesk.undolog.approvals.get(rid)
    assert rec.state == "approved" and rec.approved_args == {"to": "acme", "amount": 90.0}


def test_a_link_expires_with_its_request(mdesk: MailDesk) -> None:
    rid = mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    with _browser_like(mdesk) as c:
        _confirm_by_code(mdesk, c, link, "ana@example.com")
        page = c.get(link)
        rec = mdesk.undolog.approvals.get(rid)
        mdesk.undolog.approvals.expire_due(now=rec.timeout_at + timedelta(seconds=1))
        r = c.post(link + "/decide", data={"csrf_token": _csrf(page.text), "action": "approve"})
        assert r.status_code == 410 and "timed out" in r.text
        assert c.get(link).status_code == 410
    assert mdesk.undolog.approvals.get(rid).state == "timed_out"


def test_a_forged_or_foreign_link_is_refused(mdesk: MailDesk) -> None:
    mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    payload, sig = link.rsplit("/", 1)[1].split(".")
    alphabet = string.ascii_uppercase + string.ascii_lowercase + string.digits + "-_"
    # A signature one character off (always another one: the first character replaced by its neighbour), and the
    # same signature spelled with its last character's unused low bits set (decoded, the same bytes; failed before:
    # a forgery that changed only those bits, like the old ``sig[:-2] + "AA"`` when the signature ended in "A",
    # passed: 200 where 404 is right).
    changed = alphabet[(alphabet.index(sig[0]) + 1) % 64] + sig[1:]
    respelled = sig[:-1] + alphabet[alphabet.index(sig[-1]) | 1]
    assert respelled != sig and changed != sig
    with _browser_like(mdesk) as c:
        for bad in (changed, respelled):
            assert c.get(f"{mdesk.url}/ui/email/{payload}.{bad}").status_code == 404, bad
        # Signed with another key (a database dump holds no key): the same refusal.
        tok = mdesk.estore.token(next(t for t in [_token_id(link)]))
        assert tok is not None
        forged = sign_token(b"x" * 32, token_id=tok.token_id, approval_request_id=tok.approval_request_id,
                            key_id=tok.key_id, action_digest=tok.action_digest, expires_at=tok.expires_at)
        r = c.get(f"{mdesk.url}/ui/email/{forged}")
        assert r.status_code == 404 and "not one this desk sent" in r.text
    assert any(a["payload"].get("why") == "bad_signature" for a in _audit(mdesk))


def _token_id(link: str) -> str:
    import base64
    import json

    payload = link.rsplit("/", 1)[1].split(".")[0]
    return str(json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))["t"])


def test_five_wrong_codes_void_the_link(mdesk: MailDesk) -> None:
    rid = mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    with _browser_like(mdesk) as c:
        page = c.get(link)
        c.post(link + "/code", data={"csrf_token": _csrf(page.text)})
        mdesk.pump()
        right = mdesk.code("ana@example.com")
        wrong = f"{(int(right) + 1) % 1_000_000:06d}"
        for i in range(MAX_CODE_ATTEMPTS - 1):
            r = c.post(link + "/verify", data={"csrf_token": _csrf(page.text), "code": wrong})
            assert r.status_code == 303 and r.headers["location"].endswith("e=wrong"), (i, r.headers)
            assert f"{MAX_CODE_ATTEMPTS - 1 - i} attempt" in c.get(r.headers["location"]).text
        r = c.post(link + "/verify", data={"csrf_token": _csrf(page.text), "code": wrong})
        assert r.status_code == 410 and "Too many wrong codes" in r.text
        # Void for good: the right code, a new code, the page: all refused.
        assert c.post(link + "/verify", data={"csrf_token": _csrf(page.text), "code": right}).status_code == 410
        assert c.post(link + "/code", data={"csrf_token": _csrf(page.text)}).status_code == 410
        assert c.get(link).status_code == 410
    assert mdesk.undolog.approvals.get(rid).state == "pending"  # the desk can still decide it
    tok = mdesk.estore.token(_token_id(link))
    assert tok is not None and tok.void_at is not None and tok.code_attempts == MAX_CODE_ATTEMPTS


def test_non_ascii_form_values_are_refused_not_a_server_error(mdesk: MailDesk) -> None:
    """A CSRF token or a code with characters outside ASCII (``hmac.compare_digest`` raises ``TypeError`` on such
    text) is refused like any wrong one, and counts as an attempt. Failed before: 500 for both."""
    mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    with _browser_like(mdesk) as c:
        page = c.get(link)
        r = c.post(link + "/code", data={"csrf_token": "\u00e9" * 8})
        assert r.status_code == 403, r.status_code
        c.post(link + "/code", data={"csrf_token": _csrf(page.text)})
        r = c.post(link + "/verify", data={"csrf_token": _csrf(page.text), "code": "\u0661" * 6})
        assert r.status_code == 303 and r.headers["location"].endswith("e=wrong"), (r.status_code, r.headers)
    tok = mdesk.estore.token(_token_id(mdesk.link("ana@example.com")))
    assert tok is not None and tok.code_attempts == 1


# ---------------------------------------------------------------------------------------- the outbox


@pytest.mark.storage
def test_mail_queued_while_the_smtp_server_is_down_is_sent_once_it_is_back(
        db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    down = Smtp(_free_port())  # nothing listens on its port yet
    desk = _make(db, down, monkeypatch, backoff_base=0.5, backoff_max=1.0)
    try:
        rid = desk.pending()
        desk.app.state.sweeper.tick()
        sender = desk.app.state.email_sender
        sender.send_due()  # the fan-out: one mail per approver queued
        sender.send_due()  # their first attempt, refused at the connect
        mails = [m for m in desk.estore.messages(rid) if m["kind"] == "approval"]
        assert mails and all(m["status"] == "pending" and m["attempts"] == 1 and m["last_error"] for m in mails), mails
        down.start()
        for _ in range(200):  # until the backoff is due: the retry, not a timer, is what is checked
            desk.pump()
            if all(m["status"] == "sent" for m in desk.estore.messages(rid) if m["kind"] == "approval"):
                break
            time.sleep(0.05)
        sent = [m for m in desk.estore.messages(rid) if m["kind"] == "approval"]
        assert {m["status"] for m in sent} == {"sent"} and all(m["attempts"] >= 2 for m in sent), sent
        assert len(down.inbox.to("ana@example.com")) == 1  # sent once, not once per attempt
    finally:
        down.stop()
        desk.server.stop()
        desk.undolog.close()


def _ca_and_server_cert(tmp: Any) -> tuple[str, ssl.SSLContext]:
    """A private CA and a certificate it signed for 127.0.0.1: the client checks both, as against a real server."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
          .not_valid_after(now + dt.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "smtp")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    ca_file, cert_file, key_file = tmp / "ca.pem", tmp / "cert.pem", tmp / "key.pem"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(cert_file), str(key_file))
    return str(ca_file), context


def test_starttls_and_login_with_the_password_from_the_environment(
        db: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    from aiosmtpd.smtp import AuthResult, LoginPassword

    ca_file, server_tls = _ca_and_server_cert(tmp_path)
    logins: list[tuple[str, str]] = []

    def authenticator(server: Any, session: Any, envelope: Any, mechanism: str, data: Any) -> AuthResult:
        if isinstance(data, LoginPassword):
            logins.append((data.login.decode(), data.password.decode()))
            return AuthResult(success=(data.login, data.password) == (b"desk", b"s3cret-from-env"))
        return AuthResult(success=False)

    port = _free_port()
    smtp = Smtp(port)
    # The server refuses anything before STARTTLS and any login over plain text.
    smtp.controller = Controller(smtp.inbox, hostname="127.0.0.1", port=port, tls_context=server_tls,
                                 require_starttls=True, auth_require_tls=True, auth_required=True,
                                 authenticator=authenticator)
    smtp.controller.start()
    monkeypatch.setenv("UNDOLOG_SMTP_PASSWORD", "wrong")
    desk = _make(db, smtp, monkeypatch, security="starttls", username="desk", ca_file=ca_file)
    try:
        rid = desk.pending()
        desk.app.state.sweeper.tick()
        sender = desk.app.state.email_sender
        sender.send_due()
        sender.send_due()
        assert smtp.inbox.messages == [] and ("desk", "wrong") in logins  # refused: the mail waits for a retry
        # The password is read at each send: fixing the environment is enough, nothing is stored.
        monkeypatch.setenv("UNDOLOG_SMTP_PASSWORD", "s3cret-from-env")
        from undolog_server.storage.email import email_outbox

        with desk.undolog.store.tx() as conn:  # due now, rather than after the backoff
            conn.execute(email_outbox.update().where(email_outbox.c.status == "pending").values(next_attempt_at=0))
        sender.send_due()
        assert len(smtp.inbox.to("ana@example.com")) == 1, [m["status"] for m in desk.estore.messages(rid)]
        assert ("desk", "s3cret-from-env") in logins
    finally:
        smtp.stop()
        desk.server.stop()
        desk.undolog.close()


# ---------------------------------------------------------------------------------------- in a real browser


@pytest.mark.browser
def test_browser_follows_the_mailed_link_confirms_by_code_and_decides_once(mdesk: MailDesk) -> None:
    from playwright.sync_api import expect, sync_playwright

    rid = mdesk.pending()
    mdesk.pump()
    link = mdesk.link("ana@example.com")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            # Someone the mail was forwarded to: sees how to prove who they are, never the request.
            other = browser.new_context().new_page()
            other.set_default_timeout(15000)
            other.goto(link)
            expect(other.locator("#challenge")).to_be_visible()
            assert SECRET_ARG not in other.content()
            expect(other.locator("#approve")).to_have_count(0)

            page = browser.new_context().new_page()
            page.set_default_timeout(15000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(link)
            assert mdesk.undolog.approvals.get(rid).state == "pending"  # opening decided nothing
            assert SECRET_ARG not in page.content()
            page.click("#send-code")
            expect(page.locator("#code-sent")).to_be_visible()
            mdesk.pump()
            page.fill("#code", "000000" if mdesk.code("ana@example.com") != "000000" else "111111")
            page.click("#verify")
            expect(page.locator("#error")).to_contain_text("4 attempts left")
            page.fill("#code", mdesk.code("ana@example.com"))
            page.click("#verify")
            expect(page.locator("#args")).to_contain_text(SECRET_ARG)
            expect(page.locator("#who")).to_contain_text("ana")
            assert mdesk.undolog.approvals.get(rid).state == "pending"  # seeing it decided nothing either
            page.fill("#approve-reason", "checked by mail")
            page.click("#approve")
            expect(page.locator("#state")).to_have_text("approved")
            expect(page.locator("#decided-by")).to_contain_text("ana")
            # Back to the mail, click again: the link is spent.
            page.goto(link)
            expect(page.locator("#refused h1")).to_have_text("Link already used")
            # The forwarded copy is dead too.
            other.goto(link)
            expect(other.locator("#refused")).to_be_visible()
            assert not errors, errors
        finally:
            browser.close()
    rec = mdesk.undolog.approvals.get(rid)
    assert rec.state == "approved" and rec.decided_by == mdesk.key("ana").identity
    assert rec.decision_reason == "checked by mail"
