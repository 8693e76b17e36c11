"""The tool proxy: TOML contracts, forwarding, 202 + Retry-After, exactly-once after approval."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from undolog_core import errors
from undolog_server.proxy import ProxyTools

from ..support.upstream import Upstream
from .conftest import Desk, make_desk, problem


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    u = Upstream().start()
    yield u
    u.stop()


@pytest.fixture
def proxy(db: Any, upstream: Upstream, tmp_path: Path) -> Iterator[Desk]:
    cfg = tmp_path / "tools.toml"
    cfg.write_text(upstream.config())
    d = make_desk(db, proxy_config=str(cfg))
    yield d
    d.close()


def new_session(d: Desk, who: str = "agent") -> str:
    r = d.client(who).post("/v1/sessions", json={"agent_id": "http-agent"})
    assert r.status_code == 201, r.text
    return r.json()["session_id"]


def invoke(d: Desk, sid: str, tool: str, args: dict[str, Any], key: str | None = None, who: str = "agent") -> Any:
    headers = {"Idempotency-Key": key} if key else {}
    return d.client(who).post(f"/v1/sessions/{sid}/tools/{tool}:invoke", json=args, headers=headers)


def test_config_becomes_registered_contracts(proxy: Desk) -> None:
    tools = {t["name"]: t for t in proxy.client("agent").get("/v1/tools").json()}
    assert tools["refund"]["proxied"] and tools["refund"]["tier"] == "compensable"
    assert tools["close_account"]["tier"] == "irreversible" and tools["close_account"]["fingerprint"]
    spec = proxy.undolog.tool_spec("close_account")
    assert spec.risk_tags == ("pii",) and spec.reason.startswith("Closes")


def test_bad_configs_are_refused() -> None:
    with pytest.raises(errors.ConfigurationError, match="compensation_url"):
        ProxyTools.load({"tools": {"x": {"tier": "compensable", "url": "http://127.0.0.1:1/x"}}})
    with pytest.raises(errors.ConfigurationError, match="tier"):
        ProxyTools.load({"tools": {"x": {"tier": "risky", "url": "http://127.0.0.1:1/x"}}})
    with pytest.raises(errors.ConfigurationError, match="url"):
        ProxyTools.load({"tools": {"x": {"tier": "safe"}}})


def test_safe_and_compensable_are_forwarded_and_rolled_back(proxy: Desk, upstream: Upstream) -> None:
    sid = new_session(proxy)
    r = invoke(proxy, sid, "lookup_order", {"order_id": "o1"})
    assert r.status_code == 200 and r.json()["echo"] == {"order_id": "o1"}
    r = invoke(proxy, sid, "refund", {"order_id": "o1", "amount": 5}, key="refund-1")
    assert r.status_code == 200 and r.headers["UndoLog-Replayed"] == "false"
    [(body, key)] = upstream.to("/refund")
    assert body == {"order_id": "o1", "amount": 5} and key.startswith("do-")
    assert [e for p, e in upstream.epochs if p == "/refund"] == ["1"]  # the fencing token beside the key
    # The same Idempotency-Key replays the stored response instead of refunding twice.
    again = invoke(proxy, sid, "refund", {"order_id": "o1", "amount": 5}, key="refund-1")
    assert again.status_code == 200 and again.headers["UndoLog-Replayed"] == "true"
    assert again.json() == r.json() and len(upstream.to("/refund")) == 1
    problem(invoke(proxy, sid, "refund", {"order_id": "o1", "amount": "five"}), 422, "arguments_invalid")
    rb = proxy.client("agent").post(f"/v1/sessions/{sid}:rollback").json()
    assert [s["outcome"] for s in rb["steps"]] == ["compensated"]
    [(cbody, ckey)] = upstream.to("/refund/cancel")
    assert ckey == f"undo-{rb['steps'][0]['undo_id']}"
    assert cbody["args"] == {"order_id": "o1", "amount": 5} and cbody["result"]["path"] == "/refund"


def test_irreversible_waits_then_runs_once_with_the_approved_args(proxy: Desk, upstream: Upstream) -> None:
    sid = new_session(proxy)
    r = invoke(proxy, sid, "close_account", {"account": "acc-1", "notify": True}, key="close-1")
    assert r.status_code == 202, r.text
    assert int(r.headers["Retry-After"]) >= 1
    rid = r.json()["approval_request_id"]
    assert r.headers["Location"] == f"/v1/approvals/{rid}"
    again = invoke(proxy, sid, "close_account", {"account": "acc-1", "notify": True}, key="close-1")
    assert again.status_code == 202 and again.json()["approval_request_id"] == rid
    assert upstream.to("/close") == []
    ok = proxy.client("approver").post(f"/v1/approvals/{rid}:modify", json={"args": {"account": "acc-1", "notify": False}})
    assert ok.status_code == 200, ok.text
    done = invoke(proxy, sid, "close_account", {"account": "acc-1", "notify": True}, key="close-1")
    assert done.status_code == 200 and done.json()["echo"] == {"account": "acc-1", "notify": False}
    replay = invoke(proxy, sid, "close_account", {"account": "acc-1", "notify": True}, key="close-1")
    assert replay.status_code == 200 and replay.headers["UndoLog-Replayed"] == "true"
    assert len(upstream.to("/close")) == 1


def test_concurrent_retries_after_approval_forward_once(proxy: Desk, upstream: Upstream) -> None:
    from concurrent.futures import ThreadPoolExecutor

    sid = new_session(proxy)
    args = {"account": "acc-9", "notify": True}
    rid = invoke(proxy, sid, "close_account", args, key="close-9").json()["approval_request_id"]
    assert proxy.client("approver").post(f"/v1/approvals/{rid}:approve", json={}).status_code == 200
    upstream.delay["/close"] = 0.3
    url = f"{proxy.url}/v1/sessions/{sid}/tools/close_account:invoke"
    headers = {"Authorization": f"Bearer {proxy.token('agent')}", "Idempotency-Key": "close-9"}

    def retry(_: int) -> httpx.Response:
        return httpx.post(url, json=args, headers=headers, timeout=30)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(retry, range(6)))
    # Retries racing the one forwarded call wait for it or are told it is in flight; none forwards again.
    assert all(r.status_code in (200, 409) for r in answers), [(r.status_code, r.text) for r in answers]
    assert sum(r.status_code == 200 and r.headers["UndoLog-Replayed"] == "false" for r in answers) == 1
    assert len(upstream.to("/close")) == 1
    late = retry(0)
    assert late.status_code == 200 and late.headers["UndoLog-Replayed"] == "true"
    assert len(upstream.to("/close")) == 1


def test_modify_of_a_proxied_tool_is_validated_against_its_toml_schema(proxy: Desk, upstream: Upstream) -> None:
    sid = new_session(proxy)
    rid = invoke(proxy, sid, "close_account", {"account": "acc-5"}, key="k5").json()["approval_request_id"]
    c = proxy.client("approver")
    bad = problem(c.post(f"/v1/approvals/{rid}:modify", json={"args": {"account": {"nested": 1}}}), 422,
                  "arguments_invalid")
    assert [e["field"] for e in bad["errors"]] == ["account"] and "account" in bad["detail"]
    problem(c.post(f"/v1/approvals/{rid}:modify", json={"args": {"notify": False}}), 422, "arguments_invalid")
    assert proxy.undolog.approvals.get(rid).state == "pending"
    assert c.post(f"/v1/approvals/{rid}:modify", json={"args": {"account": "acc-6"}}).status_code == 200
    done = invoke(proxy, sid, "close_account", {"account": "acc-5"}, key="k5")
    assert done.status_code == 200 and done.json()["echo"] == {"account": "acc-6"}


def test_irreversible_without_idempotency_key_is_matched_by_arguments(proxy: Desk, upstream: Upstream) -> None:
    sid = new_session(proxy)
    args = {"account": "acc-2", "notify": True}
    rid = invoke(proxy, sid, "close_account", args).json()["approval_request_id"]
    assert invoke(proxy, sid, "close_account", args).json()["approval_request_id"] == rid
    proxy.client("approver").post(f"/v1/approvals/{rid}:approve", json={})
    assert invoke(proxy, sid, "close_account", args).status_code == 200
    assert len(upstream.to("/close")) == 1


def test_rejection_is_403_with_the_reason(proxy: Desk, upstream: Upstream) -> None:
    sid = new_session(proxy)
    args = {"account": "acc-3", "notify": True}
    rid = invoke(proxy, sid, "close_account", args, key="k").json()["approval_request_id"]
    proxy.client("approver").post(f"/v1/approvals/{rid}:reject", json={"reason": "customer called back"})
    body = problem(invoke(proxy, sid, "close_account", args, key="k"), 403, "approval_rejected")
    assert "customer called back" in body["detail"] and body["reason"] == "customer called back"
    # An agent that retries without its Idempotency-Key is matched by the arguments and told the same.
    body = problem(invoke(proxy, sid, "close_account", args), 403, "approval_rejected")
    assert body["reason"] == "customer called back"
    assert upstream.to("/close") == []
    # The rejection halted the session: writes are refused until a person resumes it.
    problem(invoke(proxy, sid, "refund", {"order_id": "o", "amount": 1}), 409, "session_halted")


def test_a_timed_out_request_is_403_and_never_forwarded(proxy: Desk, upstream: Upstream) -> None:
    proxy.undolog.policy.set(actor="test", approval_timeout_seconds=1)
    sid = new_session(proxy)
    args = {"account": "acc-t", "notify": True}
    assert invoke(proxy, sid, "close_account", args, key="kt").status_code == 202
    import time

    time.sleep(1.1)
    problem(invoke(proxy, sid, "close_account", args, key="kt"), 403, "approval_timed_out")
    assert upstream.to("/close") == []


def test_upstream_failure_is_502_and_rolls_the_session_back(proxy: Desk, upstream: Upstream) -> None:
    sid = new_session(proxy)
    assert invoke(proxy, sid, "refund", {"order_id": "o9", "amount": 9}).status_code == 200
    upstream.fail.add("/flaky")
    body = problem(invoke(proxy, sid, "flaky", {}), 502, "upstream_error")
    assert body["upstream_status"] == 500
    assert [s["tool_name"] for s in body["rollback"]["steps"]][-1] == "refund"
    assert len(upstream.to("/refund/cancel")) == 1


def test_only_the_owner_invokes_and_only_proxied_tools(proxy: Desk) -> None:
    sid = new_session(proxy)
    problem(invoke(proxy, sid, "lookup_order", {"order_id": "o"}, who="agent2"), 404, "session_not_found")
    problem(invoke(proxy, sid, "search_kb", {"query": "x"}), 404, "tool_not_proxied")
    problem(invoke(proxy, "nope", "lookup_order", {"order_id": "o"}), 404, "session_not_found")



def test_probe_endpoint_answers_recoverys_question(proxy: Desk, upstream: Upstream) -> None:
    from undolog_core import ProbeContext

    probe = proxy.undolog.tool_spec("close_account").probe
    ctx = ProbeContext(args={"account": "done"}, idempotency_key="do-e1", effect_id="e1", session_id="s",
                       tool_name="close_account")
    assert probe(ctx) == {"status_code": 200, "body": {"closed": True}, "media_type": "application/json"}
    assert probe(ProbeContext(args={"account": "nope"}, idempotency_key="do-e2", effect_id="e2", session_id="s",
                              tool_name="close_account")) is False
    [(body, _)] = upstream.to("/close/status")[:1]
    assert body == {"tool": "close_account", "args": {"account": "done"}, "idempotency_key": "do-e1"}


class _SlowUpstream:
    """A real HTTP tool server whose ``/close`` acts only once the test releases it, long after the proxy's read
    timeout, and whose probe answers honestly from what it has done (not yet: "did not happen")."""

    def __init__(self) -> None:
        import json
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.release = threading.Event()
        self.acted = threading.Event()
        self.closed: list[str | None] = []  # the side effect: one entry per account closing actually done
        self.refunded: list[str | None] = []
        self.cancels: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path in ("/close/status", "/refund/status"):
                    done = outer.closed if self.path == "/close/status" else outer.refunded
                    out: dict[str, Any] = {"happened": body.get("idempotency_key") in done}
                elif self.path == "/refund/cancel":
                    outer.cancels.append(self.headers.get("Idempotency-Key"))
                    out = {"cancelled": body.get("args")}  # a refund not made yet: nothing to cancel
                elif self.path == "/refund":
                    outer.release.wait(30)
                    outer.refunded.append(self.headers.get("Idempotency-Key"))
                    outer.acted.set()
                    out = {"refunded": body.get("order_id")}
                else:
                    outer.release.wait(30)  # still working when the proxy gives up waiting
                    outer.closed.append(self.headers.get("Idempotency-Key"))
                    outer.acted.set()
                    out = {"closed": body.get("account")}
                raw = json.dumps(out).encode()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except OSError:
                    pass  # the proxy had hung up: the work is done all the same

        class Server(ThreadingHTTPServer):
            daemon_threads = True

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def config(self, probe: bool = True) -> str:
        probe_line = f'probe_url = "{self.url}/close/status"' if probe else ""
        return f"""
