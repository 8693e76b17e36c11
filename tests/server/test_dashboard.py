"""The dashboard: cookie login, CSRF on every form, and a real browser run in headless Chromium."""

from __future__ import annotations

import html
import re
from pathlib import Path

import httpx
import pytest

from undolog_core import ApprovalPending, errors

from ..support.demo_app import UNDONE
from .conftest import Desk

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",
]


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


def test_login_sets_a_strict_httponly_cookie(desk: Desk) -> None:
    c = httpx.Client(base_url=desk.url, follow_redirects=False, timeout=30)
    assert c.get("/ui/").headers["location"] == "/ui/login"
    page = c.get("/ui/login")
    assert "content-security-policy" in page.headers and page.headers["x-frame-options"] == "DENY"
    r = c.post("/ui/login", data={"api_key": desk.token("approver"), "csrf_token": _csrf(page.text)})
    assert r.status_code == 303
    cookies = r.headers.get_list("set-cookie")
    session = next(h for h in cookies if h.startswith("undolog_session="))
    assert "HttpOnly" in session and "SameSite=strict" in session.replace("Strict", "strict")
    assert c.get("/ui/").status_code == 200


def test_bad_key_and_agent_key_cannot_log_in(desk: Desk) -> None:
    c = httpx.Client(base_url=desk.url, follow_redirects=False, timeout=30)
    token = _csrf(c.get("/ui/login").text)
    assert c.post("/ui/login", data={"api_key": "ulk_x_y", "csrf_token": token}).status_code == 401
    assert c.post("/ui/login", data={"api_key": desk.token("agent"), "csrf_token": token}).status_code == 403


def test_every_form_needs_the_csrf_token(desk: Desk) -> None:
    rid, sid = desk.pending()
    c = _login(desk, "admin")
    page = c.get(f"/ui/approvals/{rid}").text
    token = _csrf(page)
    # Every <form> on the page carries the token.
    assert page.count("<form") == page.count('name="csrf_token"') >= 4
    for path, data in (
        (f"/ui/approvals/{rid}/approve", {}),
        (f"/ui/approvals/{rid}/reject", {"reason": "x"}),
        (f"/ui/approvals/{rid}/modify", {"args": "{}"}),
        (f"/ui/sessions/{sid}/rollback", {}),
        (f"/ui/sessions/{sid}/resume", {}),
        ("/ui/logout", {}),
    ):
        assert c.post(path, data=data).status_code == 403, path
        assert c.post(path, data={**data, "csrf_token": "0" * 64}).status_code == 403, path
    assert desk.undolog.approvals.get(rid).state == "pending"
    # A token minted for another browser does not fit this one's nonce cookie.
    other = _login(desk, "approver")
    other_token = _csrf(other.get(f"/ui/approvals/{rid}").text)
    assert other_token != token
    assert c.post(f"/ui/approvals/{rid}/approve", data={"csrf_token": other_token}).status_code == 403
    assert c.post(f"/ui/approvals/{rid}/approve", data={"csrf_token": token}).status_code == 303
    assert desk.undolog.approvals.get(rid).state == "approved"


def test_modify_form_reports_the_bad_field(desk: Desk) -> None:
    rid, _ = desk.pending("wire_money", to="acme", amount=3.0)
    c = _login(desk, "approver")
    token = _csrf(c.get(f"/ui/approvals/{rid}").text)
    r = c.post(f"/ui/approvals/{rid}/modify", data={"step": "confirm", "args_json": "{not json", "csrf_token": token})
    assert r.status_code == 422 and "not valid JSON" in r.text
    r = c.post(f"/ui/approvals/{rid}/modify", data={"/to": "acme", "/amount": "lots", "csrf_token": token})
    assert r.status_code == 422 and "amount" in r.text
    assert 'value="lots"' in r.text  # the edit is kept for correction
    review = c.post(f"/ui/approvals/{rid}/modify", data={"/to": "acme", "/amount": "1.5", "csrf_token": token})
    assert review.status_code == 200 and 'id="diff"' in review.text
    assert desk.undolog.approvals.get(rid).state == "pending"  # reviewing decides nothing
    edited = html.unescape(re.search(r'name="args_json" value="([^"]*)"', review.text).group(1))
    r = c.post(f"/ui/approvals/{rid}/modify", data={"step": "confirm", "args_json": edited, "csrf_token": token})
    assert r.status_code == 303
    assert desk.undolog.approvals.get(rid).approved_args == {"to": "acme", "amount": 1.5}


