"""Approvals in Slack: the real ``slack_sdk`` against a local stand-in for Slack's Web API, and interactivity payloads
signed as Slack signs them, sent to a real desk on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from undolog_server.slack import REPLAY_WINDOW, SlackConfig, SlackDesk, escape
from undolog_server.state import ServerSettings
from undolog_server.storage import ApproverGroup, NotificationPolicy, ServerStore, utcnow
from undolog_server.storage.slack import SlackChannel, SlackStore

from ..support.slack_standin import (
    SIGNING_SECRET,
    TEAM,
    TOKEN,
    SlackStandIn,
    block_action,
    signed,
    view_submission,
)
from .conftest import Desk, make_desk

# SQLite run only (reads_store), but for the tests marked storage: those run the desk's Slack SQL that differs by
# database (the fan-out's and the replay guard's INSERT ... ON CONFLICT ... RETURNING, the claim's SKIP LOCKED).
pytestmark = pytest.mark.reads_store

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SlackRig:
    desk: Desk
    standin: SlackStandIn
    app: Any

    @property
    def state(self) -> Any:
        return self.app.state.undolog_server

    @property
    def slack(self) -> SlackDesk:
        desk: SlackDesk = self.state.slack
        return desk

    def sweep(self) -> dict[str, int]:
        counts: dict[str, int] = self.app.state.sweeper.tick()
        return counts

    def send(self, payload: dict[str, Any], **kw: Any) -> httpx.Response:
        body, headers = signed(payload, **kw)
        return httpx.post(self.desk.url + "/v1/slack/interactivity", content=body, headers=headers, timeout=30)

    def click(self, action: str, rid: str, *, digest: str | None = None, **kw: Any) -> httpx.Response:
        rec = self.desk.undolog.approvals.get(rid)
        value = json.dumps({"r": rid, "d": digest or rec.action_digest})
        return self.send(block_action(self.standin, action, value, **kw))

    def posted(self, channel: str | None = None) -> list[dict[str, Any]]:
        return [c.args for c in self.standin.of("chat.postMessage") if channel is None or c.args["channel"] == channel]


def _config(standin: SlackStandIn, **kw: Any) -> SlackConfig:
    return SlackConfig(bot_token=TOKEN, signing_secret=SIGNING_SECRET, team_id=TEAM, api_url=standin.api_url,
                       response_url_prefixes=(standin.url + "/response/",), desk_url="https://desk.example",
                       update_now=False, **kw)


@pytest.fixture
def rig(db: Any) -> Iterator[SlackRig]:
    standin = SlackStandIn().start()
    desk = make_desk(db, settings=ServerSettings(background=False, slack=_config(standin)))
    app = desk.server.server.config.app
    store = desk.store
    store.put_group(ApproverGroup("finance", tools=("wire_money",)))
    store.put_group(ApproverGroup("risk", risk_tags=("billing",)))
    desk.add_key("ana", ["approver"], ["finance"])
    desk.add_key("ben", ["approver"], ["risk"])
    desk.add_key("both", ["agent", "approver"], ["finance"])
    slack = SlackStore(desk.undolog.store)
    slack.put_channel(SlackChannel("finance", "C0FIN", sensitive=("to",)))
    slack.put_channel(SlackChannel("risk", "C0RISK"))
    slack.put_channel(SlackChannel("*", "C0ALL"))
    admin = desk.client("admin")
    for user, key in (("U0ANA", "ana"), ("U0BEN", "ben"), ("U0BOTH", "both")):
        r = admin.put(f"/v1/slack/users/{TEAM}/{user}", json={"key_id": desk.key(key).key_id})
        assert r.status_code == 200, r.text
    try:
        yield SlackRig(desk, standin, app)
    finally:
        desk.close()
        desk.undolog.close()
        standin.stop()


def _wire(rig: SlackRig, owner: str = "agent", **args: Any) -> str:
    rid, _ = rig.desk.pending("wire_money", owner=owner, **(args or {"to": "acme", "amount": 10.0}))
    return rid


def _texts(blocks: Any) -> str:
    return json.dumps(blocks, ensure_ascii=False)


# ------------------------------------------------------------------------------------------------ posting


@pytest.mark.storage
def test_a_pending_request_is_posted_to_its_groups_channels_with_everything_to_decide_on(rig: SlackRig) -> None:
    s = rig.desk.session()
    with s:
        s.call_sync("send_refund_email", user_id="u1", amount=5.0)
        try:
            s.call_sync("wire_money", to="<!channel> ACME & <@U0BOSS>", amount=12.5, call_id="w1")
        except Exception as exc:  # ApprovalPending
            rid = exc.approval_request_id  # type: ignore[attr-defined]
    counts = rig.sweep()
    assert counts["slack_sent"] == 2
    fin, risk = rig.posted("C0FIN"), rig.posted("C0RISK")
    assert len(fin) == 1 and len(risk) == 1 and not rig.posted("C0ALL")
    for msg in (fin[0], risk[0]):
        assert msg["metadata"] == {"event_type": "undolog_approval_request",
                                   "event_payload": {"approval_request_id": rid}}
        text = _texts(msg["blocks"])
        assert "wire_money" in text and "Moves money out" in text and "billing" in text
        assert "<!date^" in text  # the deadline, in the reader's time zone
        assert "send_refund_email" in text  # recent calls and the undo plan
        assert "1 step is undone" in text and "cannot be" in text
        actions = next(b for b in msg["blocks"] if b["type"] == "actions")["elements"]
        assert [a["action_id"] for a in actions] == ["undolog_approve", "undolog_reject", "undolog_edit"]
        assert json.loads(actions[0]["value"]) == {"r": rid, "d": rig.desk.undolog.approvals.get(rid).action_digest}
    # The finance channel hides "to" (its group marks it sensitive); the risk channel shows it, escaped.
    assert "ACME" not in _texts(fin[0]["blocks"]) and "hidden (sensitive)" in _texts(fin[0]["blocks"])
    shown = _texts(risk[0]["blocks"])
    assert "&lt;!channel&gt; ACME &amp; &lt;@U0BOSS&gt;" in shown
    assert "<!channel>" not in shown and "<@U0BOSS>" not in shown
    # Sent once: another sweep posts nothing new.
    rig.sweep()
    assert len(rig.standin.of("chat.postMessage")) == 2


def test_long_values_are_folded_and_requests_no_group_claims_go_to_the_catch_all(rig: SlackRig) -> None:
    rig.desk.pending("delete_user_account", user_id="u" * 2000)
    rig.sweep()
    [msg] = rig.posted("C0ALL")
    assert "(+1700 characters)" in _texts(msg["blocks"])


def test_escape_neutralises_mentions_and_markup() -> None:
    assert escape("<!here> <@U1> <#C1> <http://x|y> @channel & @everyone") == (
        "&lt;!here&gt; &lt;@U1&gt; &lt;#C1&gt; &lt;http://x|y&gt; @\u200bchannel &amp; @\u200beveryone")


def test_ratelimited_posts_wait_for_retry_after(rig: SlackRig) -> None:
    rig.standin.ratelimit["chat.postMessage"] = 7
    rid = _wire(rig)
    before = time.time()
    rig.sweep()
    assert len(rig.standin.of("chat.postMessage")) == 2 and len(rig.posted()) == 2  # one 429, one posted
    store = rig.slack.store
    waiting = [p for p in store.posts(rid) if not p.ts]
    assert len(waiting) == 1
    with rig.desk.undolog.store.read() as conn:
        due = conn.execute(sa.text("SELECT next_attempt_at, last_error FROM undolog_slack_posts WHERE post_id = :p"),
                           {"p": waiting[0].post_id}).one()
    assert due[0] >= before + 7 and due[1] == "ratelimited"
    rig.slack.run_due(now=time.time())  # not yet due: nothing is sent
    assert len(rig.standin.of("chat.postMessage")) == 2
    rig.slack.run_due(now=due[0] + 0.01)
    assert len(rig.posted()) == 3 and all(p.ts for p in store.posts(rid))


def test_escalation_reposts_an_undecided_request_to_the_next_channel(rig: SlackRig) -> None:
    SlackStore(rig.desk.undolog.store).put_channel(
        SlackChannel("finance", "C0FIN", escalation_channel="C0BOSS", escalate_after_seconds=60))
    rid = _wire(rig)
    rig.sweep()
    assert not rig.posted("C0BOSS")
    rig.slack.tick(now=time.time() + 61)
    rig.slack.tick(now=time.time() + 62)
    [msg] = rig.posted("C0BOSS")
    assert "escalated" in _texts(msg["blocks"]) and msg["metadata"]["event_payload"]["approval_request_id"] == rid


def test_without_its_own_delay_a_channel_escalates_at_the_notification_policys_time(rig: SlackRig) -> None:
    """The issue's "at the policy's escalation time": a channel that names only where to escalate follows the
    notification policy of the request's risk tags (the webhooks' clock)."""
    SlackStore(rig.desk.undolog.store).put_channel(SlackChannel("finance", "C0FIN", escalation_channel="C0BOSS"))
    ServerStore(rig.desk.undolog.store).put_policy(NotificationPolicy("*", escalate_after_seconds=120))
    rid = _wire(rig)
    rig.sweep()
    rig.slack.tick(now=time.time() + 61)
    rig.slack.tick(now=time.time() + 62)
    assert not rig.posted("C0BOSS")
    rig.slack.tick(now=time.time() + 121)
    rig.slack.tick(now=time.time() + 122)
    [msg] = rig.posted("C0BOSS")
    assert msg["metadata"]["event_payload"]["approval_request_id"] == rid


def test_the_link_to_the_desk_is_the_desks_public_url_unless_slack_names_its_own(db: Any) -> None:
    """One public address for the desk: the email links' ``--public-url`` serves Slack's "Open on the desk" too."""
    standin = SlackStandIn().start()
    config = SlackConfig(bot_token=TOKEN, signing_secret=SIGNING_SECRET, team_id=TEAM, api_url=standin.api_url,
                         update_now=False)
    desk = make_desk(db, settings=ServerSettings(background=False, slack=config,
                                                 public_url="https://desk.example.org"))
    try:
        desk.store.put_group(ApproverGroup("finance", tools=("wire_money",)))
        SlackStore(desk.undolog.store).put_channel(SlackChannel("finance", "C0FIN"))
        rig = SlackRig(desk, standin, desk.server.server.config.app)
        rid = _wire(rig)
        rig.sweep()
        [msg] = rig.posted("C0FIN")
        assert f"https://desk.example.org/ui/approvals/{rid}" in _texts(msg["blocks"])
    finally:
        desk.close()
        desk.undolog.close()
        standin.stop()


def test_without_slack_configured_the_endpoint_says_how_to_turn_it_on(desk: Desk) -> None:
    body, headers = signed({"type": "block_actions"})
    r = httpx.post(desk.url + "/v1/slack/interactivity", content=body, headers=headers, timeout=30)
    assert r.status_code == 404 and r.json()["code"] == "slack_not_configured"
    assert "UNDOLOG_SLACK_BOT_TOKEN" in r.json()["detail"]


# ------------------------------------------------------------------------------------------------ deciding


def test_approve_updates_the_message_in_every_channel(rig: SlackRig) -> None:
    rid = _wire(rig)
    rig.sweep()
    r = rig.click("approve", rid)
    assert r.status_code == 200 and r.json()["decided"] == "approve", r.text
    rec = rig.desk.undolog.approvals.get(rid)
    assert rec.state == "approved" and rec.decided_by == rig.desk.key("ana").identity
    rig.sweep()
    updates = rig.standin.of("chat.update")
    assert sorted(u.args["channel"] for u in updates) == ["C0FIN", "C0RISK"]
    for u in updates:
        text = _texts(u.args["blocks"])
        assert "Approved" in text and "ana" in text and "undolog_approve" not in text
        assert rig.standin.message(u.args["channel"], u.args["ts"])["edited"]
    rig.sweep()
    assert len(rig.standin.of("chat.update")) == 2 and len(rig.posted()) == 2


def test_a_message_updated_before_the_click_handler_marks_it_is_not_updated_again(rig: SlackRig,
                                                                                 monkeypatch: Any) -> None:
    """The decision's outbox event can be fanned out, and its messages updated, between the decision and the click
    handler's own "needs an update" mark (a loaded desk: CI saw the message updated twice). The mark finds the
    messages already showing the decision and leaves them alone."""
    rid = _wire(rig)
    rig.sweep()
    approvals = rig.state.undolog.approvals
    real = approvals.approve

    def approve_then_sweep(*args: Any, **kw: Any) -> Any:
        out = real(*args, **kw)
        rig.sweep()  # the sweeper's turn comes before the handler's mark
        return out

    monkeypatch.setattr(approvals, "approve", approve_then_sweep)
    r = rig.click("approve", rid)
    assert r.status_code == 200 and r.json()["decided"] == "approve", r.text
    assert sorted(u.args["channel"] for u in rig.standin.of("chat.update")) == ["C0FIN", "C0RISK"]
    rig.sweep()
    rig.sweep()
    assert len(rig.standin.of("chat.update")) == 2, [(c.method, c.args.get("channel")) for c in rig.standin.calls]


def test_reject_halts_the_session(rig: SlackRig) -> None:
    rid = _wire(rig)
    rig.sweep()
    assert rig.click("reject", rid).json()["decided"] == "reject"
    rec = rig.desk.undolog.approvals.get(rid)
    assert rec.state == "rejected"
    assert rig.state.views.session_row(rec.session_id)["state"] == "halted"
    rig.sweep()
    assert all("Rejected" in _texts(u.args["blocks"]) for u in rig.standin.of("chat.update"))


def test_edit_opens_a_modal_from_the_schema_shows_the_diff_then_approves(rig: SlackRig) -> None:
    rid = _wire(rig)
    rig.sweep()
    r = rig.click("edit", rid)
    assert r.status_code == 200
    [opened] = rig.standin.of("views.open")
    view = opened.args["view"]
    assert opened.args["trigger_id"].endswith("U0ANA")
    inputs = {b["block_id"]: b["element"] for b in view["blocks"] if b["type"] == "input"}
    assert inputs["/to"]["type"] == "plain_text_input" and inputs["/to"]["initial_value"] == "acme"
    assert inputs["/amount"]["type"] == "number_input" and inputs["/amount"]["is_decimal_allowed"] is True
    # A value the schema refuses: the modal shows the error on the field.
    bad = rig.send(view_submission(view, {"/to": {"value": {"type": "plain_text_input", "value": "acme"}},
                                          "/amount": {"value": {"type": "number_input", "value": "lots"}}}))
    assert bad.json()["response_action"] == "errors" and "/amount" in bad.json()["errors"], bad.text
    review = rig.send(view_submission(view, {"/to": {"value": {"type": "plain_text_input", "value": "acme"}},
                                             "/amount": {"value": {"type": "number_input", "value": "90"}}})).json()
    assert review["response_action"] == "update", review
    diff = _texts(review["view"]["blocks"])
    assert "*amount*" in diff and "10.0" in diff and "90" in diff and "*to*" not in diff
    assert rig.desk.undolog.approvals.get(rid).state == "pending"  # nothing decided before the review
    done = rig.send(view_submission(review["view"], {})).json()
    assert done == {"response_action": "clear"}
    rec = rig.desk.undolog.approvals.get(rid)
    assert rec.state == "approved" and rec.approved_args == {"to": "acme", "amount": 90}
    rig.sweep()
    assert all("Approved with edits" in _texts(u.args["blocks"]) for u in rig.standin.of("chat.update"))


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.storage
def test_forged_stale_and_replayed_requests_are_refused(rig: SlackRig) -> None:
    rid = _wire(rig)
    rec = rig.desk.undolog.approvals.get(rid)
    payload = block_action(rig.standin, "approve", json.dumps({"r": rid, "d": rec.action_digest}))
    forged = rig.send(payload, secret="not-the-signing-secret")
    assert forged.status_code == 401 and forged.json()["code"] == "slack_signature_invalid"
    stale = rig.send(payload, timestamp=int(time.time()) - REPLAY_WINDOW - 5)
    assert stale.status_code == 401 and stale.json()["code"] == "slack_request_stale"
    assert rig.desk.undolog.approvals.get(rid).state == "pending"
    body, headers = signed(block_action(rig.standin, "reject", json.dumps({"r": rid, "d": rec.action_digest})))
    unsigned = httpx.post(rig.desk.url + "/v1/slack/interactivity", content=body,
                          headers={"Content-Type": headers["Content-Type"]}, timeout=30)
    assert unsigned.status_code == 401
    first = httpx.post(rig.desk.url + "/v1/slack/interactivity", content=body, headers=headers, timeout=30)
    assert first.status_code == 200 and first.json()["decided"] == "reject"
    again = httpx.post(rig.desk.url + "/v1/slack/interactivity", content=body, headers=headers, timeout=30)
    assert again.status_code == 409 and again.json()["code"] == "slack_request_replayed"


def _refusal_events(rig: SlackRig, rid: str) -> list[Any]:
    return [e for e in rig.desk.undolog.approvals.events(rid) if e.action == "slack_refused"]


def test_another_workspace_and_an_unmapped_user_are_refused_told_why_and_audited(rig: SlackRig) -> None:
    rid = _wire(rig)
    foreign = rig.click("approve", rid, team="T0OTHER", user="U0ANA").json()
    assert foreign["refused"] == "slack_foreign_team" and "workspace" in foreign["text"]
    unmapped = rig.click("approve", rid, user="U0NOBODY").json()
    assert unmapped["refused"] == "slack_user_unmapped" and "admin" in unmapped["text"]
    assert rig.desk.undolog.approvals.get(rid).state == "pending"
    told = [r for r in rig.standin.responses]
    assert len(told) == 2 and all(t["response_type"] == "ephemeral" for t in told)
    events = _refusal_events(rig, rid)
    assert [json.loads(e.payload)["why"] if isinstance(e.payload, str) else e.payload["why"] for e in events] == [
        "slack_foreign_team", "slack_user_unmapped"]
    assert rig.desk.undolog.verify_audit().ok


def test_self_approval_is_refused_through_the_mapped_key(rig: SlackRig) -> None:
    rid = _wire(rig, owner="both")
    r = rig.click("approve", rid, user="U0BOTH").json()
    assert r["refused"] == "self_approval_forbidden"
    assert rig.desk.undolog.approvals.get(rid).state == "pending"
    assert any(e.action == "refused" for e in rig.desk.undolog.approvals.events(rid))


def test_a_key_outside_the_requests_groups_is_refused(rig: SlackRig) -> None:
    rig.desk.store.put_group(ApproverGroup("risk", risk_tags=("not-billing",)))  # wire_money: finance's alone now
    rid = _wire(rig)
    refused = rig.click("approve", rid, user="U0BEN").json()
    assert refused["refused"] == "not_in_approver_group" and "finance" in refused["text"]
    assert rig.desk.undolog.approvals.get(rid).state == "pending"


def test_a_click_after_expiry_or_after_the_request_changed_is_refused(rig: SlackRig) -> None:
    rid = _wire(rig)
    rig.sweep()
    changed = rig.click("approve", rid, digest="0" * 64).json()
    assert changed["refused"] == "slack_request_changed"
    rig.desk.undolog.approvals.expire_due(now=utcnow() + timedelta(days=30))
    assert rig.desk.undolog.approvals.get(rid).state == "timed_out"
    late = rig.click("approve", rid).json()
    assert late["refused"] == "approval_already_decided" and "timed out" in late["text"]
    rig.sweep()
    updates = rig.standin.of("chat.update")
    assert len(updates) == 2 and all("Timed out" in _texts(u.args["blocks"]) for u in updates)


def test_admin_api_maps_users_with_audit(rig: SlackRig) -> None:
    admin = rig.desk.client("admin")
    agent_key = rig.desk.key("agent").key_id
    r = admin.put(f"/v1/slack/users/{TEAM}/U0NEW", json={"key_id": agent_key})
    assert r.status_code == 409 and r.json()["code"] == "key_not_approver"
    assert rig.desk.client("ana").put(f"/v1/slack/users/{TEAM}/U0NEW",
                                      json={"key_id": rig.desk.key("ana").key_id}).status_code == 403
    assert admin.put(f"/v1/slack/users/{TEAM}/U0NEW", json={"key_id": rig.desk.key("ben").key_id}).status_code == 200
    assert admin.delete(f"/v1/slack/users/{TEAM}/U0NEW").status_code == 204
    assert admin.delete(f"/v1/slack/users/{TEAM}/U0NEW").status_code == 404
    users = {(u["team_id"], u["user_id"]) for u in admin.get("/v1/slack/users").json()}
    assert (TEAM, "U0ANA") in users and (TEAM, "U0NEW") not in users
    with rig.desk.undolog.store.read() as conn:
        actions = [r[0] for r in conn.execute(sa.text(
            "SELECT action FROM undolog_approval_events WHERE subject = :s ORDER BY event_id"), {"s": f"slack:{TEAM}/U0NEW"})]
    assert actions == ["slack_user_mapped", "slack_user_unmapped"]
    assert rig.desk.undolog.verify_audit().ok


# ------------------------------------------------------------------------------------------------ crashes


@pytest.mark.storage
def test_a_crash_between_the_decision_and_the_update_updates_once_after_restart(rig: SlackRig, db: Any) -> None:
    rid = _wire(rig)
    rig.sweep()
    digest = rig.desk.undolog.approvals.get(rid).action_digest
    env = {**os.environ, **db.env, "SLACK_API_URL": rig.standin.api_url, "PYTHONPATH": str(ROOT)}
    # Another desk process takes ana's click and is SIGKILLed right after the decision commits, before it marks or
    # updates a message: the core's outbox row is all that is left of it.
    child = subprocess.run([sys.executable, "-m", "tests.support.slack_sender", "approve-then-die", rid, digest],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
    assert rig.desk.undolog.approvals.get(rid).state == "approved"
    assert not rig.standin.of("chat.update")
    # The desk that goes on (a restarted one is the same: everything is in the database) updates each message once.
    rig.sweep()
    rig.sweep()
    updates = rig.standin.of("chat.update")
    assert sorted(u.args["channel"] for u in updates) == ["C0FIN", "C0RISK"]
    assert all("Approved" in _texts(u.args["blocks"]) for u in updates)
    assert len(rig.posted()) == 2  # no duplicate post


def test_a_post_killed_in_flight_is_found_not_reposted_and_a_duplicate_is_updated_too(rig: SlackRig, db: Any) -> None:
    SlackStore(rig.desk.undolog.store).delete_channel("risk")  # one channel keeps the story short
    rid = _wire(rig)
    hold = threading.Event()
    rig.standin.hold["chat.postMessage"] = hold
    env = {**os.environ, **db.env, "SLACK_API_URL": rig.standin.api_url, "PYTHONPATH": str(ROOT)}
    # Another desk process sweeps: it fans the request out and posts it.
    child = subprocess.Popen([sys.executable, "-m", "tests.support.slack_sender", "sweep"], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not rig.posted() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rig.posted(), "the child never reached chat.postMessage"
        # Slack has the message; the sender is killed before it hears the answer or records anything.
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
        hold.set()
        rig.standin.hold.clear()
    [post] = rig.slack.store.posts(rid)
    assert post.channel == "C0FIN" and post.ts == () and post.attempts == 1
    # Once the dead sender's lease has run out, the next one looks before posting: the message is there.
    rig.slack.run_due(now=time.time() + 120)
    assert len(rig.posted("C0FIN")) == 1
    [post] = rig.slack.store.posts(rid)
    assert post.ts == (rig.standin.channels["C0FIN"][0]["ts"],)
    # A duplicate that slipped through (another process posted too) is updated like the original.
    dup = rig.standin.add_message("C0FIN", "dup", {"event_type": "undolog_approval_request",
                                                   "event_payload": {"approval_request_id": rid}})
    assert rig.click("approve", rid).json()["decided"] == "approve"
    rig.slack.run_due()
    updated = sorted(u.args["ts"] for u in rig.standin.of("chat.update"))
    assert updated == sorted([post.ts[0], dup])
    rig.slack.run_due()
    assert len(rig.standin.of("chat.update")) == 2 and len(rig.posted()) == 1


def _wait_for(check: Any, what: str, seconds: float = 60.0) -> None:
    """Wait for the desk's own loops (not a timed assertion: the bound only stops a hung test)."""
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, f"the desk's loops never {what}"
        time.sleep(0.05)


