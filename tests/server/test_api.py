"""The REST API through a real server on loopback."""

from __future__ import annotations

import datetime as dt

import httpx
import pytest

from undolog_core import ApprovalPending

from ..support.demo_app import UNDONE
from .conftest import Desk, LiveServer, problem


def test_openapi_is_served_and_names_the_actions(desk: Desk) -> None:
    spec = httpx.get(desk.url + "/openapi.json", timeout=30).json()
    assert spec["openapi"].startswith("3.")
    for path in ("/v1/approvals/{approval_request_id}:approve", "/v1/sessions/{session_id}:rollback",
                 "/v1/sessions/{session_id}/tools/{tool}:invoke", "/v1/audit/verify"):
        assert path in spec["paths"], path
    assert "HTTPBearer" in spec["components"]["securitySchemes"]


def test_unknown_route_is_problem_json(desk: Desk) -> None:
    problem(desk.client("admin").get("/v1/nope"), 404, "not_found")
    problem(desk.client("admin").delete("/v1/approvals"), 405, "method_not_allowed")


def test_list_filters(desk: Desk) -> None:
    wire, wire_sid = desk.pending("wire_money")
    delete, _ = desk.pending("delete_user_account")
    c = desk.client("approver")
    ids = lambda r: [a["approval_request_id"] for a in r.json()]  # noqa: E731
    assert ids(c.get("/v1/approvals")) == [delete, wire]  # newest first
    assert ids(c.get("/v1/approvals", params={"tool": "wire_money"})) == [wire]
    assert ids(c.get("/v1/approvals", params={"risk_tag": "pii"})) == [delete]
    assert ids(c.get("/v1/approvals", params={"session_id": wire_sid})) == [wire]
    assert ids(c.get("/v1/approvals", params={"state": "approved"})) == []
    assert ids(c.get("/v1/approvals", params={"limit": 1, "offset": 1})) == [wire]
    problem(c.get("/v1/approvals", params={"state": "bogus"}), 422, "validation_failed")


def test_show_has_everything_to_decide(desk: Desk) -> None:
    s = desk.session()
    with s:
        s.call_sync("search_kb", query="refund policy")
        s.call_sync("send_refund_email", user_id="u9", amount=12.5, call_id="e1")
        try:
            s.call_sync("delete_user_account", user_id="u9", call_id="d1")
        except ApprovalPending as p:
            rid = p.approval_request_id
    a = desk.client("approver").get(f"/v1/approvals/{rid}").json()
    assert a["proposed_args"] == {"user_id": "u9"}
    assert a["reason"] == "Deletes every record of the user"
    assert a["risk_tags"] == ["pii"]
    assert 0 < a["seconds_left"] <= 3600
    assert dt.datetime.fromisoformat(a["timeout_at"]) > dt.datetime.now(dt.UTC)
    assert [c["tool_name"] for c in a["recent_calls"]][:2] == ["delete_user_account", "send_refund_email"] or \
        "send_refund_email" in [c["tool_name"] for c in a["recent_calls"]]
    assert [(u["tool_name"], u["compensation_name"], u["compensation_registered"]) for u in a["undo_plan"]] == [
        ("send_refund_email", "cancel_refund_email", True)
    ]
    assert a["tool"]["tier"] == "irreversible" and a["tool"]["fingerprint"]
    problem(desk.client("approver").get("/v1/approvals/does-not-exist"), 404, "approval_not_found")