@pytest.mark.parametrize(("edit", "why"), [
    ('{"to": "acme", "amount": NaN}', "not a finite number"),
    ('{"to": "acme", "amount": Infinity}', "not a finite number"),
    ('{"to": "acme", "amount": 1e999}', "not a finite number"),
    ('{"to": "acme\\u0000", "amount": 1}', "NUL"),
    ('{"to": "\\ud800", "amount": 1}', "lone surrogate"),
    ("[" * 100_000 + "]" * 100_000, "deeper than 64"),
])
def test_the_modify_form_refuses_what_the_api_refuses(desk: Desk, edit: str, why: str) -> None:
    """The form's JSON text never passed the API's door: NaN, infinities and 1e999 were a 500 (the decision's digest
    cannot encode them), deep nesting a RecursionError (500), and an escaped NUL, which the API refuses, was
    approved and handed to the tool."""
    rid, _ = desk.pending("wire_money", to="acme", amount=3.0)
    c = _login(desk, "approver")
    token = _csrf(c.get(f"/ui/approvals/{rid}").text)
    r = c.post(f"/ui/approvals/{rid}/modify", data={"step": "confirm", "args_json": edit, "csrf_token": token})
    assert r.status_code == 422, r.text[:300]
    assert why in r.text
    assert desk.undolog.approvals.get(rid).state == "pending"


def test_the_python_api_refuses_a_non_finite_edit(desk: Desk) -> None:
    """``approvals.modify`` with a NaN raised the encoder's ValueError from inside the decision."""
    rid, _ = desk.pending("wire_money", to="acme", amount=3.0)
    for bad in (float("nan"), float("inf"), [1.0, float("-inf")]):
        with pytest.raises(errors.ArgumentsInvalid) as caught:
            desk.undolog.approvals.modify(rid, approver="ana", args={"to": "acme", "amount": bad})
        assert caught.value.errors[0]["type"] == "not_finite"
    assert desk.undolog.approvals.get(rid).state == "pending"


def test_links_and_forms_reach_a_session_whose_id_has_url_characters(desk: Desk) -> None:
    """An embedded app names its sessions (a thread id): ``ticket#42?re=1``, ``50%off``, ``a\\b`` are valid ids. The
    dashboard wrote them into links and form actions as they are, so the request page linked to another session (the
    browser cut the id at ``#`` or ``?``) and the session page's Rollback form posted elsewhere; a backslash, which a
    browser reads as ``/``, could aim it at another route."""
    c = _login(desk, "admin")
    for sid in ("ticket#42?re=1", "50%off", "..\\approvals\\x\\approve?"):
        s = desk.undolog.session(session_id=sid, agent_id="bot", created_by=desk.key("agent").principal_ref)
        with s:
            s.call_sync("send_refund_email", user_id="u1", amount=2.0, call_id="r1")
            try:
                s.call_sync("delete_user_account", user_id="u1", call_id="c1")
            except ApprovalPending as p:
                rid = p.approval_request_id
        page = c.get(f"/ui/approvals/{rid}").text
        href = re.search(r'<dt>Session</dt><dd><a href="([^"]+)"', page).group(1)  # type: ignore[union-attr]
        # As a browser follows it: relative to the page, a backslash read as a slash, the fragment dropped.
        url = httpx.URL(f"{desk.url}/ui/approvals/{rid}").join(html.unescape(href).replace("\\", "/"))
        shown = c.get(url)
        assert shown.status_code == 200 and html.escape(sid) in shown.text, (sid, href, str(url))
        action = re.search(r'action="([^"]+/rollback)"', shown.text).group(1)  # type: ignore[union-attr]
        target = url.join(html.unescape(action).replace("\\", "/"))
        r = c.post(target, data={"csrf_token": _csrf(shown.text)})
        assert r.status_code == 200 and "compensated" in r.text, (sid, action, str(target), r.status_code)
        assert desk.undolog.sessions.get(sid).state.value == "rolled_back"


