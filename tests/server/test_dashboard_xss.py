"""The dashboard in a real browser against an XSS corpus in every agent- or model-supplied field (issue 34).

Arguments of a pending IRREVERSIBLE call, of logged COMPENSABLE calls and of SAFE calls (the agent context), the
agent id, a tool's exception and a failing compensation's (the effect's error, the session's halt reason) and a
person's decision reason carry payloads that would run script or add elements if a page did not escape them.
Headless Chromium visits the queue, the request pages, the session list and the session page and checks: no
payload ran (a marker it would set stays unset, no dialog opened), no element a payload would add exists, no
Content-Security-Policy violation was reported (escaping must hold without the CSP's help), the payloads are shown
as text, and every page is served with the CSP.
"""

from __future__ import annotations

from typing import Any

import pytest

from undolog_core import ApprovalPending, ToolTier, compensation, undolog_tool

from .conftest import Desk
from .test_dashboard import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.browser

PAYLOADS = [
    "<script>window.__pwned='script'</script>",
    '"><img src=x onerror="window.__pwned=\'img\'">',
    "'><svg onload=window.__pwned='svg'>",
    "</textarea><script>window.__pwned='textarea'</script>",
    "</script><script>window.__pwned='script-close'</script>",
    '<iframe srcdoc="<script>parent.__pwned=\'iframe\'</script>"></iframe>',
    '<a href="javascript:window.__pwned=\'href\'" id="xss-link">x</a>',
    '" autofocus onfocus="window.__pwned=\'attr\'" x="',
    "{{constructor.constructor('window.__pwned=1')()}}",
    "<math><mtext><table><mglyph><style><img src=x onerror=window.__pwned='mxss'>",
]
HOSTILE = " ".join(PAYLOADS)
INJECTED = "img[src='x'], svg[onload], iframe[srcdoc], #xss-link, math mglyph, script:not([src])"


def _seed(desk: Desk) -> dict[str, str]:
    @undolog_tool(tier=ToolTier.COMPENSABLE, compensation="xss_undo")
    def xss_tool(note: str) -> None:
        raise RuntimeError(f"model said {HOSTILE}")

    @compensation("xss_undo")
    def xss_undo(ctx: Any) -> None:
        raise RuntimeError(f"undo said {PAYLOADS[1]}")

    desk.undolog.register(xss_tool, xss_undo)
    desk.undolog.saga.backoff_seconds = 0
    ids: dict[str, str] = {}
    s = desk.session(agent_id=PAYLOADS[1][:190])
    with s:
        s.call_sync("search_kb", query=HOSTILE)
        s.call_sync("send_refund_email", user_id=HOSTILE, amount=1.0, call_id="m")
        try:
            s.call_sync("delete_user_account", user_id=HOSTILE, call_id="d")
        except ApprovalPending as p:
            ids["pending"] = p.approval_request_id
    ids["session"] = s.id
    rid, _ = desk.pending("delete_user_account", user_id=PAYLOADS[0])
    desk.undolog.approvals.reject(rid, approver="approver", reason=HOSTILE)
    ids["rejected"] = rid
    failing = desk.session(agent_id="plain")
    with pytest.raises(RuntimeError):
        with failing:
            failing.call_sync(xss_tool, note=HOSTILE)
    ids["failing"] = failing.id
    return ids


def test_the_dashboard_shows_an_xss_corpus_inert(desk: Desk) -> None:
    from playwright.sync_api import sync_playwright

    ids = _seed(desk)
    assert "undo said" in (desk.undolog.sessions.get(ids["failing"]).halted_reason or "")
    pages = ["/ui/", f"/ui/approvals/{ids['pending']}", f"/ui/approvals/{ids['rejected']}", "/ui/sessions",
             f"/ui/sessions/{ids['session']}", f"/ui/sessions/{ids['failing']}"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            ctx = browser.new_context()
            ctx.add_init_script("window.__violations = []; document.addEventListener('securitypolicyviolation', "
                                "e => window.__violations.push(e.violatedDirective + ' ' + e.blockedURI));")
            page = ctx.new_page()
            page.set_default_timeout(15000)
            dialogs: list[str] = []
            page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
            page.goto(desk.url + "/ui/login")
            page.fill("#api_key", desk.token("admin"))
            page.click("button[type=submit]")
            page.wait_for_url("**/ui/")
            shown = ""
            for path in pages:
                resp = page.goto(desk.url + path)
                assert resp is not None and resp.status == 200, path
                assert "script-src 'self'" in (resp.headers.get("content-security-policy") or ""), path
                page.wait_for_load_state("networkidle")
                page.mouse.move(5, 5)
                assert page.evaluate("window.__pwned") is None, (path, page.evaluate("window.__pwned"))
                assert page.evaluate("window.__violations") == [], (path, page.evaluate("window.__violations"))
                assert page.locator(INJECTED).count() == 0, path
                shown += page.evaluate("document.body.innerText")
            assert not dialogs, dialogs
        finally:
            browser.close()
    # Shown as text: the payloads are on the pages, inert.
    for marker in ("<script>window.__pwned='script'</script>", "onerror=", "javascript:window.__pwned"):
        assert marker in shown, marker