[tools.close_account]
tier = "irreversible"
url = "{self.url}/close"
{probe_line}
timeout = 2.0
[tools.close_account.args_schema]
type = "object"
required = ["account"]
properties = {{ account = {{ type = "string" }} }}

[tools.refund]
tier = "compensable"
url = "{self.url}/refund"
compensation_url = "{self.url}/refund/cancel"
probe_url = "{self.url}/refund/status"
timeout = 2.0

[tools.refund_blind]
tier = "compensable"
url = "{self.url}/refund"
compensation_url = "{self.url}/refund/cancel"
timeout = 2.0
"""


@pytest.mark.reads_store
@pytest.mark.parametrize("probe", [True, False], ids=["with_probe", "without_probe"])
def test_a_read_timeout_never_lets_an_approved_irreversible_call_run_twice(db: Any, tmp_path: Path,
                                                                           probe: bool) -> None:
    """The proxy's read timeout fires while the upstream is still working; the upstream then finishes. Before: the
    probe's honest "did not happen (yet)" put the call back to approved and the retry closed the account twice.
    A read timeout is not "the request can no longer land": the call is unknown and the session halted."""
    slow = _SlowUpstream()
    cfg = tmp_path / "tools.toml"
    cfg.write_text(slow.config(probe))
    d = make_desk(db, proxy_config=str(cfg))
    try:
        sid = new_session(d)
        rid = invoke(d, sid, "close_account", {"account": "acc-s"}, key="slow-1").json()["approval_request_id"]
        assert d.client("approver").post(f"/v1/approvals/{rid}:approve", json={}).status_code == 200
        lost = invoke(d, sid, "close_account", {"account": "acc-s"}, key="slow-1")
        body = problem(lost, 504, "outcome_unknown")
        assert body["session_state"] == "halted"
        [effect] = d.undolog.sessions.effects(sid)
        assert effect["state"] == "unknown"
        assert d.client("admin").get(f"/v1/sessions/{sid}").json()["state"] == "halted"
        # The upstream finishes the original request after the proxy gave up on it.
        slow.release.set()
        assert slow.acted.wait(10)
        # The agent retries: it is never re-sent.
        problem(invoke(d, sid, "close_account", {"account": "acc-s"}, key="slow-1"), 409)
        assert len(slow.closed) == 1 and slow.closed[0] == f"do-{effect['effect_id']}"
        assert d.undolog.sessions.effects(sid)[0]["state"] == "unknown"
    finally:
        slow.stop()
        d.close()
        d.undolog.close()


@pytest.mark.reads_store
def test_a_read_timeout_never_settles_a_compensable_call_while_it_may_still_land(db: Any, tmp_path: Path) -> None:
    """A COMPENSABLE call with a probe loses its answer to the proxy's read timeout while the upstream still works
    on it. Before: a plain failure, so the session was rolled back at once: the cancel went out for a refund not
    made yet (a no-op), then the refund landed and stood while the log said compensated. Now, as the MCP gateway:
    the probe's "not yet" holds it in flight (no cancel sent, never "not run") for as long as it may still land."""
    slow = _SlowUpstream()
    cfg = tmp_path / "tools.toml"
    cfg.write_text(slow.config())
    d = make_desk(db, proxy_config=str(cfg))
    try:
        sid = new_session(d)
        lost = invoke(d, sid, "refund", {"order_id": "o-s", "amount": 5}, key="refund-slow")
        body = problem(lost, 504, "outcome_unknown")
        assert "held in flight" in body["detail"]
        [effect] = d.undolog.sessions.effects(sid)
        assert effect["state"] in ("pending", "running"), effect  # in flight: neither failed nor compensated
        assert slow.cancels == []
        slow.release.set()  # the upstream finishes the original request
        assert slow.acted.wait(10)
        problem(invoke(d, sid, "refund", {"order_id": "o-s", "amount": 5}, key="refund-slow"), 409)
        assert slow.refunded == [f"do-{effect['effect_id']}"] and slow.cancels == []
        assert d.undolog.sessions.effects(sid)[0]["undo_state"] != "compensated"
        # A person takes it over once the upstream is done: its probe now says it happened, so it is committed
        # (its undo still armed for a rollback), and still nothing was cancelled.
        report = d.undolog.recover(take_over=[effect["effect_id"]])
        assert [r["outcome"] for r in report.reconciled] == ["committed"], report
        [settled] = d.undolog.sessions.effects(sid)
        assert settled["state"] == "committed" and slow.cancels == [] and len(slow.refunded) == 1
    finally:
        slow.stop()
        d.close()
        d.undolog.close()


