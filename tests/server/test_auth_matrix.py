"""Every endpoint x {no key, agent, approver, admin}: 401, 403 or admitted, as the README's auth matrix says.

Denied cells address objects that do not exist: the answer must still be 401/403, which
shows the role check runs before any lookup.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from undolog_core import ApprovalPending
from undolog_server.state import ServerSettings

from ..conftest import PG_URL, TEST_DB, Db
from .conftest import Desk, make_desk, problem

# The PostgreSQL smoke subset: every endpoint under every role, each cell a few reads and writes of the desk's tables.
# SQLite run only (reads_store), but for the tests marked pg_smoke: the matrix's cells check each route's roles,
# which sit above storage; the visibility and key tests read through the desk's queries, so they are kept in the
# PostgreSQL smoke subset.
pytestmark = pytest.mark.reads_store

PUBLIC = "public"
ALL = frozenset({"agent", "approver", "admin"})
DECIDERS = frozenset({"approver", "admin"})
ADMIN = frozenset({"admin"})
AGENT = frozenset({"agent"})
ROLES = ("agent", "approver", "admin")


def pending(d: Desk) -> dict[str, str]:
    rid, sid = d.pending()
    return {"approval_request_id": rid, "session_id": sid}


def agent_session(d: Desk) -> dict[str, str]:
    s = d.session("agent")
    with s:
        s.call_sync("send_refund_email", user_id="u1", amount=5.0, call_id="r1")
    return {"session_id": s.id}


def halted_session(d: Desk) -> dict[str, str]:
    rid, sid = d.pending()
    d.undolog.approvals.reject(rid, approver="someone", reason="no")
    return {"session_id": sid}


def unknown_effect(d: Desk) -> dict[str, str]:
    """A call of an agent's session that finished after another process took it over: ``unknown``, to resolve."""
    from undolog_core import errors
    from undolog_core.storage import schema as t

    s = d.session("agent")
    e = t.effect_log
    call = d.undolog.engine.intercept(s.id, "send_refund_email", {"user_id": "u1", "amount": 5.0}, call_id="late")
    with d.undolog.store.tx() as c:
        c.execute(e.update().where(e.c.effect_id == call.effect_id).values(owner="elsewhere|1|1|x"))
    with pytest.raises(errors.OutcomeConflict):
        d.undolog.engine.complete(call.effect_id, {"message_id": "m"})
    return {"effect_id": str(call.effect_id), "session_id": s.id}


def throwaway_key(d: Desk) -> dict[str, str]:
    key, _ = d.store.create_key("temp", ["agent"])
    return {"key_id": key.key_id}


def webhook(d: Desk) -> dict[str, str]:
    import uuid

    t = d.store.create_target("t-" + uuid.uuid4().hex[:6], "http://127.0.0.1:9/hook")
    return {"target_id": t.target_id}


def group(d: Desk) -> dict[str, str]:
    from undolog_server.storage import ApproverGroup

    d.store.put_group(ApproverGroup("g1", ("nothing",), ()))
    return {"name": "g1"}


def policy(d: Desk) -> dict[str, str]:
    from undolog_server.storage import NotificationPolicy

    d.store.put_policy(NotificationPolicy("pii"))
    return {"risk_tag": "pii"}


def email_address(d: Desk) -> dict[str, str]:
    from undolog_server.storage.email import EmailStore

    EmailStore(d.undolog.store).map_address("matrix@example.com", d.key("approver").key_id, actor="test")
    return {"address": "matrix@example.com"}


def slack_user(d: Desk) -> dict[str, str]:
    from undolog_server.storage.slack import SlackStore

    SlackStore(d.undolog.store).put_user("T0MATRIX", "U0GONE", d.key("approver").key_id, None)
    return {"team_id": "T0MATRIX", "user_id": "U0GONE"}


def slack_channel(d: Desk) -> dict[str, str]:
    from undolog_server.storage.slack import SlackChannel, SlackStore

    SlackStore(d.undolog.store).put_channel(SlackChannel("matrix-slack", "C0GONE"))
    return {"group": "matrix-slack"}