def test_request_page_shows_what_the_agent_did_before_asking(desk: Desk) -> None:
    s = desk.session()
    with s:
        s.call_sync("search_kb", query="who is u5")
        s.call_sync("send_refund_email", user_id="u5", amount=1.0, call_id="m")
        try:
            s.call_sync("delete_user_account", user_id="u5", call_id="d")
        except ApprovalPending as p:
            rid = p.approval_request_id
    page = _login(desk, "approver").get(f"/ui/approvals/{rid}").text
    context = page.split('id="agent-context"', 1)[1].split("</ol>", 1)[0]
    assert "search_kb" in context and "send_refund_email" in context and "who is u5" in context
    assert "cancel_refund_email" in page  # the undo plan


def test_dashboard_refuses_self_approval_and_outsiders(desk: Desk) -> None:
    desk.add_key("both", ["agent", "approver"])
    rid, _ = desk.pending(owner="both")
    c = _login(desk, "both")
    page = c.get(f"/ui/approvals/{rid}").text
    assert "another person must decide" in page
    assert c.post(f"/ui/approvals/{rid}/approve", data={"csrf_token": _csrf(page)}).status_code == 403
    assert desk.undolog.approvals.get(rid).state == "pending"
    rows = c.get("/ui/queue/rows")
    assert rid in rows.text and rows.headers["cache-control"] == "no-store"
    assert httpx.get(desk.url + "/ui/queue/rows", timeout=30).status_code == 401


def _seed(desk: Desk) -> dict[str, str]:
    ids = {}
    for name, tool, args in (
        ("approve", "delete_user_account", {"user_id": "u-approve"}),
        ("modify", "wire_money", {"to": "acme", "amount": 900.0}),
        ("reject", "delete_user_account", {"user_id": "u-reject"}),
    ):
        ids[name], _ = desk.pending(tool, **args)
    s = desk.session(agent_id="support-bot")
    with s:
        s.call_sync("search_kb", query="refund")
        s.call_sync("send_refund_email", user_id="u7", amount=20.0, call_id="m1")
        s.call_sync("send_refund_email", user_id="u8", amount=30.0, call_id="m2")
    ids["session"] = s.id
    return ids