def test_approve_once_then_409(desk: Desk) -> None:
    rid, sid = desk.pending()
    c = desk.client("approver")
    r = c.post(f"/v1/approvals/{rid}:approve", json={"reason": "checked with the user"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "approved"
    assert desk.key("approver").key_id in r.json()["decided_by"]
    problem(c.post(f"/v1/approvals/{rid}:approve", json={}), 409, "approval_already_decided")
    problem(desk.client("admin").post(f"/v1/approvals/{rid}:reject", json={"reason": "late"}), 409,
            "approval_already_decided")
    problem(c.post(f"/v1/approvals/{rid}:modify", json={"args": {"user_id": "x"}}), 409, "approval_already_decided")
    # The call runs once, with the approved args, when the agent re-issues it.
    s = desk.undolog.session(agent_id="bot", session_id=sid)
    with s:
        assert s.call_sync("delete_user_account", user_id="u1", call_id="c-1") == {"deleted": "u1"}
    events = c.get(f"/v1/approvals/{rid}/events").json()
    assert [e["actor"] for e in events if desk.key("approver").key_id in e["actor"]]


@pytest.mark.pg_smoke
def test_concurrent_decisions_one_wins_the_rest_are_409(desk: Desk) -> None:
    from concurrent.futures import ThreadPoolExecutor

    desk.add_key("approver2", ["approver"])
    rid, sid = desk.pending()
    moves = [("approver", "approve", {}), ("approver2", "reject", {"reason": "no"}), ("admin", "modify",
             {"args": {"user_id": "u9"}}), ("approver2", "approve", {}), ("approver", "reject", {"reason": "x"}),
             ("admin", "approve", {})]

    def decide(m: tuple[str, str, dict]) -> httpx.Response:  # type: ignore[type-arg]
        who, action, body = m
        return httpx.post(f"{desk.url}/v1/approvals/{rid}:{action}", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {desk.token(who)}"})

    with ThreadPoolExecutor(len(moves)) as pool:
        answers = list(pool.map(decide, moves))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] + [409] * (len(moves) - 1), [(r.status_code, r.text[:200]) for r in answers]
    for r in answers:
        if r.status_code == 409:
            problem(r, 409, "approval_already_decided")
    events = desk.client("admin").get(f"/v1/approvals/{rid}/events").json()
    assert sum(e["action"] in ("approved", "approve", "rejected", "reject", "modified", "modify") for e in events) == 1, events


def test_approve_without_body(desk: Desk) -> None:
    rid, _ = desk.pending()
    assert desk.client("approver").post(f"/v1/approvals/{rid}:approve").status_code == 200


@pytest.mark.pg_smoke
def test_reject_needs_reason_and_halts_the_session(desk: Desk) -> None:
    rid, sid = desk.pending()
    c = desk.client("approver")
    problem(c.post(f"/v1/approvals/{rid}:reject", json={}), 422, "validation_failed")
    r = c.post(f"/v1/approvals/{rid}:reject", json={"reason": "not this user"})
    assert r.json()["state"] == "rejected" and r.json()["decision_reason"] == "not this user"
    assert desk.client("admin").get(f"/v1/sessions/{sid}").json()["state"] == "halted"


def test_modify_validates_against_the_tool_schema(desk: Desk) -> None:
    rid, _ = desk.pending("wire_money", to="acme", amount=10.0)
    c = desk.client("approver")
    bad = problem(c.post(f"/v1/approvals/{rid}:modify", json={"args": {"to": "acme", "amount": "lots"}}), 422,
                  "arguments_invalid")
    assert "amount" in bad["detail"]
    assert any(e["field"] == "amount" for e in bad["errors"])
    assert desk.undolog.approvals.get(rid).state == "pending"
    r = c.post(f"/v1/approvals/{rid}:modify", json={"args": {"to": "acme", "amount": 5.0}, "reason": "halve it"})
    assert r.status_code == 200, r.text
    assert r.json()["approved_args"] == {"to": "acme", "amount": 5.0}


@pytest.mark.pg_smoke
def test_sessions_create_show_rollback(desk: Desk) -> None:
    agent = desk.client("agent")
    r = agent.post("/v1/sessions", json={"agent_id": "http-bot", "label": "sess-http"})
    assert r.status_code == 201, r.text
    assert r.json()["created_by"] == desk.key("agent").principal_ref
    sid = r.json()["session_id"]
    assert sid.startswith("sess-http.") and r.headers["Location"] == f"/v1/sessions/{sid}"
    # Posting the same label again mints another session: ids are never the caller's to pick.
    assert agent.post("/v1/sessions", json={"agent_id": "http-bot", "label": "sess-http"}).json()["session_id"] != sid
    s = desk.undolog.session(agent_id="http-bot", session_id=sid)
    with s:
        s.call_sync("send_refund_email", user_id="a", amount=1.0, call_id="m1")
        s.call_sync("send_refund_email", user_id="b", amount=2.0, call_id="m2")
    shown = agent.get(f"/v1/sessions/{sid}").json()
    assert [e["tool_name"] for e in shown["effects"]] == ["send_refund_email"] * 2
    assert all(e["tier"] == "compensable" and e["state"] == "committed" for e in shown["effects"])
    assert shown["effects"][0]["args_snapshot"] == {"user_id": "a", "amount": 1.0}
    assert shown["effects"][0]["result_snapshot"] == {"sent_to": "a", "amount": 1.0}
    UNDONE.clear()
    rb = agent.post(f"/v1/sessions/{sid}:rollback")
    assert rb.status_code == 200, rb.text
    steps = rb.json()["steps"]
    assert [st["compensation_name"] for st in steps] == ["cancel_refund_email"] * 2
    assert all(st["outcome"] for st in steps)
    assert [u["args"]["user_id"] for u in UNDONE] == ["b", "a"]  # LIFO
    assert all(u["key"].startswith("undo-") for u in UNDONE)
    assert agent.get(f"/v1/sessions/{sid}").json()["state"] == "rolled_back"
    again = agent.post(f"/v1/sessions/{sid}:rollback").json()
    assert again["steps"] == [] or again["already_rolled_back"]


def test_resume_after_rejection(desk: Desk) -> None:
    rid, sid = desk.pending()
    desk.client("approver").post(f"/v1/approvals/{rid}:reject", json={"reason": "no"})
    r = desk.client("admin").post(f"/v1/sessions/{sid}:resume", json={"reason": "talked to the team"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] != "halted"


@pytest.mark.pg_smoke
def test_rollback_with_a_missing_compensation_changes_nothing(desk: Desk, db) -> None:  # type: ignore[no-untyped-def]
    from undolog_server import create_app
    from undolog_server.state import ServerSettings

    s = desk.session()
    with s:
        s.call_sync("send_refund_email", user_id="a", amount=1.0, call_id="m1")
    before = desk.client("admin").get(f"/v1/sessions/{s.id}").json()
    bare = db.open()  # a server started without --app: the compensation is not loaded
    server = LiveServer(create_app(bare, settings=ServerSettings(background=False))).start()
    try:
        r = httpx.post(f"{server.url}/v1/sessions/{s.id}:rollback",
                       headers={"Authorization": f"Bearer {desk.token('admin')}"}, timeout=30)
        body = problem(r, 409, "compensation_not_found")
        assert "cancel_refund_email" in body["detail"]
        plan = httpx.get(f"{server.url}/v1/sessions/{s.id}", headers={"Authorization": f"Bearer {desk.token('admin')}"}, timeout=30).json()
        # Nothing changed: not the session's state, not its undo stack, not its effects.
        assert plan["state"] == before["state"] and plan["halted_reason"] == before["halted_reason"]
        assert plan["undo_plan"] == [dict(u, compensation_registered=False) for u in before["undo_plan"]]
        assert plan["effects"] == before["effects"]
        assert plan["undo_plan"][0]["compensation_registered"] is False
    finally:
        server.stop()
        bare.close()
    assert desk.client("admin").post(f"/v1/sessions/{s.id}:rollback").status_code == 200


@pytest.mark.pg_smoke
def test_tools_registry_and_audit(desk: Desk) -> None:
    tools = {t["name"]: t for t in desk.client("agent").get("/v1/tools").json()}
    assert {"search_kb", "send_refund_email", "delete_user_account", "wire_money"} <= set(tools)
    t = tools["delete_user_account"]
    assert t["tier"] == "irreversible" and len(t["fingerprint"]) >= 16 and t["registered_here"]
    assert t["revisions"][0]["revision"] == t["revision"]
    problem(desk.client("agent").get("/v1/tools/nope"), 404, "tool_not_registered")
    rid, _ = desk.pending()
    desk.client("approver").post(f"/v1/approvals/{rid}:approve", json={})
    audit = desk.client("approver").get("/v1/audit/verify").json()
    assert audit["ok"] is True and audit["events_checked"] >= 1


def test_admin_manages_keys(desk: Desk) -> None:
    admin = desk.client("admin")
    r = admin.post("/v1/keys", json={"name": "bo", "roles": ["approver"], "groups": ["billing"]})
    assert r.status_code == 201
    token = r.json()["key"]
    me = httpx.get(desk.url + "/v1/me", headers={"Authorization": f"Bearer {token}"}, timeout=30).json()
    assert me["name"] == "bo" and me["roles"] == ["approver"] and me["groups"] == ["billing"]
    listed = admin.get("/v1/keys").json()
    assert all("key" not in k and "secret_hash" not in k for k in listed)
    problem(admin.post("/v1/keys", json={"name": "x", "roles": ["root"]}), 422, "validation_failed")
    assert admin.delete(f"/v1/keys/{r.json()['key_id']}").status_code == 204
    problem(admin.delete(f"/v1/keys/{r.json()['key_id']}"), 404, "key_not_found")


@pytest.mark.pg_smoke
def test_revalidate_after_a_contract_change(desk: Desk) -> None:
    from undolog_core import errors

    s = desk.session()
    with s:
        s.call_sync("send_refund_email", user_id="a", amount=1.0, call_id="m1")

    def send_refund_email(user_id: str, amount: float) -> dict:  # type: ignore[type-arg]
        return {"sent_to": user_id, "amount": amount, "v": 2}

    desk.undolog.register_tool(send_refund_email, name="send_refund_email", tier="compensable",
                               compensation="cancel_refund_email", reason="now also emails a copy")
    tool = desk.client("agent").get("/v1/tools/send_refund_email").json()
    assert [r["revision"] for r in tool["revisions"]] == [2, 1]
    assert tool["revisions"][0]["previous_fingerprint"] == tool["revisions"][1]["fingerprint"]
    s2 = desk.undolog.session(agent_id="bot", session_id=s.id)
    try:
        s2.call_sync("send_refund_email", user_id="b", amount=2.0, call_id="m2")
        raise AssertionError("expected ContractChanged")
    except errors.ContractChanged:
        pass
    r = desk.client("admin").post(f"/v1/sessions/{s.id}:revalidate", json={})
    assert r.status_code == 200, r.text
    assert r.json()["changes"]
    s3 = desk.undolog.session(agent_id="bot", session_id=s.id)
    assert s3.call_sync("send_refund_email", user_id="b", amount=2.0, call_id="m2")["v"] == 2