@dataclass(frozen=True)
class Row:
    method: str
    path: str
    allowed: Any
    ok: frozenset[int]
    params: Callable[[Desk], dict[str, str]] | None = None
    body: Any = None
    static: dict[str, str] = field(default_factory=dict)


MATRIX = [
    Row("GET", "/v1/health", PUBLIC, frozenset({200})),
    Row("GET", "/v1/me", ALL, frozenset({200})),
    Row("GET", "/v1/approvals", DECIDERS, frozenset({200})),
    Row("GET", "/v1/approvals/{approval_request_id}", DECIDERS, frozenset({200}), pending),
    Row("POST", "/v1/approvals/{approval_request_id}:approve", DECIDERS, frozenset({200}), pending, {}),
    Row("POST", "/v1/approvals/{approval_request_id}:reject", DECIDERS, frozenset({200}), pending, {"reason": "no"}),
    Row("POST", "/v1/approvals/{approval_request_id}:modify", DECIDERS, frozenset({200}), pending,
        {"args": {"user_id": "u2"}}),
    Row("GET", "/v1/approvals/{approval_request_id}/events", DECIDERS, frozenset({200}), pending),
    Row("POST", "/v1/sessions", AGENT, frozenset({201}), None, {"agent_id": "bot"}),
    Row("GET", "/v1/sessions", ALL, frozenset({200})),
    Row("GET", "/v1/sessions/{session_id}", ALL, frozenset({200}), agent_session),
    Row("POST", "/v1/sessions/{session_id}:rollback", frozenset({"agent", "admin"}), frozenset({200}), agent_session),
    Row("POST", "/v1/sessions/{session_id}:resume", ADMIN, frozenset({200}), halted_session, {}),
    Row("POST", "/v1/sessions/{session_id}:revalidate", ADMIN, frozenset({200}), agent_session, {}),
    Row("POST", "/v1/effects/{effect_id}:resolve", DECIDERS, frozenset({200}), unknown_effect,
        {"as": "committed", "reason": "checked the upstream"}),
    # No proxy is configured in this desk: an admitted agent gets 404 tool_not_proxied.
    Row("POST", "/v1/sessions/{session_id}/tools/{tool}:invoke", AGENT, frozenset({404}), agent_session, {},
        {"tool": "search_kb"}),
    Row("GET", "/v1/tools", ALL, frozenset({200})),
    Row("GET", "/v1/tools/{tool_name}", ALL, frozenset({200}), None, None, {"tool_name": "delete_user_account"}),
    Row("GET", "/v1/audit/verify", DECIDERS, frozenset({200})),
    Row("GET", "/v1/keys", ADMIN, frozenset({200})),
    Row("POST", "/v1/keys", ADMIN, frozenset({201}), None, {"name": "x", "roles": ["agent"]}),
    Row("DELETE", "/v1/keys/{key_id}", ADMIN, frozenset({204}), throwaway_key),
    Row("GET", "/v1/approver-groups", ADMIN, frozenset({200})),
    # (A tag no request carries: the matrix shares one desk, and this group must not reroute later cells.)
    Row("PUT", "/v1/approver-groups/{name}", ADMIN, frozenset({200}), None, {"risk_tags": ["matrix-only"]},
        {"name": "g2"}),
    Row("DELETE", "/v1/approver-groups/{name}", ADMIN, frozenset({204}), group),
    Row("GET", "/v1/webhooks", ADMIN, frozenset({200})),
    Row("POST", "/v1/webhooks", ADMIN, frozenset({201}), None, {"name": "w", "url": "http://127.0.0.1:9/x"}),
    Row("DELETE", "/v1/webhooks/{target_id}", ADMIN, frozenset({204}), webhook),
    Row("GET", "/v1/webhooks/{target_id}/deliveries", ADMIN, frozenset({200}), webhook),
    Row("GET", "/v1/notification-policies", ADMIN, frozenset({200})),
    Row("PUT", "/v1/notification-policies/{risk_tag}", ADMIN, frozenset({200}), None, {}, {"risk_tag": "pii"}),
    Row("DELETE", "/v1/notification-policies/{risk_tag}", ADMIN, frozenset({204}), policy),
    Row("GET", "/v1/email/approvers", ADMIN, frozenset({200})),
    # The body names no key (rows are static): an admitted admin is told so, 409 key_not_found.
    Row("PUT", "/v1/email/approvers/{address}", ADMIN, frozenset({409}), None, {"key_id": "nosuchkey"},
        {"address": "x@example.com"}),
    Row("DELETE", "/v1/email/approvers/{address}", ADMIN, frozenset({204}), email_address),
    Row("GET", "/v1/email/groups", ADMIN, frozenset({200})),
    Row("PUT", "/v1/email/groups/{group}", ADMIN, frozenset({200}), None, {"include_arguments": False},
        {"group": "matrix-only"}),
    Row("GET", "/v1/email/messages", ADMIN, frozenset({200})),
    Row("GET", "/v1/slack/users", ADMIN, frozenset({200})),
    # (The body names no key: an admitted admin is told so, 409; tests/server/test_slack.py maps real ones.)
    Row("PUT", "/v1/slack/users/{team_id}/{user_id}", ADMIN, frozenset({409}), None, {"key_id": "nosuchkey"},
        {"team_id": "T0MATRIX", "user_id": "U0MATRIX"}),
    Row("DELETE", "/v1/slack/users/{team_id}/{user_id}", ADMIN, frozenset({204}), slack_user),
    Row("GET", "/v1/slack/channels", ADMIN, frozenset({200})),
    Row("PUT", "/v1/slack/channels/{group}", ADMIN, frozenset({200}), None, {"channel": "C0MATRIX"}, {"group": "*"}),
    Row("DELETE", "/v1/slack/channels/{group}", ADMIN, frozenset({204}), slack_channel),
]