@pytest.mark.browser
def test_browser_approve_modify_reject_and_rollback(desk: Desk) -> None:
    from playwright.sync_api import expect, sync_playwright

    ids = _seed(desk)
    UNDONE.clear()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            ctx = browser.new_context(viewport={"width": 1280, "height": 860})
            page = ctx.new_page()
            page.set_default_timeout(15000)
            errors: list[str] = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(desk.url + "/ui/")
            expect(page).to_have_url(re.compile(r"/ui/login$"))
            page.fill("#api_key", desk.token("admin"))
            page.click("button[type=submit]")
            expect(page.locator("#queue-rows tr[data-id]")).to_have_count(3)
            expect(page.locator(".countdown").first).to_have_text(re.compile(r"^\d+:\d\d"))
            # Live refresh: a request raised while the page is open appears without a reload.
            late, _ = desk.pending("delete_user_account", user_id="u-late")
            expect(page.locator(f'#queue-rows tr[data-id="{late}"]')).to_have_count(1, timeout=10000)
            page.screenshot(path=str(ARTIFACTS / "dashboard-queue.png"), full_page=True)

            page.click(f'#queue-rows tr[data-id="{ids["approve"]}"] a.strong')
            page.fill("#approve-reason", "verified by phone")
            page.click("#approve")
            expect(page.locator("#state")).to_have_text("approved")
            expect(page.locator("#decided-by")).to_contain_text("admin")

            page.goto(f"{desk.url}/ui/approvals/{ids['modify']}")
            # The edit form comes from the tool's schema (tests/server/test_forms.py covers every kind).
            page.fill("#arg-amount", "")
            page.click("#review")
            expect(page.locator("#error")).to_contain_text("amount")
            page.fill("#arg-amount", "90.0")
            page.fill("#modify-reason", "cap at 90")
            page.click("#review")
            expect(page.locator('#diff tr[data-name="/amount"] td.after')).to_have_text("90.0")
            page.click("#modify")
            expect(page.locator("#state")).to_have_text("approved")
            page.screenshot(path=str(ARTIFACTS / "dashboard-request.png"), full_page=True)

            page.goto(f"{desk.url}/ui/approvals/{ids['reject']}")
            page.fill("#reject-reason", "wrong user")
            page.click("#reject")
            expect(page.locator("#state")).to_have_text("rejected")

            page.goto(f"{desk.url}/ui/sessions/{ids['session']}")
            # SAFE calls are not logged as effects; the two compensable ones are.
            expect(page.locator("ol.timeline li")).to_have_count(2)
            page.once("dialog", lambda d: d.accept())
            page.click("#rollback")
            report = page.locator("#rollback-report")
            expect(report).to_contain_text("Rollback complete")
            expect(report.locator("li.step")).to_have_count(2)
            expect(report.locator(".outcome").first).to_have_text("compensated")
            expect(page.locator("#session-state")).to_have_text("rolled back")
            page.screenshot(path=str(ARTIFACTS / "dashboard-rollback.png"), full_page=True)

            # A phone far from UTC: the countdown must still count to the server's timeout_at.
            phone = browser.new_context(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True,
                                        device_scale_factor=2, timezone_id="Pacific/Kiritimati")
            phone.add_cookies(ctx.cookies())
            m = phone.new_page()
            m.goto(desk.url + "/ui/")
            expect(m.locator("#queue-rows tr[data-id]")).to_have_count(1)
            # The queue reflows into cards: nothing scrolls sideways on a phone.
            assert m.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
            m.screenshot(path=str(ARTIFACTS / "dashboard-phone.png"), full_page=True)
            m.goto(f"{desk.url}/ui/approvals/{late}")
            assert m.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
            expect(m.locator(".countdown.big")).to_have_text(re.compile(r"^\d+:\d\d"))
            shown = [int(x) for x in m.locator(".countdown.big").inner_text().split(":")]
            shown_seconds = sum(v * 60 ** i for i, v in enumerate(reversed(shown)))
            left = desk.client("admin").get(f"/v1/approvals/{late}").json()["seconds_left"]
            assert abs(shown_seconds - left) < 30, (shown, left)
            m.screenshot(path=str(ARTIFACTS / "dashboard-phone-request.png"), full_page=True)
            assert not errors, errors
        finally:
            browser.close()
    assert desk.undolog.approvals.get(ids["approve"]).state == "approved"
    assert desk.undolog.approvals.get(ids["modify"]).approved_args == {"to": "acme", "amount": 90.0}
    assert desk.undolog.approvals.get(ids["reject"]).state == "rejected"
    assert [u["args"]["user_id"] for u in UNDONE] == ["u8", "u7"]
    assert (ARTIFACTS / "dashboard-rollback.png").stat().st_size > 10_000


@pytest.mark.parametrize("path", ["/ui/sessions", "/ui/sessions/none", "/ui/approvals/none"])
def test_pages_render_for_approvers(desk: Desk, path: str) -> None:
    c = _login(desk, "approver")
    r = c.get(path)
    assert r.status_code in (200, 404)
    assert "<html" in r.text


def test_pending_via_library(desk: Desk) -> None:
    s = desk.session()
    with s, pytest.raises(ApprovalPending):
        s.call_sync("delete_user_account", user_id="z")