def test_the_desks_own_loops_post_and_update_after_a_click(db: Any) -> None:
    """No test hand: the sweeper started by the app's lifespan posts, and a click's decision updates the message
    right away (``update_now``) or at the next sweep."""
    standin = SlackStandIn().start()
    cfg = SlackConfig(bot_token=TOKEN, signing_secret=SIGNING_SECRET, team_id=TEAM, api_url=standin.api_url)
    desk = make_desk(db, settings=ServerSettings(background=True, sweep_interval=0.2, slack=cfg))
    try:
        desk.add_key("ana", ["approver"])
        SlackStore(desk.undolog.store).put_channel(SlackChannel("*", "C0ALL"))
        SlackStore(desk.undolog.store).put_user(TEAM, "U0ANA", desk.key("ana").key_id, "test")
        rid, _ = desk.pending("delete_user_account", user_id="u1")
        _wait_for(lambda: standin.of("chat.postMessage"), "posted the request")
        rec = desk.undolog.approvals.get(rid)
        body, headers = signed(block_action(standin, "approve", json.dumps({"r": rid, "d": rec.action_digest})))
        r = httpx.post(desk.url + "/v1/slack/interactivity", content=body, headers=headers, timeout=30)
        assert r.json()["decided"] == "approve", r.text
        _wait_for(lambda: standin.of("chat.update"), "updated the message")
        first = _texts(standin.of("chat.update")[0].args["blocks"])
        assert "Approved" in first, first
        # The decision's outbox event, fanned out afterwards, finds the message already showing it: no second update.
        sweeper = desk.server.server.config.app.state.sweeper
        sweeper.tick()
        sweeper.tick()
        seen = [(c.method, c.args.get("channel"), c.args.get("ts")) for c in standin.calls]
        assert len(standin.of("chat.update")) == 1 and len(standin.of("chat.postMessage")) == 1, seen
    finally:
        desk.close()
        desk.undolog.close()
        standin.stop()