_MISSING = {
    "approval_request_id": "no-such-request",
    "session_id": "no-such-session",
    "key_id": "nosuchkey",
    "target_id": "wh_none",
    "name": "no-such-group",
    "risk_tag": "no-such-tag",
    "tool_name": "no_such_tool",
    "tool": "no_such_tool",
    "address": "nobody@example.com",
    "team_id": "T0NONE",
    "user_id": "U0NONE",
    "group": "no-such-group",
    "effect_id": "no-such-effect",
}


def _fill(path: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        path = path.replace("{" + k + "}", v)
    assert "{" not in path, path
    return path


def _call(d: Desk, who: str | None, row: Row, values: dict[str, str]) -> Any:
    kw: dict[str, Any] = {}
    if row.body is not None:
        kw["json"] = row.body
    return d.client(who).request(row.method, _fill(row.path, values), **kw)


def test_matrix_covers_every_api_route(desk: Desk) -> None:
    spec = desk.client(None).get("/openapi.json").json()
    routes = {(m.upper(), path) for path, ops in spec["paths"].items() for m in ops}
    assert routes == {(row.method, row.path) for row in MATRIX}


@pytest.fixture(scope="module")
def matrix_desk(tmp_path_factory: pytest.TempPathFactory, pg_admin: Any) -> Iterator[Desk]:
    """One desk for every cell: each cell makes the objects it needs, so they share it safely and the
    matrix does not pay a server start per cell."""
    if TEST_DB == "postgres":
        db = Db("postgres", PG_URL, "t_" + uuid.uuid4().hex[:16])
    else:
        db = Db("sqlite", f"sqlite:///{Path(tmp_path_factory.mktemp('matrix')) / 'undolog.db'}", None)
    # The webhook rows register a loopback target, which the target policy refuses without the opt-in.
    d = make_desk(db, settings=ServerSettings(background=False, webhook_allow_private=True))
    try:
        yield d
    finally:
        d.close()
        for u in db.opened:
            u.close()
        if db.schema:
            with pg_admin.connect() as c:
                c.exec_driver_sql(f'DROP SCHEMA IF EXISTS "{db.schema}" CASCADE')


@pytest.mark.parametrize("row", MATRIX, ids=[f"{r.method} {r.path}" for r in MATRIX])
def test_cell(matrix_desk: Desk, row: Row) -> None:
    desk = matrix_desk
    missing = {**_MISSING, **row.static} if row.allowed is PUBLIC else dict(_MISSING)
    failures = []
    for who in (None, *ROLES):
        admitted = row.allowed is PUBLIC or (who is not None and who in row.allowed)
        if not admitted:
            resp = _call(desk, who, row, missing)
            want = 401 if who is None else 403
            if resp.status_code != want:
                failures.append(f"{who or 'no key'}: expected {want}, got {resp.status_code} {resp.text[:200]}")
                continue
            problem(resp, want, "unauthenticated" if who is None else "role_forbidden")
            if who is None:
                assert resp.headers.get("www-authenticate", "").lower().startswith("bearer")
            if row.method in ("POST", "PUT"):
                # A malformed body must not be judged before the caller is: still 401/403, not 422.
                bad = desk.client(who).request(row.method, _fill(row.path, missing), content=b"{not json",
                                               headers={"Content-Type": "application/json"})
                if bad.status_code != want:
                    failures.append(f"{who or 'no key'} + malformed body: expected {want}, got {bad.status_code}")
            continue
        values = {**_MISSING, **row.static, **(row.params(desk) if row.params else {})}
        resp = _call(desk, who, row, values)
        if resp.status_code not in row.ok:
            failures.append(f"{who}: expected {sorted(row.ok)}, got {resp.status_code} {resp.text[:300]}")
    assert not failures, "\n".join(failures)


@pytest.mark.pg_smoke
def test_invalid_and_revoked_keys_are_401(desk: Desk) -> None:
    import httpx

    for token in ("nonsense", "ulk_abc_def", desk.token("admin") + "x", "ulk__"):
        r = httpx.get(desk.url + "/v1/me", headers={"Authorization": f"Bearer {token}"}, timeout=30)
        problem(r, 401, "invalid_api_key")
    r = httpx.get(desk.url + "/v1/me", headers={"Authorization": "Basic Zm9vOmJhcg=="}, timeout=30)
    problem(r, 401)
    key, token = desk.add_key("leaver", ["approver"])
    assert httpx.get(desk.url + "/v1/me", headers={"Authorization": f"Bearer {token}"}, timeout=30).status_code == 200
    desk.store.revoke_key(key.key_id)
    problem(httpx.get(desk.url + "/v1/me", headers={"Authorization": f"Bearer {token}"}, timeout=30), 401, "invalid_api_key")


@pytest.mark.pg_smoke
def test_keys_are_stored_hashed(desk: Desk) -> None:
    import sqlalchemy as sa

    from undolog_server.storage import api_keys

    with desk.store.core.tx() as conn:
        hashes = conn.execute(sa.select(api_keys.c.secret_hash)).scalars().all()
    for name in ("admin", "approver", "agent"):
        secret = desk.token(name).split("_", 2)[2]
        assert all(secret not in h for h in hashes)
    assert all(h.startswith("sha256:") for h in hashes)


@pytest.mark.pg_smoke
def test_agent_sees_only_its_own_sessions(desk: Desk) -> None:
    mine = agent_session(desk)["session_id"]
    s = desk.session("agent2")
    with s:
        s.call_sync("search_kb", query="x")
    theirs = s.id
    listed = {x["session_id"] for x in desk.client("agent").get("/v1/sessions").json()}
    assert mine in listed and theirs not in listed
    problem(desk.client("agent").get(f"/v1/sessions/{theirs}"), 404, "session_not_found")
    problem(desk.client("agent").post(f"/v1/sessions/{theirs}:rollback"), 404, "session_not_found")
    assert {mine, theirs} <= {x["session_id"] for x in desk.client("approver").get("/v1/sessions").json()}


@pytest.mark.pg_smoke
def test_no_one_decides_a_request_of_a_session_their_key_created(desk: Desk) -> None:
    desk.add_key("both", ["agent", "approver", "admin"])
    rid, _ = desk.pending(owner="both")
    for action, body in (("approve", {}), ("reject", {"reason": "x"}), ("modify", {"args": {"user_id": "u"}})):
        problem(desk.client("both").post(f"/v1/approvals/{rid}:{action}", json=body), 403, "self_approval_forbidden")
    assert desk.undolog.approvals.get(rid).state == "pending"
    assert desk.client("approver").post(f"/v1/approvals/{rid}:approve", json={}).status_code == 200


@pytest.mark.pg_smoke
def test_approver_groups_route_visibility_and_decisions(desk: Desk) -> None:
    from undolog_server.storage import ApproverGroup

    desk.store.put_group(ApproverGroup("billing", (), ("billing",)))
    desk.store.put_group(ApproverGroup("security", ("delete_user_account",), ()))
    desk.add_key("biller", ["approver"], ["billing"])
    wire, _ = desk.pending("wire_money")
    delete, _ = desk.pending("delete_user_account")
    seen = {a["approval_request_id"] for a in desk.client("biller").get("/v1/approvals").json()}
    assert wire in seen and delete not in seen
    problem(desk.client("biller").get(f"/v1/approvals/{delete}"), 403, "not_in_approver_group")
    problem(desk.client("biller").post(f"/v1/approvals/{delete}:approve", json={}), 403, "not_in_approver_group")
    # The plain approver is in no group: routed requests are not theirs.
    problem(desk.client("approver").post(f"/v1/approvals/{wire}:approve", json={}), 403, "not_in_approver_group")
    assert desk.client("biller").get(f"/v1/approvals/{wire}").json()["groups"] == ["billing"]
    assert desk.client("biller").post(f"/v1/approvals/{wire}:approve", json={}).status_code == 200
    # A session page does not show an outsider the requests routed to another group.
    delete_sid = desk.undolog.approvals.get(delete).session_id
    shown = desk.client("biller").get(f"/v1/sessions/{delete_sid}").json()["approvals"]
    assert shown == []
    assert [a["approval_request_id"] for a in desk.client("agent").get(f"/v1/sessions/{delete_sid}").json()[
        "approvals"]] == [delete]  # the agent that raised it sees its own session's requests
    # Admins see and decide everything.
    assert [a["approval_request_id"] for a in desk.client("admin").get(f"/v1/sessions/{delete_sid}").json()[
        "approvals"]] == [delete]
    assert desk.client("admin").post(f"/v1/approvals/{delete}:reject", json={"reason": "no"}).status_code == 200


@pytest.mark.pg_smoke
def test_pending_raises_for_irreversible(desk: Desk) -> None:
    s = desk.session()
    with s, pytest.raises(ApprovalPending):
        s.call_sync("wire_money", to="x", amount=1.0)


@pytest.mark.pg_smoke
def test_group_filtered_listing_pages_over_visible_requests(desk: Desk) -> None:
    from undolog_server.storage import ApproverGroup

    desk.store.put_group(ApproverGroup("billing", ("wire_money",), ()))
    desk.store.put_group(ApproverGroup("security", ("delete_user_account",), ()))
    desk.add_key("biller2", ["approver"], ["billing"])
    wires = []
    for i in range(5):
        wires.append(desk.pending("wire_money", to=f"t{i}", amount=1.0)[0])
        desk.pending("delete_user_account", user_id=f"x{i}")  # invisible to biller2
    wires.reverse()  # newest first
    c = desk.client("biller2")
    got = [a["approval_request_id"] for a in c.get("/v1/approvals", params={"limit": 2}).json()]
    assert got == wires[:2]
    got = [a["approval_request_id"] for a in c.get("/v1/approvals", params={"limit": 2, "offset": 2}).json()]
    assert got == wires[2:4]
    got = [a["approval_request_id"] for a in c.get("/v1/approvals", params={"limit": 10, "offset": 4}).json()]
    assert got == wires[4:]