def test_the_revalidate_button_lets_a_session_call_a_changed_tool(desk: Desk) -> None:
    """The MCP gateway's contract_changed refusal sends a person to this button: an MCP client cannot revalidate a
    session itself. Before: only the CLI and the REST API could."""
    from undolog_core.errors import ContractChanged

    def contract(extra: dict[str, object]) -> dict[str, object]:
        return {"type": "object", "properties": {"q": {"type": "string"}, **extra}, "required": ["q"]}

    u = desk.undolog
    u.register_tool(None, name="lookup_order", tier="safe", reason="reads an order", args_schema=contract({}),
                    binding={"kind": "test"})
    s = desk.session()
    u.driver.decide(s.id, "lookup_order", {"q": "a"})
    u.register_tool(None, name="lookup_order", tier="safe", reason="reads an order",
                    args_schema=contract({"limit": {"type": "integer"}}), binding={"kind": "test"})
    with pytest.raises(ContractChanged):
        u.driver.decide(s.id, "lookup_order", {"q": "a"})
    c = _login(desk, "admin")
    page = c.get(f"/ui/sessions/{s.id}").text
    assert 'id="revalidate"' in page
    assert c.post(f"/ui/sessions/{s.id}/revalidate", data={}).status_code == 403  # no CSRF token: refused
    r = c.post(f"/ui/sessions/{s.id}/revalidate", data={"csrf_token": _csrf(page)})
    assert r.status_code == 303, r.text
    u.driver.decide(s.id, "lookup_order", {"q": "a"})  # pinned to the new contract now
    approver = _login(desk, "approver")
    assert 'id="revalidate"' not in approver.get(f"/ui/sessions/{s.id}").text  # admins only


def _late_finish(desk: Desk, owner: str = "agent") -> tuple[str, str]:
    """A call of a new session that finished after another process had taken it over (recovery's claim: a new
    owner, one epoch more): recorded as a late finish, the effect unknown, the session halted."""

    from undolog_core.storage import schema as t

    s = desk.session(owner)
    d = desk.undolog.engine.intercept(s.id, "send_refund_email", {"user_id": "u9", "amount": 5.0}, call_id="late")
    e = t.effect_log
    with desk.undolog.store.tx() as c:
        c.execute(e.update().where(e.c.effect_id == d.effect_id).values(owner="elsewhere|1|1|x", epoch=e.c.epoch + 1))
    with pytest.raises(errors.OutcomeConflict):
        desk.undolog.engine.complete(d.effect_id, {"message_id": "m"})
    return str(d.effect_id), s.id


@pytest.mark.pg_smoke
def test_the_resolve_button_settles_a_late_finish_and_leaves_the_session_halted(desk: Desk) -> None:
    eid, sid = _late_finish(desk)
    c = _login(desk, "approver")
    page = c.get(f"/ui/sessions/{sid}").text
    assert "late finish" in page and f'action="/ui/effects/{eid}/resolve"' in page
    path = f"/ui/effects/{eid}/resolve"
    assert c.post(path, data={"outcome": "committed", "reason": "x"}).status_code == 403  # no CSRF token
    token = _csrf(page)
    assert c.post(path, data={"outcome": "perhaps", "reason": "x", "csrf_token": token}).status_code == 422
    assert c.post(path, data={"outcome": "committed", "reason": " ", "csrf_token": token}).status_code == 422
    done = c.post(path, data={"outcome": "committed", "reason": "the refund is sent", "csrf_token": token})
    assert done.status_code == 303 and done.headers["location"] == f"/ui/sessions/{sid}"
    [effect] = desk.undolog.sessions.effects(sid)
    assert effect["state"] == "committed"
    assert desk.undolog.sessions.get(sid).state == "halted"  # resolving does not resume
    after = c.get(f"/ui/sessions/{sid}").text
    assert f'action="/ui/effects/{eid}/resolve"' not in after  # settled: no button any more
    again = c.post(path, data={"outcome": "compensated", "reason": "y", "csrf_token": _csrf(after)})
    assert again.status_code == 409 and "not unknown" in html.unescape(again.text)


@pytest.mark.reads_store
def test_the_resolve_button_is_refused_to_the_sessions_own_key(desk: Desk) -> None:
    desk.add_key("both", ["agent", "approver"])
    eid, sid = _late_finish(desk, owner="both")
    c = _login(desk, "both")
    page = c.get(f"/ui/sessions/{sid}").text
    assert "late finish" in page and "/resolve" not in page  # no button for the session's own key
    r = c.post(f"/ui/effects/{eid}/resolve", data={"outcome": "committed", "reason": "mine", "csrf_token": _csrf(page)})
    assert r.status_code == 403
    assert desk.undolog.sessions.effects(sid)[0]["state"] == "unknown"
