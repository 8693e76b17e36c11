"""Inputs fuzzers rarely produce but attackers do: NUL bytes, huge ids, odd JSON."""

from __future__ import annotations

import pytest

from .conftest import Desk


@pytest.mark.parametrize(
    "who,method,path,body",
    [
        ("approver", "GET", "/v1/approvals/a%00b", None),
        ("approver", "GET", "/v1/approvals?session_id=a%00b", None),
        ("approver", "GET", "/v1/approvals?tool=a%00b&risk_tag=x%00", None),
        ("approver", "POST", "/v1/approvals/a%00b:approve", {}),
        ("admin", "GET", "/v1/sessions/a%00b", None),
        ("admin", "GET", "/v1/sessions?agent_id=a%00b", None),
        ("agent", "POST", "/v1/sessions", {"agent_id": "a\x00b"}),
        ("agent", "GET", "/v1/tools/a%00b", None),
        ("admin", "PUT", "/v1/approver-groups/g%00", {"tools": ["a\x00"]}),
        ("admin", "POST", "/v1/keys", {"name": "n\x00", "roles": ["agent"]}),
        ("admin", "POST", "/v1/webhooks", {"name": "w\x00", "url": "http://127.0.0.1:9/\x00"}),
        ("admin", "PUT", "/v1/notification-policies/t%00", {}),
        ("agent", "POST", "/v1/sessions/s%00/tools/t:invoke", {"a": "\x00"}),
        ("approver", "GET", "/v1/approvals/" + "x" * 5000, None),
    ],
)
def test_no_5xx_on_hostile_input(desk: Desk, who: str, method: str, path: str, body: object) -> None:
    r = desk.client(who).request(method, path, json=body) if body is not None else desk.client(who).request(method, path)
    assert r.status_code < 500, r.text
    assert r.headers["content-type"].startswith(("application/problem+json", "application/json"))


def test_decision_reason_with_nul_is_refused_not_crashed(desk: Desk) -> None:
    rid, _ = desk.pending()
    r = desk.client("approver").post(f"/v1/approvals/{rid}:reject", json={"reason": "no\x00pe"})
    assert r.status_code == 422, r.text
    r = desk.client("approver").post(f"/v1/approvals/{rid}:modify", json={"args": {"user_id": "a\x00"}})
    assert r.status_code == 422, r.text
    assert desk.undolog.approvals.get(rid).state == "pending"
