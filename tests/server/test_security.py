"""The desk's security findings 8-12 of issue 11, each through a real server on loopback.

Session-id squatting (9), proxy outcomes and contract fingerprints (10), group visibility (8), dashboard sessions
and CSRF (11) and the approved-call lifetime (12).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from undolog_core import CompensationDescriptor, ToolTier, compensation, undolog_tool
from undolog_server import create_app
from undolog_server.proxy import ProxyTools
from undolog_server.state import ServerSettings

from ..support import demo_app
from ..support.upstream import Upstream
from .conftest import Desk, LiveServer, make_desk, problem


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream().start()
    yield u
    u.stop()


def _proxy_desk(db: Any, upstream: Upstream, tmp_path: Path, config: str | None = None) -> Desk:
    cfg = tmp_path / "tools.toml"
    cfg.write_text(config or upstream.config())
    return make_desk(db, proxy_config=str(cfg))


# ---------------------------------------------------------------------------------- 9. session-id squatting


def test_an_agent_key_cannot_pick_a_session_id_an_embedded_app_will_use(desk: Desk) -> None:
    agent = desk.client("agent")
    # Today's main let the agent create "ticket-1042" ahead of the app, then read and roll back the app's calls.
    problem(agent.post("/v1/sessions", json={"agent_id": "bot", "session_id": "ticket-1042"}), 422)
    made = agent.post("/v1/sessions", json={"agent_id": "bot", "label": "ticket-1042"})
    assert made.status_code == 201, made.text
    minted = made.json()["session_id"]
    assert minted != "ticket-1042" and minted.startswith("ticket-1042.") and len(minted) > len("ticket-1042.") + 20
    # The embedded app keeps resuming its own session by id, as today.
    app_session = desk.undolog.session(agent_id="app", session_id="ticket-1042")
    with app_session:
        app_session.call_sync("send_refund_email", user_id="victim", amount=1.0, call_id="m1")
    again = desk.undolog.session(session_id="ticket-1042")
    assert again.id == "ticket-1042"
    # The agent key sees nothing of it and cannot roll it back.
    problem(agent.get("/v1/sessions/ticket-1042"), 404, "session_not_found")
    problem(agent.post("/v1/sessions/ticket-1042:rollback"), 404, "session_not_found")
    assert "ticket-1042" not in {s["session_id"] for s in agent.get("/v1/sessions").json()}
    assert desk.undolog.sessions.get("ticket-1042").state == "active"
    # Its own minted session is its own, and nobody else's agent key's.
    assert agent.get(f"/v1/sessions/{minted}").status_code == 200
    problem(desk.client("agent2").get(f"/v1/sessions/{minted}"), 404, "session_not_found")
    problem(desk.client("agent2").post(f"/v1/sessions/{minted}:rollback"), 404, "session_not_found")


# ---------------------------------------------------------------------------------- 10. proxy outcomes

# The proxy's deadline in these tests. The call it gives up on is held by the upstream until the test lets go (not
# delayed a fixed 1.5 s past a 0.5 s deadline), and every other call to the upstream, the probe's too, must answer
# within it: 0.5 s was tight for an answer on a loaded machine, where a late one read as a timeout.
PROXY_DEADLINE = 2.0


def test_an_upstream_timeout_on_an_approved_irreversible_call_is_unknown_and_halts(
    db: Any, upstream: Upstream, tmp_path: Path
) -> None:
    # No probe: nothing can tell whether the upstream acted.
    config = upstream.config().replace("timeout = 5", f"timeout = {PROXY_DEADLINE}").replace(
        f'probe_url = "{upstream.url}/close/status"\n', "")
    d = _proxy_desk(db, upstream, tmp_path, config)
    held = threading.Event()
    try:
        assert d.undolog.tool_spec("close_account").probe is None
        sid = d.client("agent").post("/v1/sessions", json={"agent_id": "a"}).json()["session_id"]
        url = f"/v1/sessions/{sid}/tools/close_account:invoke"
        first = d.client("agent").post(url, json={"account": "acme"}, headers={"Idempotency-Key": "close-1"})
        assert first.status_code == 202, first.text
        rid = first.json()["approval_request_id"]
        assert d.client("approver").post(f"/v1/approvals/{rid}:approve").status_code == 200
        upstream.hold["/close"] = held  # the upstream does the work, but answers after the proxy gave up
        r = d.client("agent").post(url, json={"account": "acme"}, headers={"Idempotency-Key": "close-1"})
        body = problem(r, 504, "outcome_unknown")
        assert body["effect_id"] == first.json()["effect_id"]
        assert len(upstream.to("/close")) == 1
        effect = d.undolog.sessions.effects(sid)[-1]
        assert effect["state"] == "unknown", effect  # not failed: the upstream may well have closed the account
        session = d.client("admin").get(f"/v1/sessions/{sid}").json()
        assert session["state"] == "halted" and "unknown" in (session["halted_reason"] or "")
        assert upstream.to("/close/cancel") == [] and not any(
            e["undo_state"] == "compensated" for e in session["effects"])
        # Re-issuing never re-sends it blindly.
        problem(d.client("agent").post(url, json={"account": "acme"}, headers={"Idempotency-Key": "close-1"}), 409)
        assert len(upstream.to("/close")) == 1
    finally:
        held.set()
        d.close()
        d.undolog.close()


def test_a_probe_answer_that_is_neither_yes_nor_no_cannot_tell(db: Any, upstream: Upstream, tmp_path: Path) -> None:
    """Only an explicit {"happened": ...} (or a 404) is an answer. Before: any other body was read by its truth
    ({"status": "ok"}: "it happened"), so a lost call was recorded committed on a guess."""
    d = _proxy_desk(db, upstream, tmp_path, upstream.config().replace("timeout = 5", f"timeout = {PROXY_DEADLINE}"))
    held = threading.Event()
    try:
        sid = d.client("agent").post("/v1/sessions", json={"agent_id": "a"}).json()["session_id"]
        url = f"/v1/sessions/{sid}/tools/close_account:invoke"
        first = d.client("agent").post(url, json={"account": "vague"}, headers={"Idempotency-Key": "vague"})
        rid = first.json()["approval_request_id"]
        assert d.client("approver").post(f"/v1/approvals/{rid}:approve").status_code == 200
        upstream.hold["/close"] = held
        lost = d.client("agent").post(url, json={"account": "vague"}, headers={"Idempotency-Key": "vague"})
        problem(lost, 504, "outcome_unknown")
        assert d.undolog.sessions.effects(sid)[-1]["state"] == "unknown"
        assert d.client("admin").get(f"/v1/sessions/{sid}").json()["state"] == "halted"
    finally:
        held.set()
        d.close()
        d.undolog.close()


def test_with_a_probe_a_lost_answer_is_settled_by_asking_the_upstream(
    db: Any, upstream: Upstream, tmp_path: Path
) -> None:
    d = _proxy_desk(db, upstream, tmp_path, upstream.config().replace("timeout = 5", f"timeout = {PROXY_DEADLINE}"))
    held = threading.Event()
    try:
        sid = d.client("agent").post("/v1/sessions", json={"agent_id": "a"}).json()["session_id"]
        url = f"/v1/sessions/{sid}/tools/close_account:invoke"
        for account in ("done", "not-yet"):  # the fake probe says "done" happened, anything else did not
            first = d.client("agent").post(url, json={"account": account}, headers={"Idempotency-Key": account})
            rid = first.json()["approval_request_id"]
            assert d.client("approver").post(f"/v1/approvals/{rid}:approve").status_code == 200
        upstream.hold["/close"] = held  # held past the deadline; the probe (not held) answers
        happened = d.client("agent").post(url, json={"account": "done"}, headers={"Idempotency-Key": "done"})
        assert happened.status_code == 200 and happened.json() == {"closed": True}, happened.text
        assert happened.headers["UndoLog-Replayed"] == "true"
        not_yet = d.client("agent").post(url, json={"account": "not-yet"}, headers={"Idempotency-Key": "not-yet"})
        # The probe says it did not happen, but the held upstream is still working on it: "not yet" is no proof.
        # Before: the approval was put back and the retry below sent it a second time.
        problem(not_yet, 504, "outcome_unknown")
        assert d.undolog.sessions.effects(sid)[-1]["state"] == "unknown"
        assert d.client("admin").get(f"/v1/sessions/{sid}").json()["state"] == "halted"
        upstream.hold.pop("/close")
        held.set()  # the upstream finishes the original request
        again = d.client("agent").post(url, json={"account": "not-yet"}, headers={"Idempotency-Key": "not-yet"})
        problem(again, 409)
        assert [b["account"] for b, _ in upstream.to("/close")] == ["done", "not-yet"]
    finally:
        held.set()
        d.close()
        d.undolog.close()


def test_a_connect_failure_is_still_a_plain_upstream_error(db: Any, upstream: Upstream, tmp_path: Path) -> None:
    # Nothing was sent: failed (and, COMPENSABLE, rolled back per policy) as before.
    d = _proxy_desk(db, upstream, tmp_path, upstream.config().replace(f'url = "{upstream.url}/refund"',
                                                                      'url = "http://127.0.0.1:9/refund"'))
    try:
        sid = d.client("agent").post("/v1/sessions", json={"agent_id": "a"}).json()["session_id"]
        r = d.client("agent").post(f"/v1/sessions/{sid}/tools/refund:invoke", json={"order_id": "o", "amount": 1},
                                   headers={"Idempotency-Key": "r-1"})
        problem(r, 502, "upstream_error")
    finally:
        d.close()
        d.undolog.close()


def test_the_upstream_url_method_and_plain_headers_are_in_the_contract(
    db: Any, upstream: Upstream, tmp_path: Path
) -> None:
    base = upstream.config().replace(
        "[tools.close_account.args_schema]",
        'headers = { "X-Tenant" = "acme", "Authorization" = "Bearer one" }\n[tools.close_account.args_schema]',
    )
    d = _proxy_desk(db, upstream, tmp_path, base)
    try:
        sid = d.client("agent").post("/v1/sessions", json={"agent_id": "a"}).json()["session_id"]
        r = d.client("agent").post(f"/v1/sessions/{sid}/tools/close_account:invoke", json={"account": "acme"})
        rid = r.json()["approval_request_id"]
        spec = d.undolog.tool_spec("close_account")
        assert spec.contract()["binding"]["proxy"]["url"] == f"{upstream.url}/close"
        assert spec.contract()["binding"]["proxy"]["headers"] == {"x-tenant": "acme"}
        assert "Bearer one" not in str(spec.contract())

        def revision_after(config: str) -> tuple[int, str]:
            undolog = d.undolog
            ProxyTools.load(_toml(config)).register(undolog)
            spec = undolog.tool_spec("close_account")
            return spec.revision, undolog.approvals.get(rid).state

        rev = spec.revision
        # A rotated secret is not a new contract...
        assert revision_after(base.replace("Bearer one", "Bearer two")) == (rev, "pending")
        # ...but another upstream is: the pending approval was for the old one and is cancelled.
        moved = base.replace(f'url = "{upstream.url}/close"', 'url = "http://127.0.0.1:9/close"')
        assert revision_after(moved) == (rev + 1, "cancelled")
        # So are a changed method and a changed plain header.
        assert revision_after(moved.replace('"X-Tenant" = "acme"', '"X-Tenant" = "evil"'))[0] == rev + 2
        assert revision_after(moved.replace('"X-Tenant" = "acme"', '"X-Tenant" = "evil"').replace(
            'tier = "irreversible"', 'tier = "irreversible"\nmethod = "PUT"'))[0] == rev + 3
    finally:
        d.close()
        d.undolog.close()


def _toml(text: str) -> dict[str, Any]:
    import tomllib

    return tomllib.loads(text)


# ---------------------------------------------------------------------------------- 8. group visibility


def _csrf(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([0-9a-f]+)"', html)
    assert m, html[:500]
    return m.group(1)


def _login(desk: Desk, who: str) -> httpx.Client:
    c = httpx.Client(base_url=desk.url, follow_redirects=False, timeout=30)
    page = c.get("/ui/login")
    r = c.post("/ui/login", data={"api_key": desk.token(who), "csrf_token": _csrf(page.text)})
    assert r.status_code == 303, r.text
    return c


SECRET = "IBAN-DE-SECRET-4242"


def test_an_approver_outside_a_group_never_reads_that_groups_arguments(desk: Desk) -> None:
    admin = desk.client("admin")
    assert admin.put("/v1/approver-groups/treasury", json={"tools": ["wire_money", "send_refund_email"]}).status_code == 200
    desk.add_key("outsider", ["approver"], ["support"])
    desk.add_key("insider", ["approver"], ["treasury"])
    s = desk.session()
    with s:
        s.call_sync("send_refund_email", user_id=SECRET, amount=1.0, call_id="refund")
        try:
            s.call_sync("wire_money", to=SECRET, amount=9.0, call_id="wire")
        except Exception as exc:  # ApprovalPending
            wire_rid = exc.approval_request_id  # type: ignore[attr-defined]
        try:
            s.call_sync("delete_user_account", user_id="u1", call_id="delete")
        except Exception as exc:
            delete_rid = exc.approval_request_id  # type: ignore[attr-defined]
    outsider = desk.client("outsider")
    problem(outsider.get(f"/v1/approvals/{wire_rid}"), 403, "not_in_approver_group")
    # The request the outsider may decide shows the session's calls, without the treasury's arguments.
    detail = outsider.get(f"/v1/approvals/{delete_rid}")
    assert detail.status_code == 200, detail.text
    assert SECRET not in detail.text
    hidden = [c for c in detail.json()["recent_calls"] if c["tool_name"] in ("wire_money", "send_refund_email")]
    assert len(hidden) == 2 and all(c["redacted"] and c["args_snapshot"] is None for c in hidden)
    context = detail.json()["agent_context"]
    assert any(c["tool_name"] == "send_refund_email" and c.get("redacted") for c in context)
    shown = outsider.get(f"/v1/sessions/{s.id}")
    assert shown.status_code == 200 and SECRET not in shown.text
    assert {e["tool_name"]: e["redacted"] for e in shown.json()["effects"]} == {
        "send_refund_email": True, "wire_money": True, "delete_user_account": False}
    # The dashboard hides them the same way.
    page = _login(desk, "outsider")
    assert SECRET not in page.get(f"/ui/sessions/{s.id}").text
    request_page = page.get(f"/ui/approvals/{delete_rid}").text
    assert SECRET not in request_page and "Arguments withheld" in request_page
    # Members of the group, admins and the session's own key read everything.
    for who in ("insider", "admin", "agent"):
        assert SECRET in desk.client(who).get(f"/v1/sessions/{s.id}").text, who
    assert SECRET in desk.client("insider").get(f"/v1/approvals/{delete_rid}").text


@undolog_tool(tier=ToolTier.COMPENSABLE, compensation=CompensationDescriptor.new("void_charge"))
def charge_card(card: str, amount: float) -> dict[str, Any]:
    """Charge a card (its compensation fails, naming the card, as real errors do)."""
    return {"charged": amount}


@compensation("void_charge")
def void_charge(ctx: Any) -> None:
    raise RuntimeError(f"card {ctx.args['card']} could not be voided")


def test_an_approver_outside_a_group_never_reads_that_groups_halt_reasons(desk: Desk) -> None:
    """A session's ``halted_reason`` quotes what stopped it: a failed compensation's error, or a rejection's reason.
    The call's own error was redacted for an approver outside its groups, and the request itself was 403, but the
    session (its detail, the listing, the dashboard page) said it all in ``halted_reason``."""
    desk.undolog.register(charge_card, void_charge)
    admin = desk.client("admin")
    assert admin.put("/v1/approver-groups/treasury", json={"tools": ["wire_money", "charge_card"]}).status_code == 200
    desk.add_key("outsider", ["approver"], ["support"])
    desk.add_key("insider", ["approver"], ["treasury"])
    failed = desk.session()
    with failed:
        failed.call_sync("charge_card", card=SECRET, amount=1.0, call_id="c")
    assert SECRET in admin.post(f"/v1/sessions/{failed.id}:rollback").json()["halted_reason"]
    rejected = desk.session()
    with rejected:
        try:
            rejected.call_sync("wire_money", to="acme", amount=5.0, call_id="w")
        except Exception as exc:  # ApprovalPending
            rid = exc.approval_request_id  # type: ignore[attr-defined]
    assert desk.client("insider").post(f"/v1/approvals/{rid}:reject",
                                       json={"reason": f"card {SECRET} is stolen"}).status_code == 200
    # A halt of a session whose calls the outsider may read is still told in full.
    visible = desk.session()
    with visible:
        try:
            visible.call_sync("delete_user_account", user_id="u1", call_id="d")
        except Exception as exc:
            other = exc.approval_request_id  # type: ignore[attr-defined]
    assert desk.client("insider").post(f"/v1/approvals/{other}:reject", json={"reason": "not this one"}).status_code == 200
    outsider = desk.client("outsider")
    page = _login(desk, "outsider")
    for sid in (failed.id, rejected.id):
        shown = outsider.get(f"/v1/sessions/{sid}").json()
        assert shown["state"] == "halted" and shown["halted_reason"] is None and shown["halted_reason_redacted"], shown
        shown_page = page.get(f"/ui/sessions/{sid}").text
        assert SECRET not in shown_page and "Why is withheld" in shown_page
    listed = {s["session_id"]: s for s in outsider.get("/v1/sessions").json()}
    assert SECRET not in str(listed) and listed[failed.id]["halted_reason_redacted"]
    assert "not this one" in listed[visible.id]["halted_reason"]
    assert "not this one" in outsider.get(f"/v1/sessions/{visible.id}").json()["halted_reason"]
    # Members of the group, admins and the session's own key read it.
    for who in ("insider", "admin", "agent"):
        for sid in (failed.id, rejected.id):
            assert SECRET in desk.client(who).get(f"/v1/sessions/{sid}").json()["halted_reason"], who
        assert SECRET in str(desk.client(who).get("/v1/sessions").json()), who


# ---------------------------------------------------------------------------------- 11. dashboard sessions


def test_a_csrf_token_from_an_anonymous_browser_is_worthless_after_planting_its_cookie(desk: Desk) -> None:
    rid, _ = desk.pending()
    victim = _login(desk, "approver")
    # The attacker loads the login page in their own browser: a token and the nonce cookie it fits...
    attacker = httpx.Client(base_url=desk.url, follow_redirects=False, timeout=30)
    page = attacker.get("/ui/login")
    token = _csrf(page.text)
    nonce = attacker.cookies.get("undolog_csrf")
    assert nonce
    # ...plants the cookie in the victim's browser and posts the token through it: refused on today's main too? No:
    # main accepted it, because tokens were bound to the nonce cookie, not to the victim's login.
    victim.cookies.set("undolog_csrf", nonce, path="/ui")
    r = victim.post(f"/ui/approvals/{rid}/approve", data={"csrf_token": token})
    assert r.status_code == 403, r.text
    assert desk.undolog.approvals.get(rid).state == "pending"
    # The victim's own token (bound to their login) works.
    own = _csrf(victim.get(f"/ui/approvals/{rid}").text)
    assert victim.post(f"/ui/approvals/{rid}/approve", data={"csrf_token": own}).status_code == 303


def test_a_non_ascii_csrf_token_is_refused_not_a_server_error(desk: Desk) -> None:
    """``hmac.compare_digest`` raises ``TypeError`` on text outside ASCII, which whoever posts the form controls: such
    a token is refused like any wrong one (403), at the login form and after it. Failed before: 500."""
    rid, _ = desk.pending()
    anon = httpx.Client(base_url=desk.url, follow_redirects=False, timeout=30)
    anon.get("/ui/login")
    r = anon.post("/ui/login", data={"api_key": desk.token("approver"), "csrf_token": "\u00e9" * 8})
    assert r.status_code == 403, r.status_code
    c = _login(desk, "approver")
    r = c.post(f"/ui/approvals/{rid}/approve", data={"csrf_token": "\u0661" * 64})
    assert r.status_code == 403, r.status_code
    assert desk.undolog.approvals.get(rid).state == "pending"


def test_logout_revokes_the_session_so_a_copied_cookie_stops_working(desk: Desk) -> None:
    c = _login(desk, "approver")
    cookie = c.cookies.get("undolog_session")
    assert cookie and c.get("/ui/").status_code == 200
    copy = httpx.Client(base_url=desk.url, follow_redirects=False, cookies={"undolog_session": cookie}, timeout=30)
    assert copy.get("/ui/").status_code == 200
    token = _csrf(c.get("/ui/").text)
    assert c.post("/ui/logout", data={"csrf_token": token}).status_code == 303
    # The copy (another tab, a stolen cookie) is logged out too: the session is gone server-side.
    assert copy.get("/ui/").status_code == 303 and copy.get("/ui/").headers["location"] == "/ui/login"
    assert copy.get("/ui/queue/rows").status_code == 401
    # A fresh login is a new session with a new cookie; logging in again in the same browser ends the previous one.
    again = _login(desk, "approver")
    first = again.cookies.get("undolog_session")
    assert first != cookie
    stale = httpx.Client(base_url=desk.url, follow_redirects=False, cookies={"undolog_session": first}, timeout=30)
    assert stale.get("/ui/").status_code == 200
    page = again.get("/ui/login")
    assert again.post("/ui/login", data={"api_key": desk.token("approver"), "csrf_token": _csrf(page.text)}
                      ).status_code == 303
    assert again.cookies.get("undolog_session") != first and again.get("/ui/").status_code == 200
    assert stale.get("/ui/").status_code == 303


def test_docs_are_off_by_default_and_carry_the_dashboards_headers_when_on(db: Any) -> None:
    desk = make_desk(db)
    try:
        assert httpx.get(desk.url + "/docs", timeout=30).status_code == 404
        assert httpx.get(desk.url + "/openapi.json", timeout=30).status_code == 200
    finally:
        desk.close()
        desk.undolog.close()
    undolog = db.open()
    demo_app.register(undolog)
    server = LiveServer(create_app(undolog, settings=ServerSettings(background=False, docs=True))).start()
    try:
        r = httpx.get(server.url + "/docs", timeout=30)
        assert r.status_code == 200 and "swagger-ui" in r.text
        csp = r.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in csp and "script-src 'self' https://cdn.jsdelivr.net;" in csp
        assert "unsafe-inline" not in csp and r.headers["x-frame-options"] == "DENY"
        assert "<script>" not in r.text  # no inline script: the init is /ui/static/docs.js
        assert httpx.get(server.url + "/ui/static/docs.js", timeout=30).status_code == 200
    finally:
        server.stop()
        undolog.close()


# ---------------------------------------------------------------------------------- 12. approval lifetime


def test_an_approval_not_used_within_its_ttl_expires_and_the_agent_must_ask_again(
    db: Any, upstream: Upstream, tmp_path: Path
) -> None:
    import time

    d = _proxy_desk(db, upstream, tmp_path)
    try:
        assert d.undolog.policy.get().approved_ttl_seconds == 24 * 3600  # the default
        d.undolog.policy.set(actor="test", approved_ttl_seconds=1)
        sweeper = d.server.server.config.app.state.sweeper
        agent = d.client("agent")
        sid = agent.post("/v1/sessions", json={"agent_id": "a"}).json()["session_id"]
        url = f"/v1/sessions/{sid}/tools/close_account:invoke"

        def ask(key: str) -> httpx.Response:
            return agent.post(url, json={"account": "acme"}, headers={"Idempotency-Key": key})

        # Applied by the sweeper.
        first = ask("close-1")
        rid = first.json()["approval_request_id"]
        assert d.client("approver").post(f"/v1/approvals/{rid}:approve").status_code == 200
        time.sleep(1.2)
        assert sweeper.tick()["lapsed"] == 1
        shown = d.client("admin").get(f"/v1/approvals/{rid}").json()
        assert shown["state"] == "expired" and shown["decided_by"]  # who approved stays on record
        events = d.client("admin").get(f"/v1/approvals/{rid}/events").json()
        assert [(e["action"], e["actor"]) for e in events][-1] == ("expire", "undolog:approval-ttl")
        session = d.client("admin").get(f"/v1/sessions/{sid}").json()
        assert session["state"] != "halted"
        assert [e["state"] for e in session["effects"] if e["effect_id"] == first.json()["effect_id"]] == ["expired"]
        # Re-issuing the call raises a new request; the upstream was never called.
        again = ask("close-1")
        assert again.status_code == 202 and again.json()["approval_request_id"] != rid
        assert upstream.to("/close") == []
        assert sweeper.tick()["lapsed"] == 0

        # Applied on re-issue, without a sweep: the stale approval never runs.
        rid2 = again.json()["approval_request_id"]
        assert d.client("approver").post(f"/v1/approvals/{rid2}:approve").status_code == 200
        time.sleep(1.2)
        third = ask("close-1")
        assert third.status_code == 202 and third.json()["approval_request_id"] not in (rid, rid2)
        assert d.undolog.approvals.get(rid2).state == "expired" and upstream.to("/close") == []
        # A fresh approval used in time runs once. In time for sure: with the 1 s TTL, a loaded machine could take
        # longer than that between the approval and its use, and the call would rightly be asked again (202).
        d.undolog.policy.set(actor="test", approved_ttl_seconds=3600)
        rid3 = third.json()["approval_request_id"]
        assert d.client("approver").post(f"/v1/approvals/{rid3}:approve").status_code == 200
        assert ask("close-1").status_code == 200 and len(upstream.to("/close")) == 1
        assert d.undolog.verify_audit().ok
    finally:
        d.close()
        d.undolog.close()
