"""The desk's limits, tried as an attacker would, through a real server on loopback (issue 11, findings 1, 2, 3, 7).

Each test failed on the code before: bodies of any size were buffered, hostile JSON gave 500s (a RecursionError in
the NUL check, UnicodeEncodeError on a surrogate), listings returned whole argument blobs, proxied tools' schemas were
mostly ignored, and identities longer than PostgreSQL's VARCHAR(200) were 500s that left requests pending.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from undolog_core import ApprovalPending, limits
from undolog_server.state import ServerSettings
from undolog_server.storage import KEY_NAME_MAX, ApproverGroup

from .conftest import Desk, make_desk, problem
from .test_dashboard import _login
from .test_processes import _spawn, _stop, _wait_up


def raw_exchange(url: str, head: str, chunks: list[bytes], timeout: float = 10.0) -> bytes:
    """Send a request as raw bytes (a head, then body chunks) and read the answer until the server closes or stops."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(head.encode())
        for chunk in chunks:
            try:
                sock.sendall(chunk)
            except OSError:
                break  # the server answered and closed: that is the point
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
                part = sock.recv(65536)
                if not part:
                    break
                data += part
        except OSError:
            pass
    return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 0


def status_and_body(data: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"application/problem+json" in head, head
    return int(head.split(b" ", 2)[1]), json.loads(body)


def nested(n: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(n):
        value = {"a": value}
    return value


def post_raw(d: Desk, who: str, path: str, body: bytes) -> httpx.Response:
    return d.client(who).post(path, content=body, headers={"Content-Type": "application/json"})


@pytest.fixture
def small(db: Any) -> Iterator[Desk]:
    d = make_desk(db, settings=ServerSettings(background=False, max_body_bytes=1000))
    yield d
    d.close()


# -- finding 1: request bodies --------------------------------------------------------------------------------------


def test_a_content_length_over_the_limit_is_413_before_the_body_is_sent(desk: Desk) -> None:
    """The default limit (1 MiB) is checked up front: the server answers without waiting for 50 MB."""
    head = (f"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {desk.token('agent')}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {50 * 1024 * 1024}\r\n\r\n")
    status, body = status_and_body(raw_exchange(desk.url, head, []))
    assert status == 413 and body["code"] == "payload_too_large" and body["limit"] == 1 << 20
    assert desk.undolog.sessions.list() == []


def test_a_chunked_body_is_counted_while_it_is_read(small: Desk) -> None:
    """No Content-Length: the server reads 800 + 800 bytes, passes the limit (1000) and answers 413, never waiting
    for the rest of the body (which is never sent)."""
    head = (f"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {small.token('agent')}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b'{"agent_id": "' + b"a" * 780
    status, body = status_and_body(raw_exchange(small.url, head, [b"%x\r\n%s\r\n" % (len(chunk), chunk),
                                                                  b"320\r\n" + b"b" * 800 + b"\r\n"]))
    assert status == 413 and body["limit"] == 1000
    # Under the limit, the same route works.
    r = small.client("agent").post("/v1/sessions", json={"agent_id": "bot"})
    assert r.status_code == 201, r.text
    problem(small.client("agent").post("/v1/sessions", json={"agent_id": "x" * 2000}), 413, "payload_too_large")


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_undolog_serve_keeps_its_memory_under_a_50_mb_body(db: Any, tmp_path: Path) -> None:
    """A real `undolog serve` process: a 50 MB chunked body is refused at the limit; its RSS hardly moves (it rose
    by about 620 MB before). `--max-body-bytes` sets the limit."""
    log = tmp_path / "serve.log"
    proc, url = _spawn(db, log, "--max-body-bytes", "65536")
    try:
        _wait_up(proc, url, log)
        before = _rss_kib(proc.pid)
        head = ("POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer ulk_x_y\r\n"
                "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = b"x" * 65536
        chunks = [b"%x\r\n%s\r\n" % (len(block), block)] * 800  # 50 MiB
        status, body = status_and_body(raw_exchange(url, head, chunks, timeout=30))
        assert status == 413 and body["limit"] == 65536
        grown_mib = (_rss_kib(proc.pid) - before) / 1024
        print(f"RSS before {before / 1024:.1f} MiB, grown by {grown_mib:.1f} MiB")
        assert grown_mib < 20
        assert httpx.get(url + "/v1/health", timeout=5).status_code == 200
    finally:
        _stop(proc)


# -- finding 2: hostile JSON ----------------------------------------------------------------------------------------


def test_a_lone_surrogate_is_refused_naming_the_path_and_nothing_is_stored(desk: Desk) -> None:
    body = problem(post_raw(desk, "agent", "/v1/sessions", b'{"agent_id": "bot \\ud800"}'), 422, "invalid_unicode")
    assert body["errors"][0]["field"] == "agent_id"
    assert desk.undolog.sessions.list() == []
    rid, _ = desk.pending()
    body = problem(post_raw(desk, "approver", f"/v1/approvals/{rid}:modify",
                            b'{"args": {"user_id": "\\udfff"}}'), 422, "invalid_unicode")
    assert body["errors"][0]["field"] == "args.user_id"
    problem(post_raw(desk, "approver", f"/v1/approvals/{rid}:reject", b'{"reason": "\\ud83d"}'), 422, "invalid_unicode")
    assert desk.undolog.approvals.get(rid).state == "pending"


def test_nesting_past_64_is_refused_naming_the_path(desk: Desk) -> None:
    rid, _ = desk.pending()
    for depth in (65, 900, 100_000):
        raw = b'{"args": ' + b'{"a": ' * (depth - 1) + b"1" + b"}" * (depth - 1) + b"}"
        if len(raw) > 1 << 20:
            raw = b'{"args": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"
        body = problem(post_raw(desk, "approver", f"/v1/approvals/{rid}:modify", raw), 422, "json_too_deep")
        assert "64" in body["detail"]
        if depth == 65:
            assert body["errors"][0]["field"] == "args" + ".a" * 63
    assert desk.undolog.approvals.get(rid).state == "pending"


def test_a_number_too_large_to_be_finite_is_refused(desk: Desk) -> None:
    """JSON numbers are finite; 1e999 read as infinity could be neither stored alike nor sent upstream (a 500)."""
    rid, _ = desk.pending()
    body = problem(post_raw(desk, "approver", f"/v1/approvals/{rid}:modify", b'{"args": {"user_id": 1e999}}'),
                   422, "number_out_of_range")
    assert "1e999" in body["detail"]
    assert desk.undolog.approvals.get(rid).state == "pending"


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity"])
def test_nan_and_infinity_literals_are_refused_like_1e999(hostile: tuple[Desk, HostileUpstream], literal: bytes) -> None:
    """Python's JSON reader takes NaN and Infinity, which JSON has not: a modify with one was a 500 (the decision's
    digest cannot encode it), and a proxied COMPENSABLE call with one was a 500 that rolled its session back and sent
    the upstream a compensation for a call it never received."""
    d, up = hostile
    sid = _session(d)
    r = d.client("agent").post(f"/v1/sessions/{sid}/tools/pay:invoke", json={"to": "acme", "amount": 5})
    assert r.status_code == 202, r.text
    rid = r.json()["approval_request_id"]
    body = problem(post_raw(d, "approver", f"/v1/approvals/{rid}:modify",
                            b'{"args": {"to": "acme", "amount": ' + literal + b"}}"), 422, "number_out_of_range")
    assert body["errors"][0]["field"] == "args.amount" and literal.decode() in body["detail"]
    assert d.undolog.approvals.get(rid).state == "pending"
    body = problem(post_raw(d, "agent", f"/v1/sessions/{sid}/tools/echo:invoke", b'{"n": [1, ' + literal + b"]}"),
                   422, "number_out_of_range")
    assert body["errors"][0]["field"] == "n.1"
    # A string that merely says it is still an ordinary argument.
    assert post_raw(d, "agent", f"/v1/sessions/{sid}/tools/echo:invoke", b'{"n": "NaN Infinity"}').status_code == 200
    # Not rolled back: the session still waits on its pending request.
    assert d.client("agent").get(f"/v1/sessions/{sid}").json()["state"] == "awaiting_approval"
    assert [p for p, _ in up.calls] == ["/echo"]  # no call with the literal, and no compensation


def test_the_door_is_not_sidestepped_by_a_long_float_or_a_form_word_in_the_media_type(
        hostile: tuple[Desk, HostileUpstream]) -> None:
    """Two ways past the door's checks, both a 500 that rolled the session back (and sent a compensation for a call
    the upstream never got), or a NUL forwarded upstream: a float of 400 digits without an exponent (infinity to
    Python; the door looked for big exponents only), and a JSON media type whose parameter says ``form-urlencoded``
    (the door took the body for a form and skipped the JSON checks; FastAPI still parsed it as JSON)."""
    d, up = hostile
    sid = _session(d)
    echo = f"/v1/sessions/{sid}/tools/echo:invoke"
    body = problem(post_raw(d, "agent", echo, b'{"n": 1' + b"0" * 400 + b".0}"), 422, "number_out_of_range")
    assert body["errors"][0]["field"] == "n"
    sneaky = {"Content-Type": "application/json; x=form-urlencoded"}
    for raw, code in ((b'{"n": "a\\u0000b"}', "nul_character"), (b'{"n": 1e999}', "number_out_of_range"),
                      (b'{"n": ' + b"[" * 100 + b"]" * 100 + b"}", "json_too_deep")):
        body = problem(d.client("agent").post(echo, content=raw, headers=sneaky), 422, code)
        assert body["errors"][0]["field"].startswith("n"), body
    # An ordinary long integer is still an argument, and a real form is still a form (the dashboard's).
    assert post_raw(d, "agent", echo, b'{"n": 1' + b"0" * 400 + b"}").status_code == 200
    assert d.client("agent").get(f"/v1/sessions/{sid}").json()["state"] == "active"
    assert [p for p, _ in up.calls] == ["/echo"]


def test_a_nul_nested_deep_is_a_422_not_a_recursion_error(desk: Desk) -> None:
    """The NUL check used to recurse: 5,000 levels around a \\u0000 was a RecursionError (500)."""
    rid, _ = desk.pending()
    deep = b'{"args": {"user_id": ' + b"[" * 5000 + b'"\\u0000"' + b"]" * 5000 + b"}}"
    problem(post_raw(desk, "approver", f"/v1/approvals/{rid}:modify", deep), 422, "json_too_deep")
    shallow = json.dumps({"args": {"user_id": nested(10, "a\x00b")}}).encode()
    body = problem(post_raw(desk, "approver", f"/v1/approvals/{rid}:modify", shallow), 422, "nul_character")
    assert body["errors"][0]["field"] == "args.user_id." + ".".join(["a"] * 10)
    assert desk.undolog.approvals.get(rid).state == "pending"


def test_approver_groups_refuse_a_surrogate_and_a_stored_one_never_500s_the_listing(desk: Desk) -> None:
    admin = desk.client("admin")
    problem(admin.put("/v1/approver-groups/billing", content=b'{"tools": ["\\ud800"]}',
                      headers={"Content-Type": "application/json"}), 422, "invalid_unicode")
    assert admin.get("/v1/approver-groups").json() == []
    # A row stored before this check existed (written here straight through the store) is served escaped.
    try:
        desk.store.put_group(ApproverGroup("old", ("tool \ud800",), ()))
    except Exception:
        assert desk.undolog.store.dialect == "postgresql"  # PostgreSQL's json refuses a lone surrogate itself
        return
    r = admin.get("/v1/approver-groups")
    assert r.status_code == 200, r.text
    assert r.json() == [{"name": "old", "tools": ["tool \ud800"], "risk_tags": [], "description": None}]
    # The dashboard prints it escaped too, on the page of a request routed to that group.
    desk.store.put_group(ApproverGroup("old", ("tool \ud800", "delete_user_account"), ()))
    rid, _ = desk.pending()
    page = _login(desk, "admin").get(f"/ui/approvals/{rid}")
    assert page.status_code == 200 and "old" in page.text
    from undolog_server.dashboard import templates

    assert templates.env.from_string("{{ v }}").render(v="x \ud800").encode("utf-8") == b"x \\ud800"


def test_every_5xx_is_logged_with_its_traceback(desk: Desk, caplog: pytest.LogCaptureFixture,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(**kw: Any) -> Any:
        raise RuntimeError("the disk is on fire")

    monkeypatch.setattr(desk.undolog.sessions, "list", boom)
    with caplog.at_level(logging.ERROR, logger="undolog.server"):
        problem(desk.client("admin").get("/v1/sessions"), 500, "internal_error")
    (rec,) = [r for r in caplog.records if r.name == "undolog.server"]
    assert rec.exc_info is not None and "the disk is on fire" in str(rec.exc_info[1])


# -- finding 1: listings carry previews, not blobs -------------------------------------------------------------------


def test_listings_carry_previews_of_a_large_stored_argument(desk: Desk) -> None:
    big = "x" * (5 * 1024 * 1024)  # through the Python API, which has no body limit
    rid, sid = desk.pending(user_id=big)
    approver = desk.client("approver")
    t0 = time.perf_counter()
    listed = approver.get("/v1/approvals")
    poll = desk.client(None)
    assert listed.status_code == 200 and len(listed.content) < 20_000, len(listed.content)
    (item,) = listed.json()
    assert item["proposed_args"]["undolog_truncated"]["preview"].startswith('{"user_id": "xxx')
    detail = approver.get(f"/v1/approvals/{rid}")
    assert detail.json()["proposed_args"] == {"user_id": big}  # a person decides on the whole of it
    timeline = approver.get(f"/v1/sessions/{sid}")
    assert len(timeline.content) < 20_000
    assert "undolog_truncated" in timeline.json()["effects"][0]["args_snapshot"]
    events = approver.get(f"/v1/approvals/{rid}/events", params={"limit": 1})
    assert len(events.json()) == 1 and len(events.content) < 20_000
    print(f"listing with a 5 MiB argument: {time.perf_counter() - t0:.3f}s")
    del poll


def test_a_session_timeline_is_paged(desk: Desk) -> None:
    s = desk.session()
    with s:
        for i in range(5):
            s.call_sync("send_refund_email", user_id=f"u{i}", amount=1.0)
    c = desk.client("approver")
    page = c.get(f"/v1/sessions/{s.id}", params={"effects_limit": 2, "effects_offset": 1}).json()["effects"]
    assert [e["args_snapshot"]["user_id"] for e in page] == ["u1", "u2"]
    problem(c.get(f"/v1/sessions/{s.id}", params={"effects_limit": 100_000}), 422, "validation_failed")


# -- finding 3: full JSON Schema through the REST API ------------------------------------------------------------------


SCHEMA_TOML = """
[tools.pay]
tier = "irreversible"
url = "{url}/pay"
[tools.pay.args_schema]
type = "object"
required = ["to", "amount"]
additionalProperties = false
properties = {{ to = {{ type = "string", enum = ["acme", "globex"] }}, amount = {{ type = "number", minimum = 0, maximum = 1000 }}, memo = {{ type = "string", maxLength = 10 }}, lines = {{ type = "array", items = {{ type = "object", properties = {{ sku = {{ type = "string", pattern = "^S[0-9]+$" }} }} }} }} }}

[tools.echo]
tier = "compensable"
url = "{url}/echo"
compensation_url = "{url}/cancel"
max_response_bytes = 100000
"""


class HostileUpstream:
    """An upstream that answers each path with a body an attacker (or a bug) would send."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        deep = b"[" * 3000 + b"]" * 3000
        bodies = {
            "/pay": b'{"paid": true}',
            "/cancel": b"{}",
            "/echo/surrogate": b'{"note": "\\ud800 and \\udfff"}',
            "/echo/deep": deep,
            "/echo/huge": b'{"blob": "' + b"y" * 3_000_000 + b'"}',
            "/echo/text": b"plain \xff text",
        }
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                data = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                outer.calls.append((self.path, data))
                raw = bodies.get(self.path, b"{}")
                self.send_response(200)
                self.send_header("Content-Type", "text/plain" if self.path.endswith("text") else "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                try:
                    self.wfile.write(raw)
                except OSError:
                    pass  # the proxy stopped reading at its limit

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def config(self) -> str:
        cfg = SCHEMA_TOML.format(url=self.url)
        for kind in ("surrogate", "deep", "huge", "text"):
            cfg += (f'\n[tools.echo_{kind}]\ntier = "compensable"\nurl = "{self.url}/echo/{kind}"\n'
                    f'compensation_url = "{self.url}/cancel"\nmax_response_bytes = 100000\n')
        return cfg

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def hostile(db: Any, tmp_path: Path) -> Iterator[tuple[Desk, HostileUpstream]]:
    up = HostileUpstream()
    cfg = tmp_path / "tools.toml"
    cfg.write_text(up.config())
    d = make_desk(db, proxy_config=str(cfg))
    yield d, up
    d.close()
    up.stop()


def _session(d: Desk) -> str:
    r = d.client("agent").post("/v1/sessions", json={"agent_id": "http-agent"})
    assert r.status_code == 201, r.text
    return str(r.json()["session_id"])


def test_proxied_input_and_approver_edits_are_checked_against_the_whole_schema(
        hostile: tuple[Desk, HostileUpstream]) -> None:
    d, up = hostile
    sid = _session(d)
    agent = d.client("agent")
    body = problem(agent.post(f"/v1/sessions/{sid}/tools/pay:invoke", json={"to": "mallory", "amount": 1e12}),
                   422, "arguments_invalid")
    assert sorted(e["field"] for e in body["errors"]) == ["amount", "to"]
    body = problem(agent.post(f"/v1/sessions/{sid}/tools/pay:invoke",
                              json={"to": "acme", "amount": 5, "lines": [{"sku": "nope"}]}), 422, "arguments_invalid")
    assert body["errors"][0]["field"] == "lines.0.sku"
    r = agent.post(f"/v1/sessions/{sid}/tools/pay:invoke", json={"to": "acme", "amount": 5},
                   headers={"Idempotency-Key": "k-1"})
    assert r.status_code == 202, r.text
    rid = r.json()["approval_request_id"]
    body = problem(d.client("approver").post(f"/v1/approvals/{rid}:modify",
                                             json={"args": {"to": "mallory", "amount": 1e12}}), 422, "arguments_invalid")
    assert sorted(e["field"] for e in body["errors"]) == ["amount", "to"]
    problem(d.client("approver").post(f"/v1/approvals/{rid}:modify",
                                      json={"args": {"to": "acme", "amount": 5, "memo": "far too long"}}),
            422, "arguments_invalid")
    assert d.undolog.approvals.get(rid).state == "pending"
    assert up.calls == []  # the upstream never received any of it


def test_a_hostile_upstream_answer_is_stored_safe_and_the_call_commits(hostile: tuple[Desk, HostileUpstream]) -> None:
    for kind in ("surrogate", "deep", "huge", "text"):
        _hostile_answer(hostile[0], kind)


def _hostile_answer(d: Desk, kind: str) -> None:
    sid = _session(d)
    r = d.client("agent").post(f"/v1/sessions/{sid}/tools/echo_{kind}:invoke", json={}, headers={"Idempotency-Key": "k"})
    assert r.status_code == 200, r.text
    again = d.client("agent").post(f"/v1/sessions/{sid}/tools/echo_{kind}:invoke", json={},
                                   headers={"Idempotency-Key": "k"})
    assert again.headers["UndoLog-Replayed"] == "true" and again.content == r.content
    (effect,) = d.undolog.sessions.effects(sid)
    assert effect["state"] == "committed"
    body = effect["result_snapshot"]["body"]
    if kind == "surrogate":
        assert body == {"note": "\\ud800 and \\udfff"}
    elif kind == "text":
        assert body == "plain \ufffd text"
    else:
        assert "undolog_truncated" in json.dumps(body)
    assert len(r.content) < 200_000


# -- finding 7: one identity length rule -----------------------------------------------------------------------------


def test_identities_at_the_limit_work_and_longer_ones_are_4xx(desk: Desk) -> None:
    admin = desk.client("admin")
    problem(admin.post("/v1/keys", json={"name": "n" * (KEY_NAME_MAX + 1), "roles": ["approver"]}),
            422, "validation_failed")
    r = admin.post("/v1/keys", json={"name": "n" * KEY_NAME_MAX, "roles": ["approver"]})
    assert r.status_code == 201, r.text
    token = r.json()["key"]
    # A session id at the limit raises an approval request; the longest key name decides it.
    s = desk.undolog.session(session_id="s" * limits.MAX_ID_LENGTH, agent_id="a" * limits.MAX_ID_LENGTH,
                             created_by=desk.key("agent").principal_ref)
    with s, pytest.raises(ApprovalPending) as p:
        s.call_sync("delete_user_account", user_id="u1", call_id="c" * limits.MAX_ID_LENGTH)
    rid = p.value.approval_request_id
    with httpx.Client(base_url=desk.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as longest:
        r = longest.post(f"/v1/approvals/{rid}:approve", json={"reason": "ok"})
    assert r.status_code == 200, r.text
    assert len(r.json()["decided_by"]) == limits.MAX_ID_LENGTH
    assert desk.client("admin").get("/v1/audit/verify").json()["ok"] is True
    body = problem(desk.client("agent").post("/v1/sessions", json={"agent_id": "a" * (limits.MAX_ID_LENGTH + 1)}),
                   422, "validation_failed")
    assert body["errors"][0]["field"] == "body.agent_id"


def test_every_listing_is_paged(desk: Desk) -> None:
    admin = desk.client("admin")
    for i in range(3):
        assert admin.put(f"/v1/approver-groups/g{i}", json={"tools": [f"t{i}"]}).status_code == 200
    assert [g["name"] for g in admin.get("/v1/approver-groups", params={"limit": 2, "offset": 1}).json()] == ["g1", "g2"]
    assert len(admin.get("/v1/keys", params={"limit": 2}).json()) == 2
    for path in ("/v1/keys", "/v1/approver-groups", "/v1/webhooks", "/v1/notification-policies", "/v1/tools"):
        problem(admin.get(path, params={"limit": 5000}), 422, "validation_failed")
