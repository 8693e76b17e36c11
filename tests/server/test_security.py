"""The desk's security findings 8-12 of issue 11, each through a real server on loopback.

Session-id squatting (9), proxy outcomes and contract fingerprints (10), group visibility (8), dashboard sessions
and CSRF (11) and the approved-call lifetime (12).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from undolog_server import create_app
from undolog_server.proxy import ProxyTools
from undolog_server.state import ServerSettings

from . import demo_app
from .conftest import Desk, LiveServer, make_desk, problem
from .upstream import Upstream


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


def test_an_upstream_timeout_on_an_approved_irreversible_call_is_unknown_and_halts(
    db: Any, upstream: Upstream, tmp_path: Path
) -> None:
    d = _proxy_desk(db, upstream, tmp_path, upstream.config().replace("timeout = 5", "timeout = 0.5"))
    try:
        sid = d.client("agent").post("/v1/sessions", json={"agent_id": "a"}).json()["session_id"]
        url = f"/v1/sessions/{sid}/tools/close_account:invoke"
        first = d.client("agent").post(url, json={"account": "acme"}, headers={"Idempotency-Key": "close-1"})
        assert first.status_code == 202, first.text
        rid = first.json()["approval_request_id"]
        assert d.client("approver").post(f"/v1/approvals/{rid}:approve").status_code == 200
        upstream.delay["/close"] = 1.5  # the upstream does the work, but answers after the proxy gave up
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
        assert spec.contract()["endpoint"]["url"] == f"{upstream.url}/close"
        assert spec.contract()["endpoint"]["headers"] == {"x-tenant": "acme"}
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