@pytest.mark.reads_store
def test_a_read_timeout_never_compensates_a_compensable_call_without_a_probe_before_it_lands(db: Any,
                                                                                           tmp_path: Path) -> None:
    """A COMPENSABLE call without a probe loses its answer to the proxy's read timeout while the upstream still
    works on it. Before: a plain failure, so the session's policy rolled it back at once: the cancel went out for a
    refund not made yet (a no-op), then the refund landed and stood while the log said compensated. Now it is held
    unknown (nothing undone, nothing sent again), the session halted and the caller told; a person who checked the
    upstream resolves it (``/v1/effects/{id}:resolve``, audited), and the session stays halted until resumed."""
    slow = _SlowUpstream()
    cfg = tmp_path / "tools.toml"
    cfg.write_text(slow.config())
    d = make_desk(db, proxy_config=str(cfg))
    try:
        sid = new_session(d)
        lost = invoke(d, sid, "refund_blind", {"order_id": "o-b", "amount": 5}, key="refund-blind")
        body = problem(lost, 504, "outcome_unknown")
        assert body["session_state"] == "halted" and "effects resolve" in body["detail"], body
        [effect] = d.undolog.sessions.effects(sid)
        assert effect["state"] == "unknown", effect
        assert slow.cancels == []  # nothing undone while the request may still land
        slow.release.set()  # the upstream finishes the original request
        assert slow.acted.wait(10)
        problem(invoke(d, sid, "refund_blind", {"order_id": "o-b", "amount": 5}, key="refund-blind"), 409)
        assert slow.refunded == [f"do-{effect['effect_id']}"] and slow.cancels == []
        eid = effect["effect_id"]
        # A person checked the upstream: the refund is there.
        bad = d.client("approver").post(f"/v1/effects/{eid}:resolve", json={"as": "maybe", "reason": "x"})
        assert bad.status_code == 422, bad.text
        problem(d.client("agent").post(f"/v1/effects/{eid}:resolve", json={"as": "committed", "reason": "x"}), 403)
        problem(d.client("approver").post("/v1/effects/nope:resolve", json={"as": "committed", "reason": "x"}), 404,
                "effect_not_found")
        done = d.client("approver").post(f"/v1/effects/{eid}:resolve",
                                         json={"as": "committed", "reason": "refund o-b is in the ledger"})
        assert done.status_code == 200, done.text
        out = done.json()
        assert out["state"] == "committed" and out["session_state"] == "halted" and out["undo_state"] == "armed"
        assert d.client("admin").get(f"/v1/sessions/{sid}").json()["state"] == "halted"  # not resumed
        # Resolved once: a second decision is refused (it is not unknown any more).
        problem(d.client("approver").post(f"/v1/effects/{eid}:resolve", json={"as": "compensated", "reason": "y"}),
                409, "invalid_effect_state")
        # Committed and its undo armed: the person's rollback undoes the refund once, now that it has landed.
        rb = d.client("admin").post(f"/v1/sessions/{sid}:rollback")
        assert rb.status_code == 200 and rb.json()["complete"], rb.text
        assert slow.cancels == [f"undo-{effect['undo_id']}"]
        assert d.undolog.verify_audit().ok
    finally:
        slow.stop()
        d.close()
        d.undolog.close()
